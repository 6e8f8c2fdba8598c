"""The recorder and its JSON log, against the independent replay in ``test_viz_reference``."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax import BlockAllocator, RequestState, admit, check_invariants, init_state
from paged_jax.allocator import ops
from paged_jax.allocator.status import OutOfBlocksError
from paged_jax.viz import Recorder, RecordingPool, RunLog, scenarios
from paged_jax.viz.layout import block_views
from paged_jax.viz.log import Event
from tests.test_viz_reference import fork_cow_steps, seed_steps


@functools.cache
def _invariants(config):
    del config  # one compilation per config
    return jax.jit(check_invariants)


def assert_invariants(state) -> None:
    """The allocator's invariants, compiled once per config (eager checks are slow)."""
    failed = [k for k, ok in _invariants(state.config)(state).items() if not bool(ok)]
    assert not failed, f"invariants violated: {failed}"


@pytest.fixture(scope="module")
def seed_log():
    return scenarios.seed()


@pytest.fixture(scope="module")
def fork_cow_log():
    return scenarios.fork_cow()


GAINS, LOSSES = ("alloc", "share", "fork", "prefix_hit"), ("free", "preempt", "evict")


def replay_events(log: RunLog):
    """Rebuild ref counts and tables from the events alone, one event after another.

    Every event must fit the pool as it stands when it happens, and carry the block's ref
    count just after it.
    """
    refs = [0] * log.config.num_blocks
    tables: dict[str, dict[int, int]] = {}
    for t in range(log.num_steps):
        for e in log.events_at(t):
            if e.block is None:
                continue
            table = tables.setdefault(e.request, {}) if e.request is not None else None
            if e.kind in GAINS:
                assert (refs[e.block] == 0) == (e.kind == "alloc"), e
                refs[e.block] += 1
                if table is not None:
                    assert e.logical not in table, e
                    table[e.logical] = e.block
            elif e.kind in LOSSES:
                assert refs[e.block] > 0, e
                refs[e.block] -= 1
                if table is not None:
                    assert table.pop(e.logical) == e.block, e
            elif e.kind == "cow_copy":
                assert refs[e.block] == 0 and refs[e.src_block] > 1, e
                refs[e.block] += 1
                refs[e.src_block] -= 1
                assert table[e.logical] == e.src_block, e
                table[e.logical] = e.block
            else:
                assert e.kind == "append" and table[e.logical] == e.block, e
            assert e.ref_count == refs[e.block], e
        yield t, list(refs), {n: [tb[i] for i in sorted(tb)] for n, tb in tables.items() if tb}


def assert_events_explain_snapshots(log: RunLog) -> None:
    bs = log.config.block_size
    for t, refs, tables in replay_events(log):
        snap = log.snapshots[t]
        assert refs == snap.ref_counts.tolist(), f"step {t}"
        want = {n: list(r.table) for n, r in snap.requests().items() if r.table}
        assert tables == want, f"step {t}"
        reqs = snap.requests()
        last: dict[tuple, int] = {}  # (request, logical) -> tokens of its last event
        for e in log.events_at(t):
            if e.request is not None and e.kind not in LOSSES:
                last[(e.request, e.logical)] = e.tokens
            text = e.describe()
            assert "None" not in text and "(ref" not in text, text
        for (name, i), tokens in last.items():
            if name in reqs and i < len(reqs[name].table):
                assert tokens == reqs[name].tokens_in(i, bs), (t, name, i)


def test_seed_snapshots_match_the_replay(seed_log):
    want = seed_steps()
    assert seed_log.num_steps == len(want)
    for t, (snap, ref) in enumerate(zip(seed_log.snapshots, want, strict=True)):
        assert_invariants(snap.to_state())
        views = block_views(snap)
        assert [frozenset(v.owners) for v in views] == ref["owners"], f"step {t}"
        assert [v.ref_count for v in views] == ref["refs"], f"step {t}"
        assert [v.tokens for v in views] == ref["tokens"], f"step {t}"
        assert list(snap.free_order) == ref["free"], f"step {t}"
        assert {n: list(r.table) for n, r in snap.requests().items()} == ref["tables"]


def test_seed_events(seed_log):
    def at(step):
        return [(e.kind, e.request, e.logical, e.block, e.ref_count, e.tokens)
                for e in seed_log.events_at(step)]

    assert at(3) == [("alloc", "C", i, 5 + i, 1, t) for i, t in enumerate([16, 16, 16, 2])]
    assert at(11) == [("append", "A", 2, 2, 1, 16)]  # A's 48th token fills block 2
    assert at(12) == [("alloc", "A", 3, 9, 1, 1)]  # the 49th needs block 9
    assert at(14) == [("free", "B", 0, 3, 0, 16), ("free", "B", 1, 4, 0, 8)]
    assert at(15) == [("alloc", None, None, 10, 1, 16), ("alloc", None, None, 11, 1, 16)]
    assert at(17) == [("share", "E", 0, 10, 3, 16), ("share", "E", 1, 11, 3, 16),
                      ("alloc", "E", 2, 13, 1, 16)]
    assert at(19) == [("free", None, None, 10, 1, 16), ("free", None, None, 11, 1, 16)]
    assert_events_explain_snapshots(seed_log)


def test_fork_cow_matches_the_replay(fork_cow_log):
    want = fork_cow_steps()
    for t, (snap, ref) in enumerate(zip(fork_cow_log.snapshots, want, strict=True)):
        assert_invariants(snap.to_state())
        assert [frozenset(v.owners) for v in block_views(snap)] == ref["owners"], f"step {t}"
        assert snap.ref_counts.tolist() == ref["refs"], f"step {t}"
    kinds = [(e.kind, e.request, e.src_block, e.block) for e in fork_cow_log.events_at(3)]
    # P and Q copy block 1 (the pairs copy_on_write returned), then all three write.
    assert kinds == [("cow_copy", "P", 1, 2), ("cow_copy", "Q", 1, 3), ("append", "P", None, 2),
                     ("append", "Q", None, 3), ("append", "R", None, 1)]
    assert {e.kind for e in fork_cow_log.events_at(2)} == {"fork"}
    assert_events_explain_snapshots(fork_cow_log)


@pytest.mark.parametrize("name", ["prefix-sharing", "random"])
def test_other_scenarios_are_explained_by_their_events(name):
    log = scenarios.SCENARIOS[name]()
    for snap in log.snapshots:
        assert_invariants(snap.to_state())
    assert_events_explain_snapshots(log)
    kinds = {e.kind for e in log.events}
    if name == "random":  # the random run shows every kind of event
        assert kinds == {"alloc", "free", "share", "fork", "cow_copy", "append", "preempt",
                         "prefix_hit", "evict"}
    else:
        assert {"prefix_hit", "evict"} <= kinds


def test_a_preemption_lists_each_block_once():
    pool = RecordingPool(scenarios.TINY_POOL)
    pool.admit(["A"], [6])
    pool.capture("admit A")
    pool.preempt(["A"])
    pool.capture("preempt A")
    events = [(e.kind, e.request, e.logical, e.block, e.ref_count, e.tokens)
              for e in pool.log.events_at(2)]
    assert events == [("preempt", "A", 0, 0, 0, 4), ("preempt", "A", 1, 1, 0, 2)]
    # The same through a plain Recorder: the note turns the diffed frees into preemptions.
    pool.admit(["B"], [2])
    pool.capture("admit B")
    pool.note("preempt", request="B")
    pool.state = ops.release(pool.state, np.array([pool.slot("B")]))[0]
    pool.names = {}
    pool.capture("preempt B")
    assert [(e.kind, e.request) for e in pool.log.events_at(4)] == [("preempt", "B")]
    with pytest.raises(ValueError, match="note"):
        pool.note("alloc", request="A")
    with pytest.raises(ValueError, match="needs the blocks"):
        pool.note("evict")


def test_preemptions_and_prefix_hits_need_blocks():
    pool = RecordingPool(scenarios.TINY_POOL)
    pool.admit(["A"], [6])
    pool.note("preempt", request="A")  # A arrived in this step: it held nothing before
    with pytest.raises(ValueError, match="preempt of 'A': the request held no blocks"):
        pool.capture("admit A")
    pool.capture("admit A")  # the failed capture recorded nothing
    assert pool.log.num_steps == 2
    pool.note("prefix_hit", request="A")
    with pytest.raises(ValueError, match="prefix_hit of 'A': the request was given no blocks"):
        pool.capture("nothing")
    pool.admit(["Z"], [0])
    with pytest.raises(ValueError, match=r"Only a request holding blocks .* Got \['Z'\]"):
        pool.preempt(["Z"])


def _admit(state, slots, lengths):
    """``admit`` padded to ``max_seqs``: compiled once for the tiny pool, as in ``pool.py``."""
    width = state.config.max_seqs
    ids = np.full((width,), -1, np.int32)
    ids[: len(slots)] = slots
    n = np.zeros((width,), np.int32)
    n[: len(lengths)] = lengths
    state, status = _jit_admit(state, ids, n)
    status.raise_if_failed()
    return state


_jit_admit = jax.jit(admit)


def test_recorder_takes_pure_op_states_and_the_facade_alike():
    rec = Recorder()
    state = init_state(scenarios.TINY_POOL)
    rec.capture(state, title="empty")
    state = _admit(state, [1], [5])
    rec.capture(state, {1: "X"}, title="admit X in slot 1")
    assert [(e.kind, e.request, e.block) for e in rec.log.events] == [
        ("alloc", "X", 0), ("alloc", "X", 1)
    ]
    allocator = BlockAllocator(num_blocks=20, block_size=16)  # the seed's pool: compiled
    facade = Recorder()
    facade.capture_allocator(allocator)
    RequestState("req-1", 17, allocator)
    facade.capture_allocator(allocator)
    assert [(e.kind, e.request) for e in facade.log.events] == [("alloc", "req-1")] * 2
    with pytest.raises(ValueError, match="one CacheConfig"):
        facade.capture(state)


def test_duplicate_names_are_refused():
    state = _admit(init_state(scenarios.TINY_POOL), [0, 1], [1, 1])
    with pytest.raises(ValueError, match="unique"):
        Recorder().capture(state, {0: "A", 1: "A"})


def test_json_round_trip(seed_log, tmp_path):
    path = tmp_path / "run.json"
    seed_log.save(path)
    back = RunLog.load(path)
    assert back.config == seed_log.config and back.scenario == "seed"
    assert back.events == seed_log.events
    assert all(a.equals(b) for a, b in zip(back.snapshots, seed_log.snapshots, strict=True))
    assert json.loads(path.read_text())["events"][0]["kind"] == "alloc"
    with pytest.raises(ValueError, match="format"):
        RunLog.from_json({"format": "something else"})
    with pytest.raises(ValueError, match="kind"):
        Event(0, "teleport", None, None, None, None, None)


_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "append", "release", "fork", "cow", "cow_all", "hold",
                               "drop"]),
              st.integers(0, 9), st.integers(1, 9)),
    min_size=1, max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops)
def test_events_explain_any_run(ops):
    """Whatever the ops, replaying the events rebuilds every snapshot's refs and tables."""
    pool = RecordingPool(scenarios.TINY_POOL)
    held: list[int] = []
    for i, (op, pick, k) in enumerate(ops):
        live = pool.live
        who = live[pick % len(live)] if live else None
        try:
            if op == "admit" and len(live) < 4:
                pool.admit([f"r{i}"], [k])
            elif op == "append" and who:
                pool.append([who], k)
            elif op == "release" and who:
                pool.release([who])
            elif op == "fork" and who and len(live) < 4:
                pool.fork([who], [f"r{i}"])
            elif op == "cow" and who and pool.length(who):
                copies = pool.copy_on_write([who], [pick % pool.length(who)])
                pool.note("cow_copy", request=who, blocks=[d for _, _, d in copies] or None)
            elif op == "cow_all" and live:  # every request writes its last token at once
                writers = [n for n in live if pool.length(n)]
                pool.copy_on_write(writers, [pool.length(n) - 1 for n in writers])
            elif op == "hold" and who and pool.table(who):
                pool.hold(pool.table(who)[:1])
                held += pool.table(who)[:1]
            elif op == "drop" and held:
                pool.drop([held.pop()])
        except (OutOfBlocksError, ValueError):
            pass  # refused: the state is unchanged
        pool.capture(op)
    for snap in pool.log.snapshots:
        assert_invariants(snap.to_state())
    assert_events_explain_snapshots(pool.log)


def test_keep_last_bounds_the_log_to_the_newest_steps():
    """A recorder with ``keep_last=4`` fed a 40-step run holds, after every capture, the
    newest steps of the same run recorded whole (4..7 of them, renumbered from 0); the first
    kept step's events, which led from a dropped snapshot, are dropped too."""
    run = scenarios.random_run(steps=40, seed=3)
    whole, kept = Recorder("run"), Recorder("run", keep_last=4)
    for t, snap in enumerate(run.snapshots):
        args = (snap.to_state(), snap.names)
        assert whole.capture(*args, tables=snap.tables, title=snap.title) == t
        step = kept.capture(*args, tables=snap.tables, title=snap.title)
        log = kept.log
        first = kept.dropped
        assert 1 <= log.num_steps <= 7 and step == log.num_steps - 1
        assert first + log.num_steps == t + 1
        for mine, theirs in zip(log.snapshots, whole.log.snapshots[first:], strict=True):
            assert mine.equals(theirs)
        want = [(e.step - first, e.kind, e.request, e.block) for e in whole.log.events
                if e.step > first or (first == 0 and e.step == 0)]
        assert [(e.step, e.kind, e.request, e.block) for e in log.events] == want
    assert kept.dropped > 0
    with pytest.raises(ValueError, match="keep_last"):
        Recorder(keep_last=0)
