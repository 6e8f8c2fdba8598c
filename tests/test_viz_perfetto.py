"""The Perfetto (Chrome trace-event) JSON: well-formed, slices never overlap on a track, and
every slice matches the ownership the replay expects."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from paged_jax.viz import RunLog, scenarios
from paged_jax.viz.perfetto import BLOCKS_PID, STEP_US, build_trace, save_trace
from tests.test_viz_reference import seed_steps

REQUIRED = {
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "b": {"name", "cat", "id", "ph", "ts", "pid"},
    "e": {"name", "cat", "id", "ph", "ts", "pid"},
    "C": {"name", "ph", "ts", "pid", "args"},
    "i": {"name", "ph", "ts", "pid", "tid", "s"},
    "M": {"name", "ph", "pid", "args"},
}


def validate(trace: dict) -> list[dict]:
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in REQUIRED, e
        missing = REQUIRED[e["ph"]] - set(e)
        assert not missing, f"{e} lacks {missing}"
        if "ts" in e:
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] > 0
        if e["ph"] == "C":
            assert all(isinstance(v, int | float) for v in e["args"].values())
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in tracks.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"overlapping slices on {track}"
    opened = defaultdict(int)
    for e in sorted((e for e in events if e["ph"] in "be"), key=lambda e: e["ts"]):
        opened[(e["cat"], e["id"], e["name"])] += 1 if e["ph"] == "b" else -1
    assert set(opened.values()) <= {0}, "unbalanced async spans"
    return events


@pytest.fixture(scope="module")
def seed_log():
    return scenarios.seed()


def test_seed_trace_is_valid_and_matches_the_replay(seed_log, tmp_path):
    path = tmp_path / "trace.json"
    save_trace(seed_log, path)
    events = validate(json.loads(path.read_text()))
    want = seed_steps()
    # Expected slices: maximal runs of equal (owners, ref count) while in use.
    expected = set()
    for b in range(20):
        start = None
        for t in range(len(want) + 1):
            key = (tuple(sorted(want[t]["owners"][b])), want[t]["refs"][b]) if t < len(want) \
                else None
            prev = (tuple(sorted(want[start]["owners"][b])), want[start]["refs"][b]) \
                if start is not None else None
            if prev is not None and key != prev:
                expected.add((b, start * STEP_US, (t - start) * STEP_US, prev[0], prev[1]))
                start = None
            if key is not None and key[1] > 0 and start is None:
                start = t
    got = {(e["tid"] - 1, e["ts"], e["dur"], tuple(sorted(e["args"]["owners"])),
            e["args"]["ref_count"]) for e in events if e["ph"] == "X"}
    assert got == expected
    assert all(e["pid"] == BLOCKS_PID for e in events if e["ph"] == "X")
    spans = {(e["name"], e["ph"], e["ts"] // STEP_US) for e in events if e["ph"] in "be"}
    assert {("B", "b", 2), ("B", "e", 14), ("D", "b", 16), ("D", "e", 18)} <= spans
    counters = {(e["name"], e["ts"] // STEP_US): e["args"]["value"]
                for e in events if e["ph"] == "C"}
    for t, ref in enumerate(want):
        used = sum(r > 0 for r in ref["refs"])
        assert counters[("used blocks", t)] == used
        assert counters[("free blocks", t)] == 20 - used
        assert counters[("shared blocks", t)] == sum(r > 1 for r in ref["refs"])


def test_instants_for_cow_preemption_and_eviction():
    log = scenarios.random_run(steps=40)
    events = validate(build_trace(log))
    instants = [e for e in events if e["ph"] == "i"]
    assert {e["cat"] for e in instants} == {"cow_copy", "preempt", "prefix_hit", "evict"}
    for e in instants:
        if e["args"]["block"] is not None:
            assert e["tid"] == e["args"]["block"] + 1
    cows = [e for e in log.events if e.kind == "cow_copy"]
    assert len([e for e in instants if e["cat"] == "cow_copy"]) == len(cows) > 0


def test_trace_from_a_reloaded_log_is_identical(seed_log, tmp_path):
    seed_log.save(tmp_path / "run.json")
    assert build_trace(RunLog.load(tmp_path / "run.json")) == build_trace(seed_log)
