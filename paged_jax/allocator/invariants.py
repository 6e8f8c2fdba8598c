"""``check_invariants``: the allocator's accounting, recomputed from scratch. Pure, jittable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator.state import NULL_BLOCK, BlockState


def check_invariants(state: BlockState) -> dict[str, jax.Array]:
    """Every invariant as a named [] bool. All true for any state the ops produce.

    * ``free_list_well_formed``: ``0 <= num_free <= num_blocks``, the window holds real block
      ids and every entry outside it is ``NULL_BLOCK``.
    * ``free_iff_unreferenced``: each block is in the free window exactly once if its ref
      count is 0, and not at all otherwise.
    * ``refs_match_tables``: ``ref_counts == references from active tables + held >= 0``.
    * ``tables_match_lengths``: an active sequence of length ``L`` has real blocks in exactly
      its first ``ceil(L / block_size)`` columns (no ``NULL_BLOCK`` inside its length).
    * ``inactive_rows_empty``: inactive slots have length 0 and an all-null table.
    """
    cfg = state.config
    n, bs = cfg.num_blocks, cfg.block_size
    i = jnp.arange(n, dtype=jnp.int32)
    ring = state.free_list[(state.free_head + i) % n]  # [num_blocks], hand-out order
    in_window = i < state.num_free
    window_ids_ok = jnp.where(in_window, (ring >= 0) & (ring < n), ring == NULL_BLOCK)
    free_list_well_formed = (
        (state.num_free >= 0)
        & (state.num_free <= n)
        & (state.free_head >= 0)
        & (state.free_head < n)
        & jnp.all(window_ids_ok)
    )
    times_free = jnp.zeros((n,), jnp.int32).at[jnp.where(in_window, ring, n)].add(1, mode="drop")
    free_iff_unreferenced = jnp.all(times_free == (state.ref_counts == 0))

    tables = state.block_tables  # [max_seqs, max_blocks_per_seq]
    counted = state.active[:, None] & (tables != NULL_BLOCK)
    table_refs = jnp.zeros((n,), jnp.int32).at[jnp.where(counted, tables, n)].add(1, mode="drop")
    refs_match_tables = jnp.all(state.ref_counts == table_refs + state.held) & jnp.all(
        state.held >= 0
    )

    cols = jnp.arange(cfg.max_blocks_per_seq, dtype=jnp.int32)[None, :]
    need = (state.seq_lens + bs - 1) // bs  # [max_seqs]
    real = (tables >= 0) & (tables < n)
    shape_ok = jnp.where(cols < need[:, None], real, tables == NULL_BLOCK)
    tables_match_lengths = jnp.all(
        ~state.active
        | ((state.seq_lens >= 0) & (need <= cfg.max_blocks_per_seq) & jnp.all(shape_ok, axis=1))
    )
    inactive_rows_empty = jnp.all(
        state.active | ((state.seq_lens == 0) & jnp.all(tables == NULL_BLOCK, axis=1))
    )
    return {
        "free_list_well_formed": free_list_well_formed,
        "free_iff_unreferenced": free_iff_unreferenced,
        "refs_match_tables": refs_match_tables,
        "tables_match_lengths": tables_match_lengths,
        "inactive_rows_empty": inactive_rows_empty,
    }


def assert_invariants(state: BlockState) -> None:
    """Eager: raise ``AssertionError`` naming every invariant that does not hold."""
    failed = [name for name, ok in check_invariants(state).items() if not bool(np.asarray(ok))]
    if failed:
        raise AssertionError(f"BlockState invariants violated: {', '.join(failed)}")
