"""The views at scale: the palette against the swatches, integer curve axes, the grid layouts
of a 2,000-block, 200-request run (PNG and HTML canvas sampled against the state), one
request's arrows in a crowded picture, and sizes that do not grow with an idle pool."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest
from matplotlib.text import Annotation

from paged_jax.viz import RecordingPool, RunLog, scenarios
from paged_jax.viz.curves import PANELS, curves_figure
from paged_jax.viz.html import render_html
from paged_jax.viz.layout import block_views, owner_styles, selected_request, tint
from paged_jax.viz.palette import (
    FREE_COLOR,
    HELD_COLOR,
    MIN_DELTA_E,
    MIN_SWATCH_DELTA_E,
    PALETTE,
    SWATCHES,
    assign_styles,
    delta_e,
    hatch_mask,
    hex_to_rgb,
)
from paged_jax.viz.png import ARROW_LIMIT, render_step_image, step_figure, step_geometry
from tests.test_viz_html import CHROMIUM, FLAGS


@pytest.fixture(scope="module")
def big_log():
    log = scenarios.random_run(steps=40, seed=0, num_blocks=2000, num_requests=200)
    assert log.config.num_blocks == 2000 and len(log.request_names()) >= 200
    return log


# ---- colours
def test_palette_keeps_clear_of_the_swatches_and_of_itself():
    assert len(PALETTE) >= 64 and len(set(PALETTE)) == len(PALETTE)
    for color in PALETTE:
        for what, swatch in SWATCHES.items():
            assert delta_e(color, swatch) >= MIN_SWATCH_DELTA_E, f"{color} looks {what}"
        # a partly filled block's empty part must not read as free
        assert delta_e(tint(color), FREE_COLOR) >= 5, color
    for a, b in itertools.combinations(PALETTE, 2):
        assert delta_e(a, b) >= MIN_DELTA_E, (a, b)
    assert MIN_DELTA_E >= 20  # CIE76: 2.3 is just noticeable; 20 is plainly different


def test_the_random_runs_requests_never_take_a_swatch():
    styles = owner_styles(scenarios.random_run())
    assert "O" in styles  # the request that used to get the held grey
    for name, s in styles.items():
        assert all(delta_e(s.color, sw) >= MIN_SWATCH_DELTA_E for sw in SWATCHES.values()), name


def test_64_live_requests_get_64_distinct_colours_and_later_ones_no_repeat_while_alive():
    live = assign_styles([(f"r{i}", 0, 10) for i in range(64)])
    colors = [s.color for s in live.values()]
    assert len(set(colors)) == 64 and all(s.hatch == "" for s in live.values())
    assert min(delta_e(a, b) for a, b in itertools.combinations(colors, 2)) >= MIN_DELTA_E
    # 150 requests, 100 alive at once: no two live requests share (colour, hatch)
    spans = [(f"q{i}", i, i + 99) for i in range(150)]
    styles = assign_styles(spans)
    for (a, fa, la), (b, fb, lb) in itertools.combinations(spans, 2):
        if fa <= lb and fb <= la:
            assert styles[a] != styles[b], (a, b)
    # 30 requests one after another: 30 different colours (the old palette wrapped at 20)
    seq = assign_styles([(f"s{i}", i, i) for i in range(30)])
    assert len({s.color for s in seq.values()}) == 30


def test_a_reused_colour_goes_to_the_request_after_the_longest_gap():
    spans = [(f"a{i}", 0, i) for i in range(64)] + [("late", 100, 101)]
    assert assign_styles(spans)["late"].color == PALETTE[0]  # a0 ended first (step 0)


def test_hatches_differ_and_tile():
    masks = {h: hatch_mask(h, 10, 10) for h in ("/", "\\", "x")}
    assert not hatch_mask("", 10, 10).any()
    assert masks["/"].any() and not np.array_equal(masks["/"], masks["\\"])
    assert np.array_equal(masks["x"], masks["/"] | masks["\\"])
    # anchored to the image: a box at (5, 0) continues its left neighbour's lines
    assert np.array_equal(hatch_mask("/", 10, 20)[:, 10:], hatch_mask("/", 10, 10, x0=10))


# ---- axes
def test_curve_axes_tick_at_integers_and_counts_start_at_zero():
    log = scenarios.seed()  # no copies, preemptions, hits or evictions: an all-zero panel
    fig = curves_figure(log)
    axes = fig.axes[: len(PANELS)]
    fig.canvas.draw()
    for ax, (title, _) in zip(axes, PANELS, strict=True):
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (title, ticks)
        if title != "Utilization":
            bottom, top = ax.get_ylim()
            assert bottom == 0 and top >= 1, (title, bottom, top)
            yt = [t for t in ax.get_yticks() if bottom <= t <= top]
            assert all(float(t).is_integer() for t in yt), (title, yt)


# ---- the per-step PNG at scale
def expected_cell(v, styles) -> tuple[tuple[int, int, int], bool]:
    """A block's colour near the bottom of its first stripe, and whether it is owned."""
    if v.status == "free":
        return hex_to_rgb(FREE_COLOR), False
    if not v.owners:
        return hex_to_rgb(HELD_COLOR), False
    color = styles[v.owners[0]].color
    return hex_to_rgb(color if v.tokens > 0 else tint(color)), True


def near_segment(p, a, b, d=3.0) -> bool:
    p, a, b = (np.asarray(x, float) for x in (p, a, b))
    t = np.clip(np.dot(p - a, b - a) / max(1e-9, np.dot(b - a, b - a)), 0, 1)
    return np.linalg.norm(p - (a + t * (b - a))) <= d


def test_big_png_is_a_grid_that_matches_the_state(big_log):
    step = max(range(big_log.num_steps), key=lambda t: big_log.snapshots[t].ref_counts.sum())
    g = step_geometry(big_log)
    assert g.grid and g.cell <= 16
    fig = step_figure(big_log, step, g)
    arrows = [(a.xyann, a.xy) for a in fig.axes[0].texts if isinstance(a, Annotation)]
    img = render_step_image(big_log, step, g)
    assert img.shape == (g.height, g.width, 3)
    styles = owner_styles(big_log)
    checked = 0
    for v in block_views(big_log.snapshots[step]):
        x0, y0, x1, y1 = g.block_box(v.block)
        p = (x0 + 1, y1 - 2)  # inside a selected block's black edge, in the first stripe
        if any(near_segment(p, a, b) for a, b in arrows):
            continue
        want, _ = expected_cell(v, styles)
        got = tuple(int(c) for c in img[p[1], p[0]])
        assert np.abs(np.subtract(got, want)).max() <= 2, f"block {v.block}: {got} != {want}"
        checked += 1
    assert checked > 1900


def test_crowded_picture_draws_arrows_for_one_request(big_log):
    step = big_log.num_steps // 2
    snap = big_log.snapshots[step]
    entries = sum(len(r.table) for r in snap.requests().values())
    assert entries > ARROW_LIMIT
    chosen = selected_request(big_log, step)
    g = step_geometry(big_log)
    fig = step_figure(big_log, step, g)
    arrows = [a for a in fig.axes[0].texts if isinstance(a, Annotation)]
    rows = list(snap.requests())
    table = snap.requests()[chosen].table
    assert len(arrows) == len(table)
    row = rows.index(chosen)
    for i, (a, b) in enumerate(zip(arrows, table, strict=True)):
        x0, y0, x1, _ = g.table_box(row, i)
        bx0, _, bx1, _ = g.block_box(b)
        assert a.xyann == ((x0 + x1) / 2, y0) and a.xy[0] == (bx0 + bx1) / 2


def test_small_picture_keeps_every_arrow():
    log = scenarios.seed()
    fig = step_figure(log, 17)
    arrows = [a for a in fig.axes[0].texts if isinstance(a, Annotation)]
    assert len(arrows) == sum(len(r.table) for r in log.snapshots[17].requests().values())


def test_png_size_per_block_is_bounded(big_log):
    g = step_geometry(big_log)
    pool_px = g.width * (g.blocks_bottom - g.header)
    assert pool_px / g.num_blocks <= 20 * 20  # a 14 px cell, its gap and the row labels
    assert g.table_pitch * g.rows_per_column <= g.table_pitch * big_log.config.max_seqs


# ---- labels that fit their block
def crowded_log() -> RunLog:
    """Block 0 shared by five requests, two with two-letter names."""
    pool = RecordingPool(scenarios.TINY_POOL, scenario="crowded")
    pool.admit(["A"], [6])
    pool.capture("A arrives")
    pool.fork(["A"] * 4, ["B2", "C", "D2", "E"])
    pool.capture("four forks")
    pool.capture("nothing changes")  # no changed-block outline in the gaps
    return pool.log


def test_png_labels_stay_inside_their_block():
    log = crowded_log()
    g = step_geometry(log)
    img = render_step_image(log, 3, g)  # 0 is the empty pool
    x0, y0, x1, _ = g.block_box(0)
    row = slice(y0 + g.band + 2, y0 + g.band + 16)  # where the label is written
    gap = img[row, x1 + 2 : x1 + g.gap - 2]
    assert (gap == 255).all(), "the label runs into the gap after block 0"


def launch():
    from playwright.sync_api import sync_playwright

    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium.")
    return sync_playwright()


def test_html_labels_stay_inside_their_block(tmp_path):
    path = tmp_path / "crowded.html"
    path.write_text(render_html(crowded_log()), encoding="utf-8")
    with launch() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        pg = browser.new_page()
        pg.goto(path.as_uri())
        pg.wait_for_selector('[data-block="0"] rect.bg[data-owner]')
        pg.evaluate("pagedJax.show(2)")
        label = pg.locator('[data-block="0"] text.label')
        assert label.inner_html().endswith("\u2026")
        widths = pg.eval_on_selector_all("g.block text.label", "els => els.map(e => "
                                         "[e.getBBox().width, +e.closest('g').dataset.block])")
        browser.close()
    assert widths and all(w <= 40 for w, _ in widths), widths


# ---- the HTML page at scale
def test_big_page_grid_matches_the_state_and_a_slider_step_is_fast(big_log, tmp_path):
    path = tmp_path / "big.html"
    path.write_text(render_html(big_log), encoding="utf-8")
    styles = owner_styles(big_log)
    steps = [t for t in range(0, big_log.num_steps, 9)]
    with launch() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        pg = browser.new_page(viewport={"width": 1300, "height": 1000})
        errors = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(path.as_uri())
        pg.wait_for_function("window.pagedJax !== undefined")
        assert pg.locator("g.block").count() == 0 and pg.locator("#grid").is_visible()
        for t in steps:
            pixels = pg.evaluate("""(t) => {
              pagedJax.show(t);
              const c = document.getElementById('grid'), C = pagedJax.cell;
              const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
              const out = [];
              for (let b = 0; b < D.numBlocks; b++) {
                const [x, y] = pagedJax.cellXY(b), i = 4 * ((y + C - 3) * c.width + x + 1);
                out.push([data[i], data[i + 1], data[i + 2]]);
              }
              return out; }""", t)
            for v in block_views(big_log.snapshots[t]):
                want, _ = expected_cell(v, styles)
                got = tuple(pixels[v.block])
                assert np.abs(np.subtract(got, want)).max() <= 2, (t, v.block, got, want)
        # a slider step, timed in the page: the update and the layout it forces
        times = pg.evaluate("""() => {
          const s = document.getElementById('step'), n = D.steps.length, out = [];
          for (let k = 0; k < 40; k++) {
            const a = performance.now();
            s.value = (k * 7) % n;
            s.dispatchEvent(new Event('input'));
            document.body.getBoundingClientRect();
            out.push(performance.now() - a);
          }
          return out; }""")
        browser.close()
    assert errors == []
    median = float(np.median(times))
    print(f"slider step: median {median:.1f} ms, max {max(times):.1f} ms over {len(times)}")
    assert median < 100, f"a slider step takes {median:.0f} ms (median of {len(times)})"


def padded(log: RunLog, factor: int) -> RunLog:
    """The same run in a pool ``factor`` times larger (the extra blocks never used)."""
    data = log.to_json()
    n = log.config.num_blocks
    data["config"]["num_blocks"] = n * factor
    extra = list(range(n, n * factor))
    for s in data["snapshots"]:
        s["ref_counts"] += [0] * len(extra)
        s["held"] += [0] * len(extra)
        s["free_order"] += extra
    return RunLog.from_json(data)


def test_page_size_does_not_grow_with_an_idle_pool(big_log):
    small = len(render_html(big_log).encode())
    large = len(render_html(padded(big_log, 4)).encode())
    assert large - small < 0.01 * small, (small, large)  # per-step changes only
    per_change = small / sum(1 for _ in big_log.events)
    assert per_change < 400, per_change
