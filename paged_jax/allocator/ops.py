"""Pure, batched, jittable allocator ops: ``state -> (new_state, ..., status)``.

Conventions shared by every op:

* ``seq_ids`` is a [batch] int array (a scalar is a batch of one). ``-1`` entries are padding:
  ignored, so a fixed batch width serves any number of real requests with one compilation.
* Nothing loops over sequences or blocks and nothing syncs with the host. Allocation for a
  whole batch is one prefix sum over the per-entry demand followed by one gather from the free
  ring; every update is an O(batch) scatter that XLA performs in place.
* All-or-nothing (see ``status.py``): on any failure the state comes back unchanged, because
  every scatter is redirected to an out-of-range index and dropped.
* Within a batch, blocks are handed out in batch order, then in logical order.

The shared pieces (validation, the pool check, taking and dropping blocks) are in
``primitives.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator.primitives import (
    as_index_array,
    broadcast_like,
    cdiv,
    check_pool,
    decref,
    op_status,
    prepare_seq_ids,
    set_rows,
    take_blocks,
    write_tables,
)
from paged_jax.allocator.state import NULL_BLOCK, BlockState
from paged_jax.allocator.status import Code, Status, finalize, first_error

# --------------------------------------------------------------------------------------------
# Sequence ops


def admit(state: BlockState, seq_ids, num_tokens) -> tuple[BlockState, Status]:
    """Admit new sequences with ``ceil(num_tokens / block_size)`` blocks each.

    Args:
      state: the pool.
      seq_ids: [batch] int, inactive slots to fill (-1 = padding).
      num_tokens: [batch] or scalar int, prompt lengths (0 allowed: no blocks yet).

    Returns:
      ``(state, status)``.
    """
    cfg = state.config
    ids, safe, valid, code = prepare_seq_ids(state, seq_ids)
    n = broadcast_like(num_tokens, ids, "num_tokens")
    code = first_error(code, valid & state.active[safe], Code.SEQ_ACTIVE)
    code = first_error(code, valid & ((n < 0) | (n > cfg.max_tokens_per_seq)), Code.BAD_LENGTH)
    need = jnp.where(valid, cdiv(n, cfg.block_size), 0)
    code, need, cum = check_pool(code, need, state, cfg.max_blocks_per_seq)
    code, apply = finalize(code)
    new, blocks = take_blocks(state, need, cum, apply, cfg.max_blocks_per_seq)
    new = write_tables(new, jnp.where(valid, ids, cfg.max_seqs), jnp.zeros_like(ids), blocks)
    new = set_rows(new, ids, apply, valid, n, True)
    table = {Code.BAD_LENGTH: (n, cfg.max_tokens_per_seq, None)}
    return new, op_status(code, ids, jnp.sum(need), state, "admit", table)


def admit_cached(state: BlockState, seq_ids, block_ids, num_tokens) -> tuple[BlockState, Status]:
    """Start sequences on blocks that are already in use (a prefix cache's held blocks): row
    ``i``'s table begins with ``block_ids[i]`` (NULL_BLOCK-padded), each listed block gains
    one reference, and its length is ``num_tokens[i]``, which those blocks must cover. The
    sequence's own tokens follow with ``append`` (or an extending ``prefill``).

    Args:
      seq_ids: [batch] int, inactive slots (-1 = padding).
      block_ids: [batch, max_blocks_per_seq] int, each row's first blocks, then NULL_BLOCK.
      num_tokens: [batch] or scalar int, with ``cdiv(num_tokens, block_size)`` equal to the
        row's count of listed blocks.

    Refused entries: an active slot (``SEQ_ACTIVE``), a listed block that is out of range or
    free (``BAD_BLOCK``), a length that does not match the blocks (``BAD_LENGTH``).
    """
    cfg = state.config
    ids, safe, valid, code = prepare_seq_ids(state, seq_ids)
    blocks = jnp.asarray(block_ids)
    if (blocks.shape != (ids.shape[0], cfg.max_blocks_per_seq)
            or not jnp.issubdtype(blocks.dtype, jnp.integer)):
        raise ValueError(f"block_ids must be a [batch, max_blocks_per_seq] = [{ids.shape[0]}, "
                         f"{cfg.max_blocks_per_seq}] int array. Got {blocks.dtype}{blocks.shape}.")
    blocks = blocks.astype(jnp.int32)
    n = broadcast_like(num_tokens, ids, "num_tokens")
    listed = blocks != NULL_BLOCK
    count = jnp.sum(listed, axis=1, dtype=jnp.int32)
    leading = jnp.all(listed == (jnp.arange(cfg.max_blocks_per_seq)[None, :] < count[:, None]),
                      axis=1)
    in_range = (blocks >= 0) & (blocks < cfg.num_blocks)
    safe_blocks = jnp.where(in_range, blocks, 0)
    bad_block = jnp.any(listed & (~in_range | (state.ref_counts[safe_blocks] == 0)), axis=1)
    code = first_error(code, valid & state.active[safe], Code.SEQ_ACTIVE)
    code = first_error(code, valid & (bad_block | ~leading), Code.BAD_BLOCK)
    code = first_error(code, valid & ((n < 0) | (cdiv(n, cfg.block_size) != count)),
                       Code.BAD_LENGTH)
    code, apply = finalize(code)
    inc = (valid & apply)[:, None] & listed
    new = state.scatter("ref_counts", jnp.where(inc, blocks, cfg.num_blocks), 1, "add")
    new = set_rows(new, ids, apply, valid, n, True, jnp.where(listed, blocks, NULL_BLOCK))
    table = {Code.BAD_LENGTH: (n, count * cfg.block_size,
                               jnp.maximum((count - 1) * cfg.block_size + 1, 0))}
    return new, op_status(code, ids, jnp.int32(0), state, "admit_cached", table)


def _select(state: BlockState, seq_ids_or_mask):
    """Resolve ids or a mask. Returns ``(ids, valid, code, old_len, active, dense)``; in the
    dense (mask) form entry i is slot i, so lengths and flags are read without gathers."""
    cfg = state.config
    sel = jnp.asarray(seq_ids_or_mask)
    if sel.dtype == jnp.bool_:
        if sel.shape != (cfg.max_seqs,):
            raise ValueError(f"A mask must have shape ({cfg.max_seqs},). Got {sel.shape}.")
        ids = jnp.where(sel, jnp.arange(cfg.max_seqs, dtype=jnp.int32), -1)
        code = jnp.zeros(sel.shape, jnp.int32)
        return ids, sel, code, state.seq_lens, state.active, True
    ids, safe, valid, code = prepare_seq_ids(state, seq_ids_or_mask)
    return ids, valid, code, state.seq_lens[safe], state.active[safe], False


def _grow(state, ids, valid, code, old_len, active, n, dense, op, rank_fn=None, max_new=None):
    """Shared body of ``append`` and ``reserve_steps``: validate, claim blocks, extend tables
    and lengths. ``rank_fn(need, have, cum) -> [batch, max_new]`` orders the hand-out."""
    cfg = state.config
    new_len = old_len + n
    code = first_error(code, valid & ~active, Code.SEQ_INACTIVE)
    code = first_error(
        code, valid & ((n < 0) | (new_len > cfg.max_tokens_per_seq)), Code.BAD_LENGTH
    )
    have = cdiv(old_len, cfg.block_size)
    need = jnp.where(valid, cdiv(new_len, cfg.block_size) - have, 0)
    code, need, cum = check_pool(code, need, state, max_new)
    code, apply = finalize(code)
    rank = None if rank_fn is None else rank_fn(need, have, old_len)
    new, blocks = take_blocks(state, need, cum, apply, max_new, rank)
    rows = jnp.where(valid, ids, cfg.max_seqs)
    new = write_tables(new, rows, have, blocks)
    if dense:
        new = new.replace(seq_lens=jnp.where(apply & valid, new_len, state.seq_lens))
    else:
        new = new.scatter("seq_lens", jnp.where(apply, rows, cfg.max_seqs), new_len)
    table = {Code.BAD_LENGTH: (new_len, cfg.max_tokens_per_seq, None)}
    requested = cum[-1] if cum.shape[0] else jnp.int32(0)
    return new, op_status(code, ids, requested, state, op, table)


def append(state: BlockState, seq_ids_or_mask, num_tokens=1) -> tuple[BlockState, Status]:
    """Grow sequences by ``num_tokens``; each one crossing a block boundary gets new blocks.

    One call serves a whole decode step. New blocks go in batch order, then logical order.

    Args:
      seq_ids_or_mask: [batch] int ids (-1 = padding), or a [max_seqs] bool mask (the
        cheapest form: no gathers, scatters or duplicate check on lengths).
      num_tokens: scalar or [batch] int. A Python int bounds the new blocks per entry at
        ``ceil(num_tokens / block_size)`` statically, so a decode step (1 token) does O(batch)
        work rather than O(batch * max_blocks_per_seq).
    """
    cfg = state.config
    ids, valid, code, old_len, active, dense = _select(state, seq_ids_or_mask)
    n = broadcast_like(num_tokens, ids, "num_tokens")
    if isinstance(num_tokens, (int, np.integer)) and num_tokens >= 0:
        max_new = min(cfg.max_blocks_per_seq, cdiv(int(num_tokens), cfg.block_size))
    else:
        max_new = cfg.max_blocks_per_seq
    return _grow(state, ids, valid, code, old_len, active, n, dense, "append",
                 max_new=max_new)


def reserve_steps(state: BlockState, seq_ids_or_mask, num_steps: int, steps=None):
    """``num_steps`` decode steps of bookkeeping in one op: the same state as ``num_steps``
    successive ``append(state, seq_ids_or_mask, 1)`` calls, blocks handed out step by step.

    A multi-step decode calls this once per dispatch, then reads each step's write slot with
    ``slot_mapping`` at positions ``len .. len + num_steps - 1``. All-or-nothing over all the
    steps: if the pool cannot hold every step, nothing changes.

    ``steps`` (optional, scalar or [batch] int in ``0..num_steps``) lets entries stop early:
    entry ``i`` takes part in the first ``steps[i]`` of the ``num_steps`` appends only, so a
    row with a smaller budget claims no block past it. A count outside ``0..num_steps``
    refuses the op (``BAD_LENGTH``).

    How the order is computed without a loop: entry ``i`` (length ``L``, ``h = cdiv(L, bs)``
    blocks, ``need_i`` new ones) takes its ``j``-th new block at step ``t = (h + j) * bs -
    L``, so its crossings form the residue class ``t0_i = h * bs - L (mod bs)``. The blocks
    handed out before that one are, over every entry ``i'``, its crossings at earlier steps,
    ``clip(cdiv(t - t0_i', bs), 0, need_i')``, plus the crossings of earlier entries of the
    same class at the same step.
    """
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"num_steps must be a Python int >= 0. Got {num_steps!r}.")
    cfg = state.config
    bs = cfg.block_size
    ids, valid, code, old_len, active, dense = _select(state, seq_ids_or_mask)
    max_new = min(cfg.max_blocks_per_seq, cdiv(int(num_steps), bs))
    if steps is None:
        n = jnp.full(ids.shape, num_steps, jnp.int32)
    else:
        n = broadcast_like(steps, ids, "steps")
        # More steps than the dispatch runs: refused as a bad length, like a negative count.
        n = jnp.where(n > num_steps, -1, n)

    def rank_fn(need, have, length):
        t0 = have * bs - length  # [batch] step of the first crossing, in [0, bs)
        t = t0[:, None] + bs * jnp.arange(max_new, dtype=jnp.int32)[None, :]  # [batch, new]
        # Crossings of every entry i' before step t: [batch, new, batch'] summed over i'.
        before = jnp.clip(cdiv(t[..., None] - t0[None, None, :], bs), 0, need[None, None, :])
        batch = need.shape[0]
        order = jnp.arange(batch)
        same = ((t0[None, :] == t0[:, None]) & (order[None, :] < order[:, None]))  # [b, b']
        at_step = same[:, None, :] & (need[None, None, :] > jnp.arange(max_new)[None, :, None])
        return jnp.sum(before, axis=-1) + jnp.sum(at_step, axis=-1, dtype=jnp.int32)

    return _grow(state, ids, valid, code, old_len, active, n, dense, "reserve_steps",
                 rank_fn=rank_fn, max_new=max_new)


def release(state: BlockState, seq_ids) -> tuple[BlockState, Status]:
    """Finish sequences: each block's ref count drops by one; blocks reaching zero join the
    tail of the free list (batch order, then logical order: the same as releasing one sequence
    at a time) and the slots become inactive."""
    ids, safe, valid, code = prepare_seq_ids(state, seq_ids)
    code = first_error(code, valid & ~state.active[safe], Code.SEQ_INACTIVE)
    code, apply = finalize(code)
    rows = state.block_tables[safe]  # [batch, max_blocks_per_seq]
    new = decref(state, rows, jnp.broadcast_to((valid & apply)[:, None], rows.shape))
    new = set_rows(new, ids, apply, valid, 0, False, NULL_BLOCK)
    return new, op_status(code, ids, jnp.int32(0), state, "release")


def _pairs(state: BlockState, src_ids, dst_ids, op: str, names, unique_src: bool):
    """Check ``(source, destination)`` slot pairs as ``_share`` and ``move_slots`` take them:
    ids in range (and unique, where asked), padding on both sides or neither, active
    sources. Returns ``(src, src_safe, dst, dst_safe, valid, code, src_fault)``;
    ``src_fault`` marks the entries whose error lies with the source, which the status then
    names instead of the destination."""
    src, src_safe, src_valid, code_s = prepare_seq_ids(state, src_ids, names[0],
                                                       unique=unique_src)
    dst, dst_safe, dst_valid, code = prepare_seq_ids(state, dst_ids, names[1])
    if src.shape != dst.shape:
        raise ValueError(f"{op}: source ids {src.shape} and destination ids {dst.shape} differ.")
    src_fault = (code == Code.OK) & (code_s != Code.OK)
    code = jnp.where(code == Code.OK, code_s, code)
    code = first_error(code, (src == -1) != (dst == -1), Code.BAD_SEQ_ID)
    valid = src_valid & dst_valid & (code == Code.OK)
    code = first_error(code, valid & ~state.active[src_safe], Code.SEQ_INACTIVE)
    return src, src_safe, dst, dst_safe, valid, code, src_fault | (code == Code.SEQ_INACTIVE)


def _share(state: BlockState, src_ids, dst_ids, num_blocks, op: str):
    cfg = state.config
    # An error that lies with the source (a bad or inactive parent, too few blocks to share)
    # names the source, not the destination.
    src, src_safe, dst, dst_safe, valid, code, src_fault = _pairs(
        state, src_ids, dst_ids, op, ("parent/src ids", "child/dst ids"), unique_src=False)
    code = first_error(code, valid & state.active[dst_safe], Code.SEQ_ACTIVE)
    src_len = state.seq_lens[src_safe]
    src_blocks = cdiv(src_len, cfg.block_size)
    k = src_blocks if num_blocks is None else broadcast_like(num_blocks, src, "num_blocks")
    code = first_error(code, valid & ((k < 0) | (k > src_blocks)), Code.BAD_NUM_BLOCKS)
    src_fault = src_fault | (code == Code.BAD_NUM_BLOCKS)
    blamed = jnp.where(src_fault, src, dst)
    table = {Code.BAD_SEQ_ID: (blamed, cfg.max_seqs, None),
             Code.BAD_NUM_BLOCKS: (k, src_blocks, dst)}
    code, apply = finalize(code)
    cols = jnp.arange(cfg.max_blocks_per_seq, dtype=jnp.int32)[None, :]
    shared = jnp.where(cols < k[:, None], state.block_tables[src_safe], NULL_BLOCK)
    inc = (valid & apply)[:, None] & (shared != NULL_BLOCK)
    new = state.scatter("ref_counts", jnp.where(inc, shared, cfg.num_blocks), 1, "add")
    new_len = jnp.minimum(k * cfg.block_size, src_len)
    new = set_rows(new, dst, apply, valid, new_len, True, shared)
    return new, op_status(code, blamed, jnp.int32(0), state, op, table)


def fork(state: BlockState, parent_ids, child_ids) -> tuple[BlockState, Status]:
    """Children share all of their parents' blocks (beam search, parallel sampling).

    Args:
      parent_ids: [batch] active slots (repeats allowed: several children per parent).
      child_ids: [batch] inactive slots, unique.
    """
    return _share(state, parent_ids, child_ids, None, "fork")


def share_prefix(state: BlockState, src_id, dst_id, num_blocks) -> tuple[BlockState, Status]:
    """``dst`` starts as a new sequence whose first ``num_blocks`` blocks are ``src``'s.

    The seed's shared system prompt: each shared block's ref count goes up by one per sharer.
    ``dst``'s length becomes ``min(num_blocks * block_size, len(src))``; its own tokens come
    from a following ``append``. Batched: all three arguments may be [batch] arrays.
    """
    return _share(state, src_id, dst_id, num_blocks, "share_prefix")


def move_slots(state: BlockState, src_ids, dst_ids) -> tuple[BlockState, Status]:
    """Move sequences to other slots: slot ``dst[i]`` takes ``src[i]``'s table row, length
    and active flag, and every source that is not also a destination is left empty. Blocks
    and ref counts do not change: a slot is only a row of the tables. What it is for: a
    decode step computes the slots up to the highest one decoding, so a server moves its
    decoding sequences down into slots that finished sequences freed (vLLM's persistent
    batch condenses the same way).

    Args:
      src_ids: [batch] int, active slots, unique (-1 = padding).
      dst_ids: [batch] int, unique; each inactive, or the source of another entry (swaps
        and cycles move in one op). Padding must be padding on both sides.

    Refused entries: an inactive source (``SEQ_INACTIVE``, naming the source), a destination
    that is active and stays so (``SEQ_ACTIVE``).
    """
    cfg = state.config
    src, src_safe, dst, dst_safe, valid, code, src_fault = _pairs(
        state, src_ids, dst_ids, "move_slots", ("src_ids", "dst_ids"), unique_src=True)
    leaving = jnp.zeros((cfg.max_seqs,), bool).at[jnp.where(valid, src, cfg.max_seqs)].set(
        True, mode="drop")
    code = first_error(code, valid & state.active[dst_safe] & ~leaving[dst_safe],
                       Code.SEQ_ACTIVE)
    blamed = jnp.where(src_fault, src, dst)
    code, apply = finalize(code)
    tables, lens = state.block_tables[src_safe], state.seq_lens[src_safe]
    new = set_rows(state, src, apply, valid, 0, False, NULL_BLOCK)
    new = set_rows(new, dst, apply, valid, lens, True, tables)
    table = {Code.BAD_SEQ_ID: (blamed, cfg.max_seqs, None)}
    return new, op_status(code, blamed, jnp.int32(0), state, "move_slots", table)


def copy_on_write(state: BlockState, seq_ids, positions):
    """Make the block holding ``positions`` private to each writer before it writes.

    For every entry whose block has ref count > 1, a fresh block replaces it in the writer's
    table and the old block loses one reference. When every holder of a block writes in the
    same batch, the last of them (in batch order) keeps the original and no copy is made.

    Args:
      seq_ids: [batch] int, active slots (-1 = padding).
      positions: [batch] int, token positions about to be written.

    Returns:
      ``(state, (src, dst), status)``: ``src``/``dst`` are [batch] block ids the KV cache must
      copy (``dst <- src``), NULL_BLOCK where no copy is needed.
    """
    cfg = state.config
    ids, safe, valid, code = prepare_seq_ids(state, seq_ids)
    pos = broadcast_like(positions, ids, "positions")
    code = first_error(code, valid & ~state.active[safe], Code.SEQ_INACTIVE)
    have = cdiv(state.seq_lens[safe], cfg.block_size)
    col = pos // cfg.block_size
    code = first_error(code, valid & ((pos < 0) | (col >= have)), Code.BAD_POSITION)
    live = valid & (code == Code.OK)
    col = jnp.where(live, col, 0)
    old = jnp.where(live, state.block_tables[safe, col], NULL_BLOCK)
    # Rank of each writer among the writers of the same block, in batch order.
    key = jnp.where(live, old, cfg.num_blocks)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    idx = jnp.arange(key.shape[0], dtype=jnp.int32)
    seg_start = jax.lax.cummax(jnp.where(jnp.diff(sorted_key, prepend=-1) != 0, idx, 0))
    rank = jnp.zeros_like(idx).at[order].set(idx - seg_start)
    refs = state.ref_counts[jnp.where(live, old, 0)]
    copy = live & (rank != refs - 1)
    code, need, cum = check_pool(code, copy.astype(jnp.int32), state, 1)
    code, apply = finalize(code)
    new, blocks = take_blocks(state, need, cum, apply, 1)
    new = write_tables(new, jnp.where(live, ids, cfg.max_seqs), col, blocks)
    copy = copy & apply
    new = new.scatter("ref_counts", jnp.where(copy, old, cfg.num_blocks), -1, "add")
    src = jnp.where(copy, old, NULL_BLOCK)
    dst = jnp.where(copy, blocks[:, 0], NULL_BLOCK)
    table = {Code.BAD_POSITION: (pos, have * cfg.block_size, None)}
    return new, (src, dst), op_status(code, ids, jnp.sum(need), state, "copy_on_write", table)


def slot_mapping(state: BlockState, seq_ids, positions) -> jax.Array:
    """Physical slots ``block_tables[s, p // bs] * bs + p % bs`` for token positions.

    Args:
      seq_ids: [batch] int (-1 = padding).
      positions: [batch] or [batch, tokens] int.

    Returns:
      Slots shaped like ``positions``, int32; ``-1`` for padding, inactive sequences and
      positions outside ``[0, seq_len)``. Writers must drop ``-1`` slots, never index with them.
    """
    cfg = state.config
    ids = as_index_array(seq_ids, "seq_ids")
    pos = jnp.asarray(positions)
    if not jnp.issubdtype(pos.dtype, jnp.integer) or pos.ndim not in (1, 2):
        raise ValueError(
            f"positions must be a [batch] or [batch, tokens] int array. Got {pos.dtype}{pos.shape}."
        )
    if pos.shape[0] != ids.shape[0]:
        raise ValueError(f"positions {pos.shape} and seq_ids {ids.shape} disagree on batch.")
    pos = pos.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < cfg.max_seqs)
    safe = jnp.where(in_range, ids, 0)
    ok = in_range & state.active[safe]
    lens = state.seq_lens[safe]
    if pos.ndim == 2:
        ok, lens, safe = ok[:, None], lens[:, None], safe[:, None]
    ok = ok & (pos >= 0) & (pos < lens)
    col = jnp.where(ok, pos // cfg.block_size, 0)
    block = state.block_tables[safe, col]
    return jnp.where(ok, block * cfg.block_size + pos % cfg.block_size, -1)
