"""The shapes the engine compiles for: powers of two, so that their number is bounded.

Prefill widths are bucketed to powers of two from ``MIN_PREFILL_WIDTH`` up to
``max_num_batched_tokens`` and its rows to powers of two up to ``max_num_seqs``, so at most
``(log2(max_num_seqs) + 1) * (log2(max_num_batched_tokens / MIN_PREFILL_WIDTH) + 1)`` prefill
executables are compiled, whatever the prompts (``prefill_buckets``). ``prefill_shapes``
narrows that to what an engine that groups an iteration's chunks by width class can meet,
which ``engine.warmup`` compiles ahead of serving, with the packed prefill's widths
(``packed_widths``).
"""

from __future__ import annotations

__all__ = ["MIN_PREFILL_WIDTH", "packed_widths", "pow2_at_least", "prefill_buckets",
           "prefill_shapes"]

MIN_PREFILL_WIDTH = 16


def pow2_at_least(n: int, low: int, high: int) -> int:
    """The smallest power of two ``>= n``, clipped to ``[low, high]``."""
    return min(max(low, 1 << max(n - 1, 0).bit_length()), high)


def _pow2_buckets(low: int, high: int) -> list[int]:
    """Every value ``pow2_at_least(n, low, high)`` takes for ``n`` in ``1..high``."""
    return sorted({pow2_at_least(n, low, high) for n in range(1, high + 1)})


def prefill_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """Every ``(rows, width)`` a prefill may compile for: the bound on prefill executables."""
    widths = _pow2_buckets(MIN_PREFILL_WIDTH, max_num_batched_tokens)
    return [(r, w) for r in _pow2_buckets(1, max_num_seqs) for w in widths]


def packed_widths(max_num_batched_tokens: int) -> list[int]:
    """Every width a ``prefill_packed`` dispatch may have: its chunks' tokens in all, rounded
    up to a power of two from ``MIN_PREFILL_WIDTH`` to ``max_num_batched_tokens``."""
    return _pow2_buckets(MIN_PREFILL_WIDTH, max_num_batched_tokens)


def prefill_shapes(max_num_seqs: int, max_num_batched_tokens: int,
                   by_width: bool = True) -> list[tuple[int, int]]:
    """Every ``(rows, width)`` an engine with these limits can dispatch a prefill in
    (``engine.warmup`` compiles them). With ``by_width``, an iteration's chunks of more than
    ``w / 2`` tokens (``w > 16``) go in width class ``w``, so at most
    ``max_num_batched_tokens // (w / 2 + 1)`` share its dispatch; the 16-wide class holds up
    to ``max_num_seqs``. Without it, every ``prefill_buckets`` pair can occur."""
    buckets = prefill_buckets(max_num_seqs, max_num_batched_tokens)
    if not by_width:
        return buckets
    out = []
    for rows, width in buckets:
        most = max_num_seqs if width == MIN_PREFILL_WIDTH else min(
            max_num_seqs, max_num_batched_tokens // (width // 2 + 1))
        if rows <= pow2_at_least(most, 1, max_num_seqs):
            out.append((rows, width))
    return out
