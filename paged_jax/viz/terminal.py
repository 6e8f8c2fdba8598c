"""The terminal view: the seed's picture with a legend, each request's table, the free list;
and a ``rich`` live view that steps through a recorded run.

    Step 14/19  req_b.release()
    [A][A][A][ ][ ][C][C][C][C][A][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ]
     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
                             ~  ~
    A: [0, 1, 2, 9]  50 tokens
    ...

The first two lines are ``render_layout``'s, unchanged; the third marks each block whose ref
count is above 1 with that count and each partly filled block with ``~``.
"""

from __future__ import annotations

import itertools
import time

from paged_jax.viz.ascii import FREE, HELD, SHARED, render_layout
from paged_jax.viz.layout import block_views, owner_colors
from paged_jax.viz.log import RunLog

PARTIAL = "~"
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

LEGEND = (
    f"Legend: [A] owner  [{SHARED}] shared  [{HELD}] held outside any table  [{FREE}] free  |  "
    f"under the ruler: ref count if > 1, {PARTIAL} partly filled"
)


def cell_width(num_blocks: int) -> int:
    """Characters inside one ``[..]`` cell: ``render_layout`` widens cells past 100 blocks."""
    return max(1, len(str(num_blocks - 1)) - 1)


def char_labels(log: RunLog) -> dict[str, str]:
    """Request name -> the label drawn in its cells.

    A name that fits the cell is drawn as itself. A longer one gets a short label no
    fitting name uses and no request alive at the same time has; the picture's key lists it.
    """
    width = cell_width(log.config.num_blocks)
    names = log.request_names()
    life: dict[str, tuple[int, int]] = {}
    for t, snap in enumerate(log.snapshots):
        for name in snap.requests():
            life[name] = (life.get(name, (t, t))[0], t)
    marks = {SHARED, HELD, FREE}

    def fits(name: str) -> bool:
        return 0 < len(name) <= width and not (set(name) & marks) and name.isprintable()

    out = {n: n for n in names if fits(n)}
    reserved = set(out.values())
    users: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        if name in out:
            continue
        first, last = life[name]
        lead = [c for c in (name[:1].lower(), name[:1].upper()) if c in _ALPHABET]
        pairs = (a + b for a in _ALPHABET for b in _ALPHABET) if width > 1 else ()
        for cand in itertools.chain(lead, _ALPHABET, pairs):
            if cand not in reserved and all(
                last < lo or hi < first for lo, hi in users.get(cand, ())
            ):
                break
        else:
            raise ValueError(f"No label left for request {name!r}: too many live requests.")
        out[name] = cand
        users.setdefault(cand, []).append((first, last))
    return out


def _per_row(num_blocks: int) -> int | None:
    return None if num_blocks <= 40 else 32


def render_picture(
    log: RunLog, step: int, *, marks: bool = True, chars: dict[str, str] | None = None
) -> str:
    """The seed's picture of ``step`` (``render_layout``), the marks line per row, and a key
    (``Key: a = A2``) for the requests drawn by a label other than their name.

    ``chars``: ``char_labels(log)``, for a caller drawing many steps (it reads the whole log).
    """
    snap = log.snapshots[step]
    chars = char_labels(log) if chars is None else chars
    labels = {slot: chars[name] for slot, name in snap.names.items()}
    tables = {chars[name]: list(t) for name, t in snap.tables.items()}
    per_row = _per_row(log.config.num_blocks)
    text = render_layout(snap.to_state(), labels, tables=tables, per_row=per_row)
    keyed = [f"{chars[n]} = {n}" for n in snap.requests() if chars[n] != n]
    key = ["Key: " + ", ".join(keyed)] if keyed else []
    if not marks:
        return "\n".join([text, *key])
    n = log.config.num_blocks
    inner = cell_width(n)
    row = per_row or n
    lines = text.splitlines()
    out = []
    every = block_views(snap)
    for r, start in enumerate(range(0, n, row)):
        views = every[start : start + row]
        cells = []
        for v in views:
            mark = (str(v.ref_count) if v.ref_count > 1 else "") + (PARTIAL if v.partial else "")
            cells.append(f"{mark:>{inner + 1}} ")
        out += lines[2 * r : 2 * r + 2] + ["".join(cells).rstrip()]
    return "\n".join(out + key)


def render_step(
    log: RunLog, step: int, *, legend: bool = True, events: bool = True,
    chars: dict[str, str] | None = None,
) -> str:
    """Picture, legend, tables (``A: [0, 1, 2, 9]``), free list and events of ``step``."""
    snap = log.snapshots[step]
    bs = log.config.block_size
    lines = [f"Step {step}/{log.num_steps - 1}  {snap.title}".rstrip(),
             render_picture(log, step, chars=chars)]
    if legend:
        lines.append(LEGEND)
    for name, req in snap.requests().items():
        where = "" if req.slot is not None else "  (table kept outside the state)"
        last = req.tokens_in(len(req.table) - 1, bs) if req.table else 0
        lines.append(
            f"{name}: {list(req.table)}  {req.num_tokens} tokens, last block {last}/{bs}{where}"
        )
    lines.append(f"Free list, next to be handed out first: {list(snap.free_order)}")
    if events:
        for e in log.events_at(step):
            lines.append("  " + e.describe())
    return "\n".join(lines)


def render_run(log: RunLog) -> str:
    """Every step, one after another: the text file the CLI writes."""
    chars = char_labels(log)
    return "\n\n".join(render_step(log, t, chars=chars) for t in range(log.num_steps)) + "\n"


def rich_step(log: RunLog, step: int):
    """``render_step`` as ``rich`` text, each owner's cells in its colour."""
    from rich.text import Text

    text = Text(render_step(log, step))
    colors = owner_colors(log)
    chars = char_labels(log)
    snap = log.snapshots[step]
    live = {chars[name]: colors[name] for name in snap.requests()}
    n = log.config.num_blocks
    rows = 3 * len(range(0, n, _per_row(n) or n))  # cells, ruler and marks per row
    cell = cell_width(n) + 2
    lines = text.plain.splitlines()
    offset = len(lines[0]) + 1
    for i, line in enumerate(lines[1 : 1 + rows]):
        if i % 3 == 0:  # a row of cells
            for j in range(0, len(line), cell):
                label = line[j + 1 : j + cell - 1].strip()
                if label in live:
                    text.stylize(f"bold white on {live[label]}", offset + j, offset + j + cell)
        offset += len(line) + 1
    return text


def play(log: RunLog, *, delay: float = 0.8, console=None, start: int = 0) -> None:
    """Step through the run in a ``rich`` live view (``delay`` seconds per step)."""
    from rich.live import Live
    from rich.panel import Panel

    def frame(step):
        return Panel(rich_step(log, step), title=f"paged_jax: {log.scenario or 'run'}")

    with Live(frame(start), console=console, auto_refresh=False) as live:
        for step in range(start, log.num_steps):
            live.update(frame(step), refresh=True)
            time.sleep(delay)
