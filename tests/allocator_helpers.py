"""Shared assertions for the allocator tests: a ``BlockState`` against the pure-Python model."""

from __future__ import annotations

import jax
import numpy as np

from paged_jax import NULL_BLOCK, check_invariants, free_list_order


def assert_matches_model(state, model) -> None:
    """Tables, lengths, active flags, ref counts, held counts and free order all agree."""
    tables = np.asarray(state.block_tables)
    lens = np.asarray(state.seq_lens)
    active = np.asarray(state.active)
    for slot in range(model.max_seqs):
        want = model.tables.get(slot)
        if want is None:
            assert not active[slot], f"slot {slot} should be inactive"
            assert lens[slot] == 0
            assert (tables[slot] == NULL_BLOCK).all()
        else:
            assert active[slot], f"slot {slot} should be active"
            assert lens[slot] == model.lens[slot], (slot, lens[slot], model.lens[slot])
            row = tables[slot]
            assert row[: len(want)].tolist() == want, (slot, row.tolist(), want)
            assert (row[len(want):] == NULL_BLOCK).all()
    assert np.asarray(state.ref_counts).tolist() == model.refs
    assert np.asarray(state.held).tolist() == model.held
    assert free_list_order(state) == list(model.free)
    assert int(state.num_free) == len(model.free)


def assert_invariants_hold(state) -> None:
    failed = [k for k, v in check_invariants(state).items() if not bool(v)]
    assert not failed, failed


def assert_same_state(a, b) -> None:
    """Bit-identical pytrees (used to prove a failed op changed nothing)."""
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
