"""The jitted serving steps: ``prefill``, ``prefill_packed``, ``prefill_decode``,
``decode_step`` and the K-step ``decode_steps``.

Each step takes the model as ``(graphdef, params)`` from ``nnx.split`` (the graph is static,
the parameters are arguments, never constants in the HLO), the paged ``KVCache`` and the
allocator's ``BlockState``, and returns them updated. ``params`` may be the ``nnx.State`` or,
cheaper per call, its plain nested dict ``nnx.to_pure_dict(params)``: jit flattens its
arguments on every call, and an ``nnx.State`` flattens through a Python callback per
variable where the dict needs none. A serving loop converts once, with ``serving_params``:
that dict plus what the steps would otherwise make from the parameters in every dispatch
(a 16-bit model's embedding bits on CPU, ``Llama.embedding_bits``). The cache and the state
are donated: XLA updates them in place and the caller's input arrays are deleted.

Row ``s`` of a step's batch is sequence slot ``s`` of the ``BlockState``. Everything that
varies between calls (which rows are active, their lengths, their tables) is an array, so one
compiled executable serves every mix of sequences.

The functions here take the ``graphdef`` on every call, a static jit argument that jit hashes
per call (a walk of the whole graph, which can cost more than a small model's step). A serving
loop builds a ``Steps(graphdef)`` once instead: the same steps as methods, jitted with the
graph closed over, so no call hashes it (``test_steps_hash_the_graphdef_once_not_per_call``).

Failure is all-or-nothing, as in the allocator: when a step cannot get the blocks it needs,
its ``Status`` says so, the returned cache and state equal the inputs, and the logits are
meaningless.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from paged_jax.allocator import BlockState, Status
from paged_jax.engine.step_bodies import (
    EMBED_BITS,
    decode_step_body,
    decode_steps_body,
    packed_prefill_body,
    prefill_body,
    prefill_decode_body,
)
from paged_jax.engine.step_inputs import (
    check_cache,
    check_decode_tokens,
    decode_steps_inputs,
    packed_prefill_inputs,
    prefill_decode_inputs,
    prefill_inputs,
    step_impl,
)
from paged_jax.kernels.strategies import CONTEXT_BUCKET_TOKENS, HOIST_MAX_BYTES
from paged_jax.kvcache import KVCache
from paged_jax.sharding import (
    auto_axes,
    check_heads,
    check_mesh,
    replicate,
    shard_cache,
    shard_params,
)

__all__ = ["CONTEXT_BUCKET_TOKENS", "DONATE", "HOIST_MAX_BYTES", "Steps", "check_cache",
           "decode_step", "decode_steps", "pad_prompts", "prefill", "prefill_decode",
           "prefill_packed", "serving_params", "step_impl"]

DONATE = ("kv", "state")


def _prefill(graphdef, params, kv, state, tokens, seq_ids, num_tokens, extend, *, all_logits,
             bucket_tokens=CONTEXT_BUCKET_TOKENS, mesh=None):
    # A def of its own so that compile logs name the prefill executables jit(_prefill) in both
    # forms (tests/test_engine.py counts prefill compilations by that name).
    return prefill_body(graphdef, params, kv, state, tokens, seq_ids, num_tokens, extend,
                        all_logits=all_logits, bucket_tokens=bucket_tokens, mesh=mesh)


def _prefill_packed(graphdef, params, kv, state, tokens, seq_ids, num_tokens, *, mesh=None):
    # Named apart from _prefill in compile logs.
    return packed_prefill_body(graphdef, params, kv, state, tokens, seq_ids, num_tokens,
                               mesh=mesh)


_PREFILL_DECODE_STATIC = ("impl", "interpret", "sample", "filtered", "rows")
_DECODE_STEPS_STATIC = ("num_steps", "impl", "interpret", "return_logits", "sample", "filtered",
                        "rows", "hoist_max_bytes")


def serving_params(model) -> dict:
    """The steps' ``params`` for a serving loop: ``nnx.to_pure_dict`` of ``model``'s state
    and, where the model gathers its embedding as bits (a 16-bit ``Llama`` on CPU), those
    bits under ``"embed_bits"`` (``Llama.embedding_bits``), made once here. Without them
    every dispatch copies the whole table to reinterpret it (``paged-jax bench decode
    --dtype bfloat16`` times the difference); with them the table is held twice. Made from
    the parameters as they are now: after changing them, make these again."""
    params = nnx.to_pure_dict(nnx.state(model))
    bits = model.embedding_bits()
    return params if bits is None else {**params, EMBED_BITS: bits}


def pad_prompts(prompts, width: int | None = None) -> np.ndarray:
    """Ragged prompts as ``prefill``'s ``tokens``: [len(prompts), width] int32, each row
    left-aligned and zero-padded (``width`` defaults to the longest prompt)."""
    width = width or max(len(p) for p in prompts)
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out


class Steps:
    """The jitted steps of one model graph, built once: ``prefill``, ``prefill_packed``,
    ``prefill_decode``, ``decode_step`` and ``decode_steps`` as methods that take the module
    functions' arguments less the ``graphdef``. The graph is closed over, never a static
    argument, so no call hashes it.

    ``hoist_max_bytes`` is ``decode_steps``' bound on the context the xla path gathers once
    per dispatch (0: always per step). ``context_bucket_tokens`` is the narrowest table the
    prefill's attention and the xla decode path read (``kernels.strategies.context_widths``:
    doubling up to ``max_blocks_per_seq``, the smallest that covers the longest row chosen
    in each step); 0 reads the whole table in every step. The jitted functions are public
    (``prefill_jit``, ``prefill_packed_jit``, ``prefill_decode_jit``, ``decode_step_jit``,
    ``decode_steps_jit``; the bodies of ``step_bodies.py`` with the graph bound) so a caller
    can ``.lower()`` them on checked inputs.

    ``mesh``: a ``jax.sharding.Mesh`` with a ``"tp"`` axis (``paged_jax.sharding``; any
    ``"dp"`` axis of size 1) to run tensor parallel: the params, cache and state must be
    placed on it (``shard``), the decode attention runs per shard, and the cache and state
    come back on their input shardings. A bad mesh raises ``ValueError`` here, a cache whose
    KV heads ``tp`` does not divide at the call, before anything is traced.
    """

    def __init__(self, graphdef: nnx.GraphDef, *, hoist_max_bytes: int = HOIST_MAX_BYTES,
                 context_bucket_tokens: int = CONTEXT_BUCKET_TOKENS, mesh=None):
        for name, value in (("hoist_max_bytes", hoist_max_bytes),
                            ("context_bucket_tokens", context_bucket_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0. Got {value!r}.")
        if mesh is not None:
            check_mesh(mesh)
            mesh = auto_axes(mesh)
        self.graphdef = graphdef
        self.hoist_max_bytes = hoist_max_bytes
        self.context_bucket_tokens = context_bucket_tokens
        self.mesh = mesh
        bucket = {"bucket_tokens": context_bucket_tokens}
        # decode_steps' key when sampling without key or seeds; made here once, since making
        # a key is a dispatch of its own.
        self.default_key = jax.random.key(0)
        self.prefill_jit = jax.jit(functools.partial(_prefill, graphdef, mesh=mesh, **bucket),
                                   static_argnames=("all_logits",), donate_argnames=DONATE)
        self.prefill_packed_jit = jax.jit(functools.partial(_prefill_packed, graphdef, mesh=mesh),
                                          donate_argnames=DONATE)
        self.prefill_decode_jit = jax.jit(
            functools.partial(prefill_decode_body, graphdef, mesh=mesh, **bucket),
            static_argnames=_PREFILL_DECODE_STATIC, donate_argnames=DONATE)
        self.decode_step_jit = jax.jit(functools.partial(decode_step_body, graphdef, mesh=mesh,
                                                         **bucket),
                                       static_argnames=("impl", "interpret"),
                                       donate_argnames=DONATE)
        self.decode_steps_jit = jax.jit(
            functools.partial(decode_steps_body, graphdef, hoist_max_bytes=hoist_max_bytes,
                              mesh=mesh, **bucket),
            static_argnames=_DECODE_STEPS_STATIC[:-1], donate_argnames=DONATE,
        )

    def shard(self, params, kv: KVCache, state: BlockState):
        """``(params, kv, state)`` placed on this ``Steps``' mesh: params by
        ``sharding.param_specs`` (``params`` a pure dict), the cache over its KV heads, the
        state replicated. Without a mesh, returned as given."""
        if self.mesh is None:
            return params, kv, state
        return (shard_params(params, self.mesh), shard_cache(kv, self.mesh),
                replicate(state, self.mesh))

    def _check_mesh(self, kv: KVCache) -> None:
        if self.mesh is not None:
            check_heads(kv.k.shape[1], self.mesh)

    def prefill(self, params, kv: KVCache, state: BlockState, tokens, seq_ids, num_tokens,
                extend=None, *, all_logits: bool = False):
        """``prefill(self.graphdef, ...)``."""
        self._check_mesh(kv)
        args = prefill_inputs(kv, state, tokens, seq_ids, num_tokens, extend)
        return self.prefill_jit(params, kv, state, *args, all_logits=all_logits)

    def prefill_packed(self, params, kv: KVCache, state: BlockState, tokens, seq_ids,
                       num_tokens):
        """``prefill_packed(self.graphdef, ...)``."""
        self._check_mesh(kv)
        args = packed_prefill_inputs(kv, state, tokens, seq_ids, num_tokens)
        return self.prefill_packed_jit(params, kv, state, *args)

    def prefill_decode(self, params, kv: KVCache, state: BlockState, tokens, seq_ids,
                       num_tokens, extend, decode_tokens, key=None, temperature=0.0, *,
                       top_k=0, top_p=1.0, impl: str = "auto", interpret: bool = False,
                       budgets=None, seeds=None, rows: int | None = None):
        """``prefill_decode(self.graphdef, ...)``."""
        self._check_mesh(kv)
        args, static = prefill_decode_inputs(
            kv, state, tokens, seq_ids, num_tokens, extend, decode_tokens, key, temperature,
            top_k, top_p, impl=impl, budgets=budgets, seeds=seeds, rows=rows,
            default_key=self.default_key)
        return self.prefill_decode_jit(params, kv, state, *args, impl=impl, interpret=interpret,
                                       **static)

    def decode_step(self, params, kv: KVCache, state: BlockState, tokens, *, impl: str = "auto",
                    interpret: bool = False):
        """``decode_step(self.graphdef, ...)``."""
        self._check_mesh(kv)
        check_decode_tokens(tokens, state)
        check_cache(kv, state)
        step_impl(impl, kv, state)
        return self.decode_step_jit(params, kv, state, tokens, impl=impl, interpret=interpret)

    def decode_steps(self, params, kv: KVCache, state: BlockState, tokens, key=None,
                     temperature=0.0, *, top_k=0, top_p=1.0, num_steps: int, impl: str = "auto",
                     interpret: bool = False, return_logits: bool = False, budgets=None,
                     stop_ids=None, seeds=None, rows: int | None = None):
        """``decode_steps(self.graphdef, ..., hoist_max_bytes=self.hoist_max_bytes)``."""
        self._check_mesh(kv)
        args, static = decode_steps_inputs(
            kv, state, tokens, key, temperature, top_k, top_p, num_steps=num_steps, impl=impl,
            budgets=budgets, stop_ids=stop_ids, seeds=seeds, rows=rows,
            default_key=self.default_key)
        return self.decode_steps_jit(params, kv, state, *args, num_steps=num_steps, impl=impl,
                                     interpret=interpret, return_logits=return_logits, **static)


# --------------------------------------------------------------------------------------------
# The same steps with the graphdef as an argument


_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "all_logits"),
                       donate_argnames=DONATE)
_prefill_packed_jit = jax.jit(_prefill_packed, static_argnames=("graphdef",),
                              donate_argnames=DONATE)
_prefill_decode_jit = jax.jit(prefill_decode_body,
                              static_argnames=("graphdef", *_PREFILL_DECODE_STATIC),
                              donate_argnames=DONATE)
_decode_step_jit = jax.jit(decode_step_body, static_argnames=("graphdef", "impl", "interpret"),
                           donate_argnames=DONATE)
_decode_steps_jit = jax.jit(decode_steps_body, static_argnames=("graphdef", *_DECODE_STEPS_STATIC),
                            donate_argnames=DONATE)


def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv: KVCache,  # donated
    state: BlockState,  # donated
    tokens: jax.Array,  # [B, T] int32, row b's new tokens left-aligned, padded past num_tokens
    seq_ids: jax.Array,  # [B] int32 sequence slots, -1 = padding row
    num_tokens: jax.Array,  # [B] int32 new tokens per row, 1 <= n <= T for real rows
    extend: jax.Array | None = None,  # [B] bool rows that continue an active slot; None: none
    *,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache, BlockState, Status]:
    """Run a ragged batch of prompts, write their K/V into their blocks.

    A row is admitted into its inactive slot with ``num_tokens`` tokens, unless ``extend``
    marks it: an extending row continues the active sequence in its slot (after
    ``share_prefix``, a prefix-cache hit, or an earlier chunk of the same prompt), which
    holds ``seq_len`` cached tokens. Only its new tokens are computed, at positions
    ``seq_len, seq_len + 1, ...``, attending over the cached blocks (a shared, partly filled
    last block is copied first).

    The call is refused as a whole (cache and state unchanged; ``status`` names the row and
    the numbers) when a row:

    * goes into an active slot without ``extend`` (``SEQ_ACTIVE``: a scheduler that lost
      track of a slot would otherwise glue two prompts together), or extends an inactive one
      (``SEQ_INACTIVE``);
    * brings ``num_tokens`` outside ``1..T`` (``BAD_NUM_TOKENS``);
    * would outgrow its table (``BAD_LENGTH``), or the pool (``OUT_OF_BLOCKS``);
    * holds an id outside ``[0, vocab_size)`` among its first ``num_tokens`` tokens
      (``BAD_TOKEN``, with the id and its position); padding past them is never read.

    Returns:
      ``(logits, kv, state, status)``: logits ``[B, V]`` f32 at each row's last new token
      (``[B, T, V]`` at every position with ``all_logits=True``).
    """
    args = prefill_inputs(kv, state, tokens, seq_ids, num_tokens, extend)
    return _prefill_jit(graphdef, params, kv, state, *args, all_logits=all_logits)


def prefill_packed(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv: KVCache,  # donated
    state: BlockState,  # donated
    tokens: jax.Array,  # [T] int32: row 0's new tokens, then row 1's, ...; padding after
    seq_ids: jax.Array,  # [R] int32 sequence slots, -1 = padding row (brings no tokens)
    num_tokens: jax.Array,  # [R] int32 new tokens per row, >= 1 for real rows, sum <= T
) -> tuple[jax.Array, KVCache, BlockState, Status]:
    """Prefill the first chunks of several prompts packed into one row of tokens.

    ``prefill`` computes ``[B, T]`` positions, each row padded to the widest; here the rows'
    chunks lie one after another in ``tokens``, so the projections and the MLP, nearly all of
    a prefill's work, run on ``sum(num_tokens)`` tokens and the padding after them, and one
    dispatch reads the weights once for all rows. Every real row continues its active slot,
    which must hold no tokens yet (an admission without a prefix-cache hit: ``admit_cached``
    with a count of 0); its tokens go at positions ``0 .. num_tokens - 1`` and attend to the
    tokens before them in the same row. A chunk that starts after cached tokens goes through
    ``prefill``, which reads them from the blocks.

    Refused as a whole (cache and state unchanged; ``status`` names the row) when a row's slot
    holds tokens (``SEQ_ACTIVE``) or is inactive (``SEQ_INACTIVE``), when it brings fewer than
    one token or runs past ``T`` (``BAD_NUM_TOKENS``), would outgrow its table
    (``BAD_LENGTH``) or the pool (``OUT_OF_BLOCKS``), or feeds an id outside
    ``[0, vocab_size)`` (``BAD_TOKEN``, with its position in the row).

    Returns:
      ``(logits, kv, state, status)``: logits ``[R, V]`` f32 at each row's last new token.
    """
    args = packed_prefill_inputs(kv, state, tokens, seq_ids, num_tokens)
    return _prefill_packed_jit(graphdef, params, kv, state, *args)


def prefill_decode(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv: KVCache,  # donated
    state: BlockState,  # donated
    tokens: jax.Array,  # [B, T] int32, as prefill's
    seq_ids: jax.Array,  # [B] int32, as prefill's
    num_tokens: jax.Array,  # [B] int32, as prefill's
    extend: jax.Array | None,  # [B] bool, as prefill's
    decode_tokens: jax.Array,  # [max_seqs] int32, the token each decoding slot feeds
    key: jax.Array | None = None,
    temperature=0.0,
    *,
    top_k=0,
    top_p=1.0,
    impl: str = "auto",
    interpret: bool = False,
    budgets: jax.Array | None = None,  # [max_seqs] int32 in 0..1: 0 = the slot does not decode
    seeds: jax.Array | None = None,  # [max_seqs] int32
    rows: int | None = None,  # static: decode only slots 0..rows-1 (1..max_seqs)
) -> tuple[jax.Array, jax.Array, KVCache, BlockState, Status]:
    """A ``prefill`` and one ``decode_steps`` step in one dispatch.

    A prefill dispatch reads every weight once, whatever its width, and so does a decode
    step; while prompts are prefilled in chunks beside running sequences, the two run as one
    forward pass here: the prefill rows' ``B * T`` positions and the ``max_seqs`` decode rows
    go through the projections and the MLP as one row of tokens. The decode rows attend as
    ``decode_steps`` does (the Pallas kernel or the xla path, ``impl``), the prefill rows as
    ``prefill`` does. The decoding rows are the active slots whose ``budgets`` entry is 1
    (every active slot without ``budgets``), among the first ``rows`` (the model computes
    those only, as ``decode_steps``' ``rows``); the prefill rows are ``prefill``'s, and the
    sampling arguments are ``decode_steps``'.

    Refused as a whole (cache and state unchanged) for any reason either step refuses, and
    when a slot is in both parts (``DUPLICATE_SEQ``). The status lists the ``max_seqs``
    decode entries, then the ``B`` prefill rows.

    Returns:
      ``(emitted, logits, kv, state, status)``: emitted ``[max_seqs]`` int32, each decoding
      row's new token (-1 for the others); logits ``[B, V]`` f32 at each prefill row's last
      new token.
    """
    args, static = prefill_decode_inputs(kv, state, tokens, seq_ids, num_tokens, extend,
                                         decode_tokens, key, temperature, top_k, top_p,
                                         impl=impl, budgets=budgets, seeds=seeds, rows=rows)
    return _prefill_decode_jit(graphdef, params, kv, state, *args, impl=impl,
                               interpret=interpret, **static)


def decode_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv: KVCache,  # donated
    state: BlockState,  # donated
    tokens: jax.Array,  # [max_seqs] int32, each active sequence's newest token
    *,
    impl: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, KVCache, BlockState, Status]:
    """One decode step for every active sequence.

    Appends a slot per active sequence (``append`` with the active mask; ``copy_on_write``
    when that slot lies in a shared block, the block copy applied here), writes the new K/V in
    place, runs ``paged_attention`` (``impl`` "auto", "pallas" (``interpret=True`` on CPU) or
    "xla") and returns ``(logits [max_seqs, V] f32, kv, state, status)``. Rows of inactive
    slots are computed but write nothing; their logits are meaningless, and their tokens are
    never read. An active slot fed a token outside ``[0, vocab_size)`` (such as the -1 a
    step that did not run emits) refuses the step: ``BAD_TOKEN``, cache and state unchanged.
    """
    check_decode_tokens(tokens, state)
    check_cache(kv, state)
    step_impl(impl, kv, state)
    return _decode_step_jit(graphdef, params, kv, state, tokens, impl=impl, interpret=interpret)


def decode_steps(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv: KVCache,  # donated
    state: BlockState,  # donated
    tokens: jax.Array,  # [max_seqs] int32, each active sequence's newest token
    key: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,  # scalar or [max_seqs] float >= 0, 0 = greedy
    *,
    top_k: int | jax.Array = 0,  # scalar or [max_seqs] int >= 0, 0 = off
    top_p: float | jax.Array = 1.0,  # scalar or [max_seqs] float in (0, 1], 1 = off
    num_steps: int,
    impl: str = "auto",
    interpret: bool = False,
    return_logits: bool = False,
    budgets: jax.Array | None = None,  # [max_seqs] int in 0..num_steps: steps per row
    stop_ids: jax.Array | None = None,  # [max_seqs, M] int, -1 = none: ids that end a row
    seeds: jax.Array | None = None,  # [max_seqs] int: per-row keys by (seed, position)
    rows: int | None = None,  # the model runs on slots 0..rows-1; None: every slot
    hoist_max_bytes: int = HOIST_MAX_BYTES,
) -> tuple[jax.Array, jax.Array | None, KVCache, BlockState, Status]:
    """``num_steps`` decode steps in one dispatch (a ``lax.scan``), each step's token fed
    back: greedy (``temperature == 0``) or sampled with ``key`` by ``sampling.sample`` at
    ``temperature``, ``top_k`` and ``top_p`` (each a scalar or one value per sequence slot).

    Rows stop inside the dispatch (what a serving loop needs to keep ``num_steps`` at 8 or
    more without overrun): with ``budgets``, active row ``r`` runs at most ``budgets[r]``
    steps and claims blocks for those only (0: the row does not decode, as a slot still being
    prefilled); with ``stop_ids``, a row that emits one of its ids (EOS, say) emits it and
    nothing after. A row that stopped early keeps the slots it claimed up to its budget, and
    a serving loop releases it. With ``seeds``, row ``r`` draws the token at position ``p``
    with ``sampling.row_keys``: ``fold_in(key(seeds[r]), p)``, whatever else is batched
    (``key`` is then unused).

    Every step computes a row per slot, active or not. With ``rows`` (a static int in
    ``1..max_seqs``), it computes only slots ``0..rows-1``: an active slot at or past
    ``rows`` does not decode in this dispatch (as with a budget of 0; it emits -1 and
    claims nothing). A serving loop whose decoding slots are all below ``rows`` passes the
    smallest such bucket and pays for those rows only (one compilation per value).

    A Python ``temperature`` of 0 compiles a greedy-only scan that draws no random numbers
    (``top_k`` and ``top_p`` cannot change an argmax); Python ``top_k=0`` and ``top_p=1.0``
    compile a scan without the filters' full-vocabulary sort. Arrays may hold any mix.

    The blocks for all ``num_steps`` steps are claimed up front by one ``reserve_steps`` (the
    same state as ``num_steps`` successive appends), so the scan body runs the model and
    nothing else. All-or-nothing: if the pool cannot hold every step, no step runs, the cache
    and state come back unchanged, and ``status`` says why (retry with fewer steps). Then
    every token is -1, and feeding those back is refused too (``BAD_TOKEN``, as in
    ``decode_step``), so a loop may read the status when it streams the tokens rather than
    after every dispatch: nothing runs on garbage in between.

    On the xla path (``impl="xla"``, or ``"auto"`` off GPU) with ``num_steps > 1``, each row's
    context is gathered from its blocks once per dispatch, not once per step; each step
    attends over it plus the dispatch's new tokens, which it also writes to their slots. That
    holds the gathered context of every layer at once, ``2 * layers * max_seqs *
    max_blocks_per_seq * block_size * kv_heads * head_dim`` elements; above
    ``hoist_max_bytes`` (default ``HOIST_MAX_BYTES``, 256 MiB) the steps gather per step
    instead (``kernels.strategies.decode_strategy``). The results are the
    same either way, up to float summation order.

    Returns ``(tokens [num_steps, max_seqs] int32, logits [num_steps, max_seqs, V] or None,
    kv, state, status)``; ``tokens`` is -1 for inactive rows and when nothing ran.
    """
    args, static = decode_steps_inputs(
        kv, state, tokens, key, temperature, top_k, top_p, num_steps=num_steps, impl=impl,
        budgets=budgets, stop_ids=stop_ids, seeds=seeds, rows=rows)
    return _decode_steps_jit(graphdef, params, kv, state, *args, num_steps=num_steps, impl=impl,
                             interpret=interpret, return_logits=return_logits,
                             hoist_max_bytes=hoist_max_bytes, **static)
