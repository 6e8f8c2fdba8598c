"""The memory benchmark's replay (``allocator/memory*.py``, ``bench memory``): slot accounting
against hand-computed values, the real allocator's block counts against the seed's model,
sharing counts by hand and in closed form, bad input, and the CLI end to end."""

import json

import numpy as np
import pytest

from paged_jax.allocator.bench_memory import main as bench_main
from paged_jax.allocator.memory import (
    CATEGORIES,
    ContiguousExact,
    ContiguousMax,
    Paged,
    replay,
)
from paged_jax.allocator.memory_blocks import (
    DeviceBlocks,
    SeedBlocks,
    paged_strategy,
    physical_limit,
)
from paged_jax.allocator.memory_sharing import (
    parallel_sampling_blocks,
    reduction,
    reduction_bound,
    system_prompt_blocks,
)

# The seed's scenario: 20 blocks of 16, prompts A 40, B 24 and C 50. Outputs 10, 4 and 6 make
# the final lengths 50, 28 and 56.
SEED_STREAM = [(40, 10), (24, 4), (50, 6)]
SEED_POOL = 20 * 16


def rows(rep, t):
    return tuple(int(rep.usage[c][t]) for c in CATEGORIES)


def random_stream(seed, count, top):
    rng = np.random.default_rng(seed)
    return [(int(p), int(o)) for p, o in rng.integers(1, top, size=(count, 2))]


def test_seed_scenario_paged_waste_by_hand():
    rep = replay(SEED_STREAM, paged_strategy(SEED_POOL, 16, SEED_STREAM), 3)
    # Step 0: 3 + 2 + 4 blocks hold 114 tokens; the seed's 30 unused slots of 144 split into
    # reserved (A 8, B 4, C 6: written later) and internal (B 32 - 28, C 64 - 56).
    assert rows(rep, 0) == (114, 18, 12, 0, 11 * 16)
    # Step 1: one token each, no block crossed.
    assert rows(rep, 1) == (117, 15, 12, 0, 11 * 16)
    assert rep.waste_percent()["total"] == pytest.approx(100 * (30 + 27 + 24) / (3 * 144))


def test_seed_scenario_contiguous_by_hand():
    cmax = replay(SEED_STREAM, ContiguousMax(SEED_POOL, max_len=100), 2)
    # Three units of 100 and a remainder of 20 that holds none.
    assert rows(cmax, 0) == (114, 10 + 4 + 6, 50 + 72 + 44, 20, 0)
    exact = replay(SEED_STREAM, ContiguousExact(SEED_POOL), 2)
    assert rows(exact, 0) == (114, 20, 0, 0, SEED_POOL - 134)


def test_contiguous_exact_external_fragmentation_by_hand():
    # R0 [0, 22), R1 [22, 72), R2 [72, 94), a hole of 6; R3 needs 45. At step 2 R0 and R2 are
    # done: 50 slots free in holes of 22 and 28, none of which holds R3.
    stream = [(20, 2), (40, 10), (20, 2), (40, 5)]
    rep = replay(stream, ContiguousExact(100), 12)
    assert rows(rep, 0) == (80, 14, 0, 0, 6)
    assert rows(rep, 2) == (42, 8, 0, 50, 0)
    assert rows(rep, 9) == (49, 1, 0, 50, 0)
    assert rep.running.tolist()[9:11] == [1, 1]  # R1 finishes at step 10, R3 starts then
    assert rows(rep, 10) == (40, 5, 0, 0, 55)
    # Paged at slot granularity admits R3 on its prompt alone, at step 2.
    phys = replay(stream, physical_limit(100, stream), 3)
    assert phys.running.tolist() == [3, 3, 2]
    assert rows(phys, 2) == (82, 0, 0, 0, 18)


@pytest.mark.parametrize("seed", [0, 1])
def test_categories_sum_to_pool_every_step(seed):
    stream = random_stream(seed, 60, 120)
    pool = 1000
    made = [ContiguousMax(pool, 250), ContiguousExact(pool), paged_strategy(pool, 16, stream),
            paged_strategy(pool, 8, stream, "seed"), physical_limit(pool, stream)]
    preempted = 0
    for strategy in made:
        rep = replay(stream, strategy, 150)
        total = sum(rep.usage[c] for c in CATEGORIES)
        assert (total == pool).all(), strategy.name
        assert all((rep.usage[c] >= 0).all() for c in CATEGORIES), strategy.name
        preempted += int(rep.preemptions[-1])
    assert preempted > 0  # the preemption path was exercised


def test_every_strategy_sees_the_identical_stream():
    stream = random_stream(2, 50, 100)
    made = [ContiguousMax(800, 200), ContiguousExact(800), paged_strategy(800, 32, stream),
            physical_limit(800, stream)]
    reps = [replay(stream, s, 80) for s in made]
    for rep in reps:
        assert rep.stream == tuple(stream)
        # First come, first served: first admissions are the stream's first requests in order.
        assert rep.admitted == list(range(len(rep.admitted)))
        assert len(rep.admitted) > 3


class Twin:
    """The real allocator and the seed's model side by side: every call goes to both, and
    every answer must agree."""

    def __init__(self, num_blocks, block_size, max_seqs, max_blocks_per_seq):
        self.device = DeviceBlocks(num_blocks, block_size, max_seqs, max_blocks_per_seq)
        self.seed = SeedBlocks(num_blocks, block_size, max_seqs)
        self.block_size, self.num_blocks, self.max_seqs = block_size, num_blocks, max_seqs
        self.checks = 0

    def num_free(self):
        a, b = self.device.num_free(), self.seed.num_free()
        assert a == b
        return a

    def counts(self, slots):
        a, b = self.device.counts(slots), self.seed.counts(slots)
        assert a == b
        self.checks += 1
        return a

    def __getattr__(self, op):
        def both(arg):
            getattr(self.device, op)(arg)
            getattr(self.seed, op)(arg)
        return both


@pytest.mark.parametrize("block_size", [4, 16])
def test_real_allocator_block_counts_equal_the_seed_model(block_size):
    stream = random_stream(3, 40, 90)
    twin = Twin(600 // block_size, block_size, 40, -(-180 // block_size))
    rep = replay(stream, Paged(600, twin), 120)
    assert twin.checks == 120  # every step's per-request counts compared
    assert rep.preemptions[-1] > 0 and rep.completed[-1] > 5
    # And the counts are the blocks the lengths need: ceil(tokens / block_size) each.
    held = twin.seed.requests.values()
    assert all(len(r.block_table) == -(-r.num_tokens // block_size) for r in held)


def test_sharing_counts_by_hand():
    # n = 4, prompt 20, block 16: 2 shared blocks; step 1 copies the partial block for three
    # writers (the last keeps it). Without sharing, 4 x 2 blocks.
    assert parallel_sampling_blocks([(20, 3)], share=True).tolist() == [2, 5, 5]
    assert parallel_sampling_blocks([(20, 3)], share=False).tolist() == [8, 8, 8]
    # A prompt on a block boundary: no copy, each sample's first token opens a block.
    assert parallel_sampling_blocks([(32, 2)], share=True).tolist() == [2, 6]
    # System prompts of 40 (3 blocks, held; 2 whole ones shared); own prompts 20 and 5.
    stream = [(20, 3), (5, 2)]
    shared = system_prompt_blocks(stream, share=True, system_len=40, num_system=2)
    private = system_prompt_blocks(stream, share=False, system_len=40, num_system=2)
    assert shared.tolist() == [6 + 2 + 1, 6 + 2 + 1, 6 + 2]
    assert private.tolist() == [4 + 3, 4 + 3, 4]


def test_sharing_counts_closed_form():
    stream = random_stream(4, 12, 40)
    bs, n, steps = 8, 3, max(o for _, o in stream)
    p = np.array([a for a, _ in stream])
    o = np.array([b for _, b in stream])
    # After step t's releases the requests with o > t run; from step 1 on, each holds its
    # prompt's whole blocks once and n private tails (the copied partial block included).
    expect_shared = [int(np.sum(np.where(o > t, (p // bs) + n * (-(-(p + t) // bs) - p // bs)
                                         if t else -(-p // bs), 0))) for t in range(steps)]
    expect_private = [int(np.sum(np.where(o > t, n * (-(-(p + t) // bs)), 0)))
                      for t in range(steps)]
    assert parallel_sampling_blocks(stream, share=True, block_size=bs, n=n).tolist() == \
        expect_shared
    assert parallel_sampling_blocks(stream, share=False, block_size=bs, n=n).tolist() == \
        expect_private
    sys_len = 20  # 2 whole blocks of 8 shared, 3 held per system prompt
    expect = [3 * 3 + int(np.sum(np.where(o > t, -(-(sys_len + p + t) // bs) - 2, 0)))
              for t in range(steps)]
    got = system_prompt_blocks(stream, share=True, block_size=bs, system_len=sys_len,
                               num_system=3)
    assert got.tolist() == expect


def test_reduction_bound_by_hand_and_on_the_allocator():
    # n = 4, prompt 20, 3 steps holding 20, 21 and 22 tokens per sample: 4 x 63 = 252 slots
    # private; the prompt once (3 x 20) and four tails of 0, 1 and 2: 72 shared.
    assert reduction_bound([(20, 3)], "parallel", n=4) == pytest.approx(100 * (1 - 72 / 252))
    # System prompts of 40, 2 of them, own prompts 20 and 5 for 3 and 2 steps: private
    # (60 + 3 + 3 * 40) + (10 + 1 + 2 * 40) = 274; shared 2 x 40 x 3 + 63 + 11 = 314.
    assert reduction_bound([(20, 3), (5, 2)], "system", system_len=40, num_system=2) == \
        pytest.approx(100 * (1 - 314 / 274))
    # The bound is the allocator's own count with blocks of one token, and no block size
    # saves more.
    stream = random_stream(5, 10, 30)
    for mix, run, kw in (("parallel", parallel_sampling_blocks, {"n": 3}),
                         ("system", system_prompt_blocks, {"system_len": 20, "num_system": 3})):
        at = {bs: reduction(run(stream, share=True, block_size=bs, **kw),
                            run(stream, share=False, block_size=bs, **kw))
              for bs in (1, 8)}
        bound = reduction_bound(stream, mix, **kw)
        assert bound == pytest.approx(at[1]["mean_reduction_percent"])
        assert at[8]["mean_reduction_percent"] <= bound
    with pytest.raises(ValueError, match="mix must be 'parallel' or 'system'. Got 'beam'"):
        reduction_bound(stream, "beam")
    with pytest.raises(ValueError, match="n must be a positive int. Got 0"):
        reduction_bound(stream, "parallel", n=0)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="pool_slots 1000 is smaller than one request's"):
        replay(SEED_STREAM, ContiguousMax(1000, 2048), 5)
    with pytest.raises(ValueError, match="pool_slots 50 is smaller than a request of 56"):
        replay(SEED_STREAM, ContiguousExact(50), 5)
    with pytest.raises(ValueError, match="cannot hold a request of 56 tokens"):
        replay(SEED_STREAM, paged_strategy(48, 16, SEED_STREAM), 5)
    with pytest.raises(ValueError, match="holds no block of block_size 16"):
        paged_strategy(8, 16, SEED_STREAM)
    for bad in (0, -16):
        with pytest.raises(ValueError, match=f"block_size must be a positive int. Got {bad}"):
            paged_strategy(SEED_POOL, bad, SEED_STREAM)
    with pytest.raises(ValueError, match="stream is empty"):
        replay([], ContiguousExact(100), 5)
    with pytest.raises(ValueError, match=r"Request 1 is \(24, 0\)"):
        replay([(40, 10), (24, 0)], ContiguousExact(100), 5)
    with pytest.raises(ValueError, match="steps must be a positive int. Got 0"):
        replay(SEED_STREAM, ContiguousExact(SEED_POOL), 0)
    with pytest.raises(ValueError, match="pool_slots must be a positive int. Got -5"):
        ContiguousExact(-5)


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    # Small enough that the sharing runs reuse the shapes test_sharing_counts_by_hand compiled.
    rc = bench_main(["--synthetic", "30", "--num-requests", "12", "--steps", "25",
                     "--pool-slots", "600", "--max-len", "60", "--system-len", "24",
                     "--block-sizes", "16",
                     "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("contiguous-max", "contiguous-exact", "paged-16", "physical-limit",
                 "system-prompt", "n=4 sampling", "Goals:", "1.65%", "at most"):
        assert name in text
    for png in ("utilization.png", "waste.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    names = [s["strategy"] for s in results["strategies"]]
    assert names == ["contiguous-max", "contiguous-exact", "paged-16", "physical-limit"]
    limit = results["strategies"][-1]
    assert limit["waste_percent"]["total"] == 0.0
    assert [g["goal"].split(" ")[0] for g in results["goals"]] == [
        "paged-16", "paged-16", "system-prompt:", "n=4"]
