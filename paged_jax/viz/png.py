"""The picture of one step, drawn with matplotlib in pixel coordinates.

Top: the physical blocks, coloured by owner. A block fills from the bottom in proportion to
``tokens / block_size`` (the pale rest is internal fragmentation); a black band across its top
and a ``x3`` above it mark a block with ref count > 1; a block shared by several requests is
split into stripes of their colours; blocks touched in this step are outlined in magenta.
Below: each request's block table, an arrow from every logical entry to its physical block.

``step_geometry(log)`` gives every box in pixels (origin top left), so tests can sample the
saved PNG at known places; it depends on the whole log, so every frame of a run has one size.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    block_views,
    changed_blocks,
    owner_colors,
    tint,
)
from paged_jax.viz.log import RunLog

DPI = 100
Box = tuple[int, int, int, int]  # x0, y0, x1, y1 pixels, origin top left


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    num_blocks: int
    per_row: int
    table_rows: int  # most requests alive at once
    table_len: int  # longest block table
    margin: int = 20
    header: int = 64  # title and stats
    cell: int = 44  # block side
    gap: int = 10
    row_extra: int = 34  # ref count above a block, its index below
    band: int = 9  # height of the shared mark
    arrow_room: int = 70
    lcell: tuple[int, int] = (30, 22)  # a table entry
    table_pitch: int = 30
    legend: int = 44

    @property
    def block_rows(self) -> int:
        return -(-self.num_blocks // self.per_row)

    @property
    def width(self) -> int:
        blocks = 2 * self.margin + self.per_row * (self.cell + self.gap) - self.gap
        tables = self.table_x0 + self.table_len * (self.lcell[0] + 4) + self.margin
        return int(max(blocks, tables, 760))

    @property
    def blocks_bottom(self) -> int:
        return self.header + self.block_rows * (self.cell + self.row_extra)

    @property
    def table_x0(self) -> int:
        return self.margin + 56

    @property
    def tables_top(self) -> int:
        return self.blocks_bottom + self.arrow_room

    @property
    def height(self) -> int:
        return self.tables_top + max(1, self.table_rows) * self.table_pitch + self.legend

    def block_box(self, k: int) -> Box:
        """Pixel box of physical block ``k``."""
        r, c = divmod(k, self.per_row)
        x0 = self.margin + c * (self.cell + self.gap)
        y0 = self.header + r * (self.cell + self.row_extra) + 18
        return x0, y0, x0 + self.cell, y0 + self.cell

    def mark_box(self, k: int) -> Box:
        """The shared mark's band across the top of block ``k``."""
        x0, y0, x1, _ = self.block_box(k)
        return x0, y0, x1, y0 + self.band

    def highlight_box(self, k: int) -> Box:
        """The outline drawn around a block changed in this step (line centred on it)."""
        x0, y0, x1, y1 = self.block_box(k)
        return x0 - 3, y0 - 3, x1 + 3, y1 + 3

    def table_box(self, row: int, logical: int) -> Box:
        """Pixel box of entry ``logical`` in the ``row``-th listed request's table."""
        w, h = self.lcell
        x0 = self.table_x0 + logical * (w + 4)
        y0 = self.tables_top + row * self.table_pitch
        return x0, y0, x0 + w, y0 + h


def step_geometry(log: RunLog) -> StepGeometry:
    n = log.config.num_blocks
    reqs = [s.requests() for s in log.snapshots]
    return StepGeometry(
        num_blocks=n,
        per_row=n if n <= 24 else 16,
        table_rows=max((len(r) for r in reqs), default=0),
        table_len=max((len(v.table) for r in reqs for v in r.values()), default=0),
    )


def center(box: Box) -> tuple[int, int]:
    return (box[0] + box[2]) // 2, (box[1] + box[3]) // 2


def render_step_image(log: RunLog, step: int, geometry: StepGeometry | None = None) -> np.ndarray:
    """The picture of ``step`` as an [height, width, 3] uint8 array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    g = geometry or step_geometry(log)
    fig = Figure(figsize=(g.width / DPI, g.height / DPI), dpi=DPI, facecolor="white")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, g.width)
    ax.set_ylim(g.height, 0)  # y grows downwards: data units are pixels
    ax.axis("off")
    _draw(ax, log, step, g)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_step_png(log: RunLog, step: int, path: str | os.PathLike) -> None:
    from PIL import Image

    Image.fromarray(render_step_image(log, step)).save(path)


def _rect(ax, x, y, w, h, color, **kw):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="none", **kw))


def _draw(ax, log: RunLog, step: int, g: StepGeometry) -> None:
    from matplotlib.patches import Rectangle

    snap = log.snapshots[step]
    cfg = log.config
    colors = owner_colors(log)
    views = block_views(snap)
    changed = changed_blocks(log, step)
    used = sum(v.ref_count > 0 for v in views)
    tokens = sum(v.tokens for v in views)
    shared = sum(v.ref_count > 1 for v in views)
    text = dict(fontfamily="DejaVu Sans", va="center", ha="center")
    title = f"step {step}/{log.num_steps - 1}: {snap.title}"
    ax.text(g.margin, 18, title[:140], fontsize=11, fontweight="bold", **{**text, "ha": "left"})
    ax.text(
        g.margin, 42,
        f"{used}/{cfg.num_blocks} blocks in use, {tokens}/{cfg.num_blocks * cfg.block_size} "
        f"token slots filled, {shared} shared, block size {cfg.block_size}",
        fontsize=9, color="#444444", **{**text, "ha": "left"},
    )
    for v in views:
        x0, y0, x1, y1 = g.block_box(v.block)
        w = x1 - x0
        if v.status == "free":
            _rect(ax, x0, y0, w, w, FREE_COLOR)
        elif not v.owners:
            _rect(ax, x0, y0, w, w, HELD_COLOR)
        else:
            stripe = w / len(v.owners)
            filled = w * v.fill
            for i, name in enumerate(v.owners):
                _rect(ax, x0 + i * stripe, y0, stripe, w, tint(colors[name]))
                _rect(ax, x0 + i * stripe, y1 - filled, stripe, filled, colors[name])
        ax.add_patch(Rectangle((x0, y0), w, w, fill=False, edgecolor="#555555", lw=0.8))
        if v.ref_count > 1:
            _rect(ax, x0, y0, w, g.band, SHARED_MARK)
            ax.text((x0 + x1) / 2, y0 - 11, f"x{v.ref_count}", fontsize=8, fontweight="bold",
                    **text)
        if v.owners:
            label = v.owners[0] if len(v.owners) == 1 else "+".join(v.owners)
            ax.text((x0 + x1) / 2, y0 + g.band + 9, label[:6], fontsize=9 if len(label) < 3 else 6,
                    fontweight="bold", **text)
        ax.text((x0 + x1) / 2, y1 + 8, str(v.block), fontsize=8, color="#333333", **text)
        if v.block in changed:
            hx0, hy0, hx1, hy1 = g.highlight_box(v.block)
            ax.add_patch(Rectangle((hx0, hy0), hx1 - hx0, hy1 - hy0, fill=False,
                                   edgecolor=CHANGED_COLOR, lw=2.2))
    for row, (name, req) in enumerate(snap.requests().items()):
        color = colors[name]
        _, ty0, _, ty1 = g.table_box(row, 0)
        ax.text(g.margin, (ty0 + ty1) / 2, name[:5], fontsize=10, fontweight="bold", color=color,
                **{**text, "ha": "left"})
        for i, b in enumerate(req.table):
            lx0, ly0, lx1, ly1 = g.table_box(row, i)
            ax.add_patch(Rectangle((lx0, ly0), lx1 - lx0, ly1 - ly0, facecolor=tint(color, 0.6),
                                   edgecolor=color, lw=1))
            ax.text((lx0 + lx1) / 2, (ly0 + ly1) / 2, str(b), fontsize=7, **text)
            bx0, _, bx1, by1 = g.block_box(b)
            ax.annotate("", xy=((bx0 + bx1) / 2, by1 + 15), xytext=((lx0 + lx1) / 2, ly0),
                        arrowprops=dict(arrowstyle="->", color=color, lw=0.9, alpha=0.65,
                                        shrinkA=0, shrinkB=0))
    _legend(ax, g, text)


def _legend(ax, g: StepGeometry, text: dict) -> None:
    from matplotlib.patches import Rectangle

    y = g.height - g.legend / 2
    x = g.margin
    items = [(FREE_COLOR, "free"), (HELD_COLOR, "held, no table"),
             (SHARED_MARK, "band: ref count > 1"), (None, "outline: changed this step"),
             ("#1f77b4", "fill = tokens / block size")]
    for color, label in items:
        if color is None:
            ax.add_patch(Rectangle((x, y - 7), 14, 14, fill=False, edgecolor=CHANGED_COLOR, lw=2))
        elif label.startswith("fill"):
            _rect(ax, x, y - 7, 14, 14, tint(color))
            _rect(ax, x, y, 14, 7, color)
        else:
            _rect(ax, x, y - 7, 14, 14, color)
        ax.text(x + 20, y, label, fontsize=8, **{**text, "ha": "left"})
        x += 28 + 6.2 * len(label)
