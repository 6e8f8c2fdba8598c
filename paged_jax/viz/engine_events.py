"""Record an ``LLMEngine`` run from the events it publishes: one snapshot per ``step``.

``EngineRecorder`` subscribes with ``engine.add_listener``. It keeps each step's events until
the step's ``StepDone``, turns them into recorder events, replays them on the previous
snapshot (``Holdings.apply`` refuses any that does not fit) and captures the ``BlockState``
the step left, so every picture is the engine's own state:

* ``Preempted`` -> ``preempt`` and ``Finished`` -> ``free`` of every entry the sequence held
  (first the blocks its last dispatch claimed, the tokens it appended, its copies on write);
  ``BlockRemoved`` -> ``evict`` of the cache's reference (``AllBlocksCleared``: all of them);
  ``Admitted`` with a hit -> ``prefix_hit`` of the cached blocks; ``BlockStored`` -> the
  cache's new reference (``share`` of a block outside every table);
* what the jitted steps did without telling (the blocks ``prefill`` and ``decode_steps``
  allocated, the tokens they appended, the copies on write inside the dispatch) comes from
  diffing against the step's state, parents before the completions forked from them, so a
  fork shares the blocks its parent's prefill took (``Forked`` -> ``fork``).

Drops are replayed in the order the engine made them, so the free list comes out in the
engine's order. Requests are labelled ``A``, ``B``, ... in order of admission, completion
``k > 0`` of a request ``B`` is ``Bk``; labels stay with the request across preemption.

    rec = EngineRecorder(engine)        # captures the pool as it is now
    llm.generate(prompts, params)       # one snapshot per engine step
    rec.log.save("run.json")
"""

from __future__ import annotations

import collections
import dataclasses
import string

from paged_jax.engine import events as ev
from paged_jax.viz.holdings import Holdings, diff_holdings
from paged_jax.viz.log import Event, RequestView, RunLog, Snapshot
from paged_jax.viz.recorder import Recorder

__all__ = ["EngineRecorder", "request_label"]


def request_label(order: int) -> str:
    """``A``..``Z``, then ``AA``, ``AB``...: the ``order``-th request's label (letters only, so
    a completion index can follow it)."""
    if order < 0:
        raise ValueError(f"order must be >= 0. Got {order}.")
    letters = ""
    order += 1
    while order:
        order, r = divmod(order - 1, 26)
        letters = string.ascii_uppercase[r] + letters
    return letters


class EngineRecorder:
    """A listener that records ``engine``'s steps into a ``Recorder``.

    ``counts`` tallies what the pictures show: ``preempt`` / ``prefix_hit`` / ``fork`` /
    ``free`` (sequences), ``evict`` / ``cow_copy`` (blocks).
    """

    def __init__(self, engine, recorder: Recorder | None = None, scenario: str = "engine"):
        self.engine = engine
        self.recorder = recorder if recorder is not None else Recorder(scenario)
        self.counts: collections.Counter = collections.Counter()
        self._labels: dict[str, str] = {}
        self._pending: list = []
        self.recorder.capture(engine.state, self._names(self._running()), title="start")
        engine.add_listener(self)

    @property
    def log(self) -> RunLog:
        return self.recorder.log

    def label(self, request_id: str, index: int = 0) -> str:
        """The name a sequence is drawn with (assigned at first sight, then kept)."""
        if request_id not in self._labels:
            self._labels[request_id] = request_label(len(self._labels))
        base = self._labels[request_id]
        return base if index == 0 else f"{base}{index}"

    def __call__(self, event) -> None:
        if isinstance(event, ev.StepDone):
            self._record(event.state, event.slots, event)
        else:
            self._pending.append(event)

    def flush(self, title: str) -> int | None:
        """Capture the events published outside a step (``abort_request``,
        ``reset_prefix_cache``) as one more step; None if there were none."""
        if not self._pending:
            return None
        return self._record(self.engine.state, self._running(), None, title)

    def _running(self) -> dict[int, tuple[str, int]]:
        return {s.slot: (s.request_id, s.index) for s in self.engine.scheduler.running}

    def _names(self, slots) -> dict[int, str]:
        return {int(slot): self.label(rid, idx) for slot, (rid, idx) in sorted(slots.items())}

    def _record(self, state, slots, done, title: str | None = None) -> int:
        pending, self._pending = self._pending, []
        names = self._names(slots)
        rec = self.recorder
        cur = Snapshot.from_state(state, names)
        step = rec.log.num_steps
        events = self._events(pending, Holdings.of(rec.log.snapshots[-1]), cur, slots, step)
        for e in events:
            rec.report(e.kind, e.request, e.logical, e.block, e.tokens, src_block=e.src_block,
                       detail=e.detail)
        if title is None:
            title = self._title(done, pending, events)
        return rec.capture_snapshot(dataclasses.replace(cur, title=title))

    def _events(self, pending, hold: Holdings, cur: Snapshot, slots, step: int) -> list[Event]:
        """The step's events in an order that replays: the engine's drops and hits as
        published, then the jitted steps' work and the blocks it filled entering the cache,
        then the forks, then whatever is left (the cache's references to blocks that a
        sequence finished in this step let go of)."""
        out: list[Event] = []
        bs = cur.config.block_size

        def add(kind, request, logical, block, tokens, detail="", src=None):
            out.append(hold.apply(Event(step, kind, request, logical, block, None, tokens,
                                        src, detail)))

        def drop_all(kind, name, detail):
            for i, (b, tokens) in sorted(hold.entries.get(name, {}).items()):
                add(kind, name, i, b, tokens, detail)

        forks, stored = [], []
        for e in pending:
            if isinstance(e, ev.Preempted):
                drop_all("preempt", self.label(e.request_id, e.index), "preempted")
                self.counts["preempt"] += 1
            elif isinstance(e, ev.Finished):
                name = self.label(e.request_id, e.index)
                # What the step's dispatch did to the table before the sequence finished in
                # it (a block claimed for its last tokens, a copy on write), then the drops.
                done = hold.copy()
                done.entries.pop(name, None)
                if e.blocks:
                    done.entries[name] = RequestView(
                        name, e.slot, tuple(e.blocks), e.tokens).entries(bs)
                out += self._diffed(hold, done, step)
                drop_all("free", name, f"finished: {e.reason}")
                self.counts["free"] += 1
            elif isinstance(e, ev.BlockRemoved):
                for b in e.block_ids:
                    add("evict", None, None, b, bs, "evicted from the prefix cache")
                self.counts["evict"] += len(e.block_ids)
            elif isinstance(e, ev.AllBlocksCleared):
                for b, n in enumerate(list(hold.anon)):
                    for _ in range(n):
                        add("evict", None, None, b, bs, "prefix cache cleared")
                        self.counts["evict"] += 1
            elif isinstance(e, ev.Admitted) and e.hit_blocks:
                name = self.label(e.request_id, e.index)
                why = "" if e.lookup is None else (
                    f"{e.lookup.hit_tokens} of {e.lookup.target_tokens} tokens cached, "
                    f"stopped at: {e.lookup.reason}")
                for i, b in enumerate(e.hit_blocks):
                    add("prefix_hit", name, i, b, bs, why)
                self.counts["prefix_hit"] += 1
            elif isinstance(e, ev.BlockStored):
                # A block full since the last step is entered now; one that this step's
                # prefill or decode filled (or allocated), once that work is replayed.
                for b in e.block_ids:
                    if hold.refs[b] > 0 and any(
                            entry == (b, bs) for t in hold.entries.values()
                            for entry in t.values()):
                        add("share", None, None, b, bs, "entered in the prefix cache")
                    else:
                        stored.append(b)
            elif isinstance(e, ev.Forked):
                forks.append(e)
        after = Holdings.of(cur)
        children = {slots[c] for f in forks for c in f.child_slots if c in slots}
        kids = {self.label(*c) for c in children}
        # The parents' prefill and everybody's decode first: without the completions forked
        # in this step, and without the cache's new references.
        parents = Holdings({n: t for n, t in after.entries.items() if n not in kids},
                           list(hold.anon), list(after.refs), bs)
        out += self._diffed(hold, parents, step)
        for b in stored:
            if hold.refs[b] > 0 and hold.anon[b] < after.anon[b]:
                add("share", None, None, b, bs, "entered in the prefix cache")
        for f in forks:
            parent = self.label(f.request_id, 0)
            for c in f.child_slots:
                if c not in slots:  # the completion finished with its first token
                    continue
                name = self.label(*slots[c])
                for i, (b, tokens) in sorted(after.entries.get(name, {}).items()):
                    if hold.refs[b] > 0:
                        add("fork", name, i, b, tokens, f"forked from {parent}")
                self.counts["fork"] += 1
        out += self._diffed(hold, after, step)
        self.counts["cow_copy"] += sum(e.kind == "cow_copy" for e in out)
        return [dataclasses.replace(e, detail="entered in the prefix cache")
                if e.request is None and e.kind in ("alloc", "share") else e for e in out]

    @staticmethod
    def _diffed(hold: Holdings, target: Holdings, step: int) -> list[Event]:
        events = diff_holdings(hold, target, step)
        for e in events:
            hold.apply(e)
        return events

    def _title(self, done, pending, events) -> str:
        parts = []
        if done is not None and done.prefill_tokens:
            parts.append(f"prefill {done.prefill_tokens} tokens")
        if done is not None and done.decode_rows:
            parts.append(f"decode {done.decode_rows} row{'s' * (done.decode_rows != 1)}")
        who = collections.defaultdict(list)
        for e in events:
            if e.request is not None and e.request not in who[e.kind]:
                who[e.kind].append(e.request)
        for kind, word in (("preempt", "preempt"), ("prefix_hit", "prefix hit"),
                           ("fork", "fork"), ("cow_copy", "copy-on-write")):
            if who[kind]:
                parts.append(f"{word} {', '.join(who[kind])}")
        evicted = sum(e.kind == "evict" for e in events)
        if evicted:
            parts.append(f"evict {evicted} cached block{'s' * (evicted != 1)}")
        finished = [self.label(e.request_id, e.index) for e in pending
                    if isinstance(e, ev.Finished)]
        if finished:
            parts.append(f"finished {', '.join(finished)}")
        head = f"step {done.step}" if done is not None else ""
        return ": ".join(x for x in (head, ", ".join(parts)) if x)
