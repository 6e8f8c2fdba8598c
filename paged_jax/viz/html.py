"""One self-contained, offline HTML page of a recorded run.

Everything is inline (data as JSON, JS, CSS, SVG or canvas drawn by the script) and a Content
Security Policy forbids every network fetch, so the file works from disk with no connection:

* a step slider (arrow keys step it, Home/End jump); the page opens on the first step that
  holds a block;
* hovering a block shows its owners, logical indices, ref count and tokens;
* clicking a request highlights its table and its blocks (click again to clear);
* curves of utilization, blocks and events (step functions, as in ``curves.png``), with a
  cursor on the current step; clicking a curve jumps to that step;
* the events of the current step, and (pools up to ``PICTURE_UP_TO`` blocks) its terminal
  picture.

Up to ``png.GRID_ABOVE`` blocks, every block is an SVG ``<g class="block" data-block="k">``
whose ``rect.bg`` carries ``data-owner`` (owners joined by ``+``; empty when free), so tests can
read what is shown. Larger pools are drawn as a grid on one ``<canvas id="grid">``
(``GRID_CELL`` px cells, ``GRID_PER_ROW`` to a row), repainted whole on every step.

Size: the page stores each step's *changes* (the blocks whose ref count, tokens or holders
differ from the step before), each live request's length, at most ``FREE_SHOWN`` entries of
the free list, and the events. A step's tables are rebuilt in the page from the blocks'
holders. So the page grows with the run's activity, not with steps x pool size.
"""

from __future__ import annotations

import html
import json
import os

from paged_jax.viz.html_template import TEMPLATE
from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    block_views,
    changed_blocks,
    owner_styles,
    tint,
)
from paged_jax.viz.log import RunLog
from paged_jax.viz.metrics import CURVES, step_metrics
from paged_jax.viz.palette import HATCH_PITCH
from paged_jax.viz.png import GRID_ABOVE
from paged_jax.viz.terminal import render_picture

PICTURE_UP_TO = 256  # larger pools leave the terminal picture to layout.txt
FREE_SHOWN = 64  # free-list entries listed per step (the count is always given)
GRID_CELL, GRID_PER_ROW = 12, 50


def first_busy_step(log: RunLog) -> int:
    """The first step in which some block is in use (0 if none is, ever)."""
    return next((t for t, s in enumerate(log.snapshots) if s.ref_counts.any()), 0)


def page_data(log: RunLog, refresh: float | None = None) -> dict:
    """Everything the page's script needs, JSON-ready. ``refresh`` (seconds) makes a live
    page: it opens on the last step and reloads itself every ``refresh`` seconds while the
    last step is shown (``paged-jax serve``'s ``/blocks``)."""
    styles = owner_styles(log)
    n = log.config.num_blocks
    picture = n <= PICTURE_UP_TO
    steps = []
    prev = [(0, 0, (), 0)] * n  # the empty pool
    for t, snap in enumerate(log.snapshots):
        cur = [(v.ref_count, v.tokens, v.holders, v.held) for v in block_views(snap)]
        delta = [[b, ref, tok, [list(h) for h in holders], held]
                 for b, (ref, tok, holders, held) in enumerate(cur) if cur[b] != prev[b]]
        prev = cur
        steps.append({
            "title": snap.title,
            "delta": delta,
            "requests": [[name, r.num_tokens, r.slot is None]
                         for name, r in snap.requests().items()],
            "free": list(snap.free_order[:FREE_SHOWN]),
            "numFree": len(snap.free_order),
            "changed": sorted(changed_blocks(log, t)),
            "events": [e.describe() for e in log.events_at(t)],
            "picture": render_picture(log, t) if picture else None,
        })
    metrics = step_metrics(log)
    grid = n > GRID_ABOVE
    return {
        "scenario": log.scenario,
        "numBlocks": n,
        "blockSize": log.config.block_size,
        "grid": grid,
        "perRow": (GRID_PER_ROW if grid else n if n <= 24 else 16),
        "cell": GRID_CELL,
        "start": log.num_steps - 1 if refresh else first_busy_step(log),
        "refresh": refresh,
        "colors": {name: s.color for name, s in styles.items()},
        "tints": {name: tint(s.color) for name, s in styles.items()},
        "hatches": {name: s.hatch for name, s in styles.items() if s.hatch},
        "hatchPitch": HATCH_PITCH,
        "style": {"free": FREE_COLOR, "held": HELD_COLOR, "shared": SHARED_MARK,
                  "changed": CHANGED_COLOR},
        "steps": steps,
        "metrics": {k: [float(x) for x in v] for k, v in metrics.items()},
        "curveLabels": CURVES,
    }


def render_html(log: RunLog, refresh: float | None = None) -> str:
    """The page (``page_data``'s ``refresh``: a live page)."""
    data = json.dumps(page_data(log, refresh), separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(f"paged_jax block layout: {log.scenario or 'run'}")
    return TEMPLATE.replace("__TITLE__", title).replace("__DATA__", data)


def save_html(log: RunLog, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(log))
