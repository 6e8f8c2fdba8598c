"""The offline HTML page, opened from disk in real headless Chromium (Debian's ``chromium``)
through Playwright. Never skipped: without the browser the test fails and says why."""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from paged_jax.viz import scenarios
from paged_jax.viz.html import render_html, save_html
from paged_jax.viz.layout import PALETTE, hex_to_rgb
from tests.test_viz_reference import seed_steps

CHROMIUM = os.environ.get("PAGED_JAX_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
A_COLOR = PALETTE[0]  # A is the first request of the seed


@pytest.fixture(scope="module")
def seed_log():
    return scenarios.seed()


@pytest.fixture(scope="module")
def page(seed_log, tmp_path_factory):
    """The seed's page loaded from a file, with every console message and request logged."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright (the test extra). "
                    "Do not run `playwright install`; the test uses Debian's chromium.")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium "
                    "(or set PAGED_JAX_CHROMIUM to a Chromium binary).")
    path = tmp_path_factory.mktemp("html") / "layout.html"
    save_html(seed_log, path)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        context = browser.new_context(viewport={"width": 1200, "height": 1000})
        pg = context.new_page()
        pg.log = {"console": [], "errors": [], "requests": []}
        pg.on("console", lambda m: pg.log["console"].append((m.type, m.text)))
        pg.on("pageerror", lambda e: pg.log["errors"].append(str(e)))
        context.on("request", lambda r: pg.log["requests"].append(r.url))
        pg.goto(path.as_uri())
        pg.wait_for_selector('[data-block="0"] rect.bg[data-owner]')
        pg.page_url = path.as_uri()
        yield pg
        browser.close()


def go_to(page, step: int) -> None:
    """Step with the keyboard: Home, then Right arrows on the focused slider."""
    page.focus("#step")
    page.keyboard.press("Home")
    for _ in range(step):
        page.keyboard.press("ArrowRight")
    assert page.input_value("#step") == str(step)


def shown_owners(page) -> list[str]:
    return page.eval_on_selector_all(
        "g.block rect.bg", "els => els.map(e => e.getAttribute('data-owner'))"
    )


def expected_owners(ref: dict) -> list[str]:
    return ["+".join(sorted(o)) or ("(held)" if r else "")
            for o, r in zip(ref["owners"], ref["refs"], strict=True)]


def test_page_is_self_contained(seed_log):
    text = render_html(seed_log)
    assert not re.search(r"(src|href)\s*=\s*[\"'](?!data:)", text), "external reference"
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text


def test_slider_steps_change_the_blocks_shown(page):
    want = seed_steps()
    for step in (3, 14, 17, 19):
        go_to(page, step)
        assert shown_owners(page) == expected_owners(want[step]), f"step {step}"
    go_to(page, 3)
    assert page.get_attribute('[data-block="3"] rect.bg', "data-owner") == "B"
    page.keyboard.press("ArrowRight")  # the slider keeps focus: step 4
    page.click("h1")  # blur the slider; the page's own arrow keys take over
    for _ in range(10):
        page.keyboard.press("ArrowRight")
    assert page.input_value("#step") == "14"
    assert page.get_attribute('[data-block="3"] rect.bg', "data-owner") == ""  # B released
    assert page.get_attribute('[data-block="9"] rect.bg', "data-owner") == "A"
    assert page.inner_text("#label") == "step 14 / 19"
    assert "req_b.release()" in page.inner_text("#title")


def test_hover_shows_owners_ref_count_and_tokens(page):
    go_to(page, 17)
    page.hover('[data-block="10"]')
    tip = page.inner_text("#tip")
    assert "block 10" in tip and "ref count: 3" in tip and "tokens: 16/16" in tip
    assert "D (logical 0)" in tip and "E (logical 0)" in tip
    page.hover('[data-block="9"]')
    tip = page.inner_text("#tip")
    assert "A (logical 3)" in tip and "ref count: 1" in tip and "tokens: 2/16" in tip


def test_clicking_a_request_highlights_its_table_and_blocks(page):
    go_to(page, 17)
    page.click('#tables .req[data-request="A"]')
    classes = page.eval_on_selector_all("g.block", "els => els.map(e => e.getAttribute('class'))")
    a_blocks = {0, 1, 2, 9}
    for b, cls in enumerate(classes):
        assert ("sel" in cls.split()) == (b in a_blocks), f"block {b}: {cls}"
        assert ("dim" in cls.split()) == (b not in a_blocks), f"block {b}: {cls}"
    assert "sel" in page.get_attribute('#tables .req[data-request="A"]', "class")
    page.click('#tables .req[data-request="A"]')
    assert page.locator("g.block.dim").count() == 0


def test_curves_follow_and_set_the_step(page):
    go_to(page, 5)
    x5 = float(page.get_attribute("#curves line.cursor", "x1"))
    go_to(page, 15)
    x15 = float(page.get_attribute("#curves line.cursor", "x1"))
    assert x15 > x5
    chart = page.locator('#curves g.chart[data-chart="blocks"] rect').first.bounding_box()
    page.mouse.click(chart["x"] + 1, chart["y"] + chart["height"] / 2)  # the left end: step 0
    assert page.input_value("#step") == "0"


def test_renders_offline_without_errors_and_saves_a_screenshot(page):
    go_to(page, 17)
    ARTIFACTS.mkdir(exist_ok=True)
    png = page.screenshot(full_page=True, path=str(ARTIFACTS / "viz_html_seed_step17.png"))
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20, "the page looks blank"
    box = page.locator('[data-block="0"] rect.bg').bounding_box()
    x, y = int(box["x"] + box["width"] / 2), int(box["y"] + box["height"] - 4)
    assert np.abs(img[y, x].astype(int) - hex_to_rgb(A_COLOR)).max() <= 3, "block 0 is not A's"
    assert page.log["errors"] == []
    assert [m for m in page.log["console"] if m[0] in ("error", "warning")] == []
    assert page.log["requests"] == [page.page_url], "the page made network requests"
    assert page.evaluate("performance.getEntriesByType('resource').length") == 0


def test_page_opens_on_the_first_step_that_holds_a_block(page, seed_log):
    fresh = page.context.new_page()
    fresh.goto(page.page_url)
    fresh.wait_for_selector('[data-block="0"] rect.bg[data-owner]')
    busy = [t for t, ref in enumerate(seed_steps()) if any(r > 0 for r in ref["refs"])]
    assert busy[0] > 0  # the seed's step 0 is the empty pool
    assert fresh.input_value("#step") == str(busy[0])
    assert fresh.get_attribute('[data-block="0"] rect.bg', "data-owner") == "A"
    fresh.close()


def test_curves_are_step_functions(page, seed_log):
    """Each curve holds step t's value from x_t to x_t+1, then jumps vertically (the PNG's
    ``where="post"``), at a height affine in the metric (a sloped line fails)."""
    from paged_jax.viz.metrics import step_metrics

    metrics = step_metrics(seed_log)
    lines = page.locator("#curves polyline").all()
    assert len(lines) == 9
    for line in lines:
        values = np.asarray(metrics[line.get_attribute("data-metric")])
        pts = np.array([list(map(float, p.split(",")))
                        for p in line.get_attribute("points").split()])
        assert len(pts) == 2 * len(values) - 1
        at = pts[0::2]  # (x_t, height of step t's value)
        held = pts[1::2]  # (x_t+1, height of step t's value), before the jump
        assert np.array_equal(held[:, 1], at[:-1, 1]), "a value is not held until the next step"
        assert np.array_equal(held[:, 0], at[1:, 0]), "the jump is not vertical"
        assert np.all(np.diff(at[:, 0]) > 0)
        if np.ptp(values) > 0:
            slope, icpt = np.polyfit(values, at[:, 1], 1)
            assert np.allclose(slope * values + icpt, at[:, 1], atol=1e-6)
