"""``warm_up``: the prefill shapes it compiles are every shape the scheduler can dispatch
(against a brute-force enumeration of what an iteration's chunks can be), and after it a
serving run with requests arriving at random compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from paged_jax.engine.buckets import pow2_at_least
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.steps import Steps
from paged_jax.engine.warmup import packed_widths, prefill_shapes, warm_up
from paged_jax.model import init_model
from tests.compile_log import logged_compiles
from tests.model_helpers import TINY


def _pow2(n: int, low: int, high: int) -> int:
    p = low
    while p < n:
        p *= 2
    return min(p, high)


@pytest.mark.parametrize("low, high", [(1, 1), (1, 16), (16, 256), (8, 1 << 20)])
def test_pow2_at_least_is_the_doubling_loop(low, high):
    assert [pow2_at_least(n, low, high) for n in range(1, 600)] == [
        _pow2(n, low, high) for n in range(1, 600)]


def brute_force_shapes(max_seqs: int, budget: int, by_width: bool) -> set[tuple[int, int]]:
    """Every dispatch shape of every possible iteration: up to ``max_seqs`` chunks of 1.. tokens
    summing to at most ``budget``, grouped as the engine groups them."""
    def iterations(lens, low, left):  # non-decreasing chunk lengths, sum <= budget
        if lens:
            yield lens
        if len(lens) < max_seqs:
            for n in range(low, left + 1):
                yield from iterations(lens + (n,), n, left - n)

    shapes = set()
    for lens in iterations((), 1, budget):
        widths = [_pow2(n, 16, budget) for n in lens]
        if not by_width:
            widths = [max(widths)] * len(lens)
        for w in set(widths):
            shapes.add((_pow2(widths.count(w), 1, max_seqs), w))
    return shapes


def test_prefill_shapes_are_every_shape_an_iteration_can_dispatch():
    for max_seqs, budget in ((4, 64), (3, 32), (8, 32), (16, 32)):
        for by_width in (True, False):
            want = brute_force_shapes(max_seqs, budget, by_width)
            assert set(prefill_shapes(max_seqs, budget, by_width)) == want, (max_seqs, budget)


def test_after_warm_up_serving_compiles_nothing():
    model = init_model(TINY, seed=5)
    engine = LLMEngine(model, steps=Steps(nnx.split(model)[0]), block_size=16, num_blocks=96,
                       max_num_seqs=4, max_model_len=160, max_num_batched_tokens=64,
                       steps_per_dispatch=4, eos_token_id=None, decode_with_prefill=True)
    shapes = prefill_shapes(4, 64)
    one_row = [width for rows, width in shapes if rows == 1]  # beside a decode step ...
    assert one_row == [16, 32, 64]
    decode_rows = [1, 2, 4]  # ... of each row count (decode_rows_for: powers of two)
    assert sorted({engine.decode_rows_for(slot) for slot in range(4)}) == decode_rows
    assert warm_up(engine, progress=False) == (len(shapes) + len(packed_widths(64))
                                               + len(one_row) * len(decode_rows))
    engine.check()  # padding rows changed nothing
    assert int(engine.state.num_free) == 96 and not np.asarray(engine.state.ref_counts).any()
    rng = np.random.default_rng(0)
    with logged_compiles() as logged:
        for i in range(40):  # arrivals between random steps, prompts of 1..120 tokens
            n = int(np.exp(rng.uniform(0, np.log(120))))
            engine.add_request(str(i), rng.integers(0, TINY.vocab_size, n).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=int(
                                   rng.integers(1, 20))))
            for _ in range(int(rng.integers(0, 3))):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    compiled = [m.split(" with ")[0] for m in logged]
    assert not [c for c in compiled if "prefill" in c or "decode_steps" in c], compiled
    assert engine.stats().finished == 40
