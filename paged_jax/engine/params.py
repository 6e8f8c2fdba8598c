"""What a request asks for and what it gets back, in vLLM's shapes: ``SamplingParams``,
``CompletionOutput``, ``RequestOutput`` and ``RequestMetrics``.

``SamplingParams`` checks itself when it is made, so a bad value is refused at the boundary
with its name and the range expected, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

__all__ = ["UNDELIVERED", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]

FINISH_REASONS = ("stop", "length", "abort")


def _int(name: str, value, low: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ValueError(f"SamplingParams.{name} must be an int >= {low}. Got {value!r}.")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (vLLM's ``SamplingParams`` fields and defaults).

    Attributes:
      n: completions per prompt (they fork after the prompt's prefill).
      temperature: 0 is greedy; above 0 samples from ``softmax(logits / temperature)``.
      top_p: nucleus mass in (0, 1]; 1 is off.
      top_k: keep the k most likely tokens (ties kept); -1 (or 0) is off.
      max_tokens: new tokens at most (the ``"length"`` finish).
      seed: the request's random seed; its token at position ``p`` is drawn with a key made
        from ``(seed, p)`` only. None: the engine's seed and the request's arrival index.
      stop: strings that end the completion; the text stops before the first one found.
      stop_token_ids: token ids that end the completion (emitted in ``token_ids``).
      ignore_eos: keep going past the model's EOS token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        _int("n", self.n, 1)
        _int("max_tokens", self.max_tokens, 1)
        if (not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool)
                or not self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy). Got "
                             f"{self.temperature!r}.")
        if (not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool)
                or not 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off). Got "
                             f"{self.top_p!r}.")
        _int("top_k", self.top_k, -1)
        if self.seed is not None:
            _int("seed", self.seed, 0)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them. "
                             f"Got {self.stop!r}.")
        object.__setattr__(self, "stop", tuple(stop))
        ids = list(self.stop_token_ids or ())
        for i in ids:
            _int("stop_token_ids entries", i, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool. Got {self.ignore_eos!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filter_top_k(self) -> int:
        """top_k as the samplers take it: 0 = off."""
        return max(self.top_k, 0)


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request: its index among the ``n``, its text (stop strings and
    what follows them removed, EOS not shown), its token ids, and why it ended (``"stop"``,
    ``"length"``, ``"abort"``; None while it runs)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


UNDELIVERED = math.nan  # a token's time until the step that made it returns


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's life. ``token_times``
    holds when each new token was delivered: when the ``LLMEngine.step`` that made it
    returned (every completion's, in order). A step's tokens share its time, and the first
    token's time (TTFT) includes the decode dispatch that ran after its prefill."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, from arrival to the last completion's end."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps between successive token arrivals. Tokens of one
        dispatch reach the host together, so K - 1 of every K gaps are 0."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first token time) / (tokens - 1)."""
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    def deliver(self, now: float) -> None:
        """Give the times recorded as ``UNDELIVERED`` (the tokens of the step now returning,
        and its first-token and finish times) the time ``now`` they reach the caller."""
        times = self.token_times
        i = len(times)
        while i and math.isnan(times[i - 1]):
            i -= 1
        times[i:] = [now] * (len(times) - i)
        if self.first_token_time is not None and math.isnan(self.first_token_time):
            self.first_token_time = now
        if self.finished_time is not None and math.isnan(self.finished_time):
            self.finished_time = now


@dataclasses.dataclass
class RequestOutput:
    """A request's state as ``LLMEngine.step`` reports it (every field current)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
