"""Record allocator runs: a host snapshot per step, events found by diffing consecutive ones.

Diffing snapshots (tables, ref counts, held references, lengths) rather than hooking ops means
one recorder serves the facade, the pure ops and an engine alike. Whatever a diff cannot tell
apart (a preemption from a release, a prefix-cache hit, an eviction) the caller ``note``\\ s.

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
from paged_jax.viz.log import EVENT_KINDS, Event, RequestView, RunLog, Snapshot

_NOTE_KINDS = ("preempt", "prefix_hit", "evict", "cow_copy", "fork")


def _holders(snap: Snapshot) -> dict[int, set[tuple[str, int]]]:
    out: dict[int, set[tuple[str, int]]] = {}
    for name, req in snap.requests().items():
        for i, b in enumerate(req.table):
            out.setdefault(b, set()).add((name, i))
    return out


def anonymous_held(snap: Snapshot) -> list[int]:
    """References per block held outside every table (``held`` minus outside tables)."""
    counts = snap.held.astype(int).tolist()
    for table in snap.tables.values():
        for b in table:
            counts[b] -= 1
    return [max(0, c) for c in counts]


def diff_events(prev: Snapshot | None, cur: Snapshot, step: int) -> list[Event]:
    """The events that turn ``prev`` (``None``: an empty pool) into ``cur``.

    * A request gaining a table entry: ``alloc`` if the block had no surviving holder,
      ``fork`` if the request is new and its table and length equal a live request's,
      ``share`` otherwise; an existing entry that changes block is a ``cow_copy``.
    * A lost entry is a ``free``; more tokens in a kept block is an ``append``.
    * References held outside any table give ``alloc``/``share``/``free`` with no request.
    """
    bs = cur.config.block_size
    before = prev.requests() if prev is not None else {}
    after = cur.requests()
    old_holders = _holders(prev) if prev is not None else {}
    new_holders = _holders(cur)
    old_anon = anonymous_held(prev) if prev is not None else [0] * cur.config.num_blocks
    new_anon = anonymous_held(cur)
    refs = cur.ref_counts

    def continuing(b: int) -> bool:
        kept = old_holders.get(b, set()) & new_holders.get(b, set())
        return bool(kept) or min(old_anon[b], new_anon[b]) > 0

    events: list[Event] = []

    def add(kind, req, logical, block, tokens, src=None):
        events.append(Event(step, kind, req, logical, block, int(refs[block]), tokens, src))

    # Dropped references first: a release frees blocks before anything reuses them.
    for name, old in before.items():
        new = after.get(name)
        for i, b in enumerate(old.table):
            if new is not None and i < len(new.table):
                continue  # kept, or replaced by a copy (a cow_copy below)
            add("free", name, i, b, old.tokens_in(i, bs))
    for b in range(cur.config.num_blocks):
        for _ in range(old_anon[b] - new_anon[b]):
            add("free", None, None, b, bs)

    claimed: set[int] = set()  # blocks some holder already took this step

    def gain_kind(b: int, forked: bool) -> str:
        if b in claimed or continuing(b):
            return "fork" if forked else "share"
        claimed.add(b)
        return "alloc"

    for name, new in after.items():
        old = before.get(name)
        forked = old is None and bool(new.table) and _is_fork(new, before)
        for i, b in enumerate(new.table):
            tokens = new.tokens_in(i, bs)
            was = old.table[i] if old is not None and i < len(old.table) else None
            if was == b:
                if old.tokens_in(i, bs) != tokens:
                    add("append", name, i, b, tokens)
                continue
            if was is not None:
                claimed.add(b)
                add("cow_copy", name, i, b, tokens, src=was)
            else:
                add(gain_kind(b, forked), name, i, b, tokens)
    for b in range(cur.config.num_blocks):
        for _ in range(new_anon[b] - old_anon[b]):
            add(gain_kind(b, False), None, None, b, bs)
    return events


def _is_fork(new: RequestView, before: Mapping[str, RequestView]) -> bool:
    return any(
        r.table == new.table and r.num_tokens == new.num_tokens for r in before.values()
    )


class Recorder:
    """Collects snapshots and events into a ``RunLog``.

    Every ``capture`` is one step. Notes made since the previous capture belong to it.
    """

    def __init__(self, scenario: str = ""):
        self._log: RunLog | None = None
        self._scenario = scenario
        self._notes: list[dict] = []

    @property
    def log(self) -> RunLog:
        if self._log is None:
            raise ValueError("Nothing recorded yet: call capture() at least once.")
        return self._log

    def note(
        self,
        kind: str,
        *,
        request: str | None = None,
        blocks: Sequence[int] | None = None,
        src_blocks: Sequence[int] | None = None,
        detail: str = "",
    ) -> None:
        """Record what a diff cannot see; it is attached to the next ``capture``.

        * ``preempt``: ``request`` gives up its blocks (default: its whole table before).
        * ``prefix_hit``: ``request`` reused cached blocks (default: the blocks it shared).
        * ``evict``: ``blocks`` were dropped from a cache.
        * ``cow_copy``: ``blocks`` are the copies, ``src_blocks`` the originals (the
          ``(src, dst)`` output of ``copy_on_write``); a copy the diff found is not doubled.
        * ``fork``: ``request`` was forked, so its shared blocks are ``fork`` events even if
          it also decoded in this step (the diff alone only sees a fork as one).
        """
        if kind not in _NOTE_KINDS:
            raise ValueError(f"note() takes one of {_NOTE_KINDS}. Got {kind!r}.")
        if kind in ("preempt", "prefix_hit", "fork") and request is None:
            raise ValueError(f"A {kind} note needs the request it happened to.")
        if kind in ("evict", "cow_copy") and not blocks:
            raise ValueError(f"A {kind} note needs the blocks it concerns.")
        if src_blocks is not None and len(src_blocks) != len(blocks or ()):
            raise ValueError(
                f"src_blocks {list(src_blocks)} must pair up with blocks {list(blocks or ())}."
            )
        self._notes.append(
            {
                "kind": kind,
                "request": request,
                "blocks": None if blocks is None else [int(b) for b in blocks],
                "src_blocks": None if src_blocks is None else [int(b) for b in src_blocks],
                "detail": detail,
            }
        )

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
        """
        snap = Snapshot.from_state(state, names, tables=tables, title=title)
        if self._log is None:
            self._log = RunLog(config=snap.config, scenario=self._scenario)
        elif snap.config != self._log.config:
            raise ValueError(
                f"Every step must share one CacheConfig. Got {snap.config}, recorded "
                f"{self._log.config}."
            )
        step = self._log.num_steps
        prev = self._log.snapshots[-1] if step else None
        events = diff_events(prev, snap, step)
        events = self._apply_notes(prev, snap, step, events)
        self._log.snapshots.append(snap)
        self._log.events.extend(events)
        self._notes = []
        return step

    def capture_allocator(
        self, allocator, *, tables: Mapping[str, Sequence[int]] | None = None, title: str = ""
    ) -> int:
        """``capture`` a facade ``BlockAllocator``: its requests are named by their ids."""
        names = {slot: str(req.request_id) for slot, req in allocator.requests.items()}
        return self.capture(allocator.state, names, tables=tables, title=title)

    def _apply_notes(self, prev, cur, step, events: list[Event]) -> list[Event]:
        bs = cur.config.block_size
        before = prev.requests() if prev is not None else {}
        after = cur.requests()
        first: list[Event] = []  # preempt and evict explain the frees that follow
        last: list[Event] = []
        forked = {n["request"] for n in self._notes if n["kind"] == "fork"}
        events = [
            dataclasses.replace(e, kind="fork") if e.kind == "share" and e.request in forked
            else e
            for e in events
        ]
        for note in self._notes:
            kind, req = note["kind"], note["request"]
            if kind == "fork":
                continue
            blocks = note["blocks"]
            if kind == "preempt" and blocks is None:
                blocks = list(before[req].table) if req in before else []
            if kind == "prefix_hit" and blocks is None:
                blocks = [e.block for e in events if e.request == req and e.kind == "share"]
            srcs = note["src_blocks"] or [None] * len(blocks or [])
            out = first if kind in ("preempt", "evict") else last
            if not blocks:
                out.append(Event(step, kind, req, None, None, None, None, detail=note["detail"]))
            for b, src in zip(blocks, srcs, strict=True):
                if kind == "cow_copy" and any(
                    e.kind == "cow_copy" and e.block == b and req in (e.request, None)
                    for e in events
                ):
                    continue
                logical, tokens = _where(b, req, after if kind != "preempt" else before, bs)
                if logical is None and kind != "preempt":
                    logical, tokens = _where(b, req, before, bs)
                out.append(
                    Event(step, kind, req, logical, b, int(cur.ref_counts[b]), tokens, src,
                          note["detail"])
                )
        return first + events + last


def _where(block: int, request: str | None, reqs: Mapping[str, RequestView], bs: int):
    """``(logical index, tokens)`` of ``block`` in ``request``'s table (else any table)."""
    order = [reqs[request]] if request in reqs else []
    order += [r for r in reqs.values() if r.name != request]
    for r in order:
        if block in r.table:
            i = r.table.index(block)
            return i, r.tokens_in(i, bs)
    return None, None


def count_kinds(events: Sequence[Event]) -> Counter:
    """Events per kind (``preempt`` and ``prefix_hit`` count requests, the rest blocks)."""
    counts: Counter = Counter()
    per_request = {"preempt", "prefix_hit"}
    seen = set()
    for e in events:
        if e.kind in per_request:
            key = (e.step, e.kind, e.request)
            if key in seen:
                continue
            seen.add(key)
        counts[e.kind] += 1
    return Counter({k: counts[k] for k in EVENT_KINDS if counts[k]})
