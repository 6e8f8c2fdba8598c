"""The views agree with the state they draw: picture letters, copy counts, preemptions and
prefix hits, and the reported events against a diff of the same snapshots."""

from __future__ import annotations

import re

import pytest

from paged_jax.viz import Recorder, RecordingPool, scenarios, terminal
from paged_jax.viz.engine_run import engine_run
from paged_jax.viz.recorder import count_kinds, diff_events
from tests.test_viz_recorder import GAINS, LOSSES, assert_events_explain_snapshots

NAMES = ("seed", "prefix-sharing", "fork-cow", "random", "engine")


@pytest.fixture(scope="module")
def logs():
    out = {name: scenarios.SCENARIOS[name]() for name in NAMES if name != "engine"}
    out["engine"] = engine_run("tiny")
    return out


def picture_cells(picture: str, num_blocks: int) -> tuple[dict[int, str], dict[str, str]]:
    """Block -> the text in its cell, and the key (label -> request), parsed from the text."""
    lines = picture.splitlines()
    key = {}
    if lines[-1].startswith("Key: "):
        for item in lines.pop()[5:].split(", "):
            label, name = item.split(" = ")
            key[label] = name
    cells = {}
    for row in lines[0::3]:  # cells, ruler, marks
        for label in re.findall(r"\[([^\]]*)\]", row):
            cells[len(cells)] = label.strip()
    assert len(cells) == num_blocks
    return cells, key


@pytest.mark.parametrize("name", NAMES)
def test_each_table_block_carries_its_requests_letter(logs, name):
    log = logs[name]
    for t, snap in enumerate(log.snapshots):
        cells, key = picture_cells(terminal.render_picture(log, t), log.config.num_blocks)
        owners: dict[int, set[str]] = {}
        for req, view in snap.requests().items():
            for b in view.table:
                owners.setdefault(b, set()).add(req)
        for b, who in owners.items():
            if len(who) > 1:
                assert cells[b] == "*", (t, b, who)
            else:
                (req,) = who
                assert key.get(cells[b], cells[b]) == req, (t, b, req, cells[b])
        assert set(key.values()) <= set(snap.requests()), t


def test_the_engine_picture_names_b1_as_the_tables_do(logs):
    log = logs["engine"]
    # B copied its shared block 5 to 10; B1 kept block 5; both still share blocks 3 and 4.
    text = terminal.render_step(log, 3)
    assert "[*][*][A][*][*][b][C][C][B][b][B][ ]" in text and "Key: b = B1" in text
    assert "B: [3, 4, 10, 8]" in text and "B1: [3, 4, 5, 9]" in text
    assert "[A]" not in terminal.render_picture(log, log.num_steps - 1)


@pytest.mark.parametrize("name", NAMES)
def test_copies_are_the_pairs_the_ops_returned(logs, name):
    log = logs[name]
    copies = [e for e in log.events if e.kind == "cow_copy"]
    pairs = re.findall(r"copies block (\d+) -> (\d+)", " ".join(s.title for s in log.snapshots))
    if name == "random":
        assert len(copies) == len(pairs) > 1
        assert [(str(e.src_block), str(e.block)) for e in copies] == pairs
    assert count_kinds(log.events).get("cow_copy", 0) == len(copies)


def test_random_preempts_and_hits_only_requests_with_blocks(logs):
    log = logs["random"]
    for e in log.events:
        if e.kind == "preempt":  # it held blocks in the snapshot before
            before = log.snapshots[e.step - 1].requests()
            assert e.request in before and before[e.request].table, e
            assert f"preempt {e.request}" in log.snapshots[e.step].title, e
        if e.kind == "prefix_hit":  # it holds the cached blocks after
            assert e.block in log.snapshots[e.step].requests()[e.request].table, e
    kinds = count_kinds(log.events)
    assert kinds["preempt"] >= 1 and kinds["prefix_hit"] >= 1


@pytest.mark.parametrize("name", NAMES)
def test_no_block_is_listed_twice_and_no_raw_fields_leak(logs, name):
    log = logs[name]
    for t in range(log.num_steps):
        dropped = [(e.request, e.logical, e.block) for e in log.events_at(t)
                   if e.kind in LOSSES and e.request is not None]
        assert len(dropped) == len(set(dropped)), t
        for e in log.events_at(t):
            assert "None" not in e.describe() and "(ref" not in e.describe(), e


def _coarse(kind: str) -> str:
    return "gain" if kind in GAINS else "loss" if kind in LOSSES else kind


@pytest.mark.parametrize("name", NAMES)
def test_reported_events_agree_with_the_diff(logs, name):
    """Replaying either the recorded events or a plain diff of the same snapshots explains
    every snapshot; where the diff can see what happened (no request both created and copied
    in one step), it finds the same events up to the names only a report or note can give."""
    log = logs[name]
    assert_events_explain_snapshots(log)
    for t, snap in enumerate(log.snapshots):
        diffed = diff_events(log.snapshots[t - 1] if t else None, snap, t)
        recorded = log.events_at(t)
        born = set(snap.requests()) - (set(log.snapshots[t - 1].requests()) if t else set())
        if any(e.kind == "cow_copy" and e.request in born for e in recorded):
            continue  # a fork and its copy in one step: the diff sees only the result

        assert sorted(_fold(diffed), key=str) == sorted(_fold(recorded), key=str), (t, snap.title)


def _fold(events):
    """Events as a diff can name them: a write into a block gained or copied in the same step
    is part of that gain or copy, and an entry gained and dropped in the same step (a block a
    sequence's last dispatch claimed, or copied on write, before it finished) is nothing, or
    the drop of the block it held before the copy."""
    touched = {(e.request, e.logical) for e in events if e.kind != "append"}
    out = []
    for e in events:
        if e.kind == "append" and (e.request, e.logical) in touched:
            continue
        item = (_coarse(e.kind), e.request, e.logical, e.block, e.src_block)
        if item[0] == "loss" and e.request is not None:
            gained = [x for x in out if x[0] in ("gain", "cow_copy")
                      and x[1:4] == (e.request, e.logical, e.block)]
            if gained:
                out.remove(gained[-1])
                if gained[-1][0] == "cow_copy":
                    out.append(("loss", e.request, e.logical, gained[-1][4], None))
                continue
        out.append(item)
    return out


def test_pool_scenarios_report_every_change():
    """Nothing is left to the diff when every op reports: it finds no remainder."""
    pool = RecordingPool(scenarios.TINY_POOL)
    pool.admit(["P"], [6])
    pool.fork(["P"], ["Q"])
    pool.copy_on_write(["P", "Q"], [6, 6])
    pool.append(["P", "Q"])
    pool.hold(pool.table("Q")[:1])
    pool.preempt(["Q"])
    pool.capture("everything at once")
    assert pool.recorder.diffed == 0
    assert [e.kind for e in pool.log.events_at(1)] == [
        "alloc", "alloc", "fork", "fork", "cow_copy", "append", "append", "share",
        "preempt", "preempt"]
    assert_events_explain_snapshots(pool.log)


def test_a_report_that_does_not_fit_is_refused():
    rec = Recorder()
    pool = RecordingPool(scenarios.TINY_POOL)
    rec.capture(pool.state, title="empty")
    pool.admit(["A"], [4])
    rec.report("share", "A", 0, 0, 4)  # block 0 was free: an alloc, not a share
    with pytest.raises(ValueError, match="share A\\[0\\].*block 0 has ref count 0"):
        rec.capture(pool.state, pool.names, title="admit A")
    assert rec.log.num_steps == 1
