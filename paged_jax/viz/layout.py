"""What each view draws for one step: per physical block, its holders, ref count and fill.

Also each request's style (``palette``), so a request looks the same in the PNG, the GIF, the
timeline, the HTML page and the terminal.
"""

from __future__ import annotations

import dataclasses

from paged_jax.viz.log import RunLog, Snapshot
from paged_jax.viz.palette import (  # noqa: F401  (re-exported: the views import them here)
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    PALETTE,
    SHARED_MARK,
    SHARED_OWNERS_COLOR,
    OwnerStyle,
    assign_styles,
    hex_to_rgb,
)
from paged_jax.viz.recorder import anonymous_held


@dataclasses.dataclass(frozen=True)
class BlockView:
    """One physical block at one step."""

    block: int
    ref_count: int
    holders: tuple[tuple[str, int], ...]  # (request, logical index), table references
    held: int  # references outside every table
    tokens: int  # tokens stored (a block held outside any table counts as full)
    block_size: int

    @property
    def owners(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for name, _ in self.holders))

    @property
    def status(self) -> str:
        """``free``, ``held`` (no table), ``owned`` or ``shared`` (ref count > 1)."""
        if self.ref_count == 0:
            return "free"
        if self.ref_count > 1:
            return "shared"
        return "owned" if self.holders else "held"

    @property
    def partial(self) -> bool:
        return 0 < self.tokens < self.block_size

    @property
    def fill(self) -> float:
        return self.tokens / self.block_size


def block_views(snap: Snapshot) -> list[BlockView]:
    bs = snap.config.block_size
    holders: dict[int, list[tuple[str, int]]] = {}
    tokens = [0] * snap.config.num_blocks
    for name, req in snap.requests().items():
        for i, b in enumerate(req.table):
            holders.setdefault(b, []).append((name, i))
            tokens[b] = max(tokens[b], req.tokens_in(i, bs))
    anon = anonymous_held(snap)
    views = []
    for b in range(snap.config.num_blocks):
        ref = int(snap.ref_counts[b])
        tok = tokens[b] if b in holders else (bs if ref > 0 else 0)
        views.append(BlockView(b, ref, tuple(holders.get(b, ())), anon[b], tok, bs))
    return views


def request_lifetimes(log: RunLog) -> list[tuple[str, int, int]]:
    """``(name, first step, last step)`` of every request, in order of first appearance."""
    span: dict[str, list[int]] = {}
    for t, snap in enumerate(log.snapshots):
        for name in snap.requests():
            span.setdefault(name, [t, t])[1] = t
    return [(name, first, last) for name, (first, last) in span.items()]


def owner_styles(log: RunLog) -> dict[str, OwnerStyle]:
    """Request name -> colour and hatch, stable over the whole log (``palette.assign_styles``:
    requests alive at the same time never share a style)."""
    return assign_styles(request_lifetimes(log))


def owner_colors(log: RunLog) -> dict[str, str]:
    """Request name -> colour, stable over the whole log."""
    return {name: style.color for name, style in owner_styles(log).items()}


def changed_blocks(log: RunLog, step: int) -> set[int]:
    """Blocks named by an event of ``step`` (copies and their sources alike)."""
    out = set()
    for e in log.events_at(step):
        out.update(b for b in (e.block, e.src_block) if b is not None)
    return out


def tint(color: str, amount: float = 0.7) -> str:
    """``color`` mixed with white: the empty part of a partly filled block."""
    r, g, b = (round(c + (255 - c) * amount) for c in hex_to_rgb(color))
    return f"#{r:02x}{g:02x}{b:02x}"


def fit_label(owners: tuple[str, ...], max_chars: int) -> str:
    """Owners joined by ``+``, cut to ``max_chars`` with an ellipsis when longer (the full list
    is in the hover, the tables and the events)."""
    label = "+".join(owners)
    if len(label) <= max_chars:
        return label
    return label[: max(0, max_chars - 1)] + "\u2026"


def selected_request(log: RunLog, step: int) -> str | None:
    """The request a crowded picture draws arrows for: the first live request named by an
    event of ``step``, else the live request with the longest table (first on ties)."""
    live = log.snapshots[step].requests()
    for e in log.events_at(step):
        if e.request in live:
            return e.request
    if not live:
        return None
    return max(live, key=lambda name: len(live[name].table))
