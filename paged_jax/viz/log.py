"""The event log: one host snapshot of the pool per step, plus the allocator events between.

A ``RunLog`` is the source of truth for every view. It saves to JSON and loads back, so a
picture can be redrawn later from the file alone.

Requests are named (``"A"``, ``"B"``...). A snapshot knows each active sequence slot's name, and
may also carry block tables kept outside the state (the seed's ``req_d_table = sys_prompt_blocks
+ [allocator.allocate()]``), which hold their blocks through ``held`` references.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from paged_jax.allocator.state import NULL_BLOCK, BlockState, CacheConfig

FORMAT = "paged_jax.viz.log"
VERSION = 1

EVENT_KINDS = (
    "alloc",  # a free block gets its first reference
    "free",  # a reference is dropped (ref_count says whether the block went back to the pool)
    "fork",  # a new request starts as a copy of another's table: one event per shared block
    "share",  # a reference is added to a block already in use
    "cow_copy",  # a shared block is replaced by a private copy (src_block -> block)
    "append",  # tokens are written into a block the request already had
    "preempt",  # a request is evicted from the running batch: one event per block it gave up
    "prefix_hit",  # a new request is given cached prefix blocks: one event per block
    "evict",  # a cached block's reference is dropped to make room
)


@dataclasses.dataclass(frozen=True)
class Event:
    """One allocator event. ``request`` is ``None`` for a reference held outside any table.

    Events of a step are in the order they happened: replaying them one by one from the
    previous snapshot gives the next (``viz.holdings.Holdings.apply``). ``preempt`` and
    ``evict`` drop a reference as ``free`` does; ``fork`` and ``prefix_hit`` add one as
    ``share`` does.
    """

    step: int
    kind: str
    request: str | None
    logical: int | None  # index in the request's block table
    block: int | None  # physical block
    ref_count: int | None  # the block's ref count just after this event
    tokens: int | None  # tokens in the block (after the event; before it, for a block given up)
    src_block: int | None = None  # cow_copy: the shared block the copy was made from
    detail: str = ""

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"Unknown event kind {self.kind!r}; expected one of {EVENT_KINDS}.")

    def describe(self) -> str:
        """One line for the views: ``free B[1]: block 4 back to the free list``."""
        who = self.request if self.request is not None else "held"
        entry = who if self.logical is None else f"{who}[{self.logical}]"
        text = f"{self.kind} {entry}"
        if self.block is not None:
            text += ": " + self._what()
        return text + (f" ({self.detail})" if self.detail else "")

    def _what(self) -> str:
        b, refs = self.block, self.ref_count
        tokens = "" if self.tokens is None else (
            f", {self.tokens} token{'' if self.tokens == 1 else 's'}"
        )
        if self.kind in ("free", "preempt", "evict"):
            if refs is None:
                return f"block {b}"
            return f"block {b} back to the free list" if refs == 0 else (
                f"block {b} kept by {refs} other reference{'s' if refs > 1 else ''}"
            )
        if self.kind == "cow_copy":
            return f"block {self.src_block} copied to block {b}{tokens}"
        if self.kind == "append":
            return f"block {b} now holds{tokens[1:]}"
        if self.kind == "alloc":
            return f"block {b}{tokens}"
        shared = "" if refs is None else f", now shared by {refs}"
        return f"block {b}{shared}"


@dataclasses.dataclass(frozen=True)
class RequestView:
    """A request at one step: its block table and length."""

    name: str
    slot: int | None  # None for a table kept outside the state
    table: tuple[int, ...]
    num_tokens: int

    def tokens_in(self, logical: int, block_size: int) -> int:
        return int(min(block_size, max(0, self.num_tokens - logical * block_size)))

    def entries(self, block_size: int) -> dict[int, tuple[int, int]]:
        """Logical index -> (block, tokens in it)."""
        return {i: (b, self.tokens_in(i, block_size)) for i, b in enumerate(self.table)}


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """The pool after one step, copied to the host."""

    title: str
    config: CacheConfig
    ref_counts: np.ndarray  # [num_blocks] int32
    held: np.ndarray  # [num_blocks] int32
    block_tables: np.ndarray  # [max_seqs, max_blocks_per_seq] int32, NULL_BLOCK-padded
    seq_lens: np.ndarray  # [max_seqs] int32
    active: np.ndarray  # [max_seqs] bool
    free_order: tuple[int, ...]  # free blocks, the next to be handed out first
    names: Mapping[int, str]  # active slot -> request name
    tables: Mapping[str, tuple[int, ...]]  # name -> blocks, tables kept outside the state

    @classmethod
    def from_state(
        cls,
        state: BlockState,
        names: Mapping[int, str] | None = None,
        *,
        tables: Mapping[str, Sequence[int]] | None = None,
        title: str = "",
    ) -> Snapshot:
        from paged_jax.allocator.state import free_list_order

        active = np.asarray(state.active).astype(bool)
        names = dict(names or {})
        for slot in np.flatnonzero(active):
            names.setdefault(int(slot), str(int(slot)))
        names = {int(s): str(n) for s, n in names.items() if active[int(s)]}
        return cls(
            title=title,
            config=state.config,
            ref_counts=np.asarray(state.ref_counts, np.int32).copy(),
            held=np.asarray(state.held, np.int32).copy(),
            block_tables=np.asarray(state.block_tables, np.int32).copy(),
            seq_lens=np.asarray(state.seq_lens, np.int32).copy(),
            active=active.copy(),
            free_order=tuple(free_list_order(state)),
            names=names,
            tables={str(k): tuple(int(b) for b in v) for k, v in (tables or {}).items()},
        )

    def __post_init__(self):
        names = list(self.names.values()) + list(self.tables)
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"Request names must be unique within a step. Got {dupes} more than once "
                f"(slots {dict(self.names)}, outside tables {list(self.tables)})."
            )
        n = self.config.num_blocks
        for name, table in self.tables.items():
            bad = [b for b in table if not 0 <= b < n]
            if bad:
                raise ValueError(f"Table {name!r} names blocks {bad} outside 0..{n - 1}.")

    def requests(self) -> dict[str, RequestView]:
        """Every request, slots in slot order, then the outside tables."""
        out = {}
        bs = self.config.block_size
        for slot in sorted(self.names):
            row = self.block_tables[slot]
            table = tuple(int(b) for b in row if b != NULL_BLOCK)
            out[self.names[slot]] = RequestView(
                self.names[slot], slot, table, int(self.seq_lens[slot])
            )
        for name, table in self.tables.items():
            out[name] = RequestView(name, None, tuple(table), len(table) * bs)
        return out

    def to_state(self) -> BlockState:
        """A ``BlockState`` with these contents (host arrays), for ``render_layout`` and checks."""
        n = self.config.num_blocks
        ring = np.full((n,), NULL_BLOCK, np.int32)
        ring[: min(n, len(self.free_order))] = self.free_order[:n]  # a corrupt list shows up
        # in check_invariants rather than here
        return BlockState(
            ref_counts=self.ref_counts,
            held=self.held,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            active=self.active,
            free_list=ring,
            free_head=np.int32(0),
            num_free=np.int32(len(self.free_order)),
            config=self.config,
        )

    def equals(self, other: Snapshot) -> bool:
        return (
            self.title == other.title
            and self.config == other.config
            and all(
                np.array_equal(getattr(self, f), getattr(other, f))
                for f in ("ref_counts", "held", "block_tables", "seq_lens", "active")
            )
            and self.free_order == other.free_order
            and dict(self.names) == dict(other.names)
            and dict(self.tables) == dict(other.tables)
        )

    def to_json(self) -> dict:
        reqs = {
            name: {"slot": r.slot, "num_tokens": r.num_tokens, "table": list(r.table)}
            for name, r in self.requests().items()
            if r.slot is not None
        }
        return {
            "title": self.title,
            "ref_counts": self.ref_counts.tolist(),
            "held": self.held.tolist(),
            "free_order": list(self.free_order),
            "requests": reqs,
            "tables": {k: list(v) for k, v in self.tables.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping, config: CacheConfig) -> Snapshot:
        s, m = config.max_seqs, config.max_blocks_per_seq
        tables = np.full((s, m), NULL_BLOCK, np.int32)
        lens = np.zeros((s,), np.int32)
        active = np.zeros((s,), bool)
        names = {}
        for name, req in data["requests"].items():
            slot = int(req["slot"])
            tables[slot, : len(req["table"])] = req["table"]
            lens[slot] = req["num_tokens"]
            active[slot] = True
            names[slot] = name
        return cls(
            title=data["title"],
            config=config,
            ref_counts=np.asarray(data["ref_counts"], np.int32),
            held=np.asarray(data["held"], np.int32),
            block_tables=tables,
            seq_lens=lens,
            active=active,
            free_order=tuple(int(b) for b in data["free_order"]),
            names=names,
            tables={k: tuple(v) for k, v in data["tables"].items()},
        )


@dataclasses.dataclass
class RunLog:
    """Snapshots ``0..num_steps-1`` and the events that led to each (events of step 0 lead
    from the empty pool to snapshot 0)."""

    config: CacheConfig
    snapshots: list[Snapshot] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)
    scenario: str = ""

    @property
    def num_steps(self) -> int:
        return len(self.snapshots)

    def events_at(self, step: int) -> list[Event]:
        return [e for e in self.events if e.step == step]

    def request_names(self) -> list[str]:
        """Every request name, in order of first appearance."""
        seen: dict[str, None] = {}
        for snap in self.snapshots:
            for name in snap.requests():
                seen.setdefault(name, None)
        return list(seen)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "scenario": self.scenario,
            "config": dataclasses.asdict(self.config),
            "snapshots": [s.to_json() for s in self.snapshots],
            "events": [dataclasses.asdict(e) for e in self.events],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> RunLog:
        if data.get("format") != FORMAT:
            raise ValueError(f"Not a paged_jax event log: format is {data.get('format')!r}.")
        if data.get("version") != VERSION:
            raise ValueError(
                f"Event log version {data.get('version')!r} is not supported; expected {VERSION}."
            )
        config = CacheConfig(**data["config"])
        return cls(
            config=config,
            snapshots=[Snapshot.from_json(s, config) for s in data["snapshots"]],
            events=[Event(**e) for e in data["events"]],
            scenario=data.get("scenario", ""),
        )

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunLog:
        with open(path) as f:
            return cls.from_json(json.load(f))
