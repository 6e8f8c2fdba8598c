"""What each view draws for one step: per physical block, its holders, ref count and fill.

Also the colours every view shares, so a request looks the same in the PNG, the GIF, the
timeline, the HTML page and the terminal.
"""

from __future__ import annotations

import dataclasses

from paged_jax.viz.log import RunLog, Snapshot
from paged_jax.viz.recorder import anonymous_held

# A qualitative palette (Tableau 20, dark shades first); requests take colours in order of
# first appearance.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#dbdb8d", "#9edae5", "#393b79",
)  # fmt: skip
FREE_COLOR = "#eeeeee"  # a free block
HELD_COLOR = "#9e9e9e"  # in use, but by no table (a loose or cached reference)
SHARED_MARK = "#111111"  # band on a block with ref count > 1
CHANGED_COLOR = "#ff00aa"  # outline of a block touched in this step


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


def owner_colors(log: RunLog) -> dict[str, str]:
    """Request name -> colour, stable over the whole log."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(log.request_names())}


def changed_blocks(log: RunLog, step: int) -> set[int]:
    """Blocks named by an event of ``step`` (copies and their sources alike)."""
    out = set()
    for e in log.events_at(step):
        out.update(b for b in (e.block, e.src_block) if b is not None)
    return out


def hex_to_rgb(color: str) -> tuple[int, int, int]:
    color = color.lstrip("#")
    return tuple(int(color[i : i + 2], 16) for i in (0, 2, 4))  # type: ignore[return-value]


def tint(color: str, amount: float = 0.7) -> str:
    """``color`` mixed with white: the empty part of a partly filled block."""
    r, g, b = (round(c + (255 - c) * amount) for c in hex_to_rgb(color))
    return f"#{r:02x}{g:02x}{b:02x}"
