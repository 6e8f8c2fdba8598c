"""Curves over steps: utilization by blocks and by tokens, blocks saved by sharing, event
counts (copy-on-write, preemption, prefix hits, evictions) and free blocks.

Every curve is a step function (a value holds from its step to the next), as in the HTML
page. Steps and counts are integers, so their axes only tick at integers, and a count panel
starts at 0 and reaches at least 1 (an all-zero panel is not centred on 0).
"""

from __future__ import annotations

import os

from paged_jax.viz.log import RunLog
from paged_jax.viz.metrics import CURVES, step_metrics

PANELS = (
    ("Utilization", ("block_util", "token_util")),
    ("Sharing", ("saved_blocks",)),
    ("Events (cumulative)", ("cow_copies", "preemptions", "prefix_hits", "evictions")),
    ("Free blocks", ("free_blocks",)),
)


def curves_figure(log: RunLog):
    """The matplotlib ``Figure`` of the curves (one axes per ``PANELS`` entry, same order)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    m = step_metrics(log)
    steps = range(log.num_steps)
    fig = Figure(figsize=(9, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (title, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            ax.step(steps, m[key], where="post", label=CURVES[key], lw=1.6)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax is not axes[0]:  # counts
            top = max(1.0, *(float(m[k].max()) for k in keys))
            ax.set_ylim(0, top * 1.05)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylim(0, 1.05)
    axes[0].fill_between(steps, m["token_util"], m["block_util"], step="post", alpha=0.15,
                         color="grey", label="internal fragmentation")
    axes[-1].set_ylim(0, log.config.num_blocks * 1.05)
    axes[-1].set_xlim(0, max(1, log.num_steps - 1))
    axes[-1].set_xlabel("step")
    fig.suptitle(f"paged_jax: {log.scenario or 'run'}", fontsize=11)
    return fig


def save_curves(log: RunLog, path: str | os.PathLike) -> None:
    curves_figure(log).savefig(path)
