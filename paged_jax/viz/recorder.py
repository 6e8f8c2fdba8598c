"""Record allocator runs: a host snapshot per step, and the events that led to it.

The code that changes the pool knows what it did: ``RecordingPool``'s ops and the engine run
``report`` their events (the ``(src, dst)`` pairs ``copy_on_write`` returned, the blocks a
fork shared, a preemption's blocks). At ``capture`` the recorder replays the reported events
on the previous snapshot's holdings, refusing any that do not fit, and diffs what is left
against the new snapshot: that diff covers what nobody reported (a facade call, the appends
inside a jitted engine step). ``note`` names what a diff cannot tell apart (a preemption from a
release, a prefix hit from a share, a cache eviction from a drop, a fork from a share).

    rec = Recorder()
    rec.capture(state, {0: "A"}, title="admit A")   # or rec.capture_allocator(allocator)
    rec.note("preempt", request="A")                 # belongs to the next capture
    rec.capture(release(state, 0)[0], title="preempt A")
    rec.log.save("run.json")
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from paged_jax.allocator.state import BlockState
from paged_jax.viz.holdings import Holdings, anonymous_held, diff_holdings
from paged_jax.viz.log import EVENT_KINDS, Event, RunLog, Snapshot

__all__ = ["Recorder", "anonymous_held", "count_kinds", "diff_events"]

_NOTE_KINDS = ("preempt", "prefix_hit", "evict", "cow_copy", "fork")
_RELABEL = {"preempt": "free", "evict": "free", "prefix_hit": "share", "fork": "share"}


def diff_events(prev: Snapshot | None, cur: Snapshot, step: int) -> list[Event]:
    """The events a diff finds between ``prev`` (``None``: an empty pool) and ``cur``.

    Dropped references first (``free``), then gained ones: ``alloc`` for a block nobody held,
    ``share`` for a block in use, ``cow_copy`` for a kept entry that now points at a fresh
    block, ``append`` for more tokens in a kept block.
    """
    cfg = cur.config
    start = Holdings.of(prev) if prev is not None else Holdings.empty(
        cfg.num_blocks, cfg.block_size)
    return diff_holdings(start, Holdings.of(cur), step)


class Recorder:
    """Collects snapshots and events into a ``RunLog``.

    Every ``capture`` is one step. Events reported and notes made since the previous capture
    belong to it.

    ``keep_last=N`` bounds the log for a run that never ends (a server): once it holds 2N
    steps, the oldest are dropped down to the last N, steps renumbered from 0. The first kept
    step then starts from its own snapshot, not the empty pool, so its events are dropped with
    the older ones; ``dropped`` counts the steps gone.
    """

    def __init__(self, scenario: str = "", keep_last: int | None = None):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None. Got {keep_last!r}.")
        self._log: RunLog | None = None
        self._scenario = scenario
        self._keep_last = keep_last
        self.dropped = 0
        self._notes: list[dict] = []
        self._reported: list[Event] = []
        self._diffed = 0

    @property
    def log(self) -> RunLog:
        if self._log is None:
            raise ValueError("Nothing recorded yet: call capture() at least once.")
        return self._log

    def report(
        self,
        kind: str,
        request: str | None,
        logical: int | None,
        block: int,
        tokens: int,
        *,
        src_block: int | None = None,
        detail: str = "",
    ) -> None:
        """Record an event the caller made happen, in the order it happened.

        ``ref_count`` is filled in at ``capture`` (the block's count just after the event);
        ``capture`` raises if the events do not turn the previous snapshot into one that
        agrees with the new one where they touch it.
        """
        self._reported.append(
            Event(-1, kind, request, logical, int(block), None, int(tokens),
                  None if src_block is None else int(src_block), detail)
        )

    def note(
        self,
        kind: str,
        *,
        request: str | None = None,
        blocks: Sequence[int] | None = None,
        src_blocks: Sequence[int] | None = None,
        detail: str = "",
    ) -> None:
        """Name what a diff cannot tell apart; it applies to the next ``capture``.

        * ``preempt``: ``request``'s dropped references are a preemption, not a release.
          The request must have held blocks.
        * ``prefix_hit``: the blocks ``request`` was given from another table are a prefix
          hit. The request must have received some.
        * ``evict``: the dropped references to ``blocks`` (held outside every table, or by
          ``request``'s table) are cache evictions.
        * ``fork``: the blocks ``request`` was given are a fork.
        * ``cow_copy``: ``blocks`` are copies of ``src_blocks`` (``copy_on_write``'s pairs), for
          a caller that does not ``report`` them; a copy already recorded is not doubled.
        """
        if kind not in _NOTE_KINDS:
            raise ValueError(f"note() takes one of {_NOTE_KINDS}. Got {kind!r}.")
        if kind in ("preempt", "prefix_hit", "fork") and request is None:
            raise ValueError(f"A {kind} note needs the request it happened to.")
        if kind in ("evict", "cow_copy") and not blocks:
            raise ValueError(f"A {kind} note needs the blocks it concerns. Got {blocks!r}.")
        if kind == "cow_copy" and (src_blocks is None or len(src_blocks) != len(blocks)):
            raise ValueError(
                f"src_blocks {src_blocks!r} must pair up with blocks {list(blocks)}."
            )
        self._notes.append({
            "kind": kind, "request": request,
            "blocks": None if blocks is None else [int(b) for b in blocks],
            "src_blocks": None if src_blocks is None else [int(b) for b in src_blocks],
            "detail": detail,
        })

    def capture(
        self,
        state: BlockState,
        names: Mapping[int, str] | None = None,
        *,
        tables: Mapping[str, Sequence[int]] | None = None,
        title: str = "",
    ) -> int:
        """Snapshot ``state`` as the next step; returns the step index.

        Args:
          state: the pool after this step (copied to the host).
          names: active slot -> request name (unnamed slots are named by their number).
          tables: block tables kept outside the state, name -> blocks.
          title: what happened in this step, shown by every view.

        Raises ``ValueError`` if a reported event does not fit the previous snapshot or a
        note names a preemption, prefix hit or eviction that did not happen; the step is
        then not recorded, and its reports and notes are dropped.
        """
        return self.capture_snapshot(Snapshot.from_state(state, names, tables=tables,
                                                         title=title))

    def capture_snapshot(self, snap: Snapshot) -> int:
        """``capture`` a ``Snapshot`` the caller already took of the state."""
        if self._log is not None and snap.config != self._log.config:
            raise ValueError(
                f"Every step must share one CacheConfig. Got {snap.config}, recorded "
                f"{self._log.config}."
            )
        step = self._log.num_steps if self._log is not None else 0
        prev = self._log.snapshots[-1] if step else None
        try:
            events = self._events(prev, snap, step)
        finally:
            self._notes, self._reported = [], []
        if self._log is None:
            self._log = RunLog(config=snap.config, scenario=self._scenario)
        self._log.snapshots.append(snap)
        self._log.events.extend(events)
        if self._keep_last is not None and self._log.num_steps >= 2 * self._keep_last:
            step -= self._trim(self._log.num_steps - self._keep_last)
        return step

    def _trim(self, drop: int) -> int:
        log = self._log
        log.snapshots = log.snapshots[drop:]
        log.events = [dataclasses.replace(e, step=e.step - drop) for e in log.events
                      if e.step > drop]
        self.dropped += drop
        return drop

    def capture_allocator(
        self, allocator, *, tables: Mapping[str, Sequence[int]] | None = None, title: str = ""
    ) -> int:
        """``capture`` a facade ``BlockAllocator``: its requests are named by their ids."""
        names = {slot: str(req.request_id) for slot, req in allocator.requests.items()}
        return self.capture(allocator.state, names, tables=tables, title=title)

    @property
    def diffed(self) -> int:
        """How many recorded events came from diffing rather than from ``report``."""
        return self._diffed

    def _events(self, prev: Snapshot | None, cur: Snapshot, step: int) -> list[Event]:
        cfg = cur.config
        start = Holdings.of(prev) if prev is not None else Holdings.empty(
            cfg.num_blocks, cfg.block_size)
        hold = start.copy()
        reported = [hold.apply(dataclasses.replace(e, step=step)) for e in self._reported]
        diffed = diff_holdings(hold, Holdings.of(cur), step)
        self._diffed += len(diffed)
        events = self._relabel(reported + self._with_noted_copies(diffed, reported))
        return [start.apply(e) for e in events]  # each event's ref count, in order

    def _with_noted_copies(self, diffed: list[Event], reported: list[Event]) -> list[Event]:
        """A noted copy the diff saw as a new request's ``alloc`` of the copy becomes the
        ``share`` of the original and the ``cow_copy``, as it happened."""
        pairs = {}
        for note in (n for n in self._notes if n["kind"] == "cow_copy"):
            pairs.update(zip(note["blocks"], note["src_blocks"], strict=True))
        done = {e.block for e in diffed + reported if e.kind == "cow_copy"}
        out = []
        for e in diffed:
            src = pairs.get(e.block)
            if e.kind == "alloc" and e.request is not None and src is not None and (
                e.block not in done
            ):
                out.append(dataclasses.replace(e, kind="share", block=src))
                out.append(dataclasses.replace(e, kind="cow_copy", src_block=src))
                done.add(e.block)
            else:
                out.append(e)
        missing = sorted(set(pairs) - done)
        if missing:
            raise ValueError(
                f"Noted copies to blocks {missing} are not copies in this step's snapshot."
            )
        return out

    def _relabel(self, events: list[Event]) -> list[Event]:
        """Apply the notes: a dropped or gained reference becomes what the note says."""
        events = list(events)
        for note in self._notes:
            kind, req = note["kind"], note["request"]
            if kind == "cow_copy":
                continue
            base = _RELABEL[kind]
            if kind == "evict":
                hits = []
                for b in note["blocks"]:
                    hit = next((i for i, e in enumerate(events) if e.kind == "free"
                                and e.block == b and e.request == req and i not in hits), None)
                    if hit is None:
                        raise ValueError(
                            f"Evicted block {b} lost no reference of {req or 'held'} in this "
                            "step."
                        )
                    hits.append(hit)
            else:
                hits = [i for i, e in enumerate(events)
                        if e.request == req and e.kind in (base, kind)]
                if not hits:
                    what = "held no blocks" if kind == "preempt" else "was given no blocks"
                    raise ValueError(f"A {kind} of {req!r}: the request {what} in this step.")
            for i in hits:
                events[i] = dataclasses.replace(
                    events[i], kind=kind, detail=note["detail"] or events[i].detail
                )
        return events


def count_kinds(events: Sequence[Event]) -> Counter:
    """Events per kind (``preempt`` and ``prefix_hit`` count requests, the rest blocks)."""
    counts: Counter = Counter()
    seen = set()
    for e in events:
        if e.kind in ("preempt", "prefix_hit"):
            key = (e.step, e.kind, e.request)
            if key in seen:
                continue
            seen.add(key)
        counts[e.kind] += 1
    return Counter({k: counts[k] for k in EVENT_KINDS if counts[k]})
