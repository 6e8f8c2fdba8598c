"""Decode throughput: K=1 against K=8 steps per dispatch, paged cache against contiguous.

``paged-jax bench decode`` builds a small random Llama (by default 2 layers, hidden 128, 2 query
heads sharing 1 KV head of 64, vocab 512, f32) and, for every batch x context, times
``--tokens`` greedy decode tokens per sequence four ways. Each runs the loop a server runs:
dispatch, bring the new tokens to the host (to stream them and check stop conditions), feed
the last ones back. A paged dispatch that did not run emits -1s, which the next one refuses
(``BAD_TOKEN``, state unchanged), so the paged loop reads its ``Status`` once per round.
That host round trip is what the K-step form exists to amortise:

* paged K=1: ``decode_steps(num_steps=1)``: one dispatch and one round trip per token;
* paged K=8: ``decode_steps(num_steps=8)``: a ``lax.scan`` of 8 steps per dispatch and round trip;
* contiguous K=1 / K=8: the same model over a ``[num_layers, batch, kv_heads, max_len, D]``
  cache written at ``position`` and read with the same masked-softmax math as the paged
  ``xla`` path (the baseline lives here, not in the library).

Every round starts from sequences of exactly ``context`` tokens. Printed: tokens per second
(batch * tokens / fastest round) and, per shape, the median over rounds of each round's ratio
(its two variants timed back to back). The summary line is the geometric mean of those.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import CacheConfig, admit, init_state
from paged_jax.engine.steps import Steps
from paged_jax.kernels.reference import attend_segments
from paged_jax.kvcache import init_cache
from paged_jax.model import ModelConfig, init_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax bench decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"],
                   help="tiny: the random model the flags below build; smollm2: the real "
                        "checkpoint against transformers (see `--model smollm2 --help`)")
    p.add_argument("--checkpoint", default=None,
                   help="a .gguf file or Hugging Face directory: as --model smollm2, on it")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--tokens", type=int, default=64, help="tokens per sequence per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every variant)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--quick", action="store_true", help="batch 1, 8 x context 128, 16 tokens")
    p.add_argument("--time-budget", type=float, default=900,
                   help="seconds after which the remaining shapes are skipped")
    return p


# --------------------------------------------------------------------------------------------
# The contiguous baseline


def _contiguous_decode(model, cache, lens, tokens):
    """One token per row over a dense cache ``(k, v)``, each [L, B, Hkv, max_len, D]."""
    batch = tokens.shape[0]
    max_len = cache[0].shape[3]
    rows = jnp.arange(batch)
    context = lens + 1  # [B], includes the new token
    live = jnp.arange(max_len)[None, :] < context[:, None]  # [B, max_len]

    def attend(layer, q, k, v, cache):  # q [B, 1, Hq, D]; k, v [B, 1, Hkv, D]
        ks, vs = cache
        ks = ks.at[layer, rows, :, lens].set(k[:, 0].astype(ks.dtype))
        vs = vs.at[layer, rows, :, lens].set(v[:, 0].astype(vs.dtype))
        d = ks.shape[-1]
        # The paged xla path's softmax, over the contiguous rows instead of gathered blocks
        # (the cache starts zeroed, so slots past a row's length hold finite values).
        out = attend_segments(q[:, 0], [(ks[layer], vs[layer], live)],
                              sm_scale=1.0 / math.sqrt(d))
        return out[:, None], (ks, vs)

    logits, cache = model(tokens[:, None], lens[:, None], cache, attend)
    return logits[:, 0], cache, lens + 1


def contiguous_steps(graphdef, params, cache, lens, tokens, *, num_steps):
    """``num_steps`` greedy steps over the contiguous cache; ``contiguous_jit`` jits it."""
    model = nnx.merge(graphdef, params)

    def body(carry, _):
        cache, lens, tokens = carry
        logits, cache, lens = _contiguous_decode(model, cache, lens, tokens)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (cache, lens, tokens), tokens

    (cache, lens, tokens), out = jax.lax.scan(body, (cache, lens, tokens), None, num_steps)
    return out, cache, lens


def contiguous_jit(graphdef):
    """``contiguous_steps`` jitted with ``graphdef`` closed over, as ``Steps`` does for the
    paged steps: no call hashes the graph."""
    return jax.jit(functools.partial(contiguous_steps, graphdef), static_argnames="num_steps",
                   donate_argnames="cache")


# --------------------------------------------------------------------------------------------


def bench_shape(paged_steps: Steps, contiguous, params, cfg: ModelConfig, batch, context,
                args):
    """One batch x context: ``paged_steps`` (a ``Steps``) against ``contiguous``
    (``contiguous_jit``) of the same graph. Returns ``(rates, ratios)``."""
    bs, n = args.block_size, args.tokens
    max_blocks = -(-(context + n) // bs)
    cache_cfg = CacheConfig(batch * max_blocks, bs, batch, max_blocks)
    paged = {"kv": init_cache(cfg, cache_cfg)}
    tokens = np.ones((batch,), np.int32)
    fresh_state = jax.jit(lambda: admit(init_state(cache_cfg), jnp.arange(batch), context)[0])

    def paged_run(k):
        state, nxt = fresh_state(), tokens
        for _ in range(n // k):
            out, _, paged["kv"], state, status = paged_steps.decode_steps(
                params, paged["kv"], state, nxt, num_steps=k, impl=args.impl
            )
            nxt = jax.device_get(out)[-1]  # the host round trip
        # A dispatch that did not run emits -1s, and a step fed a -1 is refused (BAD_TOKEN)
        # with the state unchanged: one look at the last status covers the whole round.
        status.raise_if_failed()

    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_blocks * bs, cfg.head_dim)
    dense = {"cache": (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))}

    def contiguous_run(k):
        lens, nxt = jnp.full((batch,), context, jnp.int32), tokens
        for _ in range(n // k):
            out, dense["cache"], lens = contiguous(params, dense["cache"], lens, nxt, num_steps=k)
            nxt = jax.device_get(out)[-1]  # the host round trip

    variants = {(name, k): functools.partial(run, k)
                for name, run in [("paged", paged_run), ("contiguous", contiguous_run)]
                for k in (1, 8)}
    for run in variants.values():
        run()  # compile and warm up
    # Rounds interleave the variants, so a burst of load elsewhere hits all of them alike.
    # Tokens/s come from each variant's fastest round (the least disturbed one); a ratio is
    # the median over rounds of that round's ratio, both halves timed back to back, which
    # holds still under load that drifts between rounds.
    seconds = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, run in variants.items():
            start = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - start)

    def ratio(a, b):  # how much faster a is than b
        return statistics.median(tb / ta for ta, tb in zip(seconds[a], seconds[b], strict=True))

    rates = {key: batch * n / min(times) for key, times in seconds.items()}
    ratios = {"k": ratio(("paged", 8), ("paged", 1)),
              "p1": ratio(("paged", 1), ("contiguous", 1)),
              "p8": ratio(("paged", 8), ("contiguous", 8))}
    return rates, ratios


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A real checkpoint goes to its own benchmark, which takes its own flags.
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    which.add_argument("--checkpoint", default=None)
    known, _ = which.parse_known_args(argv)
    if known.model != "tiny" or known.checkpoint is not None:
        from paged_jax.engine.bench_model import main as model_main

        return model_main(argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch, args.context, args.tokens, args.rounds = [1, 8], [128], 16, 2
    if args.tokens % 8:
        raise SystemExit(f"--tokens must be a multiple of 8. Got {args.tokens}.")
    cfg = ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype,
    )
    graphdef, params = nnx.split(init_model(cfg))
    params = nnx.to_pure_dict(params)  # what a serving loop passes (see engine.steps)
    paged_steps, contiguous = Steps(graphdef), contiguous_jit(graphdef)
    print(f"paged-jax bench decode: backend {jax.default_backend()}, {jax.devices()[0]}")
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.dtype}; "
          f"block {args.block_size}, impl {args.impl}, {args.tokens} tokens/seq per round, "
          f"{args.rounds} interleaved rounds")
    header = (f"{'batch':>5} {'ctx':>5} | {'paged K=1':>10} {'paged K=8':>10} "
              f"{'contig K=1':>10} {'contig K=8':>10} | {'K8/K1':>6} {'p/c K=1':>7} "
              f"{'p/c K=8':>7}")
    print("tokens per second (fastest round); ratios: median over rounds of the per-round ratio")
    print(header)
    print("-" * len(header))
    start, ratios = time.perf_counter(), {"k": [], "p1": [], "p8": []}
    for batch in args.batch:
        for context in args.context:
            if time.perf_counter() - start > args.time_budget:
                print(f"{batch:>5} {context:>5} | skipped (time budget)")
                continue
            r, q = bench_shape(paged_steps, contiguous, params, cfg, batch, context, args)
            for key, value in q.items():
                ratios[key].append(value)
            print(f"{batch:>5} {context:>5} | {r['paged', 1]:>10.0f} {r['paged', 8]:>10.0f} "
                  f"{r['contiguous', 1]:>10.0f} {r['contiguous', 8]:>10.0f} | "
                  f"{q['k']:>5.2f}x {q['p1']:>6.2f}x {q['p8']:>6.2f}x", flush=True)
    if ratios["k"]:
        gm = {key: statistics.geometric_mean(v) for key, v in ratios.items()}
        print(f"geometric mean: K=8 / K=1 (paged) {gm['k']:.2f}x (goal >= 1.5x); paged / "
              f"contiguous {gm['p1']:.2f}x at K=1, {gm['p8']:.2f}x at K=8 (goal >= 0.90x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
