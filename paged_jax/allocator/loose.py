"""Loose blocks: references held outside any block table.

The seed's ``allocate()`` / ``share()`` / ``free()`` work on bare block ids, not on sequences;
a prefix cache that keeps blocks alive does the same. Such references are counted in
``BlockState.held``, so ``ref_counts == table references + held`` still holds. Same
conventions as ``ops.py``, from the same ``primitives.py``: pure, batched, all-or-nothing
with a ``Status``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator.primitives import (
    as_index_array,
    check_pool,
    decref,
    op_status,
    take_blocks,
)
from paged_jax.allocator.state import NULL_BLOCK, BlockState
from paged_jax.allocator.status import Code, Status, finalize, first_error


def allocate_blocks(state: BlockState, num_blocks: int) -> tuple[BlockState, jax.Array, Status]:
    """Take ``num_blocks`` (static) blocks from the head of the free list, held outside any
    table with ref count 1. Returns ``(state, blocks [num_blocks], status)``."""
    if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive Python int. Got {num_blocks!r}.")
    n = state.config.num_blocks
    code = jnp.zeros((num_blocks,), jnp.int32)
    code, need, cum = check_pool(code, jnp.ones((num_blocks,), jnp.int32), state, 1)
    code, apply = finalize(code)
    new, blocks = take_blocks(state, need, cum, apply, 1)
    blocks = blocks[:, 0]
    new = new.scatter("held", jnp.where(apply, blocks, n), 1, "add")
    ids = jnp.where(apply, blocks, NULL_BLOCK)
    return new, ids, op_status(code, ids, jnp.int32(num_blocks), state, "allocate")


def _prepare_blocks(state: BlockState, block_ids):
    """``(ids, safe, in_range, code)``; NULL_BLOCK (-1) entries are padding: no error, no
    effect (so a caller can pad a varying count to a fixed shape and compile once)."""
    ids = as_index_array(block_ids, "block_ids")
    n = state.config.num_blocks
    in_range = (ids >= 0) & (ids < n)
    ok = in_range | (ids == NULL_BLOCK)
    code = jnp.where(ok, Code.OK, Code.BAD_BLOCK).astype(jnp.int32)
    return ids, jnp.where(in_range, ids, 0), in_range, code


def share_blocks(state: BlockState, block_ids) -> tuple[BlockState, Status]:
    """One more held reference on each listed block (which must be in use; -1 = padding)."""
    n = state.config.num_blocks
    ids, safe, in_range, code = _prepare_blocks(state, block_ids)
    code = first_error(code, in_range & (state.ref_counts[safe] == 0), Code.BAD_BLOCK)
    code, apply = finalize(code)
    target = jnp.where(apply & in_range, ids, n)
    new = state.scatter("ref_counts", target, 1, "add").scatter("held", target, 1, "add")
    return new, op_status(code, ids, jnp.int32(0), state, "share")


def free_blocks(state: BlockState, block_ids) -> tuple[BlockState, Status]:
    """Drop one held reference per listed block (-1 = padding); blocks reaching zero join the
    free list."""
    n = state.config.num_blocks
    ids, safe, in_range, code = _prepare_blocks(state, block_ids)
    drops = jnp.zeros((n,), jnp.int32).at[jnp.where(in_range, ids, n)].add(1, mode="drop")
    code = first_error(code, in_range & (drops[safe] > state.held[safe]), Code.BAD_BLOCK)
    code, apply = finalize(code)
    new = decref(state, ids, in_range & apply, held_too=True)
    return new, op_status(code, ids, jnp.int32(0), state, "free")
