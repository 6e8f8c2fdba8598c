"""``/metrics``: the engine in Prometheus' text format, in vLLM's metric names.

Each name is vLLM's with the ``paged_jax:`` prefix in place of ``vllm:``, so a dashboard built
for vLLM maps over by renaming the prefix:

=============================================  ========================================
``paged_jax:num_requests_running``             sequences in the running batch
``paged_jax:num_requests_waiting``             sequences queued (new or preempted)
``paged_jax:kv_cache_usage_perc``              blocks in use / blocks (0..1); blocks only
                                               the prefix cache holds count as in use
``paged_jax:kv_cache_token_usage_perc``        tokens held / token slots (0..1); the gap to
                                               block usage is the unfilled ends of blocks
                                               (no vLLM counterpart)
``paged_jax:kv_cache_blocks``                  blocks by ``state``: used, free, cached
``paged_jax:prefix_cache_queries_total``       prompt tokens looked up in the prefix cache
``paged_jax:prefix_cache_hits_total``          of them, tokens found
``paged_jax:num_preemptions_total``            preemptions (by recompute)
``paged_jax:request_success_total``            finished requests by ``finished_reason``
``paged_jax:prompt_tokens_total``              prompt tokens of finished requests
``paged_jax:generation_tokens_total``          tokens they generated
``paged_jax:time_to_first_token_seconds``      histogram, arrival to first token
``paged_jax:inter_token_latency_seconds``      histogram, gaps between deliveries (one
                                               dispatch's tokens arrive together)
``paged_jax:e2e_request_latency_seconds``      histogram, arrival to finish
=============================================  ========================================

Gauges and the engine's counters are read from ``LLMEngine.stats()`` when scraped; the
histograms and per-request counters are observed as requests finish. Buckets are vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paged_jax.engine.llm_engine import EngineStats
from paged_jax.engine.params import RequestOutput

__all__ = ["PREFIX", "ServerMetrics", "delivery_gaps"]

PREFIX = "paged_jax:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def delivery_gaps(token_times: list[float]) -> list[float]:
    """The gaps between successive deliveries: tokens with one time arrived together."""
    times = sorted(set(token_times))
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class _Stats:
    """A collector of one ``EngineStats`` (built per scrape)."""

    def __init__(self, stats: EngineStats):
        self.stats = stats

    def collect(self):
        s = self.stats
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch.", s.running),
                ("num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting),
                ("kv_cache_usage_perc", "KV-cache blocks in use over all blocks (0..1).",
                 s.block_occupancy),
                ("kv_cache_token_usage_perc", "KV-cache tokens held over token slots (0..1).",
                 s.token_occupancy)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        blocks = GaugeMetricFamily(PREFIX + "kv_cache_blocks", "KV-cache blocks by state.",
                                   labels=["state"])
        blocks.add_metric(["used"], s.blocks_used)
        blocks.add_metric(["free"], s.blocks_free)
        blocks.add_metric(["cached"], s.blocks_cached)
        yield blocks
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_cache_hits),
                ("num_preemptions", "Preemptions (by recompute).", s.preemptions)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """The histograms and counters observed as requests finish, and the exposition."""

    def __init__(self):
        self._finished = CollectorRegistry(auto_describe=True)
        r = self._finished
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token, from arrival.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gaps between token deliveries.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Request latency, arrival to finish.", buckets=E2E_BUCKETS,
                             registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests.",
                               ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated by "
                                         "finished requests.", registry=r)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Count the requests among ``outputs`` that finished (called after each step)."""
        for out in outputs:
            if not out.finished:
                continue
            m = out.metrics
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in delivery_gaps(m.token_times):
                self.itl.observe(gap)
            if m.e2e is not None:
                self.e2e.observe(m.e2e)
            for c in out.outputs:
                self.success.labels(finished_reason=c.finish_reason).inc()
                self.generation_tokens.inc(len(c.token_ids))
            self.prompt_tokens.inc(len(out.prompt_token_ids))

    def exposition(self, stats: EngineStats) -> bytes:
        """The text format of everything, with the gauges taken from ``stats``."""
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_Stats(stats))
        return generate_latest(registry) + generate_latest(self._finished)
