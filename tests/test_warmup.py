"""``warm_up``: the prefill shapes it compiles are every shape the scheduler can dispatch
(against a brute-force enumeration of what an iteration's chunks can be), and after it a
serving run with requests arriving at random compiles nothing; it warns before compiling
more than the kernel's memory-mapping limit allows."""

from __future__ import annotations

import contextlib
import mmap
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax.engine import warmup
from paged_jax.engine.buckets import pow2_at_least
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.steps import Steps
from paged_jax.engine.warmup import MappingWatch, mappings, packed_widths, prefill_shapes, warm_up
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


class Readings:
    """A fake ``mappings()``: the given readings in turn, counting the calls."""

    def __init__(self, *readings):
        self.readings, self.calls = list(readings), 0

    def __call__(self):
        self.calls += 1
        return self.readings.pop(0)


def test_mapping_watch_projects_the_first_compilation():
    # 5 compilations; the first adds 1,000 to 2,000 held: 2,000 + 4 x 1,000 = 6,000.
    read = Readings((1000, 5000), (2000, 5000))
    watch = MappingWatch(5, read=read)
    with pytest.warns(RuntimeWarning, match=r"compiles 5 executables; the first added 1000 "
                      r"memory mappings, so all of them would hold about 6000 against this "
                      r"kernel's vm.max_map_count of 5000") as caught:
        for _ in range(5):
            with watch:
                pass
    assert len(caught) == 1 and read.calls == 2  # only the first one is read
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch = MappingWatch(5, read=Readings((1000, 6000), (2000, 6000)))
        for _ in range(5):  # 6,000 fits a limit of 6,000
            with watch:
                pass
        off = Readings()
        watch = MappingWatch(5, enabled=False, read=off)  # another backend: nothing read
        for _ in range(5):
            with watch:
                pass
        assert off.calls == 0
        read = Readings((1000, 10), (3000, 10))
        with pytest.raises(RuntimeError, match="compile failed"):  # its error, no warning
            with MappingWatch(5, read=read):
                raise RuntimeError("compile failed")
        assert read.calls == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_mappings_counts_new_mappings():
    held, limit = mappings()
    # Neighbours with different protections cannot merge into one mapping.
    maps = [mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE * (i % 2)))
            for i in range(64)]
    try:
        now, same = mappings()
    finally:
        for m in maps:
            m.close()
    assert same == limit == int(open("/proc/sys/vm/max_map_count").read())
    assert now - held >= 32


def test_after_warm_up_serving_compiles_nothing(monkeypatch):
    model = init_model(TINY, seed=5)
    engine = LLMEngine(model, steps=Steps(nnx.split(model)[0]), block_size=16, num_blocks=96,
                       max_num_seqs=4, max_model_len=160, max_num_batched_tokens=64,
                       steps_per_dispatch=4, eos_token_id=None, decode_with_prefill=True)
    shapes = prefill_shapes(4, 64)
    one_row = [width for rows, width in shapes if rows == 1]  # beside a decode step ...
    assert one_row == [16, 32, 64]
    decode_rows = [1, 2, 4]  # ... of each row count (decode_rows_for: powers of two)
    assert sorted({engine.decode_rows_for(slot) for slot in range(4)}) == decode_rows
    compiled = (len(shapes) + len(packed_widths(64)) + len(one_row) * len(decode_rows)
                + len({1, 4}) * len(decode_rows))  # decode dispatches of 1 and 4 steps
    # A limit the first compilation's mappings, times them all, would pass.
    monkeypatch.setattr(warmup, "mappings", Readings((100, 1000), (400, 1000)))
    with (pytest.warns(RuntimeWarning, match=f"compiles {compiled} executables; the first "
                       f"added 300 .* about {400 + 300 * (compiled - 1)} against")
          if jax.default_backend() == "cpu" else contextlib.nullcontext()):  # XLA:CPU's alone
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
    ops = ("prefill", "decode_steps", "release", "fork", "admit_cached", "move_slots")
    assert not [c for c in compiled if any(op in c for op in ops)], compiled
    assert engine.stats().finished == 40
