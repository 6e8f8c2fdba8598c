"""Who holds which block: the bookkeeping events are replayed on, and diffed against.

``Holdings`` is a host-side model of one pool: each request's table entries (logical index ->
block and the tokens in it), the references held outside every table, and the ref counts.
``apply`` replays one ``Event`` and refuses one that does not fit (an ``alloc`` of a block in
use, a ``free`` of an entry the request lacks...), so every recorded event is checked against
the state before it. ``diff_holdings`` lists the events that turn one ``Holdings`` into
another, for whatever no caller reported.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.viz.log import Event, Snapshot

_GAINS = ("alloc", "share", "fork", "prefix_hit")
_LOSSES = ("free", "preempt", "evict")


def anonymous_held(snap: Snapshot) -> list[int]:
    """References per block held outside every table (``held`` minus outside tables)."""
    counts = snap.held.astype(np.int64)
    for table in snap.tables.values():
        np.subtract.at(counts, np.asarray(table, np.int64), 1)
    return np.maximum(counts, 0).tolist()


@dataclasses.dataclass
class Holdings:
    entries: dict[str, dict[int, tuple[int, int]]]  # request -> logical -> (block, tokens)
    anon: list[int]  # [num_blocks] references held outside every table
    refs: list[int]  # [num_blocks] ref counts
    block_size: int  # tokens in a block held outside every table (it counts as full)

    @classmethod
    def empty(cls, num_blocks: int, block_size: int) -> Holdings:
        return cls({}, [0] * num_blocks, [0] * num_blocks, block_size)

    @classmethod
    def of(cls, snap: Snapshot) -> Holdings:
        bs = snap.config.block_size
        entries = {name: r.entries(bs) for name, r in snap.requests().items()}
        return cls(entries, anonymous_held(snap), snap.ref_counts.astype(int).tolist(), bs)

    def copy(self) -> Holdings:
        # Entries are (block, tokens) tuples: copying the dicts and lists is a deep copy.
        return Holdings({n: dict(t) for n, t in self.entries.items()}, list(self.anon),
                        list(self.refs), self.block_size)

    def apply(self, e: Event) -> Event:
        """Replay ``e``; returns it with ``ref_count`` set to the block's count after it.

        Raises ``ValueError`` naming the event if it does not fit these holdings.
        """
        b = e.block
        if b is None:  # a request-level note with no block
            return e
        if not 0 <= b < len(self.refs):
            raise ValueError(f"{e}: block {b} is outside 0..{len(self.refs) - 1}.")
        table = self.entries.get(e.request, {}) if e.request is not None else None

        def refuse(why: str):
            raise ValueError(f"Event {e.describe()!r} does not fit the pool: {why}.")

        if e.kind in _GAINS:
            if (self.refs[b] == 0) != (e.kind == "alloc"):
                refuse(f"block {b} has ref count {self.refs[b]}")
            self.refs[b] += 1
            if table is None:
                self.anon[b] += 1
            elif e.logical in table:
                refuse(f"{e.request}[{e.logical}] is already block {table[e.logical][0]}")
            else:
                self.entries.setdefault(e.request, {})[e.logical] = (b, e.tokens)
        elif e.kind in _LOSSES:
            if self.refs[b] <= 0:
                refuse(f"block {b} is free")
            if table is None:
                if self.anon[b] <= 0:
                    refuse(f"block {b} has no reference outside the tables")
                self.anon[b] -= 1
            elif table.get(e.logical, (None,))[0] != b:
                refuse(f"{e.request}[{e.logical}] is not block {b}")
            else:
                del table[e.logical]
                if not table:
                    del self.entries[e.request]
            self.refs[b] -= 1
        elif e.kind == "cow_copy":
            src = e.src_block
            if table is None or table.get(e.logical, (None,))[0] != src:
                refuse(f"{e.request}[{e.logical}] is not block {src}")
            if self.refs[b] != 0:
                refuse(f"the copy's block {b} has ref count {self.refs[b]}")
            self.refs[src] -= 1
            self.refs[b] += 1
            table[e.logical] = (b, e.tokens)
        elif e.kind == "append":
            if table is None or table.get(e.logical, (None,))[0] != b:
                refuse(f"{e.request}[{e.logical}] is not block {b}")
            table[e.logical] = (b, e.tokens)
        return dataclasses.replace(e, ref_count=self.refs[b])


def diff_holdings(before: Holdings, after: Holdings, step: int) -> list[Event]:
    """Events turning ``before`` into ``after``, with ref counts as they are replayed.

    Dropped references first (a block given up can be reused in the same step), then gained
    ones: ``alloc`` when the block has no reference left at that point, else ``share``; a kept
    entry that points at a fresh block is a ``cow_copy``; more tokens in a kept block is an
    ``append``. ``before`` is left as it was.
    """
    hold = before.copy()
    drops: list[Event] = []
    for name, old in before.entries.items():
        new = after.entries.get(name, {})
        for i, (b, tokens) in sorted(old.items()):
            if i not in new or (new[i][0] != b and hold.refs[new[i][0]] != 0):
                drops.append(Event(step, "free", name, i, b, None, tokens))
    for b, (was, now) in enumerate(zip(before.anon, after.anon, strict=True)):
        if was > now:
            drops += [Event(step, "free", None, None, b, None, before.block_size)] * (was - now)
    events = [hold.apply(e) for e in drops]
    for name, new in after.entries.items():
        for i, (b, tokens) in sorted(new.items()):
            was = hold.entries.get(name, {}).get(i)
            if was is None:
                kind = "alloc" if hold.refs[b] == 0 else "share"
                events.append(hold.apply(Event(step, kind, name, i, b, None, tokens)))
            elif was[0] != b:
                events.append(hold.apply(Event(step, "cow_copy", name, i, b, None, tokens,
                                               src_block=was[0])))
            elif was[1] != tokens:
                events.append(hold.apply(Event(step, "append", name, i, b, None, tokens)))
    gained = [b for b, (now, was) in enumerate(zip(after.anon, hold.anon, strict=True))
              if now > was]
    for b in gained:
        for _ in range(after.anon[b] - hold.anon[b]):
            kind = "alloc" if hold.refs[b] == 0 else "share"
            events.append(hold.apply(Event(step, kind, None, None, b, None, after.block_size)))
    return events
