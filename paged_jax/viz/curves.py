"""Curves over steps: utilization by blocks and by tokens, blocks saved by sharing, event
counts (copy-on-write, preemption, prefix hits, evictions) and free blocks."""

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


def save_curves(log: RunLog, path: str | os.PathLike) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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
    axes[0].set_ylim(0, 1.05)
    axes[0].fill_between(steps, m["token_util"], m["block_util"], step="post", alpha=0.15,
                         color="grey", label="internal fragmentation")
    axes[-1].set_ylim(0, log.config.num_blocks + 0.5)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"paged_jax: {log.scenario or 'run'}", fontsize=11)
    fig.savefig(path)
