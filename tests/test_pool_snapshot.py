"""``PoolSnapshot``'s block arithmetic against hand-counted pools, and ``take`` against the
engine's device state.

The pool below has block size 4. Slot 0 holds 10 tokens in blocks [5, 6, 7]; slot 1 is its
fork, sharing 5 and 6 and 9 tokens; its own partial block is 8. The prefix cache holds block
5 (a full block of tokens 0..3) and block 2, which no table references.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.engine.pool_snapshot import PoolSnapshot
from paged_jax.engine.prefix_cache import ROOT, PrefixCache
from paged_jax.engine.scheduler import Sequence

BS = 4
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 8]


def seq(slot, cached, target=PROMPT, index=0):
    s = Sequence(request_id="r", index=index, arrival=0, prompt_ids=list(target), max_tokens=8)
    s.slot, s.cached = slot, cached
    return s


def snapshot(prefix_caching=True) -> PoolSnapshot:
    cache = PrefixCache(BS)
    h, _ = cache.insert(ROOT, PROMPT[:4], 5)
    cache.insert(h, PROMPT[4:8], 2)
    ref = np.zeros(12, np.int32)
    held = np.zeros(12, bool)
    ref[[5, 6]] = 2  # both slots
    ref[5] += 1  # and the prefix cache
    held[[5, 2]] = True
    ref[2] = 1  # the cache alone: evictable
    ref[[7, 8]] = 1
    tables = np.full((2, 4), -1, np.int32)
    tables[0, :3] = [5, 6, 7]
    tables[1, :3] = [5, 6, 8]
    return PoolSnapshot(BS, cache if prefix_caching else None, ref, held, tables,
                        num_free=3, evictable={2})


def test_free_counts_the_free_list_and_the_evictable_cached_blocks():
    assert snapshot().free() == 3 + 1


@pytest.mark.parametrize("slot, cached, steps, want", [
    (0, 10, 2, 0),  # positions 10, 11: the partial block 7 has room, and only slot 0 has it
    (0, 10, 3, 1),  # position 12 starts a block
    (0, 8, 1, 1),  # position 8 starts a block (8 // 4 = 2 blocks full)
    (1, 9, 3, 0),  # 9..11 in its own block 8
    (0, 6, 1, 1),  # position 6 lies in block 6, shared with slot 1: a copy on write
    (0, 6, 7, 3),  # the copy, then blocks for positions 8..11 and 12
])
def test_decode_need_counts_new_blocks_and_a_copy_of_a_shared_partial_block(slot, cached,
                                                                           steps, want):
    assert snapshot().decode_need(seq(slot, cached), steps) == want


def test_held_alone_counts_blocks_only_this_table_references_and_sees_earlier_releases():
    snap = snapshot()
    # Slot 0: 7 is its own; 5 is also slot 1's (and the cache's); 6 is also slot 1's.
    assert snap.held_alone(seq(0, 10)) == 1
    assert snap.ref[[5, 6, 7]].tolist() == [2, 1, 0]
    # Slot 1 after slot 0's release: 8 is its own, 6 is now too, and 5 is left to the
    # cache (evictable).
    assert snap.held_alone(seq(1, 9)) == 3


def test_lookup_records_the_hit_and_prefill_need_counts_its_evictable_blocks():
    snap = snapshot()
    queued = seq(None, 0, target=PROMPT + [9])  # 10 tokens: two whole blocks before the last
    assert snap.lookup(queued) == 8
    assert snap.hits[id(queued)] == [5, 2]
    assert snap.lookups[id(queued)].hit_tokens == 8
    queued.cached = 8
    # Block 2 of its hit is evictable: taking it off the free count costs one, plus one
    # new block for tokens 8..9.
    assert snap.prefill_need(queued, 10) == 1 + 1
    # A running sequence's chunk costs only its new blocks.
    assert snap.prefill_need(seq(0, 10), 17) == 2


def test_without_prefix_caching_lookup_finds_nothing():
    snap = snapshot(prefix_caching=False)
    queued = seq(None, 0, target=PROMPT + [9])
    assert snap.lookup(queued) == 0 and not snap.hits and not snap.lookups


def test_take_copies_the_engine_state_and_the_evictable_cached_blocks():
    from paged_jax.engine.llm import LLM
    from paged_jax.engine.params import SamplingParams

    llm = LLM("tiny", block_size=4, num_blocks=32, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=32)
    llm.generate([list(range(1, 14))], SamplingParams(temperature=0.0, max_tokens=3),
                 use_tqdm=False)
    eng = llm.engine
    snap = PoolSnapshot.take(eng.state, eng.prefix_cache, 4)
    st = eng.state
    assert (snap.ref == np.asarray(st.ref_counts)).all()
    assert (snap.held == np.asarray(st.held)).all()
    assert (snap.tables == np.asarray(st.block_tables)).all()
    assert snap.num_free == int(st.num_free)
    cached = eng.prefix_cache.blocks()
    assert len(cached) == 3  # 15 tokens in cache: three full blocks
    assert snap.evictable == set(cached)  # the request is done: the cache holds them alone
    assert snap.free() == 32
    snap.ref[:] = -1  # a copy: the device state is untouched
    assert int(np.asarray(eng.state.ref_counts).min()) >= 0
