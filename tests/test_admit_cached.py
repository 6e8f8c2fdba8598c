"""``admit_cached``, with and without jit, against the pure-Python model allocator.

``ModelAllocator`` has no admit-on-held-blocks op, so ``CachedModel`` adds one in the same
plain style: check each entry, then (all OK only) table, length and one reference per block.
"""

import math
import random

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from tests.allocator_helpers import assert_invariants_hold, assert_matches_model, assert_same_state
from tests.reference_allocator import (
    BAD_BLOCK,
    BAD_LENGTH,
    BAD_SEQ_ID,
    DUPLICATE_SEQ,
    NOT_APPLIED,
    OK,
    SEQ_ACTIVE,
    ModelAllocator,
)

NUM_BLOCKS, BS, MAX_SEQS, M = 20, 16, 8, 6
CFG = pj.CacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, max_seqs=MAX_SEQS,
                     max_blocks_per_seq=M)


class CachedModel(ModelAllocator):
    def admit_cached(self, ids, rows, ns):
        """``rows[i]``: row ``i``'s table, ``-1``-padded to ``max_blocks_per_seq``."""
        codes = self._seq_codes(ids)
        for i, (s, row, n) in enumerate(zip(ids, rows, ns, strict=True)):
            if codes[i] != OK or s == -1:
                continue
            listed = [b for b in row if b != -1]
            holey = row[: len(listed)] != listed
            if s in self.tables:
                codes[i] = SEQ_ACTIVE
            elif holey or any(not 0 <= b < self.n or self.refs[b] == 0 for b in listed):
                codes[i] = BAD_BLOCK
            elif n < 0 or math.ceil(n / self.bs) != len(listed):
                codes[i] = BAD_LENGTH
        codes, ok = self._finish(codes)
        if ok:
            for s, row, n in zip(ids, rows, ns, strict=True):
                if s != -1:
                    self.tables[s] = [b for b in row if b != -1]
                    for b in self.tables[s]:
                        self.refs[b] += 1
                    self.lens[s] = n
        return codes


def arr(xs):
    return jnp.asarray(xs, jnp.int32)


def rows(*tables):
    """Tables as ``[batch, max_blocks_per_seq]`` rows, -1-padded."""
    return [list(t) + [-1] * (M - len(t)) for t in tables]


def cached_pool():
    """Seq 0 prefilled 40 tokens (blocks 0-2) and the cache holds them; seq 0 then finished,
    so blocks 0-2 are held only by the cache. Seq 1 holds 24 tokens (blocks 3-4)."""
    state, model = pj.init_state(CFG), CachedModel(NUM_BLOCKS, BS, MAX_SEQS, M)
    state, st = pj.admit(state, arr([0, 1]), arr([40, 24]))
    st.raise_if_failed()
    model.admit([0, 1], [40, 24])
    state, st = pj.share_blocks(state, arr([0, 1, 2]))
    st.raise_if_failed()
    model.share_blocks([0, 1, 2])
    state, st = pj.release(state, arr([0]))
    st.raise_if_failed()
    model.release([0])
    assert_matches_model(state, model)
    return state, model


class AdmitCachedTest(chex.TestCase):

    def run_op(self, state, model, ids, tables, ns):
        new, st = self.variant(pj.admit_cached)(state, arr(ids), arr(tables), arr(ns))
        want = model.admit_cached(ids, tables, ns)
        assert np.asarray(st.code).tolist() == want
        assert_matches_model(new, model)
        assert_invariants_hold(new)
        if any(c != OK for c in want):
            assert_same_state(new, state)
        return new, st

    @chex.variants(with_jit=True, without_jit=True)
    def test_starts_sequences_on_held_blocks_with_one_reference_each(self):
        state, model = cached_pool()
        # Seq 2 on the whole cached prefix, seq 5 on its first block (partly: 9 tokens),
        # seq 4 on one of seq 1's own blocks, seq 6 on nothing; -1 is padding.
        ids = [2, 5, -1, 4, 6]
        tables = rows([0, 1, 2], [0], [7], [3, 4], [])
        ns = [48, 9, 99, 32, 0]
        new, st = self.run_op(state, model, ids, tables, ns)
        assert bool(st.applied)
        refs = np.asarray(new.ref_counts)
        assert refs[:5].tolist() == [3, 2, 2, 2, 2]  # 0: cache, seqs 2, 5; 3, 4: seqs 1, 4
        assert pj.blocks_of(new, 2) == [0, 1, 2] and int(new.seq_lens[2]) == 48
        assert np.asarray(new.active).tolist() == [False, True, True, False, True, True, True,
                                                  False]
        assert int(new.num_free) == int(state.num_free)  # no block is taken
        # The sequence then grows on fresh blocks; its cached blocks stay shared.
        new, st = pj.append(new, arr([2]), arr([1]))
        model.append([2], [1])
        assert bool(st.applied)
        assert pj.blocks_of(new, 2) == [0, 1, 2, 5]
        assert_matches_model(new, model)

    @chex.variants(with_jit=True, without_jit=True)
    def test_refusals_name_the_entry_and_change_nothing(self):
        state, model = cached_pool()
        cases = [
            ([1], rows([0]), [16], SEQ_ACTIVE),  # seq 1 is running
            ([3], rows([0, 9]), [32], BAD_BLOCK),  # block 9 is free
            ([3], rows([0, NUM_BLOCKS]), [32], BAD_BLOCK),  # out of range
            ([3], rows([0, -7]), [32], BAD_BLOCK),  # a negative id that is not the pad
            ([3], [[0, -1, 1] + [-1] * (M - 3)], [32], BAD_BLOCK),  # a hole
            ([3], [[-1, 0] + [-1] * (M - 2)], [16], BAD_BLOCK),  # not leading
            ([3], rows([0, 1]), [16], BAD_LENGTH),  # 16 tokens fill 1 block, not 2
            ([3], rows([0, 1]), [33], BAD_LENGTH),  # 33 need 3
            ([3], rows([0]), [-1], BAD_LENGTH),
            ([3], rows([]), [1], BAD_LENGTH),
            ([MAX_SEQS], rows([0]), [16], BAD_SEQ_ID),
            ([3, 3], rows([0], [1]), [16, 16], DUPLICATE_SEQ),
        ]
        for ids, tables, ns, code in cases:
            new, st = self.run_op(state, model, ids, tables, ns)
            assert not bool(st.applied)
            assert code in np.asarray(st.code).tolist(), (ids, tables, ns)
        # One bad entry refuses the whole batch; the good one is NOT_APPLIED.
        new, st = self.run_op(state, model, [3, 4], rows([0, 1], [9]), [20, 5])
        assert np.asarray(st.code).tolist() == [NOT_APPLIED, BAD_BLOCK]

    @chex.variants(with_jit=True, without_jit=True)
    def test_random_batches_match_the_model(self):
        rng = random.Random(7)
        state, model = cached_pool()
        op = self.variant(pj.admit_cached)
        for _ in range(25):
            ids = rng.sample(range(-1, MAX_SEQS), 3)
            tables, ns = [], []
            for _ in ids:
                count = rng.randint(0, 3)
                in_use = [b for b in range(NUM_BLOCKS) if model.refs[b] > 0]
                row = [rng.choice(in_use) if rng.random() < 0.9 else rng.randrange(NUM_BLOCKS)
                       for _ in range(count)]
                tables += rows(row)
                ns.append(max(0, BS * count - rng.randint(0, BS - 1)) if rng.random() < 0.85
                          else rng.randint(-1, BS * M))
            new, st = op(state, arr(ids), arr(tables), arr(ns))
            assert np.asarray(st.code).tolist() == model.admit_cached(ids, tables, ns)
            assert_matches_model(new, model)
            assert_invariants_hold(new)
            if not bool(st.applied):
                assert_same_state(new, state)
            state = new
            live = [s for s in range(MAX_SEQS) if s in model.tables and s != 1]
            if live and rng.random() < 0.5:  # release one, so slots and blocks come back
                s = rng.choice(live)
                state, st = pj.release(state, arr([s]))
                model.release([s])
                assert_matches_model(state, model)


def test_bad_shapes_are_refused_before_tracing():
    state, _ = cached_pool()
    with pytest.raises(ValueError, match=r"block_ids must be a \[batch, max_blocks_per_seq\]"):
        pj.admit_cached(state, arr([3]), arr([[0, 1]]), arr([20]))
    with pytest.raises(ValueError, match="block_ids"):
        pj.admit_cached(state, arr([3]), jnp.zeros((1, M), jnp.float32), arr([20]))
    with pytest.raises(ValueError, match="num_tokens"):
        pj.admit_cached(state, arr([3]), arr(rows([0])), arr([1, 2]))


def test_a_length_that_does_not_match_its_blocks_says_what_would_match():
    state, _ = cached_pool()
    _, st = pj.admit_cached(state, arr([3]), arr(rows([0, 1])), arr([10]))
    with pytest.raises(ValueError, match="admit_cached failed") as err:
        st.raise_if_failed()
    # Two listed blocks of 16 hold 17 to 32 tokens; 10 is outside that.
    assert "10" in str(err.value) and "17" in str(err.value) and "32" in str(err.value)
