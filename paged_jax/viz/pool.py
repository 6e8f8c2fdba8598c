"""``RecordingPool``: the pure allocator ops on named requests, recorded step by step.

A thin wrapper for driving scenarios: it keeps the ``BlockState``, maps request names to
sequence slots, runs each op jitted with batches padded to ``max_seqs`` (one compilation per
op, whatever the batch), raises if an op fails, reports to its ``Recorder`` the events each
op made (the blocks it allocated, shared, copied or gave up), and ``capture``\\ s a step when
asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from paged_jax.allocator import loose, ops
from paged_jax.allocator.state import NULL_BLOCK, CacheConfig, init_state
from paged_jax.viz.recorder import Recorder

_admit = jax.jit(ops.admit)
_append = jax.jit(ops.append, static_argnames="num_tokens")
_append_n = jax.jit(ops.append)
_release = jax.jit(ops.release)
_fork = jax.jit(ops.fork)
_share_prefix = jax.jit(ops.share_prefix)
_cow = jax.jit(ops.copy_on_write)
_share_blocks = jax.jit(loose.share_blocks)
_free_blocks = jax.jit(loose.free_blocks)


class RecordingPool:
    """A pool of ``config.num_blocks`` blocks whose requests are named, not numbered."""

    def __init__(self, config: CacheConfig, *, scenario: str = "", title: str = "empty pool"):
        self.config = config
        self._state = init_state(config)
        self._host: dict[str, np.ndarray] = {}  # host copies of state fields, per state
        self.names: dict[int, str] = {}  # active slot -> name
        self.recorder = Recorder(scenario)
        self.capture(title)

    # ---- bookkeeping
    @property
    def state(self):
        return self._state

    @state.setter
    def state(self, state) -> None:
        self._state = state
        self._host = {}

    def _field(self, name: str) -> np.ndarray:
        """``state.<name>`` on the host, copied once per state (scenarios ask per request)."""
        if name not in self._host:
            self._host[name] = np.asarray(getattr(self._state, name))
        return self._host[name]

    @property
    def log(self):
        return self.recorder.log

    @property
    def live(self) -> list[str]:
        return [self.names[s] for s in sorted(self.names)]

    def slot(self, name: str) -> int:
        for s, n in self.names.items():
            if n == name:
                return s
        raise KeyError(f"No live request named {name!r}; live: {self.live}.")

    def table(self, name: str) -> list[int]:
        row = self._field("block_tables")[self.slot(name)]
        return [int(b) for b in row if b != NULL_BLOCK]

    def length(self, name: str) -> int:
        return int(self._field("seq_lens")[self.slot(name)])

    def ref_count(self, block: int) -> int:
        return int(self._field("ref_counts")[block])

    @property
    def num_free(self) -> int:
        return int(self._field("num_free"))

    def capture(self, title: str = "") -> int:
        return self.recorder.capture(self.state, self.names, title=title)

    def note(self, kind: str, **kwargs) -> None:
        self.recorder.note(kind, **kwargs)

    # ---- ops
    def _pad(self, values: Sequence[int], fill: int = -1) -> np.ndarray:
        width = self.config.max_seqs
        if len(values) > width:
            raise ValueError(f"A batch holds at most max_seqs={width} entries. Got {len(values)}.")
        out = np.full((width,), fill, np.int32)
        out[: len(values)] = values
        return out

    def _new_slots(self, names: Sequence[str]) -> list[int]:
        clash = [n for n in names if n in self.names.values()]
        if clash or len(set(names)) != len(names):
            raise ValueError(f"Request names must be new and unique. Got {list(names)}.")
        free = [s for s in range(self.config.max_seqs) if s not in self.names]
        if len(free) < len(names):
            raise ValueError(f"Only {len(free)} sequence slots are free; {len(names)} requested.")
        return free[: len(names)]

    def entries(self, name: str) -> list[tuple[int, int]]:
        """``name``'s table as ``(block, tokens in it)`` per logical index."""
        bs, n = self.config.block_size, self.length(name)
        return [(b, min(bs, max(0, n - i * bs))) for i, b in enumerate(self.table(name))]

    def _report(self, kind, name, logical, block, tokens, src=None, detail="") -> None:
        self.recorder.report(kind, name, logical, block, tokens, src_block=src, detail=detail)

    def admit(self, names: Sequence[str], num_tokens: Sequence[int]) -> None:
        slots = self._new_slots(names)
        state, status = _admit(self.state, self._pad(slots), self._pad(num_tokens, 0))
        status.raise_if_failed()
        self.state = state
        self.names.update(zip(slots, names, strict=True))
        for name in names:
            for i, (b, tokens) in enumerate(self.entries(name)):
                self._report("alloc", name, i, b, tokens)

    def append(self, names: Sequence[str], num_tokens: int | Sequence[int] = 1) -> None:
        """Reports an ``alloc`` per block the op added and an ``append`` per block it wrote
        into (``append`` returns only its status, so its effect is read off each request's
        table and length)."""
        ids = self._pad([self.slot(n) for n in names])
        before = {n: self.entries(n) for n in names}
        if isinstance(num_tokens, int):
            state, status = _append(self.state, ids, num_tokens=num_tokens)
        else:
            state, status = _append_n(self.state, ids, self._pad(num_tokens, 0))
        status.raise_if_failed()
        self.state = state
        for name in names:
            old = before[name]
            for i, (b, tokens) in enumerate(self.entries(name)):
                if i >= len(old):
                    self._report("alloc", name, i, b, tokens)
                elif old[i][1] != tokens:
                    self._report("append", name, i, b, tokens)

    def release(self, names: Sequence[str], *, kind: str = "free", detail: str = "") -> None:
        """Release ``names``: each gives up its blocks (``kind``: ``free``, or ``preempt`` /
        ``evict`` for a request pushed out of the batch or a cache)."""
        if kind not in ("free", "preempt", "evict"):
            raise ValueError(f"release kind must be free, preempt or evict. Got {kind!r}.")
        slots = [self.slot(n) for n in names]
        before = {n: self.entries(n) for n in names}
        state, status = _release(self.state, self._pad(slots))
        status.raise_if_failed()
        self.state = state
        for s in slots:
            del self.names[s]
        for name in names:
            for i, (b, tokens) in enumerate(before[name]):
                self._report(kind, name, i, b, tokens, detail=detail)

    def preempt(self, names: Sequence[str]) -> None:
        """Push ``names`` out of the running batch: their blocks go back (``preempt``)."""
        empty = [n for n in names if not self.table(n)]
        if empty:
            raise ValueError(f"Only a request holding blocks can be preempted. Got {empty}.")
        self.release(names, kind="preempt")

    def fork(self, parents: Sequence[str], children: Sequence[str]) -> None:
        src = [self.slot(p) for p in parents]
        dst = self._new_slots(children)
        state, status = _fork(self.state, self._pad(src), self._pad(dst))
        status.raise_if_failed()
        self.state = state
        self.names.update(zip(dst, children, strict=True))
        for child in children:
            for i, (b, tokens) in enumerate(self.entries(child)):
                self._report("fork", child, i, b, tokens)

    def share_prefix(
        self, srcs: Sequence[str], dsts: Sequence[str], num_blocks: int, *,
        prefix_hit: bool = False,
    ) -> None:
        """New requests ``dsts`` start with the first ``num_blocks`` blocks of ``srcs``
        (``prefix_hit``: reported as prefix-cache hits rather than plain shares)."""
        src = [self.slot(p) for p in srcs]
        dst = self._new_slots(dsts)
        k = self._pad([num_blocks] * len(src), 0)
        state, status = _share_prefix(self.state, self._pad(src), self._pad(dst), k)
        status.raise_if_failed()
        self.state = state
        self.names.update(zip(dst, dsts, strict=True))
        for name in dsts:
            for i, (b, tokens) in enumerate(self.entries(name)):
                self._report("prefix_hit" if prefix_hit else "share", name, i, b, tokens)

    def copy_on_write(self, names: Sequence[str], positions: Sequence[int]):
        """Returns ``[(name, src, dst)]`` for the entries that were copied (each reported as
        a ``cow_copy``)."""
        state, (src, dst), status = _cow(
            self.state, self._pad([self.slot(n) for n in names]), self._pad(positions, 0)
        )
        status.raise_if_failed()
        self.state = state
        src, dst = np.asarray(src), np.asarray(dst)
        copies = []
        for i, name in enumerate(names):
            if dst[i] >= 0:
                logical = int(positions[i]) // self.config.block_size
                tokens = self.entries(name)[logical][1]
                self._report("cow_copy", name, logical, int(dst[i]), tokens, src=int(src[i]))
                copies.append((name, int(src[i]), int(dst[i])))
        return copies

    def hold(self, blocks: Sequence[int]) -> None:
        """One more reference held outside any table (a prefix cache keeping blocks alive)."""
        refs = self._field("ref_counts").copy()
        state, status = _share_blocks(self.state, np.asarray(blocks, np.int32))
        status.raise_if_failed()
        self.state = state
        for b in blocks:
            self._report("alloc" if refs[b] == 0 else "share", None, None, b,
                         self.config.block_size)
            refs[b] += 1

    def drop(self, blocks: Sequence[int], *, evict: bool = False, detail: str = "") -> None:
        """Drop references taken by ``hold`` (``evict``: reported as cache evictions)."""
        state, status = _free_blocks(self.state, np.asarray(blocks, np.int32))
        status.raise_if_failed()
        self.state = state
        for b in blocks:
            self._report("evict" if evict else "free", None, None, b, self.config.block_size,
                         detail=detail)
