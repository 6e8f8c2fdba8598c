"""An independent, pure-Python replay of the viz scenarios, the reference the viz tests use.

``MiniPool`` is the seed write-up's allocator with named tables: a FIFO free list, ref counts,
and per-request tables and lengths. Nothing here imports paged_jax. The tests at the bottom
pin the replay itself to numbers printed in the seed write-up.
"""

from __future__ import annotations

import collections

# The seed's own pictures, character for character.
SEED_AFTER_ADMIT = (
    "[A][A][A][B][B][C][C][C][C][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ]\n"
    " 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19"
)
SEED_AFTER_B = (
    "[A][A][A][ ][ ][C][C][C][C][A][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ]\n"
    " 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19"
)
SEED_SHARED = (
    "[A][A][A][ ][ ][C][C][C][C][A][*][*][D][E][ ][ ][ ][ ][ ][ ]\n"
    " 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19"
)
SEED_FINAL = (
    "[A][A][A][ ][ ][C][C][C][C][A][E][E][ ][E][ ][ ][ ][ ][ ][ ]\n"
    " 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19"
)
SEED_PICTURE_STEPS = {3: SEED_AFTER_ADMIT, 14: SEED_AFTER_B, 17: SEED_SHARED, 19: SEED_FINAL}


class MiniPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.n, self.bs = num_blocks, block_size
        self.free = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def allocate(self) -> int:
        b = self.free.popleft()
        self.refs[b] = 1
        return b

    def decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)

    def admit(self, name: str, tokens: int) -> None:
        self.tables[name] = [self.allocate() for _ in range(-(-tokens // self.bs))]
        self.lens[name] = tokens

    def append(self, name: str) -> None:
        self.lens[name] += 1
        if self.lens[name] > len(self.tables[name]) * self.bs:
            self.tables[name].append(self.allocate())

    def release(self, name: str) -> None:
        for b in self.tables.pop(name):
            self.decref(b)
        del self.lens[name]

    def fork(self, parent: str, child: str) -> None:
        self.tables[child] = list(self.tables[parent])
        self.lens[child] = self.lens[parent]
        for b in self.tables[child]:
            self.refs[b] += 1

    def write(self, name: str, pos: int) -> tuple[int, int] | None:
        """Copy-on-write before writing ``pos``: returns ``(src, dst)`` if a copy was made."""
        i = pos // self.bs
        b = self.tables[name][i]
        if self.refs[b] == 1:
            return None
        dst = self.allocate()
        self.tables[name][i] = dst
        self.refs[b] -= 1
        return b, dst

    def picture(self) -> dict:
        owners = [set() for _ in range(self.n)]
        tokens = [0] * self.n
        for name, table in self.tables.items():
            for i, b in enumerate(table):
                owners[b].add(name)
                tokens[b] = max(tokens[b], min(self.bs, self.lens[name] - i * self.bs))
        for b in range(self.n):
            if self.refs[b] and not owners[b]:
                tokens[b] = self.bs  # held outside any table: a whole block
        return {
            "owners": [frozenset(o) for o in owners],
            "refs": list(self.refs),
            "tokens": tokens,
            "free": list(self.free),
            "tables": {k: list(v) for k, v in self.tables.items()},
            "lens": dict(self.lens),
        }


def seed_steps() -> list[dict]:
    """One picture per step of the seed scenario, in the order ``scenarios.seed`` captures."""
    pool = MiniPool(20, 16)
    steps = [pool.picture()]
    for name, tokens in (("A", 40), ("B", 24), ("C", 50)):
        pool.admit(name, tokens)
        steps.append(pool.picture())
    for _ in range(10):
        pool.append("A")
        steps.append(pool.picture())
    pool.release("B")
    steps.append(pool.picture())
    prompt = [pool.allocate(), pool.allocate()]  # held, in no table yet
    steps.append(pool.picture())
    for name in ("D", "E"):
        pool.tables[name] = prompt + [pool.allocate()]
        pool.lens[name] = 3 * pool.bs  # outside tables are whole blocks
        for b in prompt:
            pool.refs[b] += 1
        steps.append(pool.picture())
    for b in pool.tables.pop("D"):
        pool.decref(b)
    del pool.lens["D"]
    steps.append(pool.picture())
    for b in prompt:
        pool.decref(b)
    steps.append(pool.picture())
    return steps


def fork_cow_steps() -> list[dict]:
    """The ``fork-cow`` scenario: 12 blocks of 4 tokens."""
    pool = MiniPool(12, 4)
    steps = [pool.picture()]
    pool.admit("P", 6)
    steps.append(pool.picture())
    pool.fork("P", "Q")
    pool.fork("P", "R")
    steps.append(pool.picture())
    for name in ("P", "Q", "R"):
        pool.write(name, 6)
    for name in ("P", "Q", "R"):
        pool.append(name)
    steps.append(pool.picture())
    for _ in range(2):
        for name in ("P", "Q", "R"):
            pool.append(name)
        steps.append(pool.picture())
    pool.release("Q")
    steps.append(pool.picture())
    pool.fork("R", "S")
    steps.append(pool.picture())
    pool.write("S", pool.lens["S"])
    pool.append("R")
    pool.append("S")
    steps.append(pool.picture())
    for name in ("P", "R", "S"):
        pool.release(name)
    steps.append(pool.picture())
    return steps


def render_cells(picture: dict) -> str:
    """The seed's two-line picture from a ``MiniPool`` picture (independent of ascii.py)."""
    cells = []
    for owners, ref in zip(picture["owners"], picture["refs"], strict=True):
        mark = "*" if len(owners) > 1 else (next(iter(owners)) if owners else
                                             ("#" if ref else " "))
        cells.append(f"[{mark}]")
    ruler = "".join(f"{b:>2} " for b in range(len(cells))).rstrip()
    return "".join(cells) + "\n" + ruler


def test_replay_matches_the_seed_write_up():
    steps = seed_steps()
    assert steps[1]["tables"]["A"] == [0, 1, 2]
    assert steps[2]["tables"]["B"] == [3, 4]
    assert steps[3]["tables"]["C"] == [5, 6, 7, 8]
    assert len(steps[3]["free"]) == 11
    assert steps[14]["tables"]["A"] == [0, 1, 2, 9]
    assert steps[14]["free"] == [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 4]
    assert steps[17]["refs"][10:12] == [3, 3]
    for step, picture in SEED_PICTURE_STEPS.items():
        assert render_cells(steps[step]) == picture


def test_fork_cow_replay_copies_for_all_but_the_last_writer():
    steps = fork_cow_steps()
    assert steps[2]["refs"][:2] == [3, 3]
    assert steps[3]["tables"] == {"P": [0, 2], "Q": [0, 3], "R": [0, 1]}
    assert steps[-1]["refs"] == [0] * 12
