"""``--scenario engine``: a real ``LLMEngine`` run, recorded from its events, on the tiny model.

Three independent references: the ``BlockState`` every ``StepDone`` carried (copied here by a
listener of our own), a pure-Python pool that replays the recorded events (each alloc takes a
free block, each drop returns one at zero references, in order) and must land on every
snapshot's tables, token counts, ref counts, held counts and free order, and the engine's
own events (which blocks it preempted, evicted, served from the cache, forked; how many
copies it made).
"""

import collections

import jax
import numpy as np
import pytest

from paged_jax.allocator.state import free_list_order
from paged_jax.engine import events as ev
from paged_jax.viz.cli import main, record
from paged_jax.viz.engine_events import request_label
from paged_jax.viz.engine_run import conversations, engine_run, scenario_for
from paged_jax.viz.log import EVENT_KINDS
from paged_jax.viz.recorder import count_kinds


@pytest.fixture(scope="module")
def run():
    seen = []

    def keep(e):  # the state is donated to the next step: copy it now
        if isinstance(e, ev.StepDone):
            st = jax.device_get(e.state)
            e = (e, {f: np.array(getattr(st, f)) for f in (
                "ref_counts", "held", "block_tables", "seq_lens", "active")},
                free_list_order(st))
        seen.append(e)

    log = engine_run("tiny", debug=True, reset_cache=True, listeners=[keep])
    return log, seen


def steps_of(seen):
    """The engine's events split by step: [(events before the StepDone, StepDone, arrays,
    free order)], then the events after the last step."""
    out, pending = [], []
    for e in seen:
        if isinstance(e, tuple):
            out.append((pending, *e))
            pending = []
        else:
            pending.append(e)
    return out, pending


def test_snapshots_are_the_engine_states(run):
    log, seen = run
    steps, after = steps_of(seen)
    assert after and isinstance(after[-1], ev.AllBlocksCleared)
    assert log.num_steps == 1 + len(steps) + 1  # the start, every step, the cache cleared
    names = {}
    for k, (_, done, arrays, free) in enumerate(steps, start=1):
        snap = log.snapshots[k]
        for field, want in arrays.items():
            assert np.array_equal(getattr(snap, field), want), (k, field)
        assert list(snap.free_order) == free, k
        assert set(snap.names) == set(done.slots), k
        for slot, seq in done.slots.items():  # one label per sequence, whole run long
            assert names.setdefault(seq, snap.names[slot]) == snap.names[slot], (k, seq)
    assert len(set(names.values())) == len(names)
    last = log.snapshots[-1]
    assert last.ref_counts.sum() == 0 and len(last.free_order) == log.config.num_blocks


def test_events_replay_to_every_snapshot(run):
    log, _ = run
    cfg = log.config
    free = collections.deque(range(cfg.num_blocks))
    refs, held = [0] * cfg.num_blocks, [0] * cfg.num_blocks
    tables: dict[str, dict[int, list[int]]] = {}
    for step, snap in enumerate(log.snapshots):
        for e in log.events_at(step):
            b = e.block
            if e.kind in ("alloc", "cow_copy"):
                assert b in free, e.describe()
                free.remove(b)
            if e.kind in ("alloc", "share", "fork", "prefix_hit", "cow_copy"):
                assert (refs[b] == 0) == (e.kind in ("alloc", "cow_copy")), e.describe()
                refs[b] += 1
                if e.request is None:  # the prefix cache enters full blocks only
                    assert e.kind == "alloc" or any(
                        entry == [b, cfg.block_size] for t in tables.values()
                        for entry in t.values()), e.describe()
                    held[b] += 1
                else:
                    table = tables.setdefault(e.request, {})
                    if e.kind == "cow_copy":
                        assert table[e.logical][0] == e.src_block, e.describe()
                        refs[e.src_block] -= 1
                    else:
                        assert e.logical not in table, e.describe()
                    table[e.logical] = [b, e.tokens]
            elif e.kind in ("free", "preempt", "evict"):
                assert refs[b] > 0, e.describe()
                refs[b] -= 1
                if e.request is None:
                    held[b] -= 1
                else:
                    assert tables[e.request].pop(e.logical)[0] == b, e.describe()
                    if not tables[e.request]:
                        del tables[e.request]
                if refs[b] == 0:
                    free.append(b)
            elif e.kind == "append":
                assert tables[e.request][e.logical][0] == b, e.describe()
                tables[e.request][e.logical][1] = e.tokens
            assert e.ref_count == refs[b], e.describe()
        want = {name: {i: [b, r.tokens_in(i, cfg.block_size)] for i, b in enumerate(r.table)}
                for name, r in snap.requests().items()}
        assert tables == want, (step, snap.title)
        assert refs == snap.ref_counts.tolist(), step
        assert held == snap.held.tolist(), step
        assert list(free) == list(snap.free_order), step


def test_every_event_kind_is_the_engine_s(run):
    """Each recorded preemption, eviction, prefix hit, fork, copy and free is one the engine
    published, block for block."""
    log, seen = run
    steps, _ = steps_of(seen)
    assert set(count_kinds(log.events)) == set(EVENT_KINDS)
    for k, (pending, done, _, _) in enumerate(steps, start=1):
        names = dict(log.snapshots[k].names)
        prev = log.snapshots[k - 1].requests()
        events = log.events_at(k)

        def blocks(kind, request=None, events=events):
            return [e.block for e in events if e.kind == kind and e.request == request]

        label = {seq: names[slot] for slot, seq in done.slots.items()}
        # Who held each slot: the previous snapshot's, then after each move in this step.
        prev_names = {r.slot: n for n, r in prev.items()}
        slot_names = dict(prev_names)
        for e in pending:
            if isinstance(e, ev.Preempted):
                name = log.snapshots[k - 1].names[e.slot]
                assert blocks("preempt", name) == e.blocks, k
            elif isinstance(e, ev.BlockRemoved):
                assert [b for b in blocks("evict") if b in e.block_ids] == e.block_ids, k
            elif isinstance(e, ev.Admitted) and e.hit_blocks:
                assert blocks("prefix_hit", label[(e.request_id, e.index)]) == e.hit_blocks, k
            elif isinstance(e, ev.Forked):
                parent = names[e.parent_slot]
                for c in e.child_slots:
                    assert blocks("fork", names[c]) == list(
                        log.snapshots[k].requests()[parent].table), k
            elif isinstance(e, ev.Moved):  # a decode dispatch's rows moved down before it
                slot_names[e.to_slot] = prev_names.get(e.from_slot)
            elif isinstance(e, ev.Finished):
                name = slot_names.get(e.slot)
                if name is not None:  # it held blocks at the step before
                    assert blocks("free", name) == e.blocks, k
        assert sum(e.kind == "cow_copy" for e in events) == done.copies, k
        preempted = {e.request for e in events if e.kind == "preempt"}
        assert preempted == {log.snapshots[k - 1].names[e.slot] for e in pending
                             if isinstance(e, ev.Preempted)}, k


def test_a_preempted_request_resumes_under_its_label_on_a_prefix_hit(run):
    log, _ = run
    preempted = [(e.step, e.request) for e in log.events if e.kind == "preempt"]
    assert preempted
    for step, name in preempted:
        later = [e.step for e in log.events
                 if e.kind == "prefix_hit" and e.request == name and e.step > step]
        assert later, name


def test_titles_and_summary_say_what_happened(run):
    log, seen = run
    titles = " | ".join(s.title for s in log.snapshots)
    for word in ("preempt", "prefix hit", "fork", "copy-on-write", "evict", "finished"):
        assert word in titles, word
    engine = collections.Counter(type(e).__name__ for e in seen)
    # Evictions: the blocks BlockRemoved named, then every block the cache held when cleared.
    evicted = sum(len(e.block_ids) for e in seen if isinstance(e, ev.BlockRemoved))
    evicted += int(log.snapshots[-2].held.sum())
    for count, what in ((engine["Preempted"], "preemption"), (engine["Forked"], "fork"),
                        (evicted, "eviction")):
        assert f" {count} {what}{'s' * (count != 1)}" in log.scenario, (what, log.scenario)


def test_request_labels():
    assert [request_label(i) for i in (0, 1, 25, 26, 27, 701, 702)] == [
        "A", "B", "Z", "AA", "AB", "ZZ", "AAA"]
    with pytest.raises(ValueError, match="order must be >= 0. Got -1"):
        request_label(-1)


def test_cli_routes_the_model_and_writes_the_views(tmp_path, monkeypatch, run):
    log, _ = run
    calls = []

    def fake(model="smollm2", seed=0, progress=False):
        calls.append((model, seed, progress))
        return log

    monkeypatch.setattr("paged_jax.viz.engine_run.engine_run", fake)
    out = tmp_path / "e"
    assert main(["--scenario", "engine", "--model", "tiny", "--out", str(out), "--no-gif",
                 "--quiet"]) == 0
    assert record("engine") is log  # the default model is SmolLM2
    assert calls == [("tiny", 0, False), ("smollm2", 0, False)]  # --quiet: no progress bar
    for name in ("run.json", "layout.txt", "layout.html", "trace.json", "timeline.png",
                 "curves.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "layout.txt").read_text()
    for word in ("copy-on-write", "preempt", "prefix_hit", "evict", "fork"):
        assert word in text, word


def test_default_model_scenario_shares_a_system_prompt():
    """The SmolLM2 run's wiring without the model: its chat prompts share whole blocks of
    system prompt (prefix hits) and fit the pool with max_tokens (nothing is rejected)."""
    from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

    tok = Tokenizer.from_gguf(default_gguf_path())
    shape = scenario_for("smollm2")
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)
               for c in conversations()]
    common = min(next((i for i, (a, b) in enumerate(zip(p, prompts[0], strict=False))
                       if a != b), len(p)) for p in prompts[1:])
    assert common // shape.block_size >= 2, common
    for p in prompts:
        need = -(-(len(p) + shape.max_tokens) // shape.block_size) + 1
        assert need <= shape.num_blocks and len(p) + shape.max_tokens <= shape.max_model_len
    with pytest.raises(ValueError, match="model must be one of"):
        scenario_for("big")
