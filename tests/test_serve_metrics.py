"""The serving figures against hand-computed values, and the Poisson arrivals against their
distribution."""

import math

import numpy as np
import pytest

from paged_jax.engine.serve_metrics import (
    Timing,
    peak_concurrency,
    poisson_arrivals,
    summarize,
)


def test_one_request_by_hand():
    # Arrives at 10, first token at 10.5; tokens 2-4 arrive together (one dispatch) at 11,
    # the fifth at 11.25; the response ends at 11.5.
    t = Timing(10.0, [10.5, 11.0, 11.0, 11.0, 11.25], 11.5, prompt_len=7)
    assert t.ttft == 0.5
    assert t.e2e == 1.5
    assert t.tpot == pytest.approx((1.5 - 0.5) / 4)
    assert t.itl == [0.5, 0.25]  # three deliveries after the first, not five tokens


def test_summarize_by_hand():
    a = Timing(0.0, [1.0, 2.0, 3.0], 3.0, prompt_len=10)  # ttft 1, itl 1, 1
    b = Timing(1.0, [1.5, 1.5, 4.0, 5.0], 5.0, prompt_len=6)  # ttft .5, itl 2.5, 1
    s = summarize([a, b])
    assert s["completed"] == 2
    assert s["duration_s"] == 5.0
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(7 / 5)
    assert s["total_token_throughput"] == pytest.approx((7 + 16) / 5)
    assert s["ttft_ms"]["mean"] == pytest.approx(750)
    assert s["ttft_ms"]["p50"] == pytest.approx(750)
    # TPOT: a (3 - 1) / 2 = 1 s; b (4 - 0.5) / 3.
    assert s["tpot_ms"]["mean"] == pytest.approx(1e3 * (1 + 3.5 / 3) / 2)
    # ITL gaps: a 1, 1; b 2.5, 1 (its first two tokens are one delivery).
    assert s["itl_ms"]["p50"] == pytest.approx(1000)
    assert s["itl_ms"]["p99"] == pytest.approx(1e3 * (1.0 + 0.97 * 1.5))  # linear, as numpy
    assert s["e2e_ms"]["p90"] == pytest.approx(1e3 * (3 + 0.9 * 1))
    assert s["peak_concurrency"] == 2
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


def test_peak_concurrency():
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # touching, not overlapping
    assert peak_concurrency([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3
    assert peak_concurrency([(0, 5)] * 4) == 4


def test_poisson_arrivals():
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    t = np.asarray(poisson_arrivals(20_001, 4.0, seed=3))
    assert t[0] == 0 and (np.diff(t) >= 0).all()
    gaps = np.diff(t)
    # Exponential with mean 1/4: mean and standard deviation both 0.25, P(gap > 0.5) = e^-2.
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.03)
    assert (gaps > 0.5).mean() == pytest.approx(math.exp(-2), abs=0.01)
    assert poisson_arrivals(5, 2.0, seed=1) == poisson_arrivals(5, 2.0, seed=1)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(3, bad)
    with pytest.raises(ValueError, match="num"):
        poisson_arrivals(0, 1.0)
