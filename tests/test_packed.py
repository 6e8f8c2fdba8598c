"""The packed state: fields read back exactly as written, replace touches only its field, bad
input raises before anything changes, and a jitted replace under donation works in place."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.allocator import BlockState, CacheConfig, Status, admit, init_state
from paged_jax.allocator.packed import Packed

CFG = CacheConfig(num_blocks=12, block_size=4, max_seqs=3, max_blocks_per_seq=5)
SHAPES = {
    "ref_counts": (12,), "held": (12,), "block_tables": (3, 5), "seq_lens": (3,),
    "active": (3,), "free_list": (12,), "free_head": (), "num_free": (),
}


def random_fields(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {name: rng.integers(-5, 100, shape).astype(np.int32) for name, shape in SHAPES.items()}
    out["active"] = rng.integers(0, 2, (3,)).astype(bool)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fields_read_back_as_written(seed):
    fields = random_fields(seed)
    state = BlockState(**fields, config=CFG)
    assert len(jax.tree.leaves(state)) == 2  # per-block arrays, per-sequence arrays
    for name, expected in fields.items():
        got = np.asarray(getattr(state, name))
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_replace_changes_only_its_field_eagerly_and_under_jit(name):
    fields, other = random_fields(3), random_fields(4)
    state = BlockState(**fields, config=CFG)
    for new in (state.replace(**{name: other[name]}),
                jax.jit(lambda s: s.replace(**{name: other[name]}))(state)):
        for field, expected in fields.items():
            want = other[name] if field == name else expected
            np.testing.assert_array_equal(np.asarray(getattr(new, field)), want, err_msg=field)
    for field, expected in fields.items():  # the input is untouched
        np.testing.assert_array_equal(np.asarray(getattr(state, field)), expected)


def test_status_is_packed_too():
    _, status = admit(init_state(CFG), jnp.array([0, -1, 2]), jnp.array([5, 0, 30]))
    assert len(jax.tree.leaves(status)) == 1 and status.op == "admit"
    np.testing.assert_array_equal(np.asarray(status.ids), [0, -1, 2])
    chex.assert_shape([status.code, status.ids], (3,))
    chex.assert_shape([status.requested, status.num_free], ())
    assert int(status.num_free) == 12


def test_bad_input_names_the_field_and_changes_nothing():
    fields = random_fields(5)
    state = BlockState(**fields, config=CFG)
    before = [np.asarray(b).copy() for b in state.buffers]
    with pytest.raises(ValueError, match=r"BlockState.block_tables must have shape \(3, 5\)"):
        state.replace(block_tables=np.zeros((3, 4), np.int32))
    with pytest.raises(TypeError, match="no field 'seq_len'"):
        state.replace(seq_len=fields["seq_lens"])
    with pytest.raises(AttributeError, match="immutable"):
        state.seq_lens = fields["seq_lens"]
    for buffer, old in zip(state.buffers, before, strict=True):
        np.testing.assert_array_equal(np.asarray(buffer), old)
    with pytest.raises(ValueError, match=r"BlockState.free_head must have shape \(\)"):
        BlockState(**{**fields, "free_head": np.zeros(2, np.int32)}, config=CFG)
    with pytest.raises(TypeError, match=r"Missing or unexpected: \['held'\]"):
        BlockState(**{k: v for k, v in fields.items() if k != "held"}, config=CFG)
    with pytest.raises(ValueError, match=r"Status.requested must have shape \(\)"):
        Status(code=np.zeros(2), ids=np.zeros(2), requested=np.zeros(2), num_free=0, op="x")


def test_donated_replace_is_in_place():
    state = init_state(CFG)
    pointers = [b.unsafe_buffer_pointer() for b in state.buffers]
    bump = jax.jit(lambda s: s.replace(seq_lens=s.seq_lens + 1), donate_argnums=0)
    new = bump(state)
    assert all(b.is_deleted() for b in state.buffers)
    assert [b.unsafe_buffer_pointer() for b in new.buffers] == pointers
    np.testing.assert_array_equal(np.asarray(new.seq_lens), [1, 1, 1])


@pytest.mark.parametrize("seed", [0, 1])
def test_scatter_matches_a_numpy_scatter_and_drops_out_of_range(seed):
    rng = np.random.default_rng(seed)
    fields = random_fields(seed)
    state = BlockState(**fields, config=CFG)
    # 1-D add with duplicates and out-of-range entries (past the end, and negative).
    idx = rng.integers(-3, 16, 20)
    vals = rng.integers(-4, 5, 20)
    want = fields["ref_counts"].copy()
    for i, v in zip(idx, vals, strict=True):
        if 0 <= i < 12:
            want[i] += v
    # 2-D set: distinct cells, some rows or columns out of range.
    rows, cols = np.array([0, 2, 3, 1, -1]), np.array([4, 0, 1, 5, 2])
    blocks = rng.integers(0, 12, 5)
    tables = fields["block_tables"].copy()
    for r, c, b in zip(rows, cols, blocks, strict=True):
        if 0 <= r < 3 and 0 <= c < 5:
            tables[r, c] = b
    for new in (
        state.scatter("ref_counts", idx, vals, "add").scatter("block_tables", (rows, cols), blocks),
        jax.jit(lambda s: s.scatter("ref_counts", idx, vals, "add").scatter(
            "block_tables", (rows, cols), blocks))(state),
    ):
        np.testing.assert_array_equal(np.asarray(new.ref_counts), want)
        np.testing.assert_array_equal(np.asarray(new.block_tables), tables)
        for name in SHAPES.keys() - {"ref_counts", "block_tables"}:
            np.testing.assert_array_equal(np.asarray(getattr(new, name)), fields[name])
    with pytest.raises(ValueError, match="block_tables has 2 dimensions; got 1"):
        state.scatter("block_tables", rows, blocks)
    with pytest.raises(ValueError, match="op must be 'set' or 'add'. Got 'max'"):
        state.scatter("held", idx, vals, "max")


def test_window_is_a_clamped_slice_of_its_field():
    fields = random_fields(6)
    state = BlockState(**fields, config=CFG)
    ring = fields["free_list"]
    read = jax.jit(lambda s, start: s.window("free_list", start, 4))
    for start in [-3, 0, 5, 8, 9, 30]:
        want = ring[min(max(start, 0), 12 - 4):][:4]
        np.testing.assert_array_equal(np.asarray(read(state, start)), want, err_msg=str(start))
    np.testing.assert_array_equal(np.asarray(state.window("free_list", 0, 12)), ring)
    with pytest.raises(ValueError, match=r"0 < size <= 12 \(the length of free_list\)"):
        state.window("free_list", 0, 13)
    with pytest.raises(ValueError, match=r"1-D field.*Got shape \(3, 5\)"):
        state.window("block_tables", 0, 2)


def test_groups_keep_each_buffer_to_its_fields():
    """The per-block arrays live apart from the per-sequence ones (see packed.py), and a
    class whose groups do not partition its fields is refused when it is defined."""
    state = init_state(CFG)
    pool, seqs = (b.shape[0] for b in state.buffers)
    assert pool == 12 + 12 + 3 * 5 + 12 and seqs == 3 + 3 + 1 + 1
    with pytest.raises(TypeError, match="GROUPS must list each field once"):
        type("Bad", (Packed,), {"FIELDS": (("a", jnp.int32), ("b", jnp.int32)),
                                "GROUPS": (("a",), ("a",)), "__slots__": ()})
