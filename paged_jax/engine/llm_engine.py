"""``LLMEngine``: continuous batching over the jitted steps, one object owning the compiled work.

The engine holds the model as ``(graphdef, params)`` and its ``Steps`` (the jitted prefill
and decode, built once), the paged ``KVCache``, the allocator's ``BlockState``, the jitted
allocator ops it applies between dispatches, the ``Scheduler`` and the ``PrefixCache``.
Each ``step()`` runs one iteration of the scheduler's plan, or the next part of one:

1. release the slots of preempted sequences;
2. evict cached blocks the iteration needs (least recently used first);
3. the planned chunks' prefill: where requests are left queued, the chunks that start a
   prompt packed into one ``prefill_packed`` dispatch (``pack_prefill``), then the others
   in one ragged ``prefill`` dispatch per width class, narrowest first (new admissions
   start on their prefix-cache hit through ``admit_cached`` and prefill only the rest);
   a prompt whose last chunk ran samples its first token, and a request with ``n > 1``
   forks its completions there (``fork``: they share every block; the first decode
   dispatch copies the partly filled last block on write). After a dispatch that
   finished a prompt, with more of the iteration left, ``step()`` returns that first token
   and the next call goes on with the iteration (``deliver_each_prefill``);
4. one ``decode_steps`` dispatch of K steps for every decoding sequence (of
   ``steps_while_prefilling`` steps in an iteration that prefills, or where K steps over as
   many rows last took longer than ``max_dispatch_ms``), with each row's remaining budget
   and stop ids inside the dispatch; none in an iteration whose prefill finishes a prompt
   and leaves none to prefill (``first_tokens_first``), unless the one before had none.
   The sequences whose prompt finished in the iteration join it where the free blocks
   hold their steps (``join_decode``). With ``decode_with_prefill``, a decode of one step
   runs in the same ``prefill_decode`` dispatch as the iteration's last prefill chunk where
   that is one row;
5. on the host: new tokens, stop strings, finished sequences released, newly full blocks
   entered in the prefix cache.

Prefill shapes are bucketed to powers of two (``engine.buckets``), so the number of prefill
executables is bounded whatever the prompts. A decode dispatch computes the slots up to the
highest one decoding, rounded up to a power of two
(``LLMEngine.decode_rows_for``): a step's cost grows with its rows, active or not, and slots
are handed out lowest first. Where some rows lie above the power of two that covers their
count (the sequences below them finished), they first move down into slots below it
(``condense_slots``). Decode compiles once per such row count, sampling kind in use
(greedy, sampled, sampled with top-k/top-p) and dispatch length (K and
``steps_while_prefilling``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Sequence as Seq

import jax
import numpy as np
from flax import nnx

from paged_jax.allocator import (
    CacheConfig,
    admit_cached,
    check_invariants,
    fork,
    free_blocks,
    init_state,
    move_slots,
    release,
    share_blocks,
)
from paged_jax.allocator.primitives import cdiv
from paged_jax.engine import events as ev
from paged_jax.engine.buckets import MIN_PREFILL_WIDTH, pow2_at_least
from paged_jax.engine.params import (
    UNDELIVERED,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from paged_jax.engine.pool_snapshot import PoolSnapshot
from paged_jax.engine.prefix_cache import ROOT, Lookup, PrefixCache
from paged_jax.engine.sampling import row_keys, sample
from paged_jax.engine.scheduler import (
    DEFAULT_MAX_DISPATCH_MS,
    POLICIES,
    Plan,
    Scheduler,
    Sequence,
)
from paged_jax.engine.steps import Steps, serving_params
from paged_jax.kvcache import init_cache, plan_blocks
from paged_jax.model.llama import Llama
from paged_jax.sharding import auto_axes, check_model, init_sharded_cache, replicate, shard_params

__all__ = ["EngineStats", "LLMEngine"]

DEFAULT_KV_BYTES = 256 << 20  # the pool's memory when num_blocks is not given

def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _stop_at(text: str, stops) -> int | None:
    """Where the first of ``stops`` begins in ``text``, or None."""
    found = [i for i in (text.find(x) for x in stops) if i >= 0]
    return min(found) if found else None


def completion_seed(seed: int, index: int) -> int:
    """The seed of a request's ``index``-th completion: its own seed for the first, a hash of
    (seed, index) for the others, so that the completions differ and each is reproducible."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    arrival: int
    seqs: list[Sequence]
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.aborted or (len(self.seqs) == self.params.n
                                and all(s.finish_reason is not None for s in self.seqs))


@dataclasses.dataclass
class _Iteration:
    """A planned iteration in progress: its prefill dispatches still to run, ``(width, rows,
    packed)`` (``LLMEngine._prefill_groups``), then its plan's decode."""

    plan: Plan
    groups: list[tuple[int, list, bool]]
    now: float  # when it was planned: a new prompt's first_scheduled_time

    def drop_aborted(self) -> bool:
        """Drop the rows aborted since it was planned (an abort finishes its rows); whether
        anything is left to run."""
        self.groups = [(width, live, packed) for width, rows, packed in self.groups
                       if (live := [row for row in rows if row[0].finish_reason is None])]
        self.plan = dataclasses.replace(self.plan, decode=[
            (s, n) for s, n in self.plan.decode if s.finish_reason is None])
        return bool(self.groups or self.plan.decode)


@dataclasses.dataclass
class _DecodeRows:
    """A decode dispatch's per-slot arrays ([max_seqs] each; ``stop_ids`` [max_seqs, M]):
    the token each row feeds, its budget of steps (0: it does not decode), seed and sampling
    settings; the blocks its steps take beyond the rows' last ones (``new_blocks``); and
    whether any row samples (``sampled``), with top-k or top-p (``filtered``)."""

    tokens: np.ndarray
    budgets: np.ndarray
    seeds: np.ndarray
    temps: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    stop_ids: np.ndarray | None = None
    new_blocks: int = 0
    sampled: bool = False
    filtered: bool = False

    def sampling(self) -> dict:
        """The step's sampling keywords: greedy (no per-row arrays) where no row samples, and
        no top-k/top-p arrays where no row filters, so each compiles its own lean body."""
        return {"temperature": self.temps if self.sampled else 0.0,
                "top_k": self.top_k if self.filtered else 0,
                "top_p": self.top_p if self.filtered else 1.0,
                "seeds": self.seeds if self.sampled else None}


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (``LLMEngine.stats``). Token occupancy is the tokens the
    running sequences hold over the pool's token capacity, beside block occupancy: the gap
    is internal fragmentation (the unfilled tails of last blocks)."""

    running: int
    waiting: int
    preemptions: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    block_occupancy: float
    token_occupancy: float
    prefix_cache_hit_rate: float
    copy_on_write_copies: int
    prefill_executables: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of them, tokens found (the hit rate is their ratio)
    finished: int = 0  # requests finished so far; the medians below are over them (seconds)
    median_ttft: float | None = None
    median_tpot: float | None = None
    median_itl: float | None = None
    median_e2e: float | None = None


class LLMEngine:
    """Serve requests as they come and go: ``add_request``, ``step``, ``abort_request``.

    Args:
      model: a ``Llama``.
      tokenizer: a ``paged_jax.model.tokenizer.Tokenizer`` for text prompts, output text and
        stop strings; None for token ids only.
      eos_token_id: the id that ends a completion (default: the tokenizer's).
      block_size, num_blocks: the pool; ``num_blocks=None`` fits ``kv_cache_bytes`` (256 MiB
        by default) through ``plan_blocks``.
      max_num_seqs: sequence slots (rows of every dispatch).
      max_model_len: tokens per sequence at most, prompt plus output (the table width).
      max_num_batched_tokens: prefill tokens per iteration at most (the chunk budget).
      prefill_tokens_while_decoding: the chunk budget of an iteration that also decodes (at
        most ``max_num_batched_tokens``; None: the same). A decoding row's next token waits
        for the iteration's prefill, so this bounds the inter-token latency's tail; a long
        prompt takes more iterations for it, each with a decode step.
      join_decode: a prompt whose prefill finishes in an iteration with a decode dispatch
        decodes in it too, where the free blocks hold its steps, rather than waiting for the
        next iteration's (``scheduler``'s docstring, 5). False: only the rows planned.
      steps_per_dispatch: K, decode steps per dispatch.
      steps_while_prefilling: decode steps per dispatch in an iteration that prefills (at
        most K; 1 by default, as a step that mixes decode rows and prefill chunks would
        make). Every decode step computes every slot's row: K steps beside each chunk hold
        the prompt's first token behind them and run steps for slots that have nothing to
        decode yet. Set it to K for K throughout.
      max_dispatch_ms: the longest a decode dispatch of K steps may take, so that a request
        that arrives meanwhile waits at most about this long for its prefill to start. The
        engine times every decode dispatch but the first of each shape (which compiles it);
        where the last one timed over as many rows (``decode_rows_for``; a count not timed
        yet is bounded by those that were, see ``dispatch_steps``) took longer than this per
        K steps, it dispatches ``steps_while_prefilling`` steps instead (the length
        iterations that prefill use; ``warm_up`` compiles both). K amortizes a host round
        trip: it pays where steps are short (a small model, a GPU) and costs a new arrival
        most of the dispatch where they are long (a real model on a CPU). None: K whenever
        nothing is prefilled.
      first_tokens_first: an iteration whose prefill finishes a prompt and leaves none to
        prefill runs no decode dispatch (never two such iterations in a row; ``scheduler``'s
        docstring, 4), so ``step()`` returns the prompt's first token after its prefill
        alone; the other rows decode in the next iteration, with the new one. False: every
        iteration decodes. Off where ``one_prefill_chunk`` and ``decode_with_prefill`` run
        each chunk with its decode step (``steps_while_prefilling=1``): the prompt's first
        token then comes from that one dispatch.
      deliver_each_prefill: an iteration's prefill dispatches (one per width class) run
        narrowest first, and ``step()`` returns after each one that finishes a prompt while
        more of the iteration is left: the prompt's first token comes back after its own
        dispatch, not after the iteration's wider chunks and its decode as well. The next
        ``step()`` call runs the rest of the iteration before planning another, so every
        dispatch is the one the plan made. False: ``step()`` runs the whole iteration.
      enable_prefix_caching: keep full blocks for later prompts with the same prefix.
      scheduling_policy: the admission order. ``"fcfs"``: arrival order. ``"shortest_first"``:
        the requests added since the previous ``step`` go shortest prompt first among
        themselves (behind every request added before them), which lowers their median TTFT
        when many arrive together.
      seed: the default for requests without their own.
      impl: the decode attention (``"auto"``, ``"xla"``, ``"pallas"``).
      debug: check the allocator's invariants and the host's view after every step.
      prefill_by_width: run an iteration's prefill chunks (those not packed) as one
        dispatch per width class (a power of two), so that a short chunk is not padded to the
        longest one's width; False runs them all in one dispatch (``paged-jax bench serve``
        compares the two).
      pack_prefill: where requests are still queued after an iteration's plan, run its
        chunks that start a prompt as one ``prefill_packed`` dispatch, their tokens one after
        another in a row as long as their sum (rounded up to a power of two), rather than
        rows padded to a width class: one dispatch reads the weights once for all of them,
        and no row is padded, so the queue drains sooner. With none queued, the chunks run by
        width class, narrowest first, so that a short prompt's first token does not wait for
        a longer one's prefill (``paged-jax bench serve`` compares the two). Chunks after
        cached tokens always go through ``prefill_by_width``.
      decode_with_prefill: where an iteration's last prefill dispatch is one row (a chunk after
        cached tokens, or a new prompt's) and its decode is one step (as
        ``steps_while_prefilling`` makes it), run both as one ``prefill_decode`` dispatch:
        one forward pass, which reads the weights once for both, and one host round trip.
        Its decode rows are ``decode_rows_for``'s, as a decode dispatch's. The chunk's
        prompt, if this finishes it, decodes from the next iteration on (``paged-jax bench
        serve`` compares the two). Off by default: every (chunk width, decode rows) pair is
        one more executable to compile, each slower to compile than a prefill shape, and an
        XLA:CPU process that holds a few dozen of a real model's executables can run out of
        memory mappings (``warm_up`` compiles them all; the README's server section says how
        to raise the limit).
      one_prefill_chunk: each iteration with decode rows prefills one prompt's chunk at
        most (``scheduler``'s docstring, 6). With ``decode_with_prefill`` every iteration
        whose rows decode is then one dispatch, so their next token waits for one chunk of at
        most ``prefill_tokens_while_decoding`` tokens: the inter-token latency's tail (and the
        iteration that finishes a prompt decodes too: ``first_tokens_first`` is off). An
        iteration without decode rows takes several chunks only where each starts its
        prompt, packed into one dispatch (with ``pack_prefill``). While rows decode, prompts
        are then prefilled one after another, so where many arrive together the later ones'
        first tokens come later (``paged-jax bench serve`` compares the two). Off by
        default.
      bucket_decode_rows: run each decode dispatch on the slots up to the highest one
        decoding, rounded up to a power of two (``decode_rows_for``); False computes every slot
        in every step (``paged-jax bench serve`` compares the two).
      condense_slots: before a decode dispatch (or a ``prefill_decode``) whose highest
        decoding slot lies above the power of two that covers its row count, move the rows
        above it into the free slots below (or swap them with sequences there that are being
        prefilled; ``Scheduler.condense``, ``move_slots``): a row left in a high slot after
        the ones below it finished would make every dispatch compute all the slots below it.
        Only the table rows move, never a block. False leaves every sequence in the slot it
        was admitted to (``paged-jax bench serve`` compares the two).
      steps: the model's compiled ``Steps`` to reuse (engines over one model share their
        compiled prefill and decode through it); None builds one.
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` axis to run tensor parallel over its
        devices (``paged_jax.sharding``): the params are split Megatron-style, the pool over
        its KV heads, the ``BlockState`` replicated. A ``"dp"`` axis must have size 1 here
        (``DataParallelEngine`` runs one engine per replica). A mesh that cannot apply raises
        ``ValueError`` before anything is placed or compiled.
    """

    def __init__(self, model: Llama, tokenizer=None, *, eos_token_id: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 8,
                 max_model_len: int = 1024, max_num_batched_tokens: int = 512,
                 prefill_tokens_while_decoding: int | None = None, join_decode: bool = True,
                 steps_per_dispatch: int = 8, steps_while_prefilling: int = 1,
                 max_dispatch_ms: float | None = DEFAULT_MAX_DISPATCH_MS,
                 first_tokens_first: bool = True, deliver_each_prefill: bool = True,
                 enable_prefix_caching: bool = True,
                 scheduling_policy: str = "fcfs",
                 seed: int = 0, impl: str = "auto", kv_cache_bytes: int = DEFAULT_KV_BYTES,
                 debug: bool = False, steps: Steps | None = None,
                 prefill_by_width: bool = True, pack_prefill: bool = True,
                 decode_with_prefill: bool = False, one_prefill_chunk: bool = False,
                 bucket_decode_rows: bool = True, condense_slots: bool = True, mesh=None):
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("steps_per_dispatch", steps_per_dispatch),
                            ("steps_while_prefilling", steps_while_prefilling)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int. Got {value!r}.")
        if prefill_tokens_while_decoding is not None and (
                not isinstance(prefill_tokens_while_decoding, int)
                or isinstance(prefill_tokens_while_decoding, bool)
                or not 1 <= prefill_tokens_while_decoding <= max_num_batched_tokens):
            raise ValueError(f"prefill_tokens_while_decoding must be an int in [1, "
                             f"max_num_batched_tokens={max_num_batched_tokens}] or None. Got "
                             f"{prefill_tokens_while_decoding!r}.")
        if max_dispatch_ms is not None and (
                isinstance(max_dispatch_ms, bool) or not isinstance(max_dispatch_ms, (int, float))
                or not 0 < max_dispatch_ms < math.inf):
            raise ValueError(f"max_dispatch_ms must be a positive finite number of "
                             f"milliseconds or None. Got {max_dispatch_ms!r}.")
        if scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}. "
                             f"Got {scheduling_policy!r}.")
        if steps_while_prefilling > steps_per_dispatch:
            raise ValueError(f"steps_while_prefilling must be at most steps_per_dispatch "
                             f"({steps_per_dispatch}). Got {steps_while_prefilling}.")
        if num_blocks is None:
            num_blocks = plan_blocks(model.config, kv_cache_bytes, block_size).num_blocks
        max_blocks = math.ceil(max_model_len / block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int. Got {num_blocks!r}.")
        if mesh is not None:
            check_model(model.config, mesh)
            mesh = auto_axes(mesh)
        self.mesh = mesh
        self.model_config = model.config
        self.tokenizer = tokenizer
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        self.cache_config = CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                        max_seqs=max_num_seqs, max_blocks_per_seq=max_blocks)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.steps_per_dispatch = steps_per_dispatch
        self.steps_while_prefilling = steps_while_prefilling
        self.max_dispatch_ms = max_dispatch_ms
        # Per decode row count: seconds per step of the last timed dispatch over that many
        # rows. The first dispatch of each compiled shape is not timed: it includes its
        # compilation (seconds), which would read as a slow step.
        self._step_seconds: dict[int, float] = {}
        self._dispatched: set[tuple] = set()
        self.enable_prefix_caching = enable_prefix_caching
        self.seed, self.impl, self.debug = seed, impl, debug
        self.prefill_by_width = bool(prefill_by_width)
        self.pack_prefill = bool(pack_prefill)
        self.decode_with_prefill = bool(decode_with_prefill)
        self.deliver_each_prefill = bool(deliver_each_prefill)
        self._rest: _Iteration | None = None  # the iteration step() is part way through
        self.bucket_decode_rows = bool(bucket_decode_rows)
        self.condense_slots = bool(condense_slots)

        graphdef = nnx.split(model)[0]
        self.graphdef, self.params = graphdef, serving_params(model)
        if steps is None:
            steps = Steps(graphdef, mesh=mesh)  # the model's jitted prefill and decode
        elif not isinstance(steps, Steps) or steps.graphdef != graphdef:
            raise ValueError("steps must be a Steps built from this model's graph "
                             "(Steps(nnx.split(model)[0])).")
        elif steps.mesh != mesh:
            raise ValueError(f"steps must be built on the engine's mesh ({mesh}). Got a Steps "
                             f"on {steps.mesh}.")
        self.steps = steps
        if mesh is None:
            self.kv = init_cache(model.config, self.cache_config)
            self.state = init_state(self.cache_config)
        else:
            self.params = shard_params(self.params, mesh)
            self.kv = init_sharded_cache(model.config, self.cache_config, mesh)
            self.state = replicate(init_state(self.cache_config), mesh)
        # The allocator ops applied between dispatches, jitted once for this engine; the
        # state is donated, so each updates the pool in place.
        self._release = jax.jit(release, donate_argnums=0)
        self._fork = jax.jit(fork, donate_argnums=0)
        self._admit_cached = jax.jit(admit_cached, donate_argnums=0)
        self._hold = jax.jit(share_blocks, donate_argnums=0)
        self._unhold = jax.jit(free_blocks, donate_argnums=0)
        self._move = jax.jit(move_slots, donate_argnums=0)
        self._invariants = jax.jit(check_invariants)

        # Every iteration's chunk runs in one dispatch with its decode step: the chunk that
        # finishes a prompt returns its first token from that dispatch, and deferring the
        # decode rows (first tokens first) would make them wait for two dispatches.
        merged = self.merges_prefill_decode and one_prefill_chunk
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   steps_per_dispatch=steps_per_dispatch, block_size=block_size,
                                   steps_while_prefilling=steps_while_prefilling,
                                   policy=scheduling_policy,
                                   first_tokens_first=bool(first_tokens_first) and not merged,
                                   prefill_tokens_while_decoding=prefill_tokens_while_decoding,
                                   one_prefill_chunk=bool(one_prefill_chunk),
                                   join_decode=bool(join_decode))
        self.prefix_cache = PrefixCache(block_size)
        self.requests: dict[str, _Request] = {}
        self._arrivals = 0
        self._cow_copies = 0
        # (rows, width) of each prefill dispatched, ("packed", width) of each packed one,
        # ("prefill_decode", width, decode rows) of each chunk run with the decode step.
        self._prefill_shapes: set[tuple] = set()
        # Per slot: the chain hash of its last cached full block and how many are entered.
        self._chain: dict[int, tuple[int, bytes]] = {}
        # (request id, Lookup) of every admission's prefix lookup. The scheduler may look a
        # queued sequence up again each step until it fits; only the admitting lookup counts.
        self.lookups: list[tuple[str, Lookup]] = []
        self._hit_tokens = self._looked_up_tokens = 0
        self.listeners: list = []
        self.steps_run = 0
        self._tables_of, self._tables_host = None, None
        # (request id, RequestMetrics) of every finished request, in finishing order.
        self.finished_metrics: list[tuple[str, RequestMetrics]] = []

    def add_listener(self, listener) -> None:
        """Call ``listener(event)`` with every event (``paged_jax.engine.events``): the KV
        cache events in vLLM's names, and the scheduling events with the state after each
        step. With no listener, nothing is built or read back for them."""
        self.listeners.append(listener)

    def _publish(self, make) -> None:
        if self.listeners:
            event = make()
            for listener in self.listeners:
                listener(event)

    def _refs(self, blocks) -> list[int]:
        ref = np.asarray(jax.device_get(self.state.ref_counts))
        return [int(ref[b]) for b in blocks]

    def _slot_blocks(self, slot: int) -> list[int]:
        row = self._tables()[slot]
        return [int(b) for b in row[row >= 0]]

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache: its held references are dropped (blocks no sequence uses
        become free) and ``AllBlocksCleared`` is published."""
        blocks = self.prefix_cache.clear()
        if blocks:
            self.state, status = self._unhold(self.state, self._padded(blocks))
            status.raise_if_failed()
        self._publish(ev.AllBlocksCleared)

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt`` is text (with a tokenizer) or token ids. Raises
        ``ValueError`` naming the problem (a duplicate id, an empty prompt, a token outside
        the vocabulary, a request that can never fit) with nothing else changed."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams. Got {type(params).__name__}.")
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        text, ids = self._prompt_ids(prompt)
        total = len(ids) + params.max_tokens
        cap = min(self.cache_config.max_tokens_per_seq, self.max_model_len)
        pool = self.cache_config.num_blocks * self.cache_config.block_size
        if total > cap:
            raise ValueError(
                f"Request {request_id!r}: prompt ({len(ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len {cap}.")
        blocks = math.ceil(total / self.cache_config.block_size) + params.n - 1
        if blocks > self.cache_config.num_blocks:
            raise ValueError(
                f"Request {request_id!r}: prompt ({len(ids)} tokens) + max_tokens "
                f"({params.max_tokens}) needs {blocks} blocks with n={params.n}, more than the "
                f"pool's {self.cache_config.num_blocks} ({pool} tokens).")
        if params.n > self.cache_config.max_seqs:
            raise ValueError(f"Request {request_id!r}: n={params.n} exceeds max_num_seqs "
                             f"{self.cache_config.max_seqs}.")
        now = time.perf_counter() if arrival_time is None else arrival_time
        seed = self.seed * 1_000_003 + self._arrivals if params.seed is None else params.seed
        seq = Sequence(request_id=request_id, index=0, arrival=self._arrivals,
                       prompt_ids=list(ids), max_tokens=params.max_tokens, fork=params.n,
                       seed=completion_seed(seed, 0), request_seed=seed)
        self.requests[request_id] = _Request(request_id, text, list(ids), params,
                                             RequestMetrics(arrival_time=now), self._arrivals,
                                             [seq])
        self._arrivals += 1
        self.scheduler.add(seq)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("A text prompt needs a tokenizer; this engine has none. Pass "
                                 "token ids.")
            if not prompt:
                raise ValueError("The prompt is empty.")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("The prompt is empty (no token ids).")
        vocab = self.model_config.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
        if bad:
            i, t = bad[0]
            raise ValueError(f"Prompt token {t} at position {i} is outside the vocabulary "
                             f"[0, {vocab}).")
        return None, ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its slots and blocks are released and it is forgotten (it is
        not reported again). ``KeyError`` for an id that is not running or waiting."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"No unfinished request {request_id!r} to abort.")
        req.aborted = True
        live = [s for s in req.seqs if s.finish_reason is None]
        for s in live:
            s.finish_reason = "abort"
        self._free(self.scheduler.remove(live))
        req.metrics.finished_time = time.perf_counter()
        del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # -- one iteration -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration, or its next part (``deliver_each_prefill``); returns the
        requests whose outputs changed (new tokens, or finished), each with its whole output
        so far."""
        # A part-run iteration goes on without the rows aborted since the last call; if that
        # leaves nothing to run, a new one is planned rather than an empty part run.
        if self._rest is None or not self._rest.drop_aborted():
            self._rest = self._begin()
        rest, touched = self._rest, {}
        copies, prefilled, mixed = self._cow_copies, 0, False
        while rest.groups:
            width, rows, packed = rest.groups.pop(0)
            prefilled += sum(n for _, _, n in rows)
            if not rest.groups and self._decodes_with_prefill(rest.plan, rows):
                self._run_prefill_decode(rest.plan, rows, width, rest.now, touched)
                mixed = True
            elif self._prefill_group(rows, width, rest.now, touched, packed) and rest.groups \
                    and self.deliver_each_prefill:
                break
        decode = []
        if not rest.groups:
            self._rest = None
            if rest.plan.decode and not mixed:
                self._join_decode(rest.plan)
                self._run_decode(rest.plan, touched)
            decode = rest.plan.decode
        if self.debug:
            self.check()
        self.steps_run += 1
        self._publish(lambda: ev.StepDone(
            step=self.steps_run, state=self.state,
            slots={s.slot: (s.request_id, s.index) for s in self.scheduler.running},
            prefill_tokens=prefilled, decode_rows=len(decode),
            copies=self._cow_copies - copies))
        # Tokens reach the caller when step() returns, not when their dispatch ended: a
        # prompt's first token waits for the dispatches that follow its prefill in the call.
        delivered = time.perf_counter()
        for req in touched.values():
            req.metrics.deliver(delivered)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():  # a finished request is reported once, then forgotten
            if req.finished:
                del self.requests[req.request_id]
                self.finished_metrics.append((req.request_id, req.metrics))
        return outputs

    def _begin(self) -> _Iteration:
        """Plan an iteration and start it: preempted slots released, cached blocks evicted
        for it, new admissions entered on their prefix-cache hits. Its prefill dispatches and
        its decode are left to run."""
        snap = PoolSnapshot.take(self.state, self.prefix_cache, self.cache_config.block_size,
                                 self.enable_prefix_caching)
        plan = self.scheduler.schedule(snap, steps=self.dispatch_steps())
        now = time.perf_counter()
        for seq, slot in plan.preempt:
            self._publish(lambda seq=seq, slot=slot: ev.Preempted(
                seq.request_id, seq.index, slot, self._slot_blocks(slot)))
            self._release_slots([slot])
            self.requests[seq.request_id].metrics.preemptions += 1
        self._evict_for(plan, snap)
        if plan.admitted:
            self._admit(plan, snap)
        return _Iteration(plan, self._prefill_groups(plan), now)

    def _evict_for(self, plan: Plan, snap: PoolSnapshot) -> None:
        """Free cached blocks until the plan's new blocks fit in the free list."""
        need = sum(snap.decode_need(s, n) for s, n in plan.decode)
        bs = self.cache_config.block_size
        for _, start, length in plan.prefill:
            need += cdiv(start + length, bs) - cdiv(start, bs)
        need += sum(s.fork - 1 for s, start, length in plan.prefill
                    if start + length == len(s.target))
        short = need - int(self.state.num_free)
        if short <= 0:
            return
        # Read after the preemptions' releases, which may have left more blocks evictable.
        ref = np.asarray(jax.device_get(self.state.ref_counts))
        # The hits of this plan's admissions are about to be used; a lookup that did not
        # lead to an admission holds nothing.
        in_use = {b for s in plan.admitted for b in snap.hits.get(id(s), ())}
        evictable = {b for b in self.prefix_cache.blocks() if ref[b] == 1} - in_use
        gone = self.prefix_cache.evict(short, evictable)
        if gone:
            hashes = self.prefix_cache.last_evicted
            self.state, status = self._unhold(self.state, self._padded(gone))
            status.raise_if_failed()
            self._publish(lambda: ev.BlockRemoved([ev.hash_int(hashes[b]) for b in gone],
                                                  list(gone), self._refs(gone)))

    def _admit(self, plan: Plan, snap: PoolSnapshot) -> None:
        """Start the plan's new admissions on their prefix-cache hits (or on nothing)."""
        cfg = self.cache_config
        ids = np.full(cfg.max_seqs, -1, np.int32)
        tables = np.full((cfg.max_seqs, cfg.max_blocks_per_seq), -1, np.int32)
        counts = np.zeros(cfg.max_seqs, np.int32)
        for i, s in enumerate(plan.admitted):
            blocks = snap.hits.get(id(s), [])[: s.cached // cfg.block_size]
            ids[i] = s.slot
            tables[i, : len(blocks)] = blocks
            counts[i] = s.cached
            self._chain[s.slot] = (len(blocks), self._hash_of(blocks))
            record = snap.lookups.get(id(s))
            if record is not None:
                self.lookups.append((s.request_id, record))
                self._hit_tokens += record.hit_tokens
                self._looked_up_tokens += max(record.target_tokens - 1, 0)
            self._publish(lambda s=s, blocks=blocks, record=record: ev.Admitted(
                s.request_id, s.index, s.slot, [int(b) for b in blocks], record))
        self.state, status = self._admit_cached(self.state, ids, tables, counts)
        status.raise_if_failed()

    def _prefill_groups(self, plan: Plan) -> list[tuple[int, list, bool]]:
        """The plan's prefill chunks as ``(width, rows, packed)`` dispatches. With
        ``pack_prefill`` and requests still queued after the plan (or several chunks under
        ``one_prefill_chunk``), the chunks that start a prompt (nothing cached before them)
        go first, in one ``prefill_packed`` dispatch of ``width`` tokens in all. The others
        (after a prefix-cache hit or an earlier chunk), and every chunk otherwise, go
        through ``prefill``, which computes rows x
        width positions, padding included: one dispatch per width class, narrowest first, so
        that a short chunk is not padded to the longest one's width (every row extends its
        active slot) and its first token does not wait for the longer ones."""
        rows = plan.prefill
        groups = []
        # Under one_prefill_chunk, several chunks are all first chunks (scheduler docstring,
        # 6), packed so that the iteration is one dispatch.
        if self.pack_prefill and (self.scheduler.waiting or (self.scheduler.one_prefill_chunk
                                                             and len(rows) > 1)):
            fresh = [row for row in rows if row[1] == 0]
            rows = [row for row in rows if row[1] != 0]
            if fresh:
                total = sum(length for _, _, length in fresh)
                groups.append((pow2_at_least(total, MIN_PREFILL_WIDTH,
                                             self.max_num_batched_tokens), fresh, True))
        if not rows:
            return groups
        by_width: dict[int, list] = {}
        widest = max(length for _, _, length in rows)
        for row in rows:
            length = row[2] if self.prefill_by_width else widest
            width = pow2_at_least(length, MIN_PREFILL_WIDTH, self.max_num_batched_tokens)
            by_width.setdefault(width, []).append(row)
        return groups + [(width, group, False) for width, group in sorted(by_width.items())]

    def _prefill_group(self, rows, width: int, now: float, touched, packed: bool) -> bool:
        """One prefill dispatch of ``rows`` (``(seq, start, length)`` chunks: each at most
        ``width`` tokens, or ``width`` in all where ``packed``), then each finished prompt's
        first token; whether a prompt finished."""
        if packed:
            self._prefill_shapes.add(("packed", width))
            tokens = np.zeros(width, np.int32)
            slots = np.full(self.cache_config.max_seqs, -1, np.int32)
            lens = np.zeros(self.cache_config.max_seqs, np.int32)
            at = 0
            for i, (s, start, length) in enumerate(rows):
                tokens[at:at + length] = s.target[start:start + length]
                slots[i], lens[i] = s.slot, length
                at += length
            logits, self.kv, self.state, status = self.steps.prefill_packed(
                self.params, self.kv, self.state, tokens, slots, lens)
        else:
            self._prefill_shapes.add((pow2_at_least(len(rows), 1, self.cache_config.max_seqs),
                                      width))
            logits, self.kv, self.state, status = self.steps.prefill(
                self.params, self.kv, self.state, *self._prefill_rows(rows, width))
        status.raise_if_failed()
        return self._prefilled(rows, logits, now, touched)

    def _prefill_rows(self, rows, width: int):
        """``prefill``'s ``(tokens, seq_ids, num_tokens, extend)`` for ``rows``, as many rows
        as the power of two that covers them (padding rows have slot -1)."""
        nrows = pow2_at_least(len(rows), 1, self.cache_config.max_seqs)
        tokens = np.zeros((nrows, width), np.int32)
        slots = np.full(nrows, -1, np.int32)
        lens = np.zeros(nrows, np.int32)
        for i, (s, start, length) in enumerate(rows):
            tokens[i, :length] = s.target[start:start + length]
            slots[i], lens[i] = s.slot, length
        return tokens, slots, lens, slots >= 0  # every real row continues its active slot

    def _prefilled(self, rows, logits, now: float, touched) -> bool:
        """After ``rows``' prefill dispatch: their cached tokens and blocks, then each finished
        prompt's first token from ``logits`` (row ``i`` of ``rows`` at row ``i``); whether a
        prompt finished."""
        done = []
        for i, (s, start, length) in enumerate(rows):
            s.cached = start + length
            self._enter_blocks(s)
            req = self.requests[s.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if s.cached == len(s.target):
                done.append((i, s))
        if done:
            self._first_tokens(logits, done, touched)
        return bool(done)

    @property
    def merges_prefill_decode(self) -> bool:
        """Whether a one-row prefill chunk and a decode step may run as one ``prefill_decode``
        dispatch: ``decode_with_prefill``, with the one-step decode of an iteration that
        prefills (``steps_while_prefilling=1``)."""
        return self.decode_with_prefill and self.steps_while_prefilling == 1

    def _decodes_with_prefill(self, plan: Plan, rows) -> bool:
        """Whether the iteration's last prefill dispatch, ``rows``, runs with its decode in
        one ``prefill_decode`` dispatch (``decode_with_prefill``): one row beside a decode
        dispatch of one step. A packed dispatch of one row is that row's chunk at the same
        width."""
        return (self.decode_with_prefill and len(rows) == 1 and bool(plan.decode)
                and plan.decode_steps == 1)

    def _run_prefill_decode(self, plan: Plan, rows, width: int, now: float, touched) -> None:
        """The iteration's last prefill chunk and its decode step in one ``prefill_decode``
        dispatch. The rows whose prompt finished in the iteration's earlier dispatches join
        the decode first (``join_decode``); the chunk's own prompt, if this finishes it,
        gets its first token from the dispatch's logits and decodes in the next iteration."""
        ((seq, start, length),) = rows
        bs = self.cache_config.block_size
        chunk_blocks = cdiv(start + length, bs) - cdiv(start, bs)
        self._join_decode(plan, chunk_blocks)
        self._condense(plan)
        d = self._decode_rows(plan)
        decode_rows = self.decode_rows_for(max(s.slot for s, _ in plan.decode))
        self._prefill_shapes.add(("prefill_decode", width, decode_rows))
        free_before = int(self.state.num_free)
        emitted, logits, self.kv, self.state, status = self.steps.prefill_decode(
            self.params, self.kv, self.state, *self._prefill_rows(rows, width), d.tokens, None,
            impl=self.impl, budgets=d.budgets, rows=decode_rows, **d.sampling())
        status.raise_if_failed()
        emitted = np.asarray(jax.device_get(emitted))[None]  # [1, S], as decode_steps' [K, S]
        # A continuing chunk fills its own last block and takes new ones: it copies none.
        self._decoded(plan, emitted, free_before - chunk_blocks - int(self.state.num_free)
                      - d.new_blocks, touched)
        self._prefilled(rows, logits, now, touched)

    def _hash_of(self, blocks) -> bytes:
        return self.prefix_cache.by_block[blocks[-1]] if blocks else ROOT

    def _first_tokens(self, logits, done, touched) -> None:
        """Sample each finished prompt's first token (forking ``n > 1`` first)."""
        rows, seqs = [], []
        for i, s in done:
            s.decoding = True
            if s.fork > 1:
                children = self._fork_children(s)
                rows += [i] * (1 + len(children))
                seqs += [s, *children]
            else:
                rows.append(i)
                seqs.append(s)
        params = [self.requests[s.request_id].params for s in seqs]
        # Every array here has max_seqs rows (padding repeats row 0): one compilation.
        width = self.cache_config.max_seqs
        pad = width - len(rows)
        picked = logits[np.array(rows + [0] * pad, np.int32)]
        temps = np.array([p.temperature for p in params] + [0.0] * pad, np.float32)
        if not temps.any():
            first = np.asarray(sample(picked, None, 0.0))
        else:
            keys = row_keys(np.array([s.seed for s in seqs] + [0] * pad, np.uint32),
                            np.array([len(s.target) for s in seqs] + [0] * pad, np.uint32))
            first = np.asarray(sample(
                picked, keys, temps,
                np.array([p.filter_top_k for p in params] + [0] * pad, np.int32),
                np.array([p.top_p for p in params] + [1.0] * pad, np.float32)))
        for s, token in zip(seqs, first[: len(seqs)].tolist(), strict=True):
            self._emit(s, [token], touched)

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        req = self.requests[parent.request_id]
        slots, parent.reserved = parent.reserved, []
        children = []
        for index, slot in enumerate(slots, start=1):
            child = Sequence(request_id=parent.request_id, index=index, arrival=parent.arrival,
                             prompt_ids=parent.prompt_ids, max_tokens=parent.max_tokens,
                             slot=slot, cached=parent.cached, decoding=True,
                             seed=completion_seed(parent.request_seed, index),
                             request_seed=parent.request_seed)
            children.append(child)
            self.scheduler.adopt(child)
            self._chain[slot] = self._chain[parent.slot]
        parent.fork = 1
        self.state, status = self._fork(self.state, self._per_slot([parent.slot] * len(slots)),
                                        self._per_slot(slots))
        status.raise_if_failed()
        self._publish(lambda: ev.Forked(parent.request_id, parent.slot, list(slots)))
        req.seqs += children
        return children

    def _join_decode(self, plan: Plan, taken: int = 0) -> None:
        """Add the rows whose prompt finished in this iteration to its decode dispatch, as
        many as the free blocks hold, less ``taken`` that a prefill in the same dispatch
        takes (``join_decode``; ``Scheduler.join``). Not the
        completions of a request with ``n > 1``: they forked in this iteration, and a step
        is published as one snapshot, so their first writes (a copy on write of the shared
        last block) come in the next one, where a picture can show them after the fork."""
        joiners = [s for s in self.scheduler.joiners(plan)
                   if self.requests[s.request_id].params.n == 1]
        if joiners:
            snap = PoolSnapshot.take(self.state, self.prefix_cache, self.cache_config.block_size,
                                     self.enable_prefix_caching)
            self.scheduler.join(plan, joiners, snap, snap.num_free - taken)

    def dispatch_steps(self) -> int:
        """The decode dispatch length for this iteration when nothing is prefilled: K, or
        ``steps_while_prefilling`` where the last dispatch over as many rows as the running
        sequences need took longer than ``max_dispatch_ms`` per K steps (see ``__init__``).
        A step over more rows takes at least as long as over fewer, so a row count not timed
        yet takes the shortest time of the more rows timed (an upper bound: K only where it
        fits), or where none was, the longest of the fewer rows timed; K until any was."""
        k = self.steps_per_dispatch
        slots = [s.slot for s in self.scheduler.running if s.decoding]
        if self.max_dispatch_ms is None or not slots:
            return k
        rows = self.decode_rows_for(max(slots))
        if self.condense_slots:  # the rows will move down into as many slots as they need
            rows = min(rows, self.decode_rows_for(len(slots) - 1))
        per_step = self._step_seconds.get(rows)
        if per_step is None:  # a step over more rows takes at least as long as over fewer
            more = [t for r, t in self._step_seconds.items() if r > rows]
            per_step = min(more) if more else max(
                (t for r, t in self._step_seconds.items() if r < rows), default=None)
        if per_step is None or per_step * k * 1e3 <= self.max_dispatch_ms:
            return k
        return self.steps_while_prefilling

    def decode_rows_for(self, highest_slot: int) -> int:
        """The rows a decode dispatch computes when ``highest_slot`` is the highest slot it
        decodes: the power of two covering it (at most ``max_num_seqs``), or every slot without
        ``bucket_decode_rows``. ``warm_up`` compiles each value this takes."""
        s_count = self.cache_config.max_seqs
        if not self.bucket_decode_rows:
            return s_count
        return pow2_at_least(highest_slot + 1, 1, s_count)

    def _condense(self, plan: Plan) -> None:
        """Move ``plan``'s decode rows into the slots below the row count that covers them,
        where some lie above it (``condense_slots``): the scheduler picks the moves, the pool
        makes them in one ``move_slots``, and each slot's prefix-cache chain follows."""
        if not (self.condense_slots and self.bucket_decode_rows and plan.decode):
            return
        moves = self.scheduler.condense([s for s, _ in plan.decode],
                                        self.decode_rows_for(len(plan.decode) - 1))
        if not moves:
            return
        self.state, status = self._move(self.state,
                                        self._per_slot([old for _, old, _ in moves]),
                                        self._per_slot([new for _, _, new in moves]))
        status.raise_if_failed()
        # Every moved slot's chain is taken out before any is put back: a swap's two slots
        # trade theirs.
        self._chain.update({new: self._chain.pop(old) for _, old, new in moves
                            if old in self._chain})
        for seq, old, new in moves:
            self._publish(lambda seq=seq, old=old, new=new: ev.Moved(
                seq.request_id, seq.index, old, new))

    def _decode_rows(self, plan: Plan) -> _DecodeRows:
        """The per-slot arrays of ``plan``'s decode rows (``_DecodeRows``)."""
        cfg = self.cache_config
        s_count = cfg.max_seqs
        d = _DecodeRows(
            tokens=np.zeros(s_count, np.int32), budgets=np.zeros(s_count, np.int32),
            seeds=np.zeros(s_count, np.int32), temps=np.zeros(s_count, np.float32),
            top_k=np.zeros(s_count, np.int32), top_p=np.ones(s_count, np.float32))
        stops = [[] for _ in range(s_count)]
        for s, n in plan.decode:
            p = self.requests[s.request_id].params
            r = s.slot
            d.tokens[r], d.budgets[r], d.seeds[r] = s.output_ids[-1], n, s.seed
            d.temps[r], d.top_k[r], d.top_p[r] = p.temperature, p.filter_top_k, p.top_p
            stops[r] = sorted(self._stop_ids(p))
            d.new_blocks += cdiv(s.cached + n, cfg.block_size) - cdiv(s.cached, cfg.block_size)
        width = pow2_at_least(max(map(len, stops)), 1, 1 << 30)
        d.stop_ids = np.full((s_count, width), -1, np.int32)
        for r, ids in enumerate(stops):
            d.stop_ids[r, : len(ids)] = ids
        d.sampled = bool(d.temps.any())
        d.filtered = d.sampled and bool((d.top_k > 0).any() or (d.top_p < 1).any())
        return d

    def _run_decode(self, plan: Plan, touched) -> None:
        self._condense(plan)
        d = self._decode_rows(plan)
        free_before = int(self.state.num_free)
        rows = self.decode_rows_for(max(s.slot for s, _ in plan.decode))
        start = time.perf_counter()
        toks, _, self.kv, self.state, status = self.steps.decode_steps(
            self.params, self.kv, self.state, d.tokens, None, num_steps=plan.decode_steps,
            impl=self.impl, budgets=d.budgets, stop_ids=d.stop_ids, rows=rows, **d.sampling())
        toks = np.asarray(jax.device_get(toks))  # [K, S], the host round trip
        shape = (rows, plan.decode_steps, d.sampled, d.filtered, d.stop_ids.shape[1])
        if shape in self._dispatched:
            self._step_seconds[rows] = (time.perf_counter() - start) / plan.decode_steps
        self._dispatched.add(shape)
        status.raise_if_failed()
        # Blocks taken beyond the new ones were copies on write (a first write after a fork).
        self._decoded(plan, toks, free_before - int(self.state.num_free) - d.new_blocks,
                      touched)

    def _decoded(self, plan: Plan, toks, copies: int, touched) -> None:
        """After ``plan``'s decode: ``copies`` copies on write counted, each row's tokens (its
        slot's column of ``toks`` [K, S], -1 past its stop) emitted."""
        self._cow_copies += copies
        for s, n in plan.decode:
            column = toks[:n, s.slot]
            emitted = column[column >= 0].tolist()
            s.cached += len(emitted)
            self._emit(s, emitted, touched)

    def _emit(self, seq: Sequence, new: list[int], touched) -> None:
        """Append ``new`` tokens to ``seq``, finish it if it ended, enter its full blocks."""
        req = self.requests[seq.request_id]
        now = UNDELIVERED  # stamped when step() returns (RequestMetrics.deliver)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        p = req.params
        stop_ids = self._stop_ids(p)
        for token in new:
            seq.output_ids.append(token)
            req.metrics.token_times.append(now)
            if token in stop_ids:
                seq.finish_reason = "stop"
                break
            if seq.remaining == 0:
                seq.finish_reason = "length"
                break
        text = self._text(seq)
        if p.stop and text is not None and _stop_at(text, p.stop) is not None:
            # Drop the tokens after the one that completed the stop string, and the string.
            while len(seq.output_ids) > 1 and _stop_at(self._text(seq, -1), p.stop) is not None:
                seq.output_ids.pop()
            text = text[: _stop_at(text, p.stop)]
            seq.finish_reason = "stop"
        req.texts[seq.index] = text or ""
        touched[req.request_id] = req
        if seq.finish_reason is not None:
            self._free(self.scheduler.remove([seq]))
            if req.finished:
                req.metrics.finished_time = now
        elif seq.slot is not None:
            self._enter_blocks(seq)

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        ids = set(p.stop_token_ids)
        if not p.ignore_eos and self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    def _text(self, seq: Sequence, end: int | None = None) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(seq.output_ids[:end])

    # -- blocks --------------------------------------------------------------------------------

    def _enter_blocks(self, seq: Sequence) -> None:
        """Enter ``seq``'s newly full blocks in the prefix cache, holding each new one."""
        if not self.enable_prefix_caching:
            return
        bs = self.cache_config.block_size
        done, parent = self._chain.get(seq.slot, (0, ROOT))
        full = seq.cached // bs
        if full <= done:
            return
        table = self._tables()[seq.slot]
        hold, stored = [], []
        target = seq.target
        for j in range(done, full):
            before = parent
            tokens = target[j * bs:(j + 1) * bs]
            parent, new = self.prefix_cache.insert(parent, tokens, int(table[j]))
            if new:
                hold.append(int(table[j]))
                stored.append((before, parent, tokens, int(table[j])))
        self._chain[seq.slot] = (full, parent)
        if hold:
            self.state, status = self._hold(self.state, self._padded(hold))
            status.raise_if_failed()
            for item in stored:
                self._publish(lambda item=item: self._stored(seq, *item))

    def _stored(self, seq: Sequence, parent: bytes, h: bytes, tokens, block: int):
        return ev.BlockStored(
            [ev.hash_int(h)], ev.hash_int(parent) if parent != ROOT else None,
            [int(t) for t in tokens], self.cache_config.block_size, None, [block],
            seq.request_id, self._refs([block]))

    def _per_slot(self, ids: list[int]) -> np.ndarray:
        """Slot ids padded with -1 to one entry per slot: the shape at which the slot ops
        (``release``, ``fork``, ``move_slots``) compile once."""
        out = np.full(self.cache_config.max_seqs, -1, np.int32)
        out[: len(ids)] = ids
        return out

    def _padded(self, blocks: list[int]) -> np.ndarray:
        """Block ids padded with -1 to a power of two: the loose-block ops compile once per
        size class, not once per count."""
        out = np.full(pow2_at_least(len(blocks), 8, 1 << 40), -1, np.int32)
        out[: len(blocks)] = blocks
        return out

    def _tables(self) -> np.ndarray:
        """The block tables on the host, read once per state (every op returns a new one)."""
        if self._tables_of is not self.state:
            self._tables_host = np.asarray(jax.device_get(self.state.block_tables))
            self._tables_of = self.state
        return self._tables_host

    def _free(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._publish(lambda s=s: ev.Finished(s.request_id, s.index, s.slot,
                                                  self._slot_blocks(s.slot),
                                                  s.finish_reason or "abort", s.cached))
        self._release_slots([s.slot for s in seqs])
        for s in seqs:
            s.slot = None

    def _release_slots(self, slots: list[int]) -> None:
        slots = [s for s in slots if s is not None]
        if not slots:
            return
        self.state, status = self._release(self.state, self._per_slot(slots))
        status.raise_if_failed()
        for slot in slots:
            self._chain.pop(slot, None)

    # -- reports ------------------------------------------------------------------------------

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=req.texts.get(s.index, ""),
                                 token_ids=list(s.output_ids), finish_reason=s.finish_reason)
                for s in sorted(req.seqs, key=lambda s: s.index)]
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_ids), outputs=outs,
                             finished=req.finished, metrics=req.metrics)

    def output(self, request_id: str) -> RequestOutput:
        return self._output(self.requests[request_id])

    def compile_pool_ops(self) -> None:
        """Compile the allocator ops the engine applies between dispatches at a fixed shape
        (one entry per slot): ``release``, ``fork``, ``admit_cached`` and ``move_slots``. Each
        runs once on padding alone, which changes nothing. Otherwise each compiles where it is
        first used (a request finishing, forking, admitted, its row condensed). The loose-block
        ops (``share_blocks``, ``free_blocks``) compile per size class on first use."""
        s = self.cache_config.max_seqs
        pad = self._per_slot([])
        self.state, released = self._release(self.state, pad)
        self.state, forked = self._fork(self.state, pad, pad)
        self.state, admitted = self._admit_cached(
            self.state, pad, np.full((s, self.cache_config.max_blocks_per_seq), -1, np.int32),
            np.zeros(s, np.int32))
        self.state, moved = self._move(self.state, pad, pad)
        for status in (released, forked, admitted, moved):
            status.raise_if_failed()

    def check(self) -> None:
        """Raise ``AssertionError`` unless the pool's invariants hold and the host's view
        (slots, lengths, cached blocks' held references) matches the device state."""
        report = jax.device_get(self._invariants(self.state))
        broken = [k for k, v in report.items() if not bool(v)]
        assert not broken, f"allocator invariants broken: {broken}"
        st = self.state
        lens, active, held = jax.device_get((st.seq_lens, st.active, st.held))
        slots = {s.slot: s for s in self.scheduler.running}
        for slot in range(self.cache_config.max_seqs):
            seq = slots.get(slot)
            assert bool(active[slot]) == (seq is not None), f"slot {slot} active={active[slot]}"
            if seq is not None:
                assert int(lens[slot]) == seq.cached, (slot, int(lens[slot]), seq.cached)
        cached = set(self.prefix_cache.blocks())
        assert {int(b) for b in np.flatnonzero(held)} == cached, "held blocks != cached blocks"

    def stats(self) -> EngineStats:
        st = self.state
        ref, num_free = jax.device_get((st.ref_counts, st.num_free))
        cfg = self.cache_config
        running = self.scheduler.running
        used = int(cfg.num_blocks - num_free)
        # Tokens in the used blocks: a shared block counts once, with its fullest holder's
        # count; a block only the prefix cache holds is full.
        tables, bs = self._tables(), cfg.block_size
        fill = {b: bs for b in self.prefix_cache.blocks()}
        for s in running:
            row = tables[s.slot]
            for j, b in enumerate(row[row >= 0].tolist()):
                fill[b] = max(fill.get(b, 0), min(bs, max(s.cached - j * bs, 0)))
        tokens = sum(fill.values())
        return EngineStats(
            running=len(running), waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions, blocks_total=cfg.num_blocks,
            blocks_used=used, blocks_free=int(num_free),
            blocks_cached=len(self.prefix_cache),
            block_occupancy=used / cfg.num_blocks,
            token_occupancy=tokens / (cfg.num_blocks * cfg.block_size),
            prefix_cache_hit_rate=(self._hit_tokens / self._looked_up_tokens
                                   if self._looked_up_tokens else 0.0),
            copy_on_write_copies=self._cow_copies,
            prefill_executables=len(self._prefill_shapes),
            prefix_cache_queries=self._looked_up_tokens, prefix_cache_hits=self._hit_tokens,
            finished=len(self.finished_metrics),
            **{f"median_{name}": _median(values) for name, values in self._latencies().items()})

    def _latencies(self) -> dict[str, list[float]]:
        ms = [m for _, m in self.finished_metrics]
        return {"ttft": [m.ttft for m in ms if m.ttft is not None],
                "tpot": [m.tpot for m in ms if m.tpot is not None],
                "itl": [gap for m in ms for gap in m.itl],
                "e2e": [m.e2e for m in ms if m.e2e is not None]}
