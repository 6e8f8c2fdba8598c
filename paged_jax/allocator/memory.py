"""KV memory waste of allocation strategies, replayed on one request stream (no model).

The simulation
--------------
Time runs in discrete steps ``0 .. steps - 1``. Every request arrives at step 0 and waits in
one first-come-first-served queue. Each step, in this order:

1. **Growth.** Every running request admitted in an earlier step appends one token state. A
   paged strategy whose pool cannot hold the new blocks preempts by recompute, as
   ``paged_jax.engine.scheduler`` does: the newest running request frees all it holds and
   goes back to the front of the queue, keeping the tokens it generated (on readmission it
   holds its prompt plus those tokens at once); repeated until the growth fits.
2. **Completion.** A request that has appended ``output_len`` tokens finishes and frees its
   memory.
3. **Admission** (skipped in a step that preempted, as the engine does): the queue head is
   admitted while it fits, holding its prompt's token states in this step. Head of line:
   admission stops at the first request that does not fit.
4. **Accounting** of every slot of the pool, after the admissions.

Every strategy sees the identical stream and pool of ``pool_slots`` KV token slots, and runs
the same number of steps.

Strategies
----------
* ``contiguous-max``: ``max_len`` (2,048) slots reserved per request, the seed's
  "traditional" scheme; the pool holds ``pool_slots // max_len`` requests.
* ``contiguous-exact``: ``prompt + output`` slots per request (the final length is known, as
  for Orca's oracle), placed first fit in one linear address space; freed ranges leave holes.
* ``paged-<bs>``: blocks of ``bs`` slots on demand, on the real functional allocator
  (``memory_blocks.py``); preemption as above.
* ``physical-limit``: slot granularity, each request holding exactly its token states.

Accounting, in slots (the five always add up to ``pool_slots``)
--------------------------------------------------------------
* ``tokens``: token states written.
* ``reserved``: allocated to a request and to be written by it later (below its final length).
* ``internal``: allocated to a request beyond its final length: never written.
* ``external``: free, yet unusable. For ``contiguous-exact``: every free slot, at a step where
  the queue head waits although the free slots together would hold it (no single hole
  does). For the block and unit schemes: the pool's remainder that makes no whole block
  (unit).
* ``free``: the rest.

``waste %`` is ``(reserved + internal + external) / (tokens + reserved + internal +
external)`` summed over all steps: the share of the KV memory a strategy occupies that does
not hold token states (``100 - waste %`` is the vLLM paper's "token states" share).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

CATEGORIES = ("tokens", "reserved", "internal", "external", "free")
WASTE = ("reserved", "internal", "external")


@dataclasses.dataclass(eq=False)
class Request:
    """One request of the stream while it is replayed: ``tokens`` token states held (or to be
    held on readmission), ``generated`` of its ``output`` appended so far."""

    index: int
    prompt: int
    output: int
    tokens: int = 0
    generated: int = 0
    slot: int | None = None

    @property
    def final(self) -> int:
        return self.prompt + self.output


def check_stream(stream: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stream as a list of ``(prompt_len, output_len)`` int pairs; ValueError if it is empty
    or a length is not a positive int."""
    pairs = list(stream)
    if not pairs:
        raise ValueError("The request stream is empty; expected at least one "
                         "(prompt_len, output_len) pair.")
    for i, pair in enumerate(pairs):
        if (len(pair) != 2 or any(not isinstance(v, (int, np.integer)) or isinstance(v, bool)
                                  or v < 1 for v in pair)):
            raise ValueError(f"Request {i} is {pair!r}; expected (prompt_len, output_len), "
                             f"both positive ints.")
    return [(int(p), int(o)) for p, o in pairs]


def check_positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int. Got {value!r}.")
    return int(value)


@dataclasses.dataclass
class Replay:
    """Per-step record of one strategy's replay: each category's slots, requests running and
    waiting, completed so far and preemptions so far, all [steps] int arrays; the stream it
    replayed and the request indices in the order of their first admission."""

    name: str
    pool_slots: int
    stream: tuple[tuple[int, int], ...]
    admitted: list[int]
    usage: dict[str, np.ndarray]
    running: np.ndarray
    waiting: np.ndarray
    completed: np.ndarray
    preemptions: np.ndarray

    def waste_percent(self) -> dict[str, float]:
        """Each waste category, and ``total``, as a % of the occupied slots over all steps."""
        occupied = sum(int(self.usage[c].sum()) for c in CATEGORIES if c != "free")
        out = {c: 100.0 * int(self.usage[c].sum()) / max(occupied, 1) for c in WASTE}
        out["total"] = sum(out.values())
        return out

    def summary(self) -> dict:
        return {"strategy": self.name, "waste_percent": self.waste_percent(),
                "token_state_percent": 100.0 - self.waste_percent()["total"],
                "pool_use_percent": 100.0 * float(self.usage["tokens"].mean()) / self.pool_slots,
                "peak_running": int(self.running.max()),
                "mean_running": float(self.running.mean()),
                "completed": int(self.completed[-1]), "preemptions": int(self.preemptions[-1])}


def replay(stream: Sequence[tuple[int, int]], strategy, steps: int, progress=None) -> Replay:
    """Run ``stream`` through ``strategy`` for ``steps`` steps (see the module docstring).

    ``strategy`` provides ``check(stream)``, ``victims(running)`` (preempts and returns the
    requests to send back so that every running request can grow by one token), ``grow``,
    ``release``, ``admit(queue) -> admitted`` (pops fitting requests off the head),
    ``allocated(running) -> slots per request`` and ``unheld(head) -> (external, free)``.
    ``progress``, if given, is called with 1 after each step (a tqdm bar's ``update``).
    """
    pairs = check_stream(stream)
    steps = check_positive("steps", steps)
    strategy.check(pairs)
    queue = collections.deque(Request(i, p, o, tokens=p) for i, (p, o) in enumerate(pairs))
    running: list[Request] = []
    rec = {c: np.zeros(steps, np.int64) for c in CATEGORIES}
    counts = {k: np.zeros(steps, np.int64) for k in ("running", "waiting", "completed",
                                                      "preemptions")}
    completed = preemptions = 0
    admitted: list[int] = []
    seen: set[int] = set()
    for t in range(steps):
        victims = strategy.victims(running) if running else []
        for v in victims:  # newest first, so the oldest victim ends up at the front
            running.remove(v)
            queue.appendleft(v)
        preemptions += len(victims)
        if running:
            strategy.grow(running)
            for r in running:
                r.tokens += 1
                r.generated += 1
        done = [r for r in running if r.generated == r.output]
        if done:
            strategy.release(done)
            running = [r for r in running if r.generated < r.output]
            completed += len(done)
        if not victims and queue:
            new = strategy.admit(queue)
            admitted += [r.index for r in new if r.index not in seen]
            seen.update(r.index for r in new)
            running += new
        alloc = strategy.allocated(running)
        external, free = strategy.unheld(queue[0] if queue else None)
        for r, a in zip(running, alloc, strict=True):
            kept = min(a, r.final)
            rec["tokens"][t] += r.tokens
            rec["reserved"][t] += kept - r.tokens
            rec["internal"][t] += a - kept
        rec["external"][t], rec["free"][t] = external, free
        for key, value in (("running", len(running)), ("waiting", len(queue)),
                           ("completed", completed), ("preemptions", preemptions)):
            counts[key][t] = value
        if progress is not None:
            progress(1)
    return Replay(strategy.name, strategy.pool_slots, tuple(pairs), admitted, rec, **counts)


class ContiguousMax:
    """``max_len`` slots per request, in ``pool_slots // max_len`` fixed units."""

    def __init__(self, pool_slots: int, max_len: int = 2048):
        self.pool_slots = check_positive("pool_slots", pool_slots)
        self.max_len = check_positive("max_len", max_len)
        self.name = "contiguous-max"
        self.units = pool_slots // max_len
        self.held = 0

    def check(self, pairs):
        if self.units < 1:
            raise ValueError(f"pool_slots {self.pool_slots} is smaller than one request's "
                             f"reservation of max_len {self.max_len} slots.")
        longest = max(p + o for p, o in pairs)
        if longest > self.max_len:
            raise ValueError(f"A request of {longest} tokens exceeds max_len {self.max_len}.")

    def victims(self, running):
        return []

    def grow(self, running):
        pass

    def release(self, reqs):
        self.held -= len(reqs)

    def admit(self, queue):
        admitted = []
        while queue and self.held < self.units:
            admitted.append(queue.popleft())
            self.held += 1
        return admitted

    def allocated(self, running):
        return [self.max_len] * len(running)

    def unheld(self, head):
        return self.pool_slots % self.max_len, (self.units - self.held) * self.max_len


class ContiguousExact:
    """``prompt + output`` slots per request, first fit over addresses ``0 .. pool_slots``."""

    def __init__(self, pool_slots: int):
        self.pool_slots = check_positive("pool_slots", pool_slots)
        self.name = "contiguous-exact"
        self.ranges: dict[int, tuple[int, int]] = {}  # request index -> (start, size)

    def check(self, pairs):
        longest = max(p + o for p, o in pairs)
        if longest > self.pool_slots:
            raise ValueError(f"pool_slots {self.pool_slots} is smaller than a request of "
                             f"{longest} tokens.")

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges ``(start, size)`` in address order."""
        out, at = [], 0
        for start, size in sorted(self.ranges.values()):
            if start > at:
                out.append((at, start - at))
            at = start + size
        if at < self.pool_slots:
            out.append((at, self.pool_slots - at))
        return out

    def victims(self, running):
        return []

    def grow(self, running):
        pass

    def release(self, reqs):
        for r in reqs:
            del self.ranges[r.index]

    def admit(self, queue):
        admitted = []
        while queue:
            need = queue[0].final
            hole = next((start for start, size in self.holes() if size >= need), None)
            if hole is None:
                break
            r = queue.popleft()
            self.ranges[r.index] = (hole, need)
            admitted.append(r)
        return admitted

    def allocated(self, running):
        return [self.ranges[r.index][1] for r in running]

    def unheld(self, head):
        holes = self.holes()
        free = sum(size for _, size in holes)
        stuck = (head is not None and free >= head.final
                 and all(size < head.final for _, size in holes))
        return (free, 0) if stuck else (0, free)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Paged:
    """Blocks of ``blocks.block_size`` slots on demand, over a block backend
    (``memory_blocks.py``): ``num_free()``, ``admit([(slot, tokens)])``, ``append(slots)``,
    ``release(slots)`` and ``counts(slots) -> blocks held``. Preempts by recompute when
    growth does not fit."""

    def __init__(self, pool_slots: int, blocks, name: str | None = None):
        self.pool_slots = check_positive("pool_slots", pool_slots)
        self.blocks = blocks
        self.bs = blocks.block_size
        self.name = name or f"paged-{self.bs}"
        self.slots = list(range(blocks.max_seqs))[::-1]  # a stack: lowest slot first

    def check(self, pairs):
        longest = max(p + o for p, o in pairs)
        if cdiv(longest, self.bs) > self.blocks.num_blocks:
            raise ValueError(f"pool_slots {self.pool_slots} ({self.blocks.num_blocks} blocks of "
                             f"{self.bs}) cannot hold a request of {longest} tokens.")

    def _free(self, reqs):
        self.blocks.release([r.slot for r in reqs])
        for r in reqs:
            self.slots.append(r.slot)
            r.slot = None
        self.slots.sort(reverse=True)

    def victims(self, running):
        free = self.blocks.num_free()
        crossing = {id(r) for r in running if r.tokens % self.bs == 0}
        out: list[Request] = []
        while len(crossing) > free:
            victim = running[-1 - len(out)]  # running is in admission order: newest last
            if len(out) + 1 == len(running):
                raise RuntimeError(f"The pool ({self.blocks.num_blocks} blocks) cannot grow "
                                   f"its only running request ({victim.tokens} tokens).")
            self._free([victim])
            free = self.blocks.num_free()
            crossing.discard(id(victim))
            out.append(victim)
        return out

    def grow(self, running):
        self.blocks.append([r.slot for r in running])

    def release(self, reqs):
        self._free(reqs)

    def admit(self, queue):
        free, admitted = self.blocks.num_free(), []
        while queue and self.slots and cdiv(queue[0].tokens, self.bs) <= free:
            r = queue.popleft()
            r.slot = self.slots.pop()
            free -= cdiv(r.tokens, self.bs)
            admitted.append(r)
        if admitted:
            self.blocks.admit([(r.slot, r.tokens) for r in admitted])
        return admitted

    def allocated(self, running):
        return [n * self.bs for n in self.blocks.counts([r.slot for r in running])]

    def unheld(self, head):
        return (self.pool_slots - self.blocks.num_blocks * self.bs,
                self.blocks.num_free() * self.bs)
