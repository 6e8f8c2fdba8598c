"""Claiming the blocks of ``num_steps`` decode steps: the bookkeeping of one decode dispatch.

``claim_steps`` grows every masked row by its steps' tokens and makes each row's first write
private (copy-on-write) when it lands in a shared block; ``claim_feeding`` first refuses a
step fed a token outside the vocabulary. Both are allocator ops in the sense of ``ops.py``:
pure, all-or-nothing, O(batch), with one ``Status`` that merges every part's verdict. They
return the block copies to make (``(src, dst)``, as ``copy_on_write`` does); the caller
applies them to its KV cache (``kvcache.copy_blocks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.allocator.ops import append, copy_on_write, reserve_steps
from paged_jax.allocator.primitives import cdiv
from paged_jax.allocator.state import NULL_BLOCK, BlockState
from paged_jax.allocator.status import Code, Status, combine, details


def _where(pred, on_true, on_false):
    """Pytree-wide ``where`` on a scalar predicate."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _no_failure(ids, num_free, op: str) -> Status:
    """A status in which every entry succeeded and nothing was requested."""
    return Status(code=jnp.zeros_like(ids), ids=ids, requested=0, num_free=num_free, op=op)


def bad_tokens(tokens, live, vocab_size: int):
    """Where a ``live`` entry's token id is outside ``[0, vocab_size)`` (``tokens`` and ``live``
    of one shape): the embedding lookup would silently read some other row (a -1, for one,
    wraps to the last)."""
    return live & ((tokens < 0) | (tokens >= vocab_size))


def claim_steps(
    state: BlockState,
    mask: jax.Array,  # [max_seqs] bool, the rows that decode
    num_steps: int,  # static
    budgets: jax.Array | None = None,  # [max_seqs] int in 0..num_steps: tokens per row
    *,
    op: str = "decode_step",
) -> tuple[BlockState, tuple[jax.Array, jax.Array], Status]:
    """The bookkeeping of ``num_steps`` decode steps for every row in ``mask``: the rows grow
    by ``num_steps`` tokens, or by their ``budgets`` when given (``append``, or
    ``reserve_steps`` for several), and a row's first write, at its old length, is made
    private by copy-on-write if it lands in a shared block (every later write lands in a
    block handed out here). All-or-nothing: returns ``(state, (src, dst), status)``, the
    state unchanged and no copies when ``status.applied`` is false; ``src`` and ``dst`` are
    [max_seqs] block ids (-1: no copy), the copies the caller's cache must make.

    Most steps need neither: with 16-token blocks, 15 decode steps in 16 write into a block
    the row already owns alone. Those take a fast path (``seq_lens += num_steps``) that skips
    the allocator's prefix sum, gathers and scatters; its result is the one ``append`` gives.

    The others run the allocator, whose ops are O(batch) (``tests/test_pool_scaling.py``).
    Growing first and then undoing the grow when the copy-on-write that follows runs out of
    blocks would be a select over the whole pool. So the claim decides first: when a row
    would outgrow its table, or the new blocks plus one copy per row that writes into a
    shared block exceed the free pool, it works out both ops' statuses on the input state,
    applying nothing, and a refused claim then runs the ops on no rows. The compiled steps do
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
    no_copies = (jnp.full_like(rows, NULL_BLOCK), jnp.full_like(rows, NULL_BLOCK))

    def shared_write(st):  # [S] rows whose first write lands in a block that st shares
        col = jnp.clip(positions // bs, 0, cfg.max_blocks_per_seq - 1)
        block = st.block_tables[rows, col]
        return mask & (block >= 0) & (st.ref_counts[jnp.clip(block, 0, cfg.num_blocks - 1)] > 1)

    def grow_op(st, rows_mask):
        if num_steps == 1:  # budgets are then 0 or 1, and the 0s are not in the mask
            return append(st, rows_mask, 1)
        return reserve_steps(st, rows_mask, num_steps, None if budgets is None else counts)

    def predicted(st):  # the claim's status, worked out on the input state; nothing applied
        _, s_grow = grow_op(st, mask)
        # After a successful grow the copies would see the pool less what it took.
        after = st.replace(num_free=num_free - jnp.where(s_grow.applied, s_grow.requested, 0))
        _, _, s_cow = copy_on_write(after, jnp.where(shared_write(st), rows, -1), positions)
        s_cow = _where(s_grow.applied, s_cow, _no_failure(ids, num_free, "copy_on_write"))
        return combine(ids, num_free, op, s_grow, s_cow)

    def fast(st):  # nothing can fail: no select against the input state is needed
        st = st.replace(seq_lens=positions + counts)
        return st, no_copies, _no_failure(ids, num_free, op)

    def slow(st):
        # A claim that may fail works out its status first (a cond that returns no state, so
        # the state's buffers stay free to be updated in place) and then runs the ops only
        # if it succeeds; a refused claim runs them on no rows, which changes nothing.
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
        def cow(st):
            st, copies, s_cow = copy_on_write(st, jnp.where(shared, rows, -1), positions)
            return st, copies, s_cow

        def no_cow(st):
            return st, no_copies, _no_failure(ids, num_free, "copy_on_write")

        st, copies, s_cow = jax.lax.cond(jnp.any(shared), cow, no_cow, st)
        status = _where(may_fail, verdict, combine(ids, num_free, op, s_grow, s_cow))
        return st, copies, status

    # A row needs the allocator iff it gets a new block (this includes every error: an
    # inactive slot is never in `mask`, and a row at its table's end needs a block it cannot
    # have) or its first write lands in a shared block. Growing never changes the block a
    # row's first write lands in, nor that block's ref count, so the input state tells.
    shared = shared_write(state)  # [S]
    new_blocks = cdiv(positions + counts, bs) - cdiv(positions, bs)
    needed = jnp.any(new_blocks > 0) | jnp.any(shared)
    # Neither op can fail while every row stays within its table and the pool holds the new
    # blocks plus one copy per row that writes into a shared block.
    demand = jnp.sum(new_blocks) + jnp.sum(shared, dtype=jnp.int32)
    too_long = mask & (positions + counts > cfg.max_tokens_per_seq)  # [S]
    may_fail = (demand > num_free) | jnp.any(too_long)
    return jax.lax.cond(needed, slow, fast, state)


def claim_feeding(
    state: BlockState,
    tokens: jax.Array,  # [max_seqs] int, the token each row feeds
    mask: jax.Array,  # [max_seqs] bool, the rows that decode
    num_steps: int,  # static
    vocab_size: int,  # static
    budgets: jax.Array | None = None,  # [max_seqs] int in 0..num_steps
    *,
    op: str = "decode_step",
) -> tuple[BlockState, tuple[jax.Array, jax.Array], Status]:
    """``claim_steps`` for rows that feed ``tokens``: refused as a whole (state unchanged, no
    copies) when a row in ``mask`` feeds a token outside the vocabulary (``BAD_TOKEN`` with
    the id and the row's length; every other row ``NOT_APPLIED``). A step that did not run
    emits -1, so a serving loop that feeds that back without looking gets a refusal, never a
    step over garbage: it can check the emitted tokens when it streams them rather than after
    every dispatch."""
    if budgets is not None:
        mask = mask & (budgets > 0)
    bad = bad_tokens(tokens, mask, vocab_size)  # [S]
    new_state, copies, status = claim_steps(state, mask & ~jnp.any(bad), num_steps, budgets,
                                            op=op)
    ids = jnp.where(mask, jnp.arange(mask.shape[0], dtype=jnp.int32), -1)
    code = jnp.where(bad, jnp.int32(Code.BAD_TOKEN), jnp.int32(Code.OK))
    value, limit, at = details(code, {Code.BAD_TOKEN: (tokens, vocab_size, state.seq_lens)})
    own = Status(code=code, ids=ids, value=value, limit=limit, at=at, requested=0,
                 num_free=state.num_free, op=op)
    return new_state, copies, combine(ids, state.num_free, op, status, own=own)
