"""A serving benchmark's workload and its figures, the way ``vllm bench serve`` computes them.

A workload is a list of ``Request``s (prompt token ids, the number of tokens to generate and
an arrival offset in seconds). ``poisson_arrivals`` spaces requests by a Poisson process of
a given rate (``inf``: all at once). Whatever serves the workload records, per request, a
``Timing``: when it arrived, when each new token reached the client, when it finished.
``summarize`` turns those into vLLM's figures:

* request, output-token and total-token throughput over the run's duration (first arrival to
  last finish);
* TTFT, from arrival to the first token;
* TPOT, ``(e2e - ttft) / (output tokens - 1)`` per request;
* ITL, the gaps between successive deliveries to the client. Tokens that arrive together
  (one multi-step dispatch brings K to the host at once) are one delivery, as a streamed
  response carries them in one chunk, so a gap is what a reader of the stream waits;
* end-to-end latency, from arrival to the last token;
* peak concurrency: the most requests in flight (arrived, not finished) at once.

Each latency is given as mean, median, p90 and p99, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a workload: ``prompt`` token ids, ``output_len`` tokens to generate
    (EOS ignored), ``arrival`` seconds after the run starts."""

    prompt: tuple[int, ...]
    output_len: int
    arrival: float = 0.0


@dataclasses.dataclass
class Timing:
    """What a client saw of one request, in ``time.perf_counter`` seconds: ``arrival``;
    ``token_times``, when each generated token reached it (equal times: one delivery);
    ``finish``, when the response ended; ``tokens``, the generated ids (to compare servers)."""

    arrival: float
    token_times: list[float]
    finish: float
    prompt_len: int
    tokens: list[int] | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        deliveries = sorted(set(self.token_times))
        return [b - a for a, b in zip(deliveries, deliveries[1:], strict=False)]


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """``num`` arrival offsets (seconds, nondecreasing, the first at 0): exponential gaps of
    mean ``1 / rate``, as vLLM's benchmark draws them; ``rate=inf`` sends all at 0."""
    if not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be a positive int, got {num!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """The most ``(start, end)`` intervals open at one instant (an interval ending when
    another starts does not overlap it)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    peak = live = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()),
            **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def summarize(timings: list[Timing]) -> dict:
    """vLLM's serving figures for the ``timings`` of one run (see the module docstring);
    latency stats are in ms, keyed ``mean``, ``p50`` (the median), ``p90``, ``p99``."""
    if not timings:
        raise ValueError("summarize needs at least one finished request")
    start = min(t.arrival for t in timings)
    duration = max(t.finish for t in timings) - start
    output = sum(len(t.token_times) for t in timings)
    prompt = sum(t.prompt_len for t in timings)
    return {
        "completed": len(timings),
        "duration_s": duration,
        "request_throughput": len(timings) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "output_tokens": output,
        "prompt_tokens": prompt,
        "ttft_ms": _stats_ms([t.ttft for t in timings]),
        "tpot_ms": _stats_ms([t.tpot for t in timings if t.tpot is not None]),
        "itl_ms": _stats_ms([gap for t in timings for gap in t.itl]),
        "e2e_ms": _stats_ms([t.e2e for t in timings]),
        "peak_concurrency": peak_concurrency([(t.arrival, t.finish) for t in timings]),
    }


def matmul_flops(config, requests: list[Request]) -> float:
    """The fewest matmul FLOPs a server spends on ``requests`` when it computes every prompt
    token (no prefix reuse) and generates each reply to its length: every prompt token, and
    every generated token but each request's last, passes through every layer's projections
    (q, k, v, o, gate, up, down), and each generated token comes out of one vocabulary
    projection. Attention, norms and the rest are left out, so it is a lower bound.
    ``config``: a ``ModelConfig`` (hidden, intermediate, heads, head_dim, layers, vocab)."""
    e, d = config.hidden_size, config.head_dim
    per_layer = (e * d * 2 * (config.num_heads + config.num_kv_heads)
                 + 3 * e * config.intermediate_size)
    prompt = sum(len(r.prompt) for r in requests)
    output = sum(r.output_len for r in requests)
    through_layers = prompt + output - len(requests)
    return 2.0 * (through_layers * per_layer * config.num_layers
                  + output * config.vocab_size * e)


def throughput_bound(requests: list[Request], flops: float, flops_per_s: float) -> float:
    """The most output tokens/s any server can reach on ``requests`` on a machine that
    computes at most ``flops_per_s``: a run lasts at least as long as its ``flops`` take at
    that rate, and at least from the first arrival to the last."""
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s must be > 0, got {flops_per_s!r}")
    arrivals = [r.arrival for r in requests]
    seconds = max(flops / flops_per_s, max(arrivals) - min(arrivals))
    return sum(r.output_len for r in requests) / seconds
