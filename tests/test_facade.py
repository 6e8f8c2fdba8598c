"""The seed-compatible eager facade: the seed's own code runs on it, and errors lose nothing."""

import pytest

import paged_jax as pj
from paged_jax.allocator import seed_reference
from tests.allocator_helpers import assert_invariants_hold, assert_same_state


def test_seed_scenario_block_tables():
    allocator = pj.BlockAllocator(num_blocks=20, block_size=16)
    req_a = pj.RequestState(request_id="A", prompt_len=40, allocator=allocator)
    assert req_a.block_table == [0, 1, 2] and allocator.num_free == 17
    req_b = pj.RequestState(request_id="B", prompt_len=24, allocator=allocator)
    assert req_b.block_table == [3, 4] and allocator.num_free == 15
    req_c = pj.RequestState(request_id="C", prompt_len=50, allocator=allocator)
    assert req_c.block_table == [5, 6, 7, 8] and allocator.num_free == 11
    for _ in range(10):
        req_a.append_token()
    assert req_a.block_table == [0, 1, 2, 9] and req_a.num_tokens == 50
    req_b.release()
    assert req_b.block_table == [] and allocator.free_blocks[-2:] == [3, 4]
    assert_invariants_hold(allocator.state)


def test_append_token_matches_seed_block_growth():
    """Block-table sizes follow the seed's own append_token for every step."""
    ours = pj.BlockAllocator(num_blocks=64, block_size=8)
    seed = seed_reference.BlockAllocator(num_blocks=64, block_size=8)
    mine = pj.RequestState("X", 5, ours)
    theirs = seed_reference.RequestState("X", 5, seed)
    for _ in range(40):
        mine.append_token()
        theirs.append_token()
        assert len(mine.block_table) == len(theirs.block_table)
        assert mine.num_tokens == theirs.num_tokens
        assert ours.num_free == seed.num_free


def test_share_and_free_counts():
    allocator = pj.BlockAllocator(num_blocks=8, block_size=16)
    blocks = [allocator.allocate(), allocator.allocate()]
    assert blocks == [0, 1]
    for b in blocks:
        allocator.share(b)
        allocator.share(b)
    assert allocator.ref_counts[:2] == [3, 3]
    for _ in range(3):
        allocator.free(0)
    assert allocator.ref_counts[0] == 0 and allocator.free_blocks[-1] == 0
    assert_invariants_hold(allocator.state)


def test_out_of_blocks_raises_and_changes_nothing():
    allocator = pj.BlockAllocator(num_blocks=4, block_size=16)
    pj.RequestState("A", 40, allocator)
    before = allocator.state
    with pytest.raises(pj.OutOfBlocksError, match="Out of KV cache blocks: requested 2, free 1"):
        pj.RequestState("B", 17, allocator)
    assert_same_state(allocator.state, before)
    assert isinstance(pj.OutOfBlocksError(1, 0), RuntimeError)
    allocator.allocate()
    with pytest.raises(RuntimeError, match="Out of KV cache blocks: requested 1, free 0"):
        allocator.allocate()


def test_append_token_out_of_blocks_keeps_length():
    allocator = pj.BlockAllocator(num_blocks=2, block_size=4)
    req = pj.RequestState("A", 4, allocator)
    pj.RequestState("B", 3, allocator)
    with pytest.raises(pj.OutOfBlocksError):
        req.append_token()
    assert req.num_tokens == 4 and req.block_table == [0]


def test_misuse_raises_value_error():
    allocator = pj.BlockAllocator(num_blocks=4, block_size=16)
    req = pj.RequestState("A", 20, allocator)
    before = allocator.state
    with pytest.raises(ValueError, match=r"block 3 \(entry 0\) is not a block with an outstanding"):
        allocator.free(3)  # a free block
    with pytest.raises(ValueError, match="block 0 .*outstanding"):
        allocator.free(0)  # owned by A's table, not by a loose reference
    with pytest.raises(ValueError, match="block 2 .*outstanding"):
        allocator.share(2)  # sharing a free block
    with pytest.raises(ValueError, match="block_id 7 is out of range; expected 0 <= id < 4"):
        allocator.free(7)
    with pytest.raises(ValueError, match="prompt_len must be >= 0. Got -3"):
        pj.RequestState("B", -3, allocator)
    assert_same_state(allocator.state, before)
    req.release()
    with pytest.raises(ValueError, match="release: request 'A' was already released"):
        req.release()
    with pytest.raises(ValueError, match="append_token: request 'A' was already released"):
        req.append_token()
