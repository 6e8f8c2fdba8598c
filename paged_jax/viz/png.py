"""The picture of one step, drawn with matplotlib in pixel coordinates.

Top: the physical blocks, coloured by owner. A block fills from the bottom in proportion to
``tokens / block_size`` (the pale rest is internal fragmentation); a black band across its top
(and, in the small picture, a ``x3`` above it) marks a block with ref count > 1; a block shared
by several requests is split into stripes of their colours; blocks touched in this step are
outlined in magenta. Below: each request's block table.

Two layouts, chosen by pool size:

* up to ``GRID_ABOVE`` blocks, boxes of 44 px with their index, owners and ref count written on
  them, and each table entry numbered;
* above it, a grid of ``GRID_CELL`` px cells, ``GRID_PER_ROW`` to a row with the first block's
  index at the left, painted as pixels (``raster.py``); tables become rows of small cells in
  columns. The picture is then at most about ``GRID_PER_ROW * 17`` px wide and
  ``17 * num_blocks / GRID_PER_ROW`` px tall for the pool, plus ``GRID_PITCH`` px per
  ``columns`` requests for the tables.

Arrows run from table entries to their blocks. Above ``ARROW_LIMIT`` table entries in a step
they are drawn for one request only (``layout.selected_request``, named in the picture, its
blocks edged in black), since hundreds of crossing arrows hide the pool.

``step_geometry(log)`` gives every box in pixels (origin top left), so tests can sample the
saved PNG at known places; it depends on the whole log, so every frame of a run has one size.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from paged_jax.viz import raster
from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    block_views,
    changed_blocks,
    fit_label,
    owner_styles,
    selected_request,
    tint,
)
from paged_jax.viz.log import RunLog

DPI = 100
GRID_ABOVE = 64  # pools larger than this are drawn as a grid
GRID_CELL, GRID_GAP, GRID_PER_ROW = 14, 3, 50
GRID_ENTRY, GRID_PITCH = (6, 10), 13  # a table entry in the grid layout, a table row's pitch
ARROW_LIMIT = 64  # more table entries than this in a step: arrows for one request only
Box = tuple[int, int, int, int]  # x0, y0, x1, y1 pixels, origin top left


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    num_blocks: int
    per_row: int
    table_rows: int  # most requests alive at once
    table_len: int  # longest block table
    grid: bool = False
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
    label_room: int = 0  # left of the blocks: each grid row's first block index
    name_room: int = 56  # left of a table: the request's name

    @property
    def block_rows(self) -> int:
        return -(-self.num_blocks // self.per_row)

    @property
    def row_pitch(self) -> int:
        return self.cell + (self.gap if self.grid else self.row_extra)

    @property
    def column_width(self) -> int:
        """One column of tables: name, entries, room to the next column."""
        return self.name_room + self.table_len * (self.lcell[0] + (1 if self.grid else 4)) + 16

    @property
    def width(self) -> int:
        blocks = 2 * self.margin + self.label_room + self.per_row * (self.cell + self.gap)
        tables = self.table_x0 + self.column_width - self.name_room + self.margin
        return int(max(blocks - self.gap, tables, 760))

    @property
    def columns(self) -> int:
        """Table columns side by side (one in the small layout)."""
        if not self.grid:
            return 1
        return max(1, (self.width - 2 * self.margin) // self.column_width)

    @property
    def rows_per_column(self) -> int:
        return max(1, -(-self.table_rows // self.columns))

    @property
    def blocks_bottom(self) -> int:
        return self.header + self.block_rows * self.row_pitch

    @property
    def table_x0(self) -> int:
        return self.margin + self.name_room

    @property
    def tables_top(self) -> int:
        return self.blocks_bottom + self.arrow_room

    @property
    def height(self) -> int:
        return self.tables_top + self.rows_per_column * self.table_pitch + self.legend

    def block_box(self, k: int) -> Box:
        """Pixel box of physical block ``k``."""
        r, c = divmod(k, self.per_row)
        x0 = self.margin + self.label_room + c * (self.cell + self.gap)
        y0 = self.header + r * self.row_pitch + (0 if self.grid else 18)
        return x0, y0, x0 + self.cell, y0 + self.cell

    def mark_box(self, k: int) -> Box:
        """The shared mark's band across the top of block ``k``."""
        x0, y0, x1, _ = self.block_box(k)
        return x0, y0, x1, y0 + self.band

    def highlight_box(self, k: int) -> Box:
        """The outline drawn around a block changed in this step (line centred on it)."""
        x0, y0, x1, y1 = self.block_box(k)
        d = 1 if self.grid else 3
        return x0 - d, y0 - d, x1 + d, y1 + d

    def name_xy(self, row: int) -> tuple[int, int]:
        """Where the ``row``-th listed request's name starts (left, vertical centre)."""
        x0, y0, _, y1 = self.table_box(row, 0)
        return x0 - self.name_room, (y0 + y1) // 2

    def table_box(self, row: int, logical: int) -> Box:
        """Pixel box of entry ``logical`` in the ``row``-th listed request's table."""
        w, h = self.lcell
        col, r = divmod(row, self.rows_per_column)
        x0 = self.table_x0 + col * self.column_width + logical * (w + (1 if self.grid else 4))
        y0 = self.tables_top + r * self.table_pitch
        return x0, y0, x0 + w, y0 + h


def step_geometry(log: RunLog) -> StepGeometry:
    n = log.config.num_blocks
    reqs = [s.requests() for s in log.snapshots]
    rows = max((len(r) for r in reqs), default=0)
    longest = max((len(v.table) for r in reqs for v in r.values()), default=0)
    if n <= GRID_ABOVE:
        return StepGeometry(n, n if n <= 24 else 16, rows, longest)
    return StepGeometry(
        n, min(n, GRID_PER_ROW), rows, longest, grid=True, cell=GRID_CELL, gap=GRID_GAP,
        row_extra=0, band=3, arrow_room=40, lcell=GRID_ENTRY, table_pitch=GRID_PITCH,
        label_room=36, name_room=40,
    )


def center(box: Box) -> tuple[int, int]:
    return (box[0] + box[2]) // 2, (box[1] + box[3]) // 2


def step_figure(log: RunLog, step: int, geometry: StepGeometry | None = None):
    """The matplotlib ``Figure`` of ``step``: one axes whose data units are pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    g = geometry or step_geometry(log)
    fig = Figure(figsize=(g.width / DPI, g.height / DPI), dpi=DPI, facecolor="white")
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    _draw(ax, log, step, g)
    ax.set_xlim(0, g.width)
    ax.set_ylim(g.height, 0)  # y grows downwards
    return fig


def render_step_image(log: RunLog, step: int, geometry: StepGeometry | None = None) -> np.ndarray:
    """The picture of ``step`` as an [height, width, 3] uint8 array."""
    fig = step_figure(log, step, geometry)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_step_png(log: RunLog, step: int, path: str | os.PathLike) -> None:
    from PIL import Image

    Image.fromarray(render_step_image(log, step)).save(path)


def _rect(ax, x, y, w, h, color, **kw):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="none", **kw))


TEXT = dict(fontfamily="DejaVu Sans", va="center", ha="center")


def _draw(ax, log: RunLog, step: int, g: StepGeometry) -> None:
    snap = log.snapshots[step]
    cfg = log.config
    styles = owner_styles(log)
    views = block_views(snap)
    changed = changed_blocks(log, step)
    requests = snap.requests()
    entries = sum(len(r.table) for r in requests.values())
    selected = selected_request(log, step) if entries > ARROW_LIMIT else None
    used = sum(v.ref_count > 0 for v in views)
    tokens = sum(v.tokens for v in views)
    shared = sum(v.ref_count > 1 for v in views)
    left = {**TEXT, "ha": "left"}
    title = f"step {step}/{log.num_steps - 1}: {snap.title}"
    fits = (g.width - 2 * g.margin) // 8  # 11 pt bold characters across the picture
    title = title if len(title) <= fits else title[: fits - 1] + "\u2026"
    ax.text(g.margin, 18, title, fontsize=11, fontweight="bold", **left)
    stats = (f"{used}/{cfg.num_blocks} blocks in use, {tokens}/{cfg.num_blocks * cfg.block_size} "
             f"token slots filled, {shared} shared, block size {cfg.block_size}")
    if selected is not None:
        stats += f"; arrows for {selected} only (edged black; {entries} entries)"
    ax.text(g.margin, 42, stats, fontsize=9, color="#444444", **left)
    if g.grid:
        _draw_grid(ax, g, snap, views, styles, changed, selected)
    else:
        _draw_boxes(ax, g, views, styles, changed)
    for row, (name, req) in enumerate(requests.items()):
        style = styles[name]
        x, y = g.name_xy(row)
        weight = "bold" if not g.grid or name == selected else "normal"
        ax.text(x, y, name[:5], fontsize=7 if g.grid else 10, fontweight=weight,
                color=style.color, **left)
        for i, b in enumerate(req.table):
            lx0, ly0, lx1, ly1 = g.table_box(row, i)
            if not g.grid:
                from matplotlib.patches import Rectangle

                ax.add_patch(Rectangle((lx0, ly0), lx1 - lx0, ly1 - ly0, lw=1,
                                       facecolor=tint(style.color, 0.6), edgecolor=style.color,
                                       hatch=style.hatch * 2 or None))
                ax.text((lx0 + lx1) / 2, (ly0 + ly1) / 2, str(b), fontsize=7, **TEXT)
            if selected is None or name == selected:
                bx0, by0, bx1, by1 = g.block_box(b)
                end = ((bx0 + bx1) / 2, by1 + (1 if g.grid else 15))
                ax.annotate("", xy=end, xytext=((lx0 + lx1) / 2, ly0),
                            arrowprops=dict(arrowstyle="->", color=style.color, lw=0.9,
                                            alpha=0.65 if selected is None else 0.9,
                                            shrinkA=0, shrinkB=0))
    _legend(ax, g, any(styles[n].hatch for n in requests))


def _draw_boxes(ax, g: StepGeometry, views, styles, changed) -> None:
    from matplotlib.patches import Rectangle

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
                color, hatch = styles[name].color, styles[name].hatch
                _rect(ax, x0 + i * stripe, y0, stripe, w, tint(color))
                _rect(ax, x0 + i * stripe, y1 - filled, stripe, filled, color)
                if hatch:
                    ax.add_patch(Rectangle((x0 + i * stripe, y0), stripe, w, fill=False,
                                           hatch=hatch * 2, edgecolor="white", lw=0))
        ax.add_patch(Rectangle((x0, y0), w, w, fill=False, edgecolor="#555555", lw=0.8))
        if v.ref_count > 1:
            _rect(ax, x0, y0, w, g.band, SHARED_MARK)
            ax.text((x0 + x1) / 2, y0 - 11, f"x{v.ref_count}", fontsize=8, fontweight="bold",
                    **TEXT)
        if v.owners:
            # 9 pt bold fits 4 characters across a 44 px block, 6 pt fits 6.
            small = len("+".join(v.owners)) > 4
            ax.text((x0 + x1) / 2, y0 + g.band + 9, fit_label(v.owners, 6 if small else 4),
                    fontsize=6 if small else 9, fontweight="bold", **TEXT)
        ax.text((x0 + x1) / 2, y1 + 8, str(v.block), fontsize=8, color="#333333", **TEXT)
        if v.block in changed:
            hx0, hy0, hx1, hy1 = g.highlight_box(v.block)
            ax.add_patch(Rectangle((hx0, hy0), hx1 - hx0, hy1 - hy0, fill=False,
                                   edgecolor=CHANGED_COLOR, lw=2.2))


def _draw_grid(ax, g: StepGeometry, snap, views, styles, changed, selected) -> None:
    img = np.full((g.height, g.width, 3), 255, np.uint8)
    raster.paint_blocks(img, views, styles, g.block_box, band=g.band, changed=changed,
                        selected=selected)
    for row, (name, req) in enumerate(snap.requests().items()):
        if name == selected:  # a pale bar behind the selected table
            x0, y0, _, y1 = g.table_box(row, 0)
            raster.fill(img, (x0 - 2, y0 - 1, x0 + g.column_width - g.name_room - 14, y1 + 1),
                        "#fff3b0")
        raster.paint_table(img, req.table, styles[name], lambda i, r=row: g.table_box(r, i))
    ax.imshow(img, extent=(0, g.width, g.height, 0), interpolation="nearest", aspect="auto",
              zorder=0)
    for r in range(g.block_rows):
        x0, y0, _, y1 = g.block_box(r * g.per_row)
        ax.text(x0 - 4, (y0 + y1) / 2, str(r * g.per_row), fontsize=7, color="#333333",
                **{**TEXT, "ha": "right"})


def _legend(ax, g: StepGeometry, hatched: bool) -> None:
    from matplotlib.patches import Rectangle

    y = g.height - g.legend / 2
    x = g.margin
    items = [(FREE_COLOR, "free"), (HELD_COLOR, "held, no table"),
             (SHARED_MARK, "band: ref count > 1"), (None, "outline: changed this step"),
             ("#1f77b4", "fill = tokens / block size")]
    if hatched:
        items.append(("hatch", "hatched: more than 64 requests at once"))
    for color, label in items:
        if color is None:
            ax.add_patch(Rectangle((x, y - 7), 14, 14, fill=False, edgecolor=CHANGED_COLOR, lw=2))
        elif color == "hatch":
            ax.add_patch(Rectangle((x, y - 7), 14, 14, facecolor="#1f77b4", hatch="//",
                                   edgecolor="white", lw=0))
        elif label.startswith("fill"):
            _rect(ax, x, y - 7, 14, 14, tint(color))
            _rect(ax, x, y, 14, 7, color)
        else:
            _rect(ax, x, y - 7, 14, 14, color)
        ax.text(x + 20, y, label, fontsize=8, **{**TEXT, "ha": "left"})
        x += 28 + 6.2 * len(label)
