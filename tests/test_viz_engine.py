"""``--scenario engine``: the recorded engine run against the pure-Python model allocator.

The engine's jitted steps drive the allocator inside jit (append and copy-on-write in
``decode_step``, append in ``prefill``). Replaying the same requests through the model
allocator must give every recorded snapshot: tables, lengths, ref counts and free order.
"""

import numpy as np
import pytest

from paged_jax.viz.cli import main
from paged_jax.viz.engine_run import POOL, engine_run
from tests.reference_allocator import ModelAllocator


def model_replay():
    """The run described in engine_run's docstring, step by step, on the model allocator."""
    m = ModelAllocator(POOL.num_blocks, POOL.block_size, POOL.max_seqs, POOL.max_blocks_per_seq)
    snaps = [m_copy(m)]

    def decode(slots):
        assert m.append(slots, [1] * len(slots)) == [0] * len(slots)
        codes, *_ = m.copy_on_write(slots, [m.lens[s] - 1 for s in slots])
        assert codes == [0] * len(slots)
        snaps.append(m_copy(m))

    assert m.admit([0, 1], [13, 9]) == [0, 0]
    snaps.append(m_copy(m))
    decode([0, 1])
    decode([0, 1])
    assert m.share([0], [2]) == [0]
    snaps.append(m_copy(m))
    decode([0, 1, 2])
    assert m.release([1]) == [0]
    snaps.append(m_copy(m))
    assert m.share([0], [1], [1]) == [0]
    assert m.append([1], [5]) == [0]
    snaps.append(m_copy(m))
    decode([0, 1, 2])
    decode([0, 1, 2])
    return snaps


def m_copy(m):
    return ({s: list(t) for s, t in m.tables.items()}, dict(m.lens), list(m.refs), list(m.free))


@pytest.fixture(scope="module")
def log():
    return engine_run()


def test_engine_run_matches_model_allocator(log):
    want = model_replay()
    assert log.num_steps == len(want)
    for step, (snap, (tables, lens, refs, free)) in enumerate(zip(log.snapshots, want,
                                                                  strict=True)):
        got = {int(s): [int(b) for b in snap.block_tables[s] if b >= 0]
               for s in np.flatnonzero(snap.active)}
        assert got == tables, (step, snap.title)
        assert {s: int(snap.seq_lens[s]) for s in got} == lens, step
        assert snap.ref_counts.tolist() == refs, step
        assert list(snap.free_order) == free, step


def test_engine_run_shows_fork_cow_and_prefix_hit(log):
    kinds = {(e.kind, e.request) for e in log.events}
    assert ("fork", "A2") in kinds
    assert ("cow_copy", "A") in kinds  # A wrote first, so A copied; A2 kept the block
    assert ("prefix_hit", "C") in kinds


def test_engine_scenario_writes_views(tmp_path, monkeypatch, log):
    # The CLI routes --scenario engine to engine_run (reuse the recorded run: it is slow).
    monkeypatch.setattr("paged_jax.viz.engine_run.engine_run", lambda seed=0: log)
    assert main(["--scenario", "engine", "--out", str(tmp_path / "e"), "--no-gif",
                 "--quiet"]) == 0
    for name in ("run.json", "layout.txt", "layout.html", "trace.json", "timeline.png"):
        assert (tmp_path / "e" / name).stat().st_size > 0
    assert "copy-on-write" in (tmp_path / "e" / "layout.txt").read_text()
