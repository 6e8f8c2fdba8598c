"""PNG, GIF, timeline and curves: pixels sampled at known block positions against the replay."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from paged_jax.viz import RunLog, scenarios
from paged_jax.viz.curves import save_curves
from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    PALETTE,
    SHARED_MARK,
    hex_to_rgb,
    tint,
)
from paged_jax.viz.metrics import step_metrics
from paged_jax.viz.png import center, render_step_image, save_step_png, step_geometry
from paged_jax.viz.timeline import SHARED_OWNERS_COLOR, save_gif, save_timeline, timeline_rgb
from tests.test_viz_reference import fork_cow_steps, seed_steps

# Requests take palette colours in order of first appearance: A, B, C, then D, E.
SEED_COLORS = {name: PALETTE[i] for i, name in enumerate("ABCDE")}


@pytest.fixture(scope="module")
def seed_log():
    return scenarios.seed()


def assert_color(img, xy, color, tol=3, what=""):
    x, y = xy
    got = img[y, x].astype(int)
    want = np.array(hex_to_rgb(color) if isinstance(color, str) else color)
    assert np.abs(got - want).max() <= tol, f"{what} at {xy}: got {tuple(got)}, want {color}"


def expected_block_color(owners, ref, tokens, block_size, where):
    """What a block shows at its bottom (``where="fill"``) or top-left (``"empty"``)."""
    if ref == 0:
        return FREE_COLOR
    if not owners:
        return HELD_COLOR
    (owner,) = owners
    if where == "empty" and tokens < block_size:
        return tint(SEED_COLORS[owner])
    return SEED_COLORS[owner]


@pytest.mark.parametrize("step", [3, 14, 15, 17, 19])
def test_step_png_blocks(seed_log, step, tmp_path):
    path = tmp_path / f"step_{step}.png"
    save_step_png(seed_log, step, path)
    img = np.asarray(Image.open(path).convert("RGB"))
    g = step_geometry(seed_log)
    assert img.shape == (g.height, g.width, 3)
    ref = seed_steps()[step]
    for b in range(20):
        owners, refs, tokens = ref["owners"][b], ref["refs"][b], ref["tokens"][b]
        x0, y0, x1, y1 = g.block_box(b)
        if len(owners) > 1:  # stripes of D and E under the shared band
            assert_color(img, (x0 + 5, y1 - 4), SEED_COLORS["D"], what=f"block {b}")
            assert_color(img, (x1 - 5, y1 - 4), SEED_COLORS["E"], what=f"block {b}")
        else:
            full = (center(g.block_box(b))[0], y1 - 2 if tokens < 16 else y1 - 6)
            assert_color(img, full, expected_block_color(owners, refs, tokens, 16, "fill"),
                         what=f"step {step} block {b} bottom")
            top = (x0 + 5, y0 + g.band + 3)
            if refs <= 1:
                assert_color(img, top, expected_block_color(owners, refs, tokens, 16, "empty"),
                             what=f"step {step} block {b} top")
        band = center(g.mark_box(b))
        if refs > 1:
            assert_color(img, band, SHARED_MARK, what=f"step {step} block {b} shared mark")
        else:
            assert np.abs(img[band[1], band[0]].astype(int) - hex_to_rgb(SHARED_MARK)).max() > 60


def test_changed_blocks_are_outlined(seed_log):
    img = render_step_image(seed_log, 17)  # E: shares 10, 11 and takes 13
    g = step_geometry(seed_log)
    for b in range(20):
        x0, y0, x1, y1 = g.highlight_box(b)
        ring = (x0, (y0 + y1) // 2)  # left edge of the outline, in the gap between blocks
        if b in (10, 11, 13):
            assert_color(img, ring, CHANGED_COLOR, tol=40, what=f"outline of block {b}")
        else:
            assert_color(img, ring, "#ffffff", what=f"no outline on block {b}")


def test_tables_are_drawn_under_the_blocks(seed_log):
    img = render_step_image(seed_log, 14)  # A and C alive
    g = step_geometry(seed_log)
    for row, name in enumerate("AC"):
        x0, y0, x1, y1 = g.table_box(row, 0)
        assert_color(img, (x0 + 3, y1 - 3), tint(SEED_COLORS[name], 0.6), what=f"{name}[0]")
    x0, y0, x1, y1 = g.table_box(2, 0)  # no third request at step 14
    assert_color(img, (x0 + 3, y1 - 3), "#ffffff", what="empty row")


def test_png_from_a_reloaded_log_is_identical(seed_log, tmp_path):
    seed_log.save(tmp_path / "run.json")
    back = RunLog.load(tmp_path / "run.json")
    assert np.array_equal(render_step_image(seed_log, 17), render_step_image(back, 17))


def test_timeline_colours_every_step_and_block(seed_log, tmp_path):
    rgb = timeline_rgb(seed_log)
    want = seed_steps()
    assert rgb.shape == (20, len(want), 3)
    for t, ref in enumerate(want):
        for b in range(20):
            owners = ref["owners"][b]
            if ref["refs"][b] == 0:
                color = FREE_COLOR
            elif not owners:
                color = HELD_COLOR
            elif len(owners) > 1:
                color = SHARED_OWNERS_COLOR
            else:
                color = SEED_COLORS[next(iter(owners))]
            assert tuple(rgb[b, t]) == hex_to_rgb(color), f"step {t} block {b}"
    save_timeline(seed_log, tmp_path / "timeline.png")
    img = np.asarray(Image.open(tmp_path / "timeline.png").convert("RGB")).reshape(-1, 3)
    for color in (SEED_COLORS["A"], SEED_COLORS["C"], SHARED_OWNERS_COLOR):
        assert (np.abs(img.astype(int) - hex_to_rgb(color)).max(axis=1) == 0).sum() > 50, color


def test_gif_has_one_frame_per_step(seed_log, tmp_path):
    path = tmp_path / "layout.gif"
    save_gif(seed_log, path, frames_dir=tmp_path, progress=False)
    g = step_geometry(seed_log)
    with Image.open(path) as gif:
        assert gif.n_frames == seed_log.num_steps
        gif.seek(3)
        frame = np.asarray(gif.convert("RGB"))
    assert frame.shape == (g.height, g.width, 3)
    x, y = center(g.block_box(0))
    assert_color(frame, (x, g.block_box(0)[3] - 6), SEED_COLORS["A"], tol=8, what="A in frame 3")
    assert_color(frame, center(g.block_box(12)), FREE_COLOR, tol=8, what="free in frame 3")
    assert (tmp_path / "step_019.png").exists()


def test_curves_metrics(seed_log, tmp_path):
    m = step_metrics(seed_log)
    for t, ref in enumerate(seed_steps()):
        used = sum(r > 0 for r in ref["refs"])
        assert m["used_blocks"][t] == used and m["free_blocks"][t] == 20 - used
        assert m["block_util"][t] == pytest.approx(used / 20)
        assert m["token_util"][t] == pytest.approx(sum(ref["tokens"]) / 320)
        logical = sum(len(v) for v in ref["tables"].values())
        physical = len({b for v in ref["tables"].values() for b in v})
        assert m["saved_blocks"][t] == logical - physical
    assert m["saved_blocks"][17] == 2  # the seed: "Memory saved: 2 blocks"
    fork = step_metrics(scenarios.fork_cow())
    copies = [s["refs"] for s in fork_cow_steps()]
    assert len(copies) == len(fork["cow_copies"])
    assert fork["cow_copies"].tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    save_curves(seed_log, tmp_path / "curves.png")
    assert Image.open(tmp_path / "curves.png").size[0] > 400
