"""Pixels of a pool too big for one matplotlib patch per block: the block grid and the block
tables painted straight into an RGB array (the per-step PNG of a large pool, ``png.py``).

Each block is a ``cell`` x ``cell`` square: free, held or owned as in the small picture (an
owner's tint, filled from the bottom in its colour by ``tokens / block_size``, stripes for
several owners, white hatch lines for a hatched style); a band of ``band`` rows across the top
marks ref count > 1; a one-pixel ring in the gap marks a block changed in this step, and a
black inner edge the selected request's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    BlockView,
    OwnerStyle,
    tint,
)
from paged_jax.viz.palette import hatch_mask, hex_to_rgb

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 pixels, origin top left, x1/y1 exclusive


def fill(img: np.ndarray, box: Box, color: str) -> None:
    """Paint ``box`` of ``img`` ([H, W, 3] uint8) with ``color``."""
    x0, y0, x1, y1 = box
    img[y0:y1, x0:x1] = hex_to_rgb(color)


def hatch(img: np.ndarray, box: Box, pattern: str) -> None:
    """White hatch lines of ``pattern`` (``palette.HATCHES``) over ``box``."""
    x0, y0, x1, y1 = box
    if pattern and x1 > x0 and y1 > y0:
        img[y0:y1, x0:x1][hatch_mask(pattern, y1 - y0, x1 - x0, x0, y0)] = 255


def ring(img: np.ndarray, box: Box, color: str) -> None:
    """A one-pixel outline just inside ``box``."""
    x0, y0, x1, y1 = box
    rgb = hex_to_rgb(color)
    img[y0, x0:x1] = img[y1 - 1, x0:x1] = rgb
    img[y0:y1, x0] = img[y0:y1, x1 - 1] = rgb


def paint_blocks(
    img: np.ndarray,  # [H, W, 3] uint8, painted in place
    views: Iterable[BlockView],
    styles: Mapping[str, OwnerStyle],
    block_box: Callable[[int], Box],
    *,
    band: int,
    changed: set[int],
    selected: str | None,
) -> None:
    for v in views:
        x0, y0, x1, y1 = box = block_box(v.block)
        if v.status == "free":
            fill(img, box, FREE_COLOR)
        elif not v.owners:
            fill(img, box, HELD_COLOR)
        else:
            edges = np.linspace(x0, x1, len(v.owners) + 1).round().astype(int)
            top = y1 - round((y1 - y0) * v.fill)
            for name, sx0, sx1 in zip(v.owners, edges[:-1], edges[1:], strict=True):
                fill(img, (sx0, y0, sx1, top), tint(styles[name].color))
                fill(img, (sx0, top, sx1, y1), styles[name].color)
                hatch(img, (sx0, y0, sx1, y1), styles[name].hatch)
        if v.ref_count > 1:
            fill(img, (x0, y0, x1, y0 + band), SHARED_MARK)
        if selected is not None and selected in v.owners:
            ring(img, box, "#000000")
        if v.block in changed:
            ring(img, (x0 - 1, y0 - 1, x1 + 1, y1 + 1), CHANGED_COLOR)


def paint_table(
    img: np.ndarray,  # [H, W, 3] uint8, painted in place
    table: Iterable[int],
    style: OwnerStyle,
    entry_box: Callable[[int], Box],
) -> None:
    """A request's table as a row of small cells in its colour (and hatch)."""
    for i, _ in enumerate(table):
        box = entry_box(i)
        fill(img, box, style.color)
        hatch(img, box, style.hatch)
