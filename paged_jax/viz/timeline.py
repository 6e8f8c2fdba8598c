"""The whole run at once: a step x physical-block heatmap coloured by owner with a ref-count
panel under it, and an animated GIF of the per-step pictures."""

from __future__ import annotations

import os

import numpy as np

from paged_jax.viz.layout import (
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    SHARED_OWNERS_COLOR,
    block_views,
    hex_to_rgb,
    owner_colors,
)
from paged_jax.viz.log import RunLog


def timeline_rgb(log: RunLog) -> np.ndarray:
    """[num_blocks, num_steps, 3] uint8: each block's colour at each step (owner's colour;
    ``SHARED_OWNERS_COLOR`` for several owners, ``HELD_COLOR`` for no table, free blocks
    ``FREE_COLOR``). Row ``b`` is block ``b``, column ``t`` is step ``t``."""
    colors = {name: hex_to_rgb(c) for name, c in owner_colors(log).items()}
    out = np.zeros((log.config.num_blocks, log.num_steps, 3), np.uint8)
    for t, snap in enumerate(log.snapshots):
        for v in block_views(snap):
            if v.status == "free":
                rgb = hex_to_rgb(FREE_COLOR)
            elif not v.owners:
                rgb = hex_to_rgb(HELD_COLOR)
            elif len(v.owners) > 1:
                rgb = hex_to_rgb(SHARED_OWNERS_COLOR)
            else:
                rgb = colors[v.owners[0]]
            out[v.block, t] = rgb
    return out


def ref_count_matrix(log: RunLog) -> np.ndarray:
    """[num_blocks, num_steps] int: ref counts over time."""
    return np.stack([s.ref_counts for s in log.snapshots], axis=1)


def save_timeline(log: RunLog, path: str | os.PathLike) -> None:
    """Heatmap (top) and ref counts (bottom), both block x step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    n, steps = log.config.num_blocks, log.num_steps
    # Each panel gives a block 16 px in a small pool and (from about 64 blocks on) at least
    # one pixel, so no block row is dropped when the image is resampled.
    height = 2.5 + 2 * max(0.16 * min(n, 64), n / 100)
    fig = Figure(figsize=(max(8.0, 2.5 + 0.22 * steps), height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    extent = (-0.5, steps - 0.5, n - 0.5, -0.5)
    top.imshow(timeline_rgb(log), aspect="auto", interpolation="nearest", extent=extent)
    top.set_ylabel("physical block")
    top.set_title(f"Block ownership over time{': ' + log.scenario if log.scenario else ''}")
    handles = [Patch(color=c, label=name) for name, c in owner_colors(log).items()][:24]
    handles += [Patch(color=SHARED_OWNERS_COLOR, label="several owners"),
                Patch(color=HELD_COLOR, label="held, no table"),
                Patch(facecolor=FREE_COLOR, edgecolor="#999999", label="free")]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7,
               ncols=1 + len(handles) // 16, frameon=False)
    refs = ref_count_matrix(log)
    top_ref = max(2, int(refs.max()))
    cmap = ListedColormap(["#ffffff", "#c6dbef", *([SHARED_MARK] if top_ref == 2 else
                                                   _ramp(top_ref - 1))])
    norm = BoundaryNorm(np.arange(-0.5, top_ref + 1), cmap.N)
    im = bottom.imshow(refs, aspect="auto", interpolation="nearest", extent=extent, cmap=cmap,
                       norm=norm)
    fig.colorbar(im, ax=bottom, label="ref count", ticks=range(top_ref + 1), pad=0.01)
    bottom.set_ylabel("physical block")
    bottom.set_xlabel("step")
    bottom.set_title("Ref counts (> 1: shared)")
    for ax in (top, bottom):  # block ids and steps are integers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path)


def _ramp(k: int) -> list[str]:
    from matplotlib import colormaps

    return [colormaps["Oranges"](x) for x in np.linspace(0.45, 1.0, k)]


def save_gif(
    log: RunLog,
    path: str | os.PathLike,
    *,
    duration_ms: int = 700,
    frames_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> None:
    """Every step's picture as one GIF frame (and as ``step_NNN.png`` in ``frames_dir``)."""
    from PIL import Image
    from tqdm.auto import tqdm

    from paged_jax.viz.png import render_step_image, step_geometry

    geometry = step_geometry(log)
    frames = []
    for step in tqdm(range(log.num_steps), desc="rendering steps", unit="step",
                     disable=not progress):
        frame = Image.fromarray(render_step_image(log, step, geometry))
        if frames_dir is not None:
            frame.save(os.path.join(frames_dir, f"step_{step:03d}.png"))
        frames.append(frame.convert("P", palette=Image.Palette.ADAPTIVE, colors=255))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
