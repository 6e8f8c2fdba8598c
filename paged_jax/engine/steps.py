"""The jitted serving steps: ``prefill``, ``decode_step`` and the K-step ``decode_steps``.

Each step takes the model as ``(graphdef, params)`` from ``nnx.split`` (the graph is static,
the parameters are arguments, never constants in the HLO), the paged ``KVCache`` and the
allocator's ``BlockState``, and returns them updated. ``params`` may be the ``nnx.State`` or,
cheaper per call, its plain nested dict ``nnx.to_pure_dict(params)``: jit flattens its
arguments on every call, and an ``nnx.State`` flattens through a Python callback per
variable where the dict needs none. A serving loop converts once. The cache and the state
are donated: XLA updates them in place and the caller's input arrays are deleted.

Row ``s`` of a step's batch is sequence slot ``s`` of the ``BlockState``. Everything that
varies between calls (which rows are active, their lengths, their tables) is an array, so one
compiled executable serves every mix of sequences.

Failure is all-or-nothing, as in the allocator: when a step cannot get the blocks it needs,
its ``Status`` says so, the returned cache and state equal the inputs, and the logits are
meaningless.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import (
    BlockState,
    Code,
    Status,
    admit,
    append,
    copy_on_write,
    reserve_steps,
)
from paged_jax.allocator import slot_mapping as _slot_mapping
from paged_jax.allocator.ops import _cdiv
from paged_jax.allocator.status import combine, details
from paged_jax.engine import sampling
from paged_jax.kernels import paged_attention
from paged_jax.kernels.pallas_decode import resolve_impl
from paged_jax.kernels.reference import attend_segments, gather_context, gather_pages
from paged_jax.kvcache import KVCache, copy_blocks, write
from paged_jax.model.llama import masked_attention

DONATE = ("kv", "state")


class _GraphKey:
    """A ``GraphDef`` as a static jit argument, hashed once.

    jit hashes its static arguments on every call, and ``hash(graphdef)`` walks the whole
    graph, which can cost more than a small model's decode step. The public steps pass
    ``_key(graphdef)`` instead, so the walk happens once per graph
    (``test_steps_hash_the_graphdef_once_not_per_call``).
    """

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _GraphKey) and (
            self.graphdef is other.graphdef or self.graphdef == other.graphdef
        )


_KEYS: dict[int, _GraphKey] = {}  # id(graphdef) -> key; the key keeps the graphdef alive


def _key(graphdef: nnx.GraphDef) -> _GraphKey:
    key = _KEYS.get(id(graphdef))
    if key is None or key.graphdef is not graphdef:
        key = _KEYS[id(graphdef)] = _GraphKey(graphdef)
    return key


def _merge(graphdef, params):
    """``nnx.merge`` for a ``_GraphKey`` or a plain ``GraphDef``."""
    return nnx.merge(graphdef.graphdef if isinstance(graphdef, _GraphKey) else graphdef, params)


def check_cache(kv: KVCache, state: BlockState) -> None:
    """Raise before tracing unless ``kv`` and ``state`` describe the same pool."""
    cfg = state.config
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv must be a KVCache (init_cache). Got {type(kv).__name__}.")
    if kv.k.shape[2:4] != (cfg.num_blocks, cfg.block_size) or kv.v.shape != kv.k.shape:
        raise ValueError(
            f"The KV cache (k {kv.k.shape}, v {kv.v.shape}) must hold the BlockState's "
            f"{cfg.num_blocks} blocks of {cfg.block_size} tokens in its axes 2 and 3, and k and "
            "v must match. Build both from one CacheConfig (init_cache, init_state)."
        )


def step_impl(impl: str, kv: KVCache, state: BlockState) -> str:
    """The attention ``impl`` a decode step over ``kv`` runs (``resolve_impl`` at its shapes:
    one row per sequence slot). ``"pallas"`` on shapes the kernel cannot take raises here,
    before tracing."""
    return resolve_impl(impl, batch=state.config.max_seqs, head_dim=kv.k.shape[-1],
                        block_size=state.config.block_size)


def _select(pred, on_true, on_false):
    """Pytree-wide ``where`` on a scalar predicate (all-or-nothing state updates)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


# --------------------------------------------------------------------------------------------
# Prefill


def _prefill(graphdef, params, kv: KVCache, state: BlockState, tokens, seq_ids, num_tokens,
             extend, *, all_logits: bool):
    cfg = state.config
    model = _merge(graphdef, params)
    batch, width = tokens.shape
    ids = seq_ids.astype(jnp.int32)
    n = num_tokens.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < cfg.max_seqs)
    safe = jnp.where(in_range, ids, 0)
    # An extending row continues its active slot (its first blocks shared or prefix-cached);
    # every other row is admitted fresh, so a row into an occupied slot is refused
    # (SEQ_ACTIVE) and an extending row into an empty one too (SEQ_INACTIVE).
    cached = jnp.where(extend & in_range, state.seq_lens[safe], 0)  # [B] tokens in the cache

    st, s_admit = admit(state, jnp.where(extend, -1, ids), jnp.where(extend, 0, n))
    st, s_append = append(st, jnp.where(extend, ids, -1), jnp.where(extend, n, 0))
    # Only the block holding the first new token can be shared and partly filled.
    cow_ids = jnp.where(extend & (cached % cfg.block_size != 0) & (n > 0), ids, -1)
    st, (src, dst), s_cow = copy_on_write(st, cow_ids, cached)
    # A real row must bring 1..T new tokens: more than `tokens` holds would leave cache
    # slots that nothing writes.
    bad_len = (ids != -1) & ((n < 1) | (n > width))
    # Only a row's first n tokens are read: padding past them may hold anything.
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    new = (ids != -1)[:, None] & (col < n[:, None])  # [B, T]
    bad = _bad_tokens(tokens, new, model.config.vocab_size)  # [B, T]
    first_bad = jnp.argmax(bad, axis=1)  # [B] column of the row's first bad id
    own = jnp.where(bad_len, jnp.int32(Code.BAD_NUM_TOKENS),
                    jnp.where(jnp.any(bad, axis=1), jnp.int32(Code.BAD_TOKEN), jnp.int32(Code.OK)))
    value, limit, at = details(own, {
        Code.BAD_NUM_TOKENS: (n, width, None),
        Code.BAD_TOKEN: (tokens[jnp.arange(batch), first_bad], model.config.vocab_size,
                         cached + first_bad),
    })
    own = Status(code=own, ids=ids, value=value, limit=limit, at=at, requested=0,
                 num_free=state.num_free, op="prefill")
    status = combine(ids, state.num_free, "prefill", s_admit, s_append, s_cow, own=own)
    ok = status.applied
    state = _select(ok, st, state)
    kv = copy_blocks(kv, jnp.where(ok, src, -1), dst)

    positions = cached[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, T]
    live = ok & (jnp.arange(width)[None, :] < n[:, None])  # [B, T]
    slots = jnp.where(live, _slot_mapping(state, ids, positions), -1)  # [B, T]
    kv_lens = jnp.where(ok & in_range, state.seq_lens[safe], 0)  # [B]
    tables = jnp.where(in_range[:, None], state.block_tables[safe], -1)  # [B, M]
    key_pos = jnp.arange(tables.shape[1] * cfg.block_size)  # [S]
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
        key_pos[None, None, :] < kv_lens[:, None, None]
    )  # [B, T, S]

    def attend(layer, q, k, v, kv):  # q [B, T, Hq, D]; k, v [B, T, Hkv, D]
        kv = write(kv, layer, slots, k, v)
        keys = gather_pages(kv.k[layer], tables).swapaxes(1, 2)  # [B, S, Hkv, D]
        values = gather_pages(kv.v[layer], tables).swapaxes(1, 2)
        return masked_attention(q, keys, values, mask), kv

    h, kv = model.hidden(tokens.astype(jnp.int32), positions, kv, attend)  # [B, T, E]
    if all_logits:
        logits = model.logits(h)  # [B, T, V]
    else:
        last = jnp.maximum(n - 1, 0)
        logits = model.logits(h[jnp.arange(batch), last])  # [B, V]
    return logits, kv, state, status


def pad_prompts(prompts, width: int | None = None) -> np.ndarray:
    """Ragged prompts as ``prefill``'s ``tokens``: [len(prompts), width] int32, each row
    left-aligned and zero-padded (``width`` defaults to the longest prompt)."""
    width = width or max(len(p) for p in prompts)
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out


_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "all_logits"), donate_argnames=DONATE)


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
    tokens, seq_ids = jnp.asarray(tokens), jnp.asarray(seq_ids)
    num_tokens = jnp.asarray(num_tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be a [batch, T] int array. Got {tokens.dtype}{tokens.shape}."
        )
    for name, x in (("seq_ids", seq_ids), ("num_tokens", num_tokens)):
        if x.shape != tokens.shape[:1] or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be a [batch] int array with batch = {tokens.shape[0]}. "
                f"Got {x.dtype}{x.shape}."
            )
    extend = jnp.zeros(tokens.shape[:1], bool) if extend is None else jnp.asarray(extend)
    if extend.shape != tokens.shape[:1] or extend.dtype != jnp.bool_:
        raise ValueError(
            f"extend must be a [batch] bool array with batch = {tokens.shape[0]}, or None. "
            f"Got {extend.dtype}{extend.shape}."
        )
    check_cache(kv, state)
    return _prefill_jit(_key(graphdef), params, kv, state, tokens, seq_ids, num_tokens,
                        extend, all_logits=all_logits)


# --------------------------------------------------------------------------------------------
# Decode


_GOOD_TOKENS: set = set()  # (shape, dtype, max_seqs) already accepted


def _check_decode_tokens(tokens, state: BlockState) -> None:
    # Runs on the host before every dispatch, so a (shape, dtype, max_seqs) accepted once is
    # not tested again; test_bad_inputs_are_refused checks that others are still refused.
    dtype = getattr(tokens, "dtype", None)
    if dtype is None:
        tokens = np.asarray(tokens)
        dtype = tokens.dtype
    seen = (tokens.shape, dtype, state.config.max_seqs)
    if seen in _GOOD_TOKENS:
        return
    if tokens.shape != (state.config.max_seqs,) or not np.issubdtype(dtype, np.integer):
        raise ValueError(
            f"tokens must be a [max_seqs] = [{state.config.max_seqs}] int array, one per "
            f"sequence slot. Got {dtype}{tokens.shape}."
        )
    _GOOD_TOKENS.add(seen)


def _claim(kv: KVCache, state: BlockState, mask, num_steps: int, op: str = "decode_step",
           budgets=None):
    """The bookkeeping of ``num_steps`` decode steps for every row in ``mask``: the rows grow
    by ``num_steps`` tokens, or by their ``budgets`` ([S] int in ``0..num_steps``) when
    given (``append``, or ``reserve_steps`` for several), and a row's first
    write, at its old length, is made private by copy-on-write if it lands in a shared block
    (every later write lands in a block handed out here). All-or-nothing: returns
    ``(kv, state, status)`` with the inputs unchanged when ``status.applied`` is false.

    Most steps need neither: with 16-token blocks, 15 decode steps in 16 write into a block
    the row already owns alone. Those take a fast path (``seq_lens += num_steps``) that skips
    the allocator's prefix sum, gathers and scatters; its result is the one ``append`` gives.

    The others run the allocator, whose ops are O(batch) (``tests/test_pool_scaling.py``).
    Growing first and then undoing the grow when the copy-on-write that follows runs out of
    blocks would be a select over the whole pool. So the step decides first: when a row
    would outgrow its table, or the new blocks plus one copy per row that writes into a
    shared block exceed the free pool, it works out both ops' statuses on the input state,
    applying nothing, and a refused step then runs the ops on no rows. The compiled steps do
    no pool-sized work (``test_compiled_steps_do_no_pool_sized_work``).
    """
    cfg, bs = state.config, state.config.block_size
    rows = jnp.arange(cfg.max_seqs, dtype=jnp.int32)
    if budgets is not None:
        mask = mask & (budgets > 0)
    counts = jnp.where(mask, num_steps if budgets is None else budgets, 0)  # [S] new tokens
    ids = jnp.where(mask, rows, -1)  # [S]
    positions = state.seq_lens  # [S] where each row's first new token goes
    num_free = state.num_free  # before the op, as every Status reports it

    def shared_write(st):  # [S] rows whose first write lands in a block that st shares
        col = jnp.clip(positions // bs, 0, cfg.max_blocks_per_seq - 1)
        block = st.block_tables[rows, col]
        return mask & (block >= 0) & (st.ref_counts[jnp.clip(block, 0, cfg.num_blocks - 1)] > 1)

    def grow_op(st, rows_mask):
        if num_steps == 1:  # budgets are then 0 or 1, and the 0s are not in the mask
            return append(st, rows_mask, 1)
        return reserve_steps(st, rows_mask, num_steps, None if budgets is None else counts)

    def predicted(st):  # the step's status, worked out on the input state; nothing applied
        _, s_grow = grow_op(st, mask)
        # After a successful grow the copies would see the pool less what it took.
        after = st.replace(num_free=num_free - jnp.where(s_grow.applied, s_grow.requested, 0))
        _, _, s_cow = copy_on_write(after, jnp.where(shared_write(st), rows, -1), positions)
        s_cow = _select(s_grow.applied, s_cow, _no_failure(ids, num_free, "copy_on_write"))
        return combine(ids, num_free, op, s_grow, s_cow)

    def fast(st, kv):  # nothing can fail: no select against the input state is needed
        st = st.replace(seq_lens=positions + counts)
        return st, kv, _no_failure(ids, num_free, op)

    def slow(st, kv):
        # A step that may fail works out its status first (a cond that returns no state, so
        # the state's buffers stay free to be updated in place) and then runs the ops only
        # if it succeeds; a refused step runs them on no rows, which changes nothing.
        verdict = jax.lax.cond(may_fail, predicted,
                               lambda st: _no_failure(ids, num_free, op), st)
        go = verdict.applied
        st, s_grow = grow_op(st, mask & go)
        # Read from the grown state, not the input: a read of the input's pool buffer after
        # the grow's in-place writes would make XLA copy the buffer first.
        shared = shared_write(st) & go

        # Copy-on-write is rare (the first write after a fork into a shared, partly filled
        # block) and as many small ops as the rest of the allocator work: skipped when no
        # row needs it.
        def cow(st, kv):
            st, (src, dst), s_cow = copy_on_write(st, jnp.where(shared, rows, -1), positions)
            return st, copy_blocks(kv, src, dst), s_cow

        def no_cow(st, kv):
            return st, kv, _no_failure(ids, num_free, "copy_on_write")

        st, kv, s_cow = jax.lax.cond(jnp.any(shared), cow, no_cow, st, kv)
        status = _select(may_fail, verdict, combine(ids, num_free, op, s_grow, s_cow))
        return st, kv, status

    # A row needs the allocator iff it gets a new block (this includes every error: an
    # inactive slot is never in `mask`, and a row at its table's end needs a block it cannot
    # have) or its first write lands in a shared block. Growing never changes the block a
    # row's first write lands in, nor that block's ref count, so the input state tells.
    shared = shared_write(state)  # [S]
    new_blocks = _cdiv(positions + counts, bs) - _cdiv(positions, bs)
    needed = jnp.any(new_blocks > 0) | jnp.any(shared)
    # Neither op can fail while every row stays within its table and the pool holds the new
    # blocks plus one copy per row that writes into a shared block.
    demand = jnp.sum(new_blocks) + jnp.sum(shared, dtype=jnp.int32)
    too_long = mask & (positions + counts > cfg.max_tokens_per_seq)  # [S]
    may_fail = (demand > num_free) | jnp.any(too_long)
    st, kv, status = jax.lax.cond(needed, slow, fast, state, kv)
    return kv, st, status


def _bad_tokens(tokens, live, vocab_size: int):
    """Where a ``live`` entry's token id is outside ``[0, vocab_size)``: the embedding lookup
    would silently read some other row (a -1, for one, wraps to the last)."""
    return live & ((tokens < 0) | (tokens >= vocab_size))


def _no_failure(ids, num_free, op: str) -> Status:
    """A status in which every entry succeeded and nothing was requested."""
    return Status(code=jnp.zeros_like(ids), ids=ids, requested=0, num_free=num_free, op=op)


def _claim_feeding(kv: KVCache, state: BlockState, tokens, mask, num_steps: int,
                   vocab_size: int, op: str, budgets=None):
    """``_claim`` for rows that feed ``tokens`` ([S]): refused as a whole, state and cache
    unchanged, when a row in ``mask`` feeds a token outside the vocabulary (``BAD_TOKEN``;
    every other row ``NOT_APPLIED``). A step that did not run emits -1, so a serving loop
    that feeds that back without looking gets a refusal, never a step over garbage: it can
    check the emitted tokens when it streams them rather than after every dispatch."""
    if budgets is not None:
        mask = mask & (budgets > 0)
    bad = _bad_tokens(tokens, mask, vocab_size)  # [S]
    kv, new_state, status = _claim(kv, state, mask & ~jnp.any(bad), num_steps, op, budgets)
    ids = jnp.where(mask, jnp.arange(mask.shape[0], dtype=jnp.int32), -1)
    code = jnp.where(bad, jnp.int32(Code.BAD_TOKEN), jnp.int32(Code.OK))
    value, limit, at = details(code, {Code.BAD_TOKEN: (tokens, vocab_size, state.seq_lens)})
    own = Status(code=code, ids=ids, value=value, limit=limit, at=at, requested=0,
                 num_free=state.num_free, op=op)
    return kv, new_state, combine(ids, state.num_free, op, status, own=own)


def _forward(model, kv: KVCache, state: BlockState, tokens, positions, live, attention,
             extra=()):
    """One token per row at ``positions`` (rows not ``live`` write nothing): writes its K/V
    at the row's ``slot_mapping``, then ``attention(layer, q, k, v, kv, extra) -> (out,
    extra)`` attends (q ``[S, Hq, D]``, k and v ``[S, Hkv, D]``, out ``[S, Hq, D]``; ``extra``
    is threaded through the layers beside the cache). ``state`` has already claimed the
    blocks (its lengths may run ahead, as after ``reserve_steps``).

    Returns ``(logits [S, V], kv, extra)``."""
    ids = jnp.where(live, jnp.arange(tokens.shape[0], dtype=jnp.int32), -1)  # [S]
    slots = _slot_mapping(state, ids, positions)  # [S], -1 for rows that write nothing

    def attend(layer, q, k, v, carry):  # q [S, 1, Hq, D]; k, v [S, 1, Hkv, D]
        kv, extra = carry
        kv = write(kv, layer, slots, k, v)
        out, extra = attention(layer, q[:, 0], k[:, 0], v[:, 0], kv, extra)
        return out[:, None], (kv, extra)

    logits, (kv, extra) = model(tokens[:, None], positions[:, None], (kv, extra), attend)
    return logits[:, 0], kv, extra


def _paged(state: BlockState, positions, live, impl, interpret):
    """``_forward``'s attention over the pool: ``paged_attention`` over ``positions + 1``
    tokens (the new one included), no extra state."""
    context_lens = jnp.where(live, positions + 1, 0)  # [S]

    def attention(layer, q, k, v, kv, extra):
        # The whole cache and the layer index, not kv.k[layer]: the kernel reads the layer
        # in place, where a slice would be copied before the Pallas call.
        out = paged_attention(
            q, kv.k, kv.v, state.block_tables, context_lens,
            impl=impl, interpret=interpret, layer=layer,
        )  # [S, Hq, D]
        return out, extra

    return attention


def _decode(model, kv: KVCache, state: BlockState, tokens, mask, impl: str, interpret: bool):
    """One token for every row in ``mask`` (a [max_seqs] bool); see ``decode_step``."""
    positions = state.seq_lens
    kv, state, status = _claim_feeding(kv, state, tokens, mask, 1, model.config.vocab_size,
                                       "decode_step")
    live = mask & status.applied
    logits, kv, _ = _forward(model, kv, state, tokens, positions, live,
                             _paged(state, positions, live, impl, interpret))
    return logits, kv, state, status


def _decode_step(graphdef, params, kv, state, tokens, *, impl, interpret):
    model = _merge(graphdef, params)
    return _decode(model, kv, state, tokens.astype(jnp.int32), state.active, impl, interpret)


_decode_step_jit = jax.jit(
    _decode_step, static_argnames=("graphdef", "impl", "interpret"), donate_argnames=DONATE
)


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
    _check_decode_tokens(tokens, state)
    check_cache(kv, state)
    step_impl(impl, kv, state)
    return _decode_step_jit(
        _key(graphdef), params, kv, state, tokens, impl=impl, interpret=interpret
    )


# Above this many bytes of gathered context (keys and values of every layer), the xla K-step
# path gathers per step instead of once per dispatch: the copy would cost more memory than
# the gathers it saves are worth.
HOIST_MAX_BYTES = 256 << 20


def _hoisted_bytes(kv: KVCache, state: BlockState) -> int:
    """Bytes of every row's gathered context, keys and values, all layers."""
    layers, heads, _, _, head_dim = kv.k.shape
    cfg = state.config
    tokens = cfg.max_seqs * cfg.max_blocks_per_seq * cfg.block_size
    return 2 * layers * heads * tokens * head_dim * kv.k.dtype.itemsize


def _per_step(model, state, start, live, impl, interpret):
    """The K steps as K ``_forward`` calls over the pool: each writes, then gathers and attends.

    Returns ``(step, extra)`` as ``_hoisted`` does: ``step(kv, extra, tokens, t, live_t) ->
    (logits, kv, extra)``, where ``live_t`` ([S] bool, within ``live``) are the rows still
    going at step ``t``, and the first ``extra`` (here none)."""

    def step(kv, extra, tokens, t, live_t):
        positions = start + t
        return _forward(model, kv, state, tokens, positions, live_t,
                        _paged(state, positions, live_t, impl, interpret), extra)

    return step, ()


def _hoisted(model, kv, state, start, live, num_steps):
    """The xla path's K steps with each row's context gathered once per dispatch.

    Under the scan the pool changes only at the K new slots, so each layer's context (the
    ``start`` tokens the rows held before this dispatch) is gathered and masked once, up front.
    Step ``t`` writes its K/V to the pool (``_forward``) and also keeps them in ``extra``
    (``[layers, rows, kv_heads, K, head_dim]`` keys and values); it attends over the gathered
    context plus the kept tokens ``0..t``: one gather per layer per dispatch instead of K,
    which is what makes K steps per dispatch pay on the xla path (``paged-jax bench decode``).
    """
    layers, heads, _, _, head_dim = kv.k.shape
    rows = start.shape[0]
    context = [
        gather_context(kv.k[layer], kv.v[layer], state.block_tables, jnp.where(live, start, 0))
        for layer in range(layers)
    ]  # per layer: k, v [rows, heads, T, D], live [rows, T]
    shape = (layers, rows, heads, num_steps, head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim)  # paged_attention's default, which _paged uses

    def step(kv, extra, tokens, t, live_t):
        # A row still going at step t went at every step before it: its kept tokens 0..t
        # are its own.
        new_live = (jnp.arange(num_steps)[None, :] <= t) & live[:, None]  # [rows, K]

        def attention(layer, q, k, v, kv, extra):
            new_k, new_v = (
                jax.lax.dynamic_update_slice(
                    buf, x[None, :, :, None].astype(buf.dtype), (layer, 0, 0, t, 0)
                )
                for buf, x in zip(extra, (k, v), strict=True)
            )
            # The new values past step t are still the zeros they started as: finite.
            segments = [context[layer], (new_k[layer], new_v[layer], new_live)]
            return attend_segments(q, segments, sm_scale=sm_scale), (new_k, new_v)

        return _forward(model, kv, state, tokens, start + t, live_t, attention, extra)

    return step, (jnp.zeros(shape, kv.k.dtype), jnp.zeros(shape, kv.v.dtype))


def _decode_steps(graphdef, params, kv, state, tokens, key, temperature, top_k=None, top_p=None,
                  budgets=None, stop_ids=None, seeds=None,
                  *, num_steps, impl, interpret, return_logits, sample, filtered=False):
    model = _merge(graphdef, params)
    # All K steps' blocks are claimed once, up front: the scan body does no allocator work.
    mask = state.active
    start = state.seq_lens  # [S]
    tokens = tokens.astype(jnp.int32)
    if budgets is not None:
        budgets = budgets.astype(jnp.int32)
        mask = mask & (budgets > 0)
    kv, state, status = _claim_feeding(kv, state, tokens, mask, num_steps,
                                       model.config.vocab_size, "decode_steps", budgets)
    live = mask & status.applied
    limit = jnp.full_like(start, num_steps) if budgets is None else budgets  # [S]
    if (num_steps > 1 and step_impl(impl, kv, state) == "xla"
            and _hoisted_bytes(kv, state) <= HOIST_MAX_BYTES):
        step, extra = _hoisted(model, kv, state, start, live, num_steps)
    else:
        step, extra = _per_step(model, state, start, live, impl, interpret)

    def body(loop, xs):
        kv, extra, tokens, going = loop  # going: [S] rows that run step t
        t, step_key = xs
        logits, kv, extra = step(kv, extra, tokens, t, going)
        if seeds is not None and sample:  # one key per row: its seed, the new token's position
            step_key = sampling.row_keys(seeds, start + t + 1)
        if sample:  # static: a greedy run draws no random numbers
            # Static too: with the filters off, the scan has no full-vocabulary sort.
            nxt = (sampling.sample(logits, step_key, temperature, top_k, top_p) if filtered
                   else sampling.sample(logits, step_key, temperature))
        else:
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        emitted = jnp.where(going, nxt, -1)  # [S]
        tokens = jnp.where(going, nxt, tokens)
        stopped = jnp.zeros_like(going) if stop_ids is None else jnp.any(
            (nxt[:, None] == stop_ids) & (stop_ids >= 0), axis=1)
        going = going & ~stopped & (t + 1 < limit)
        out = (emitted, logits) if return_logits else (emitted,)
        return (kv, extra, tokens, going), out

    keys = jax.random.split(key, num_steps) if sample and seeds is None else None
    steps = (jnp.arange(num_steps, dtype=jnp.int32), keys)
    (kv, _, _, _), out = jax.lax.scan(body, (kv, extra, tokens, live), steps)
    logits = out[1] if return_logits else None
    return out[0], logits, kv, state, status


def _check_row_controls(state: BlockState, num_steps: int, budgets, stop_ids, seeds):
    """``decode_steps``' per-row controls as int32 arrays, or a ``ValueError`` naming the bad
    one (shape, dtype, or a budget outside ``0..num_steps``)."""
    rows = state.config.max_seqs
    out = []
    for name, x, ndim in (("budgets", budgets, 1), ("stop_ids", stop_ids, 2), ("seeds", seeds, 1)):
        if x is None:
            out.append(None)
            continue
        dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
        shape = np.shape(x)
        if len(shape) != ndim or shape[0] != rows or not np.issubdtype(dtype, np.integer):
            want = f"[{rows}]" if ndim == 1 else f"[{rows}, M]"
            raise ValueError(f"{name} must be a {want} int array (one row per sequence slot). "
                             f"Got {dtype}{shape}.")
        out.append(jnp.asarray(x, jnp.int32))
    if budgets is not None and not isinstance(budgets, jax.core.Tracer):
        host = np.asarray(budgets)
        bad = (host < 0) | (host > num_steps)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"budgets must be in 0..num_steps ({num_steps}). Got {host[row]} "
                             f"at row {row}.")
    return tuple(out)


@functools.cache
def _default_key() -> jax.Array:
    """``jax.random.key(0)``, made once: making a key is a dispatch of its own."""
    return jax.random.key(0)


_decode_steps_jit = jax.jit(
    _decode_steps,
    static_argnames=("graphdef", "num_steps", "impl", "interpret", "return_logits", "sample",
                     "filtered"),
    donate_argnames=DONATE,
)


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
    ``HOIST_MAX_BYTES`` (256 MiB) the steps gather per step instead. The results are the
    same either way, up to float summation order.

    Returns ``(tokens [num_steps, max_seqs] int32, logits [num_steps, max_seqs, V] or None,
    kv, state, status)``; ``tokens`` is -1 for inactive rows and when nothing ran.
    """
    _check_decode_tokens(tokens, state)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int. Got {num_steps!r}.")
    check_cache(kv, state)
    step_impl(impl, kv, state)
    sampling.check_sampling(temperature, top_k, top_p, rows=state.config.max_seqs)
    budgets, stop_ids, seeds = _check_row_controls(state, num_steps, budgets, stop_ids, seeds)
    # A Python 0 compiles a greedy-only scan; any other value (or an array) can sample.
    sample = not (isinstance(temperature, (int, float)) and temperature == 0)
    filtered = sample and not sampling.filters_off(top_k, top_p)
    if not sample:
        key = temperature = None  # nothing to pass: the greedy scan takes neither
    elif key is None and seeds is None:
        key = _default_key()
    if not filtered:
        top_k = top_p = None  # nor does a scan without the filters
    return _decode_steps_jit(
        _key(graphdef), params, kv, state, tokens, key, temperature, top_k, top_p,
        budgets, stop_ids, seeds, num_steps=num_steps, impl=impl, interpret=interpret,
        return_logits=return_logits, sample=sample, filtered=filtered,
    )
