"""Serving: TTFT against throughput as the batch grows, paged_jax beside transformers.

``paged-jax bench serve`` replays one workload (ShareGPT prompts, sampled as vLLM's
benchmark samples them, or ``--dataset random`` token ids) through three servers, at each
``--request-rate`` (requests arrive by a Poisson process; ``inf`` sends them all at once) and
each ``--max-num-seqs`` (the batch limit), and reports what ``vllm bench serve`` reports (see
``paged_jax.engine.serve_metrics``):

* ``paged_jax``: an ``LLMEngine`` stepped in this process. A request joins the running batch
  at the first iteration after it arrives; prefill is chunked to ``--max-num-batched-tokens``
  tokens per iteration (``--prefill-tokens-while-decoding`` in one that also decodes, where
  set; ``paged_jax_whole_budget`` keeps the whole budget); a prompt that finishes joins its
  iteration's decode (``paged_jax_no_join`` waits for the next); decode runs
  ``--steps-per-dispatch`` steps per dispatch
  (``--steps-while-prefilling`` in an iteration that also prefills, or where K steps took
  longer than ``--max-dispatch-ms``; ``paged_jax_whole_k`` keeps K); an iteration that
  finishes a prompt defers the decode rows to the next (``paged_jax_decode_every_iteration``
  does not); ``step()`` returns after each prefill dispatch that finishes a prompt
  (``paged_jax_whole_iteration`` runs the whole iteration in one call); requests are admitted
  by ``--scheduling-policy``, first come first served by default (``paged_jax_shortest_first``
  admits the ones that arrived together shortest prompt first); a decode dispatch's rows
  move down into the lowest slots where a higher one decodes alone (``paged_jax_uncondensed``
  leaves each in its slot; ``paged_jax_one_dispatch_uncondensed`` does so beside
  ``paged_jax_one_dispatch``). Each engine
  first compiles every prefill shape it can dispatch (``engine.warmup.warm_up``); each
  configuration is then served once untimed, so that the timed passes run on compiled
  executables, and the prefix cache is emptied before each pass.
* ``generate_batch``: transformers' continuous batching (its paged cache, a background
  thread), fed the same arrivals through its manager's ``add_request``, with
  ``max_requests_per_batch`` and ``max_batch_tokens`` set to the same limits and a pool of
  the same number of token slots. Tokens are timed by its ``record_timestamps``.
* ``generate``: transformers' static ``generate``. Waiting requests are taken in arrival
  order, up to the batch limit, left-padded into one batch and generated to the longest
  one's length; the next batch starts when this one returns. A token's time is the end of
  the step that made it (a stopping criterion records each step), and a request finishes
  when ``generate`` returns.

* ``paged_jax_http`` (``--http``): the same engine behind ``paged-jax serve``'s HTTP API
  (``paged_jax.server.bench_http``): uvicorn in a background thread on 127.0.0.1, and a
  client in a process of its own (``paged_jax.server.bench_client``) that streams each
  request at its arrival, as ``vllm bench serve`` does;
  tokens are timed when their chunk reaches the client. ``--blocks-history`` sets the
  server's ``/blocks`` recorder (default: ``paged-jax serve``'s).

``--repeats N`` runs every configuration N times, the systems taking turns within each
repeat, and reports each figure as the median over the N runs (``serve.json`` keeps every
run's figures under ``repeats``): on a small shared machine one run's medians move by tens
of percent from run to run. With ``--http``, the goal line also pairs HTTP with in-process
by repeat (``http_goal``).

All are greedy, ignore EOS and generate exactly each request's output length
(ShareGPT's reply length, capped at ``--max-output-len``), from the same weights in one
``--dtype`` (f32 by default; bf16 rounds the checkpoint's on both sides), on the
same prompts and arrival times. The results go to ``--out``: ``serve.json`` (every run's
figures) and ``serve.png`` (median TTFT against output throughput per server, one point per
batch limit, one panel per rate). The run ends by printing its wall time and how much of it
paged_jax spent compiling (``warm_up``, once per batch limit) and in untimed passes
(``run_time_s`` in ``serve.json``): with a real model on a small CPU, compiling is most of it.

Goals (issue 15): at ``max_num_seqs >= 16``, output throughput at least 5x
``generate_batch``'s and 2x ``generate``'s; median TTFT no worse than transformers'; ITL
p99 at most 3x the ITL median. Issue 16: HTTP adds at most 10% to paged_jax's median TTFT
and ITL, measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import time

import numpy as np

from paged_jax.engine.scheduler import (
    DEFAULT_MAX_DISPATCH_MS,
    POLICIES,
    max_dispatch_ms_flag,
    prefill_budget_flag,
)
from paged_jax.engine.serve_baselines import BatchServer, StaticServer
from paged_jax.engine.serve_metrics import (
    Request,
    Timing,
    matmul_flops,
    poisson_arrivals,
    summarize,
    throughput_bound,
)
from paged_jax.engine.warmup import warm_up

SYSTEMS = ("paged_jax", "generate_batch", "generate")
# paged_jax with one of its engine's settings changed, on request (--systems): one of its
# speed measures turned off, or the shortest_first admission order on. What the setting
# changes is paged_jax's figures against these, in the same run. Per name: the LLMEngine
# arguments (a callable of the parsed args) and what the comparison is.
ONE_PREFILL = "paged_jax_one_prefill"
ABLATIONS = {
    ONE_PREFILL: (lambda a: {"prefill_by_width": False},
                  "prefill by width vs one prefill dispatch"),
    "paged_jax_unpacked": (lambda a: {"pack_prefill": False},
                           "first chunks packed vs rows by width class"),
    "paged_jax_decode_with_prefill": (
        lambda a: {"decode_with_prefill": True},
        "the decode step apart vs in one dispatch with a one-row chunk"),
    "paged_jax_one_dispatch": (
        lambda a: {"decode_with_prefill": True, "one_prefill_chunk": True},
        "the decode step apart vs one dispatch per decoding iteration (one prefill chunk an "
        "iteration with decode rows, run with the decode step)"),
    "paged_jax_one_dispatch_uncondensed": (
        lambda a: {"decode_with_prefill": True, "one_prefill_chunk": True,
                   "condense_slots": False},
        "paged_jax_one_dispatch with its decode rows condensed into the lowest slots vs left "
        "in the slots they were admitted to"),
    "paged_jax_uncondensed": (lambda a: {"condense_slots": False},
                              "decode rows condensed into the lowest slots vs left in the "
                              "slots they were admitted to"),
    "paged_jax_k_while_prefilling": (
        lambda a: {"steps_while_prefilling": a.steps_per_dispatch},
        "decode steps_while_prefilling vs K throughout"),
    "paged_jax_all_rows": (lambda a: {"bucket_decode_rows": False},
                           "decode rows bucketed vs every slot"),
    "paged_jax_whole_k": (lambda a: {"max_dispatch_ms": None},
                          "K steps by dispatch time vs K whenever nothing is prefilled"),
    "paged_jax_decode_every_iteration": (
        lambda a: {"first_tokens_first": False},
        "first tokens first vs a decode dispatch in every iteration"),
    "paged_jax_whole_iteration": (
        lambda a: {"deliver_each_prefill": False},
        "first tokens after their prefill dispatch vs after the whole iteration"),
    "paged_jax_no_join": (lambda a: {"join_decode": False},
                          "new rows join the iteration's decode vs wait for the next one"),
    "paged_jax_whole_budget": (
        lambda a: {"prefill_tokens_while_decoding": None},
        "a smaller chunk budget while rows decode vs max_num_batched_tokens throughout"),
    "paged_jax_shortest_first": (lambda a: {"scheduling_policy": "shortest_first"},
                                 "fcfs vs shortest_first"),
}
HTTP = "paged_jax_http"  # paged_jax behind the HTTP server (--http)
GOAL_VS_BATCH, GOAL_VS_STATIC, GOAL_ITL, GOAL_HTTP = 5.0, 2.0, 3.0, 0.10
GOAL_MIN_SEQS = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face directory (default: SmolLM2)")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument("--roles", default="first-two", choices=["first-two", "human-gpt"],
                   help="first-two: vLLM's turns 0 and 1; human-gpt: the first human turn "
                   "answered by gpt (see paged_jax.datasets.conversation_pair)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=16,
                   help="output tokens per request at most (ShareGPT's reply length, capped)")
    p.add_argument("--max-prompt-len", type=int, default=512,
                   help="drop ShareGPT prompts longer than this (vLLM's rule: 1024)")
    p.add_argument("--random-input-len", type=int, default=64,
                   help="--dataset random: prompt lengths are drawn in [len/2, len]")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf, 4.0],
                   help="requests/s of the Poisson arrivals; inf: all at once")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--prefill-tokens-while-decoding", type=int, default=0,
                   help="paged_jax's chunk budget in an iteration that also decodes (at most "
                   "--max-num-batched-tokens; LLMEngine's prefill_tokens_while_decoding); 0: "
                   "--max-num-batched-tokens")
    p.add_argument("--steps-per-dispatch", type=int, default=8)
    p.add_argument("--steps-while-prefilling", type=int, default=1,
                   help="paged_jax's decode steps per dispatch in an iteration that prefills "
                   "(at most --steps-per-dispatch)")
    p.add_argument("--max-dispatch-ms", type=float, default=DEFAULT_MAX_DISPATCH_MS,
                   help="paged_jax decodes --steps-while-prefilling steps per dispatch "
                   "wherever K steps took longer than this (LLMEngine's max_dispatch_ms); 0: "
                   "K whenever nothing is prefilled")
    p.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="paged_jax's admission order (LLMEngine's scheduling_policy), its "
                   "ablations' too, except paged_jax_shortest_first's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                   choices=[*SYSTEMS, *ABLATIONS],
                   help="servers to run; the paged_jax_* ones are paged_jax with one setting "
                   "changed (the comparison each makes: " + "; ".join(
                       f"{name}: {what}" for name, (_, what) in ABLATIONS.items()) + ")")
    p.add_argument("--http", action="store_true",
                   help=f"also run {HTTP}: paged_jax through paged-jax serve's HTTP API")
    p.add_argument("--blocks-history", type=int, default=None,
                   help=f"{HTTP}: the server's /blocks history (0: no recorder; default: "
                   "paged-jax serve's)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each configuration, the systems taking turns; each "
                   "figure is the median over them")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="every server's weights (the checkpoint's, rounded to it) and "
                   "activations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_serve_out"))
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "max_output_len", "max_prompt_len", "random_input_len",
                 "max_num_batched_tokens", "steps_per_dispatch", "steps_while_prefilling",
                 "block_size", "kv_cache_mib", "repeats"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.steps_while_prefilling > args.steps_per_dispatch:
        raise ValueError(f"--steps-while-prefilling must be at most --steps-per-dispatch "
                         f"({args.steps_per_dispatch}), got {args.steps_while_prefilling}")
    max_dispatch_ms_flag(args.max_dispatch_ms)
    prefill_budget_flag(args.prefill_tokens_while_decoding, args.max_num_batched_tokens)
    if args.max_output_len < 2:
        raise ValueError(f"--max-output-len must be >= 2 (TPOT needs two tokens), got "
                         f"{args.max_output_len}")
    for m in args.max_num_seqs:
        if m < 1:
            raise ValueError(f"--max-num-seqs values must be >= 1, got {m}")
    if args.blocks_history is not None and args.blocks_history < 0:
        raise ValueError(f"--blocks-history must be >= 0, got {args.blocks_history}")
    for r in args.request_rate:
        if not r > 0:
            raise ValueError(f"--request-rate values must be > 0 (inf: all at once), got {r}")


def workload(args, tokenizer, vocab_size: int) -> tuple[list[tuple[tuple[int, ...], int]], str]:
    """``(prompt ids, output length)`` per request, and a line saying where they came from."""
    if args.dataset == "random":
        rng = np.random.default_rng(args.seed)
        lo = max(1, args.random_input_len // 2)
        lens = rng.integers(lo, args.random_input_len + 1, size=args.num_prompts)
        reqs = [(tuple(rng.integers(0, vocab_size, int(n)).tolist()), args.max_output_len)
                for n in lens]
        return reqs, (f"random token ids, prompts of {lo}..{args.random_input_len} tokens, "
                      f"{args.max_output_len} output tokens each")
    if tokenizer is None:
        raise ValueError("--dataset sharegpt needs a model with a tokenizer; use --dataset "
                         "random for a checkpoint without one")
    from paged_jax.datasets import sample_requests

    sample = sample_requests(tokenizer, args.num_prompts, seed=args.seed, roles=args.roles,
                             max_prompt_len=args.max_prompt_len)
    reqs = [(r.prompt_ids, min(r.output_len, args.max_output_len)) for r in sample.requests]
    return reqs, (
        f"ShareGPT V3: {sample.records} complete records read ({sample.gpt_first} open with a "
        f"gpt turn; roles {sample.roles}); {len(reqs)} drawn "
        f"with seed {args.seed} (dropped on the way: {sample.too_short} too short, "
        f"{sample.too_long} too long, prompt > {args.max_prompt_len} or total > 2048); "
        f"replies capped at {args.max_output_len} tokens")


class PagedServer:
    """paged_jax's ``LLMEngine`` over one model, one engine per batch limit (they share the
    model's compiled steps)."""

    def __init__(self, model, args, max_len: int, overrides: dict | None = None,
                 steps=None):
        from flax import nnx

        from paged_jax.engine.steps import Steps
        from paged_jax.kvcache import plan_blocks

        self.model, self.args, self.max_len = model, args, max_len
        self.overrides = overrides or {}  # LLMEngine arguments of an ablation
        self.steps = Steps(nnx.split(model)[0]) if steps is None else steps
        self.num_blocks = plan_blocks(model.config, args.kv_cache_mib << 20,
                                      args.block_size).num_blocks
        self.engines = {}
        self.warmed = set()  # (batch limit, requests) served untimed already
        # Seconds spent outside the timed passes: "warm_up" compiling, "untimed" serving.
        self.spent = collections.Counter()

    def engine(self, max_num_seqs: int):
        from paged_jax.engine.llm_engine import LLMEngine

        if max_num_seqs not in self.engines:
            a = self.args
            self.engines[max_num_seqs] = LLMEngine(
                self.model, eos_token_id=None, block_size=a.block_size,
                num_blocks=self.num_blocks, max_num_seqs=max_num_seqs,
                max_model_len=self.max_len, max_num_batched_tokens=a.max_num_batched_tokens,
                steps_per_dispatch=a.steps_per_dispatch,
                **{"steps_while_prefilling": a.steps_while_prefilling,
                   "scheduling_policy": a.scheduling_policy,
                   "prefill_tokens_while_decoding": prefill_budget_flag(
                       a.prefill_tokens_while_decoding, a.max_num_batched_tokens),
                   "max_dispatch_ms": max_dispatch_ms_flag(a.max_dispatch_ms), **self.overrides},
                seed=a.seed, steps=self.steps)
            # Every prefill shape it can meet, compiled now: which ones a run meets depends
            # on the arrival order, which an HTTP client does not keep from pass to pass.
            start = time.perf_counter()
            warm_up(self.engines[max_num_seqs], progress=False)
            self.spent["warm_up"] += time.perf_counter() - start
        return self.engines[max_num_seqs]

    def serve(self, requests: list[Request], max_num_seqs: int) -> list[Timing]:
        """Serve ``requests`` timed, after an untimed pass (compiling what they need) the
        first time they meet this batch limit."""
        engine = self.engine(max_num_seqs)
        self.warm_once(requests, max_num_seqs, lambda: self._serve(engine, requests))
        return self._serve(engine, requests)

    def release(self, max_num_seqs: int) -> None:
        """Drop the engine of this batch limit (its pool and what it holds of the compiled
        steps); a later ``engine(max_num_seqs)`` builds and warms a new one."""
        self.engines.pop(max_num_seqs, None)
        self.warmed = {key for key in self.warmed if key[0] != max_num_seqs}

    def warm_once(self, requests: list[Request], max_num_seqs: int, untimed_pass) -> None:
        """Run ``untimed_pass()`` the first time ``requests`` meet this batch limit; they
        count as met once it has returned."""
        key = (max_num_seqs, tuple(requests))
        if key not in self.warmed:
            start, compiling = time.perf_counter(), self.spent["warm_up"]
            untimed_pass()  # it may build (and warm up) this limit's engine
            self.spent["untimed"] += (time.perf_counter() - start
                                      - (self.spent["warm_up"] - compiling))
            self.warmed.add(key)

    def _serve(self, engine, requests: list[Request]) -> list[Timing]:
        from paged_jax.engine.params import SamplingParams

        engine.reset_prefix_cache()  # no pass starts on blocks an earlier pass cached
        pending = collections.deque(sorted(enumerate(requests), key=lambda x: x[1].arrival))
        start, timings, tag = time.perf_counter(), {}, f"{time.perf_counter_ns()}-"
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter()
            while pending and start + pending[0][1].arrival <= now:
                i, r = pending.popleft()
                engine.add_request(tag + str(i), list(r.prompt), SamplingParams(
                    temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
                    arrival_time=start + r.arrival)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + pending[0][1].arrival - time.perf_counter()))
                continue
            for out in engine.step():
                if out.finished:
                    m = out.metrics
                    timings[int(out.request_id.removeprefix(tag))] = Timing(
                        m.arrival_time, list(m.token_times), m.finished_time,
                        len(out.prompt_token_ids), list(out.outputs[0].token_ids))
        return [timings[i] for i in range(len(requests))]


def matmul_rate(shapes: list[tuple[int, int, int]], repeats: int = 3,
                dtype: str = "float32") -> tuple[float, str]:
    """The fastest ``dtype`` matmul rate measured here, FLOP/s, and what reached it: ``[m, k]
    @ [k, n]`` for each ``(m, k, n)`` of ``shapes``, in jax (a 16-bit product accumulated in
    f32, as the model's matmuls are) and in torch, best of ``repeats`` timed calls after one
    untimed call. A stand-in for the machine's peak when bounding what any server can reach
    (``serve_metrics.throughput_bound``)."""
    import jax
    import jax.numpy as jnp
    import torch

    dot = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    best, where = 0.0, ""
    rng = np.random.default_rng(0)
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        ours = (jnp.asarray(a, dtype), jnp.asarray(b, dtype))
        theirs = (torch.from_numpy(a).to(getattr(torch, dtype)),
                  torch.from_numpy(b).to(getattr(torch, dtype)))
        for lib, mm, x, y in (("jax", dot, *ours), ("torch", torch.mm, *theirs)):
            jax.block_until_ready(mm(x, y))  # untimed: compiles, warms
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(mm(x, y))  # a torch tensor passes through
                rate = 2.0 * m * k * n / (time.perf_counter() - start)
                if rate > best:
                    best, where = rate, f"{lib} [{m}x{k}] @ [{k}x{n}]"
    return best, where


def run_order(args, systems: list[str]) -> list[tuple[float, int, int, str]]:
    """``(rate, batch limit, repeat, system)`` in the order they run: every run of one batch
    limit before the next (see ``release``), and within it each rate's repeats with the
    systems taking turns."""
    return [(rate, m, k, s) for m in args.max_num_seqs for rate in args.request_rate
            for k in range(args.repeats) for s in systems]


def release(servers: dict, max_num_seqs: int) -> None:
    """Free what the servers compiled for a batch limit whose runs are over. XLA:CPU maps
    memory for every compiled kernel, and a batch limit's warm-up compiles every prefill
    and decode shape it can dispatch (tens of thousands of mappings at 64 sequences on
    SmolLM2): kept for the whole sweep, they pass Linux's default ``vm.max_map_count`` (65,530) and
    the next compilation fails for want of memory."""
    import jax

    for server in servers.values():
        if hasattr(server, "release"):
            server.release(max_num_seqs)
    jax.clear_caches()


def median_summary(summaries: list[dict]) -> dict:
    """One summary of several runs of a configuration: each figure the median of the runs'
    (None where a run has none), the rest as the first run has it."""
    def merge(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) for k in first}
        if isinstance(first, bool) or not isinstance(first, int | float):
            return first
        if any(v is None for v in values):
            return None
        median = float(np.median(values))
        # A count stays a count where the runs agree on it (or their median is whole).
        if all(isinstance(v, int) for v in values) and median.is_integer():
            return int(median)
        return median

    return merge(summaries)


def pooled_latency(timings: list[Timing]) -> dict:
    """The latency figures (TTFT, TPOT, ITL, E2E; ms) over the requests of every repeat of a
    configuration taken together: each system's median TTFT over all the requests it served
    in the run, a larger sample than one repeat's."""
    summary = summarize(timings)
    return {"requests": len(timings),
            **{key: summary[key] for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}}


def goals(results: list[dict], bounds: dict | None = None) -> list[str]:
    """Lines saying, per rate and batch limit >= GOAL_MIN_SEQS, whether each goal is met:
    paged_jax's line, with its ablations compared against it, then a line per ablation that
    ran, its own figures against the goals; ``bounds``, per rate, the most output tokens/s
    any server can reach there (``serve_metrics.throughput_bound``), turned into the highest
    ratio reachable."""
    lines = []
    by = {(r["rate"], r["max_num_seqs"], r["system"]): r for r in results}
    engines = ["paged_jax", *ABLATIONS]
    ours = sorted((key for key in by if key[2] in engines),
                  key=lambda key: (str(key[0]), key[1], engines.index(key[2])))
    for rate, m, system in ours:
        r = by[rate, m, system]
        checks = goal_checks(by, r, bounds)
        if system != "paged_jax":
            lines.append(f"rate {rate:g}, max_num_seqs {m}, {system}: " + "; ".join(checks))
            continue
        itl = r["itl_ms"]
        for name, (_, label) in ABLATIONS.items():
            if (rate, m, name) in by:
                base = by[rate, m, name]
                checks.append(
                    f"{label}: output throughput "
                    f"{r['output_throughput'] / base['output_throughput']:.2f}x, TTFT p50 "
                    f"{base['ttft_ms']['p50'] / r['ttft_ms']['p50']:.2f}x lower, TPOT p50 "
                    f"{base['tpot_ms']['p50'] / r['tpot_ms']['p50']:.2f}x lower"
                    + ("" if not (itl["p99"] and base["itl_ms"]["p99"]) else
                       f", ITL p99 {base['itl_ms']['p99'] / itl['p99']:.2f}x lower"))
        lines.append(f"rate {rate:g}, max_num_seqs {m}: " + "; ".join(checks))
        if (rate, m, HTTP) in by:
            lines.append(f"rate {rate:g}, max_num_seqs {m}: " + http_goal(r, by[rate, m, HTTP]))
    return lines


def goal_checks(by: dict, r: dict, bounds: dict | None) -> list[str]:
    """One engine's result ``r`` against the goals: output throughput against each peer in
    ``by`` (``(rate, max_num_seqs, system)`` to result) at batch limits >= GOAL_MIN_SEQS,
    TTFT p50 against transformers' best, ITL p99 over p50."""
    rate, m = r["rate"], r["max_num_seqs"]
    checks = []
    if m >= GOAL_MIN_SEQS:
        for peer, goal in (("generate_batch", GOAL_VS_BATCH), ("generate", GOAL_VS_STATIC)):
            if (rate, m, peer) in by:
                theirs = by[rate, m, peer]["output_throughput"]
                x = r["output_throughput"] / theirs
                reach = ("" if bounds is None or rate not in bounds
                         else f"; at most {bounds[rate] / theirs:.2f}x on this machine")
                checks.append(f"throughput {x:.2f}x {peer} (goal >= {goal}x: "
                              f"{'met' if x >= goal else 'not met'}{reach})")
    peers = [by[rate, m, p]["ttft_ms"]["p50"] for p in ("generate_batch", "generate")
             if (rate, m, p) in by]
    if peers:
        ok = r["ttft_ms"]["p50"] <= min(peers)
        checks.append(f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms vs transformers' best "
                      f"{min(peers):.0f} ms ({'met' if ok else 'not met'})")
    itl = r["itl_ms"]
    if itl["p50"]:
        x = itl["p99"] / itl["p50"]
        checks.append(f"ITL p99/p50 {x:.2f} (goal <= {GOAL_ITL}: "
                      f"{'met' if x <= GOAL_ITL else 'not met'})")
    return checks


def http_goal(paged: dict, http: dict) -> str:
    """How much the HTTP server adds to paged_jax's median TTFT and ITL, against the goal
    (an ITL median is None when every request came in one delivery): against the in-process
    run; where both ran ``--repeats`` N > 1 times, also paired by repeat (the median over
    repeats of HTTP's figure over the in-process figure of the same repeat, the two runs
    adjacent in time, so a drift in machine speed between repeats cancels) and pooled (each
    system's median over the requests of all its repeats, ``pooled_latency``); and, where
    the HTTP result has it, against its own engine's timing of the same requests
    (``engine_side``)."""
    def added(ratios: dict) -> tuple[str, bool | None]:
        within, parts = [], []
        for name, x in ratios.items():
            if x is None:
                parts.append(f"{name} p50 n/a")
                continue
            within.append(x <= 1 + GOAL_HTTP)
            parts.append(f"{name} p50 {100 * (x - 1):+.1f}%")
        return ", ".join(parts), (all(within) if within else None)

    def ratio(base: dict, x: dict, key: str) -> float | None:
        b, v = base[key]["p50"], x[key]["p50"]
        return None if b is None or v is None else v / b

    def ratios(base: dict, x: dict) -> dict:
        return {"TTFT": ratio(base, x, "ttft_ms"), "ITL": ratio(base, x, "itl_ms")}

    def verdict(ok):
        return "met" if ok else "not met"

    text, ok = added(ratios(paged, http))
    line = f"HTTP vs in-process: {text} (goal <= {100 * GOAL_HTTP:.0f}%: {verdict(ok)})"
    pairs = list(zip(paged.get("repeats", []), http.get("repeats", []), strict=False))
    if len(pairs) > 1:
        per_repeat = [ratios(a, b) for a, b in pairs]
        paired = {name: None if any(r[name] is None for r in per_repeat)
                  else float(np.median([r[name] for r in per_repeat]))
                  for name in ("TTFT", "ITL")}
        text, ok = added(paired)
        line += f"; paired by repeat (median of {len(pairs)}): {text} ({verdict(ok)})"
    if "pooled" in paged and "pooled" in http:
        text, ok = added(ratios(paged["pooled"], http["pooled"]))
        line += (f"; pooled over repeats ({paged['pooled']['requests']} / "
                 f"{http['pooled']['requests']} requests): {text} ({verdict(ok)})")
    if "engine_side" in http:
        text, ok = added(ratios(http["engine_side"], http))
        line += f"; HTTP vs its engine, same requests: {text} ({verdict(ok)})"
    return line


def table(results: list[dict]) -> str:
    head = (f"{'rate':>5} {'seqs':>4} {'server':<24} {'done':>4} {'req/s':>6} {'out tok/s':>9} "
            f"{'tot tok/s':>9} | {'TTFT mean/p50/p90/p99 ms':>25} | {'TPOT p50':>8} | "
            f"{'ITL p50/p99 ms':>14} | {'E2E p50 ms':>10} | {'peak':>4} | {'same tokens':>11}")
    rows = [head, "-" * len(head)]
    for r in results:
        t, i = r["ttft_ms"], r["itl_ms"]
        itl = f"{i['p50']:.0f}/{i['p99']:.0f}" if i["p50"] is not None else "-"
        tpot = f"{r['tpot_ms']['p50']:.1f}" if r["tpot_ms"]["p50"] is not None else "-"
        # None where no paged_jax server, the tokens' reference, ran.
        agree = r["greedy_agree"]
        same = f"{agree:>5}/{r['completed']:<5}" if agree is not None else "-"
        rows.append(
            f"{r['rate']:>5g} {r['max_num_seqs']:>4} {r['system']:<24} {r['completed']:>4} "
            f"{r['request_throughput']:>6.2f} {r['output_throughput']:>9.1f} "
            f"{r['total_token_throughput']:>9.1f} | "
            f"{t['mean']:>6.0f}/{t['p50']:>5.0f}/{t['p90']:>5.0f}/{t['p99']:>5.0f} | "
            f"{tpot:>8} | {itl:>14} | {r['e2e_ms']['p50']:>10.0f} | {r['peak_concurrency']:>4} | "
            f"{same:>11}")
    return "\n".join(rows)


def plot(results: list[dict], path: pathlib.Path) -> None:
    """Median TTFT against output throughput: a line per server through its batch limits,
    a panel per request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in results}, key=lambda x: -x)
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for system in (*SYSTEMS, *ABLATIONS, HTTP):
            pts = sorted((r["max_num_seqs"], r["output_throughput"], r["ttft_ms"]["p50"])
                         for r in results if r["rate"] == rate and r["system"] == system)
            if not pts:
                continue
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=system)
            for m, x, y in pts:
                ax.annotate(str(m), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
        ax.set_title("all at once" if math.isinf(rate) else f"Poisson, {rate:g} req/s")
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel("median TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(title="points: max_num_seqs", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plain(x):
    """``x`` with what JSON cannot hold spelt out: an infinite rate as "inf", a path as str."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return str(x) if isinstance(x, pathlib.Path) else x


def load(model_arg, dtype: str = "float32"):
    """(paged_jax model, tokenizer or None, transformers model): the same weights, in
    ``dtype``."""
    from paged_jax.engine.bench_model import load_transformers
    from paged_jax.engine.llm import load_model
    from paged_jax.model.tokenizer import default_gguf_path

    path = pathlib.Path(default_gguf_path() if model_arg is None else model_arg)
    ours, tokenizer = load_model(os.fspath(path), dtype)
    return ours, tokenizer, load_transformers(path, dtype)


def run_seconds(servers: dict, total: float) -> dict[str, float]:
    """The run's wall time (``total`` seconds) beside what the paged_jax servers spent outside
    their timed passes: ``warm_up`` compiling and ``untimed`` serving (``PagedServer.spent``,
    summed over every in-process and HTTP paged_jax server)."""
    spent = collections.Counter()
    for server in servers.values():
        spent.update(getattr(getattr(server, "paged", server), "spent", {}))
    return {"total": total, "warm_up": spent["warm_up"], "untimed": spent["untimed"]}


def main(argv: list[str] | None = None, loaded=None) -> int:
    """Run the sweep; ``loaded`` is ``load(--model)``'s result when the caller has it."""
    args = build_parser().parse_args(argv)
    check_args(args)
    began = time.perf_counter()
    import jax
    import torch
    import transformers
    from tqdm import tqdm

    ours, tokenizer, theirs = load(args.model, args.dtype) if loaded is None else loaded
    cfg = ours.config
    if cfg.dtype != args.dtype:
        raise ValueError(f"--dtype {args.dtype} is not the loaded model's {cfg.dtype}.")
    reqs, where = workload(args, tokenizer, cfg.vocab_size)
    bs = args.block_size
    max_len = bs * math.ceil(max(len(p) + n for p, n in reqs) / bs)
    print(f"paged-jax bench serve: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}, {cfg.dtype}; jax {jax.__version__} ({jax.default_backend()}), "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"workload: {where}; {sum(len(p) for p, _ in reqs)} prompt and "
          f"{sum(n for _, n in reqs)} output tokens")
    # What no server can beat here: the workload's matmuls at the fastest rate measured.
    flops = matmul_flops(cfg, [Request(p, n) for p, n in reqs])
    rate_, fastest = matmul_rate([(1024, 1024, 1024), (2048, 2048, 2048),
                                  (args.max_num_batched_tokens, cfg.hidden_size,
                                   cfg.intermediate_size)], dtype=args.dtype)
    # Each rate's requests, as every server and repeat at that rate meets them.
    at_rate = {rate: [Request(p, n, t) for (p, n), t in
                      zip(reqs, poisson_arrivals(len(reqs), rate, seed=args.seed), strict=True)]
               for rate in args.request_rate}
    bounds = {rate: throughput_bound(requests, flops, rate_)
              for rate, requests in at_rate.items()}
    print(f"compute floor: the workload's matmuls are at least {flops / 1e9:.0f} GFLOP (every "
          f"token through every layer, no prefix reuse); the fastest {args.dtype} matmul here "
          f"ran at {rate_ / 1e9:.1f} GFLOP/s ({fastest}), so no run is shorter than "
          f"{flops / rate_:.2f} s; output throughput at most "
          + ", ".join(f"{b:.1f} tok/s at rate {r:g}" for r, b in bounds.items()))
    servers = {}
    paged = PagedServer(ours, args, max_len)
    if "paged_jax" in args.systems:
        servers["paged_jax"] = paged
    for name, (overrides, _) in ABLATIONS.items():  # over the same compiled steps
        if name in args.systems:
            servers[name] = PagedServer(ours, args, max_len, overrides(args), paged.steps)
    if args.http:  # its own engines over the same compiled steps (see bench_http)
        from paged_jax.server.bench_http import HttpServer
        from paged_jax.server.cli import model_name

        options = {"blocks_history": args.blocks_history}
        servers[HTTP] = HttpServer(ours, args, max_len, paged.steps,
                                   {k: v for k, v in options.items() if v is not None},
                                   model_name(args.model))
    num_blocks = paged.num_blocks
    if "generate_batch" in args.systems:
        servers["generate_batch"] = BatchServer(theirs, args, num_blocks)
    if "generate" in args.systems:
        pad = tokenizer.eos_token_id if tokenizer is not None else 0
        servers["generate"] = StaticServer(theirs, pad)
    while_decoding = (f" ({args.prefill_tokens_while_decoding} while rows decode)"
                      if args.prefill_tokens_while_decoding else "")
    print(f"limits: max_num_batched_tokens {args.max_num_batched_tokens}{while_decoding}, "
          f"pool {num_blocks} blocks of {bs} ({num_blocks * bs} token slots), paged_jax K="
          f"{args.steps_per_dispatch} ({args.scheduling_policy}), max_model_len {max_len}",
          flush=True)
    warm = [Request(reqs[0][0][:8], 2)]  # first-call overhead of the transformers paths
    for name in ("generate_batch", "generate"):
        if name in servers:
            servers[name].serve(warm, 1)
    results = []
    runs = run_order(args, list(servers))
    summaries, agree = collections.defaultdict(list), {}
    # The tokens' reference: the first paged_jax server (they come first in ``servers``), which
    # runs first in each repeat. Greedy decoding does not depend on the batch, so every
    # server should make its tokens; the transformers peers alone have none to compare with.
    reference = next((name for name in servers if name not in ("generate_batch", "generate")),
                     None)
    pooled = collections.defaultdict(list)  # every repeat's timings, per configuration
    with tqdm(runs, desc="runs", unit="run") as bar:
        for i, (rate, m, k, name) in enumerate(bar):
            bar.set_postfix(rate=f"{rate:g}", seqs=m, repeat=k, server=name)
            timings = servers[name].serve(at_rate[rate], m)
            if i + 1 == len(runs) or runs[i + 1][1] != m:  # this batch limit's last run
                release(servers, m)
            summary = summarize(timings)
            if name == HTTP:  # the same requests as its engine timed them
                summary["engine_side"] = summarize(servers[name].engine_side)
            summaries[rate, m, name].append(summary)
            pooled[rate, m, name].extend(timings)
            if name == reference:  # runs first: the reference of this repeat's tokens
                ref = [t.tokens for t in timings]
            if reference is not None:  # the fewest agreeing in any repeat
                same = sum(a == t.tokens for a, t in zip(ref, timings, strict=True))
                agree[rate, m, name] = min(same, agree.get((rate, m, name), same))
    # In the table, rate by rate as asked, then batch limit, then system.
    order = {key: i for i, key in enumerate(
        (rate, m, name) for rate in args.request_rate for m in args.max_num_seqs
        for name in servers)}
    for (rate, m, name), runs_ in sorted(summaries.items(), key=lambda x: order[x[0]]):
        results.append({"system": name, "rate": rate, "max_num_seqs": m,
                        "greedy_agree": agree.get((rate, m, name)),
                        **median_summary(runs_),
                        **({"repeats": runs_, "pooled": pooled_latency(pooled[rate, m, name])}
                           if len(runs_) > 1 else {})})
    print(table(results))
    if reference is not None:
        print(f"same tokens: requests whose greedy tokens equal {reference}'s, in every repeat")
    for line in goals(results, bounds):
        print(line)
    run_time = run_seconds(servers, time.perf_counter() - began)
    print(f"run time: {run_time['total'] / 60:.1f} min, of which paged_jax spent "
          f"{run_time['warm_up'] / 60:.1f} compiling (warm_up, each batch limit's engine) and "
          f"{run_time['untimed'] / 60:.1f} in untimed passes")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(
        plain({"workload": where, "args": vars(args), "greedy_reference": reference,
               "results": results, "run_time_s": run_time,
               "compute_floor": {"matmul_flops": flops, "flops_per_s": rate_,
                                 "fastest": fastest,
                                 "output_throughput_bound": {str(r): b
                                                             for r, b in bounds.items()}}}),
        indent=1,
        allow_nan=False))
    plot(results, args.out / "serve.png")
    print(f"wrote {args.out / 'serve.json'} and {args.out / 'serve.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
