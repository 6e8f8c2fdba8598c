"""The primitives every allocator op is built from (``ops.py``, ``loose.py``, ``claim.py``).

Validation before tracing (``as_index_array``, ``broadcast_like``, ``prepare_seq_ids``), the op's
``Status`` (``op_status``), the pool check and hand-out (``prefix_sum``, ``check_pool``,
``take_blocks``), table writes (``write_tables``, ``set_rows``) and reference drops
(``decref``). Each is pure and O(batch); ``ops.py`` states the conventions they keep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator.state import NULL_BLOCK, BlockState
from paged_jax.allocator.status import Code, Status, details, first_error


def cdiv(a, b):
    return (a + b - 1) // b


def as_index_array(x, name: str) -> jax.Array:
    """Validate dtype and rank before tracing; scalars become a batch of one."""
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array. Got dtype {arr.dtype}.")
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a [batch] vector. Got shape {arr.shape}.")
    return arr.astype(jnp.int32)


def broadcast_like(x, ids: jax.Array, name: str) -> jax.Array:
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers. Got dtype {arr.dtype}.")
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != ids.shape[0]):
        raise ValueError(
            f"{name} must be a scalar or match seq_ids' shape {ids.shape}. Got shape {arr.shape}."
        )
    return jnp.broadcast_to(arr.astype(jnp.int32), ids.shape)


def prepare_seq_ids(state: BlockState, seq_ids, name: str = "seq_ids", unique: bool = True):
    """Returns ``(ids, safe, valid, code)``: ``safe`` is a gatherable index, ``valid`` marks
    real (non-padding, in-range, non-duplicate) entries, ``code`` their first error."""
    ids = as_index_array(seq_ids, name)
    max_seqs = state.config.max_seqs
    pad = ids == -1
    in_range = (ids >= 0) & (ids < max_seqs)
    code = jnp.where(pad | in_range, Code.OK, Code.BAD_SEQ_ID).astype(jnp.int32)
    safe = jnp.where(in_range, ids, 0)
    if unique:
        counts = jnp.zeros((max_seqs,), jnp.int32).at[jnp.where(in_range, ids, max_seqs)].add(
            1, mode="drop"
        )
        code = first_error(code, in_range & (counts[safe] > 1), Code.DUPLICATE_SEQ)
    return ids, safe, in_range & (code == Code.OK), code


def op_status(code, ids, requested, state: BlockState, op: str, table=None) -> Status:
    """The op's ``Status``; ``table`` (``{Code: (value, limit, at)}``, see ``details``) gives
    the numbers its messages name. A bad seq id always names ``max_seqs``."""
    table = {Code.BAD_SEQ_ID: (ids, state.config.max_seqs, None), **(table or {})}
    value, limit, at = details(code, table)
    return Status(code=code, ids=ids, value=value, limit=limit, at=at, requested=requested,
                  num_free=state.num_free, op=op)


def prefix_sum(x: jax.Array, bound: int) -> jax.Array:
    """Inclusive cumulative sum of a [batch] int vector whose entries lie in ``[0, bound]``.

    XLA:CPU runs ``cumsum`` as a serial loop; a two-level triangular matmul in f32 is exact
    while every partial sum stays below 2**24, which ``bound`` lets us check statically. Falls
    back to ``cumsum`` otherwise (``paged-jax bench allocator`` measures the ops).
    """
    length = x.shape[0]
    width = max(8, int(np.ceil(np.sqrt(length))))
    rows = -(-length // width)
    if length < 64 or rows * width * bound >= 2**24:
        return jnp.cumsum(x, dtype=jnp.int32)
    tri = jnp.triu(jnp.ones((width, width), jnp.float32))  # [width, width]
    grid = jnp.pad(x, (0, rows * width - length)).astype(jnp.float32).reshape(rows, width)
    within = jnp.matmul(grid, tri, precision=jax.lax.Precision.HIGHEST)  # [rows, width]
    upper = jnp.triu(jnp.ones((rows, rows), jnp.float32), 1)  # [rows, rows]
    before = jnp.matmul(within[:, -1], upper, precision=jax.lax.Precision.HIGHEST)  # [rows]
    return (within + before[:, None]).reshape(-1)[:length].astype(jnp.int32)


def check_pool(code, need, state: BlockState, bound: int):
    """Mark entries whose demand, accumulated in batch order, exceeds the free pool.

    Returns ``(code, need, cum)``: ``need`` zeroed for failed entries, ``cum`` its prefix sum.
    """
    need = jnp.where(code == Code.OK, need, 0)
    cum = prefix_sum(need, bound)
    code = first_error(code, (need > 0) & (cum > state.num_free), Code.OUT_OF_BLOCKS)
    return code, need, cum


def read_ring(state: BlockState, rank) -> jax.Array:
    """``free_list[(free_head + rank) % num_blocks]`` for the ``rank`` [batch, max_new] (any
    shape) of blocks about to be taken; a rank outside ``[0, rank.size)`` reads some block.

    The taken blocks lie in the ``rank.size`` ring slots from the head, read here as two
    windows of that size (from the head, and from the ring's start for the part that wraps
    around) rather than by indexing the whole ring: on XLA:CPU a computation that reads a
    pool-sized operand is split into parallel tasks, a thread hand-off on every decode step.
    """
    n, size = state.config.num_blocks, rank.size
    if not 0 < size < n:
        return state.free_list[(state.free_head + rank) % n]
    r = jnp.clip(rank, 0, size - 1)
    position = state.free_head + r  # ring slot, before wrapping around
    start = jnp.minimum(state.free_head, n - size)  # the head window, kept inside the ring
    head = state.window("free_list", start, size)[jnp.clip(position - start, 0, size - 1)]
    wrapped = state.window("free_list", 0, size)[jnp.clip(position - n, 0, size - 1)]
    return jnp.where(position < n, head, wrapped)


def take_blocks(state: BlockState, need, cum, apply, max_new: int, rank=None):
    """Hand out ``need[i]`` blocks to each entry from the head of the free ring.

    ``cum`` is ``prefix_sum(need)`` from ``check_pool``. By default entry ``i`` takes the
    ring's blocks ``cum[i] - need[i] ...`` (batch order); ``rank`` [batch, max_new] overrides
    which head offset each new block comes from. Returns ``(state, blocks [batch, max_new])``:
    blocks taken (NULL_BLOCK past ``need``), their ref counts set to 1 and their ring slots
    cleared. Tables are not touched. Nothing is taken unless ``apply``.
    """
    n = state.config.num_blocks
    need = jnp.where(apply, need, 0)
    j = jnp.arange(max_new, dtype=jnp.int32)[None, :]  # [1, max_new]
    take = j < need[:, None]  # [batch, max_new]
    if rank is None:
        rank = (cum - need)[:, None] + j  # [batch, max_new]
    ring = (state.free_head + rank) % n  # [batch, max_new]
    blocks = jnp.where(take, read_ring(state, rank), NULL_BLOCK)
    total = jnp.where(apply, cum[-1], 0) if cum.shape[0] else jnp.int32(0)
    free_head, num_free = (state.free_head + total) % n, state.num_free - total
    state = state.scatter("ref_counts", jnp.where(take, blocks, n), 1)
    state = state.scatter("free_list", jnp.where(take, ring, n), NULL_BLOCK)
    state = state.replace(free_head=free_head, num_free=num_free)
    return state, blocks


def write_tables(state: BlockState, rows, first_col, blocks) -> BlockState:
    """``block_tables[rows[i], first_col[i] + j] = blocks[i, j]`` where the block is real."""
    m = state.config.max_blocks_per_seq
    cols = first_col[:, None] + jnp.arange(blocks.shape[1], dtype=jnp.int32)[None, :]
    cols = jnp.where(blocks != NULL_BLOCK, cols, m)
    return state.scatter("block_tables", (rows[:, None], cols), blocks)


def decref(state: BlockState, blocks, mask, held_too: bool = False) -> BlockState:
    """Drop one reference per masked entry of ``blocks`` (any shape; duplicates add up).
    Blocks reaching zero join the tail of the free ring in row-major order of ``blocks``, exactly
    as if the references were dropped one by one."""
    n = state.config.num_blocks
    flat = blocks.reshape(-1)
    live = mask.reshape(-1) & (flat != NULL_BLOCK)
    target = jnp.where(live, flat, n)
    tail = state.free_head + state.num_free
    new = state.scatter("ref_counts", target, -1, "add")
    if held_too:
        new = new.scatter("held", target, -1, "add")
    ref = new.ref_counts
    # As if the references were dropped one at a time in order: a block mentioned several
    # times is appended once, at its last mention, when its count actually reaches zero.
    order = jnp.arange(flat.shape[0], dtype=jnp.int32)
    last = jnp.full((n,), -1, jnp.int32).at[target].max(order, mode="drop")
    safe = jnp.where(live, flat, 0)
    freed = live & (last[safe] == order) & (ref[safe] == 0)
    pos = (tail + prefix_sum(freed.astype(jnp.int32), 1) - 1) % n
    num_free = new.num_free + jnp.sum(freed, dtype=jnp.int32)
    new = new.scatter("free_list", jnp.where(freed, pos, n), flat)
    return new.replace(num_free=num_free)


def set_rows(state: BlockState, ids, apply, valid, seq_lens, active, tables=None):
    rows = jnp.where(apply & valid, ids, state.config.max_seqs)
    new = state.scatter("seq_lens", rows, seq_lens).scatter("active", rows, active)
    if tables is not None:
        cols = jnp.arange(state.config.max_blocks_per_seq, dtype=jnp.int32)[None, :]
        new = new.scatter("block_tables", (rows[:, None], cols), tables)
    return new
