"""The terminal view: the seed's literal pictures, the marks line, tables, free list, live view."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from paged_jax.viz import RecordingPool, scenarios, terminal
from tests.test_viz_reference import SEED_PICTURE_STEPS, seed_steps


@pytest.fixture(scope="module")
def seed_log():
    return scenarios.seed()


@pytest.mark.parametrize("step", sorted(SEED_PICTURE_STEPS))
def test_seed_pictures_are_the_seeds(seed_log, step):
    picture = terminal.render_picture(seed_log, step)
    assert picture.splitlines()[:2] == SEED_PICTURE_STEPS[step].splitlines()
    assert terminal.render_step(seed_log, step).splitlines()[1:3] == (
        SEED_PICTURE_STEPS[step].splitlines()
    )


def test_marks_line_shows_ref_counts_and_partial_blocks(seed_log):
    want = seed_steps()
    for step in (3, 14, 17):
        marks = terminal.render_picture(seed_log, step).splitlines()[2]
        expected = []
        for ref, tokens in zip(want[step]["refs"], want[step]["tokens"], strict=True):
            mark = (str(ref) if ref > 1 else "") + ("~" if 0 < tokens < 16 else "")
            expected.append(f"{mark:>2} ")
        assert marks == "".join(expected).rstrip(), f"step {step}"
    # After B leaves: A's block 9 (2 of 16 tokens) and C's block 8 (2 of 16) are partial.
    assert terminal.render_picture(seed_log, 14).splitlines()[2] == " " * 25 + "~  ~"


def test_tables_free_list_and_legend(seed_log):
    want = seed_steps()[14]
    text = terminal.render_step(seed_log, 14)
    assert "A: [0, 1, 2, 9]  50 tokens, last block 2/16" in text
    assert "C: [5, 6, 7, 8]  50 tokens, last block 2/16" in text
    assert f"Free list, next to be handed out first: {want['free']}" in text
    assert "[*] shared" in text and "[ ] free" in text and "~ partly filled" in text
    assert "free B[1]: block 4 back to the free list" in text
    shared = terminal.render_step(seed_log, 17)
    assert "D: [10, 11, 12]" in shared and "(table kept outside the state)" in shared


def test_names_sharing_a_first_letter_get_distinct_characters():
    pool = RecordingPool(scenarios.TINY_POOL)
    pool.admit(["req-1", "req-2"], [4, 4])
    pool.capture("two requests")
    assert terminal.char_labels(pool.log) == {"req-1": "r", "req-2": "R"}
    picture = terminal.render_picture(pool.log, 1)
    assert picture.startswith("[r][R][ ]")
    assert picture.splitlines()[-1] == "Key: r = req-1, R = req-2"


def test_live_view_plays_every_step(seed_log):
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system="truecolor")
    terminal.play(seed_log, delay=0, console=console)
    out = console.file.getvalue()
    assert f"Step {seed_log.num_steps - 1}/{seed_log.num_steps - 1}" in out
    assert "38;2;31;119;180" in out or "48;2;31;119;180" in out  # A's colour, #1f77b4
