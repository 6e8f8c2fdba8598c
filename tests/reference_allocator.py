"""A pure-Python model of the allocator's specification, written independently of the JAX ops.

One object per slot and per block, plain lists and a deque: the obvious, slow version of
every op. Tests drive it side by side with the JAX ops and compare everything.
"""

from __future__ import annotations

import collections
import math

OK, BAD_SEQ_ID, DUPLICATE_SEQ, SEQ_ACTIVE, SEQ_INACTIVE = 0, 1, 2, 3, 4
BAD_LENGTH, BAD_POSITION, OUT_OF_BLOCKS, NOT_APPLIED, BAD_BLOCK = 5, 6, 7, 8, 9
BAD_NUM_BLOCKS = 12


class ModelAllocator:
    def __init__(self, num_blocks, block_size, max_seqs, max_blocks_per_seq):
        self.n, self.bs = num_blocks, block_size
        self.max_seqs, self.m = max_seqs, max_blocks_per_seq
        self.free = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.held = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}  # active slot -> block ids
        self.lens: dict[int, int] = {}

    # ---- helpers
    def _blocks(self, length):
        return math.ceil(length / self.bs)

    def _seq_codes(self, ids, unique=True):
        codes = []
        for _i, s in enumerate(ids):
            if s == -1:
                codes.append(OK)
            elif not 0 <= s < self.max_seqs:
                codes.append(BAD_SEQ_ID)
            elif unique and ids.count(s) > 1:
                codes.append(DUPLICATE_SEQ)
            else:
                codes.append(OK)
        return codes

    def _pool(self, codes, needs):
        total = 0
        for i, need in enumerate(needs):
            if codes[i] == OK:
                total += need
                if need > 0 and total > len(self.free):
                    codes[i] = OUT_OF_BLOCKS
        return codes

    @staticmethod
    def _finish(codes):
        if all(c == OK for c in codes):
            return codes, True
        return [NOT_APPLIED if c == OK else c for c in codes], False

    def _take(self):
        b = self.free.popleft()
        self.refs[b] = 1
        return b

    def _decref(self, block, held=False):
        self.refs[block] -= 1
        if held:
            self.held[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    # ---- ops (each returns the per-entry codes; state changes only if all are OK)
    def admit(self, ids, ns):
        codes = self._seq_codes(ids)
        needs = []
        for i, (s, n) in enumerate(zip(ids, ns, strict=True)):
            if codes[i] == OK and s != -1:
                if s in self.tables:
                    codes[i] = SEQ_ACTIVE
                elif n < 0 or n > self.m * self.bs:
                    codes[i] = BAD_LENGTH
            needs.append(self._blocks(n) if codes[i] == OK and s != -1 else 0)
        codes, ok = self._finish(self._pool(codes, needs))
        if ok:
            for s, n, need in zip(ids, ns, needs, strict=True):
                if s != -1:
                    self.tables[s] = [self._take() for _ in range(need)]
                    self.lens[s] = n
        return codes

    def append(self, ids, ns, unique=True):
        codes = self._seq_codes(ids, unique)
        needs = []
        for i, (s, n) in enumerate(zip(ids, ns, strict=True)):
            need = 0
            if codes[i] == OK and s != -1:
                if s not in self.tables:
                    codes[i] = SEQ_INACTIVE
                elif n < 0 or self.lens[s] + n > self.m * self.bs:
                    codes[i] = BAD_LENGTH
                else:
                    need = self._blocks(self.lens[s] + n) - len(self.tables[s])
            needs.append(need)
        codes, ok = self._finish(self._pool(codes, needs))
        if ok:
            for s, n, need in zip(ids, ns, needs, strict=True):
                if s != -1:
                    self.tables[s] += [self._take() for _ in range(need)]
                    self.lens[s] += n
        return codes

    def release(self, ids):
        codes = self._seq_codes(ids)
        for i, s in enumerate(ids):
            if codes[i] == OK and s != -1 and s not in self.tables:
                codes[i] = SEQ_INACTIVE
        codes, ok = self._finish(codes)
        if ok:
            for s in ids:
                if s != -1:
                    for b in self.tables.pop(s):
                        self._decref(b)
                    del self.lens[s]
        return codes

    def share(self, srcs, dsts, ks=None):
        """fork when ks is None, else share_prefix."""
        codes = self._seq_codes(dsts)
        src_codes = self._seq_codes(srcs, unique=False)
        codes = [c if c != OK else sc for c, sc in zip(codes, src_codes, strict=True)]
        for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            if codes[i] == OK and (s == -1) != (d == -1):
                codes[i] = BAD_SEQ_ID
        plan = []
        for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            if codes[i] != OK or s == -1:
                plan.append(None)
                continue
            if s not in self.tables:
                codes[i] = SEQ_INACTIVE
            elif d in self.tables:
                codes[i] = SEQ_ACTIVE
            else:
                have = len(self.tables[s])
                k = have if ks is None else ks[i]
                if k < 0 or k > have:
                    codes[i] = BAD_NUM_BLOCKS
                else:
                    plan.append((s, d, k))
                    continue
            plan.append(None)
        codes, ok = self._finish(codes)
        if ok:
            for p in plan:
                if p is not None:
                    s, d, k = p
                    blocks = self.tables[s][:k]
                    for b in blocks:
                        self.refs[b] += 1
                    self.tables[d] = list(blocks)
                    self.lens[d] = min(k * self.bs, self.lens[s])
        return codes

    def move(self, srcs, dsts):
        """move_slots: dst takes src's table and length; a source nobody moves into empties."""
        codes = self._seq_codes(dsts)
        src_codes = self._seq_codes(srcs)
        codes = [c if c != OK else sc for c, sc in zip(codes, src_codes, strict=True)]
        for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            if codes[i] == OK and (s == -1) != (d == -1):
                codes[i] = BAD_SEQ_ID
        leaving = {s for i, s in enumerate(srcs) if codes[i] == OK and s != -1}
        for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            if codes[i] != OK or s == -1:
                continue
            if s not in self.tables:
                codes[i] = SEQ_INACTIVE
            elif d in self.tables and d not in leaving:
                codes[i] = SEQ_ACTIVE
        codes, ok = self._finish(codes)
        if ok:
            rows = {s: (self.tables.pop(s), self.lens.pop(s)) for s in srcs if s != -1}
            for s, d in zip(srcs, dsts, strict=True):
                if s != -1:
                    self.tables[d], self.lens[d] = rows[s]
        return codes

    def copy_on_write(self, ids, positions):
        codes = self._seq_codes(ids)
        targets = []
        for i, (s, p) in enumerate(zip(ids, positions, strict=True)):
            if codes[i] == OK and s != -1:
                if s not in self.tables:
                    codes[i] = SEQ_INACTIVE
                elif p < 0 or p // self.bs >= len(self.tables[s]):
                    codes[i] = BAD_POSITION
                else:
                    targets.append((i, s, p // self.bs, self.tables[s][p // self.bs]))
        # The last of all holders writing in this batch keeps the block.
        copies = []
        for i, s, col, block in targets:
            earlier = sum(1 for j, _, _, b in targets if b == block and j < i)
            if earlier != self.refs[block] - 1:
                copies.append((i, s, col, block))
        needs = [0] * len(ids)
        for i, *_ in copies:
            needs[i] = 1
        codes, ok = self._finish(self._pool(codes, needs))
        src, dst = [-1] * len(ids), [-1] * len(ids)
        if ok:
            for i, s, col, block in copies:
                fresh = self._take()
                self.refs[block] -= 1
                self.tables[s][col] = fresh
                src[i], dst[i] = block, fresh
        return codes, src, dst

    def slot(self, s, p):
        if not 0 <= s < self.max_seqs or s not in self.tables or not 0 <= p < self.lens[s]:
            return -1
        return self.tables[s][p // self.bs] * self.bs + p % self.bs

    def allocate(self, count):
        codes = self._pool([OK] * count, [1] * count)
        codes, ok = self._finish(codes)
        blocks = [-1] * count
        if ok:
            blocks = [self._take() for _ in range(count)]
            for b in blocks:
                self.held[b] += 1
        return codes, blocks

    def share_blocks(self, blocks):
        # -1 is padding: no error, no effect.
        codes = [OK if b == -1 or (0 <= b < self.n and self.refs[b] > 0) else BAD_BLOCK
                 for b in blocks]
        codes, ok = self._finish(codes)
        if ok:
            for b in (b for b in blocks if b != -1):
                self.refs[b] += 1
                self.held[b] += 1
        return codes

    def free_blocks(self, blocks):
        codes = [
            OK if b == -1 or (0 <= b < self.n and blocks.count(b) <= self.held[b]) else BAD_BLOCK
            for b in blocks
        ]
        codes, ok = self._finish(codes)
        if ok:
            for b in (b for b in blocks if b != -1):
                self._decref(b, held=True)
        return codes
