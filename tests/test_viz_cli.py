"""``paged-jax viz``: every view written; a saved log redraws the same views."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from paged_jax.viz.cli import main
from tests.test_viz_reference import SEED_PICTURE_STEPS

VIEWS = ("run.json", "layout.txt", "layout.html", "trace.json", "timeline.png", "curves.png")


def test_scenario_writes_every_view(tmp_path, capsys):
    out = tmp_path / "fork"
    assert main(["--scenario", "fork-cow", "--out", str(out), "--quiet"]) == 0
    for name in (*VIEWS, "layout.gif"):
        assert (out / name).stat().st_size > 0, name
    log = json.loads((out / "run.json").read_text())
    steps = len(log["snapshots"])
    assert sorted(p.name for p in (out / "steps").iterdir()) == [
        f"step_{i:03d}.png" for i in range(steps)
    ]
    with Image.open(out / "layout.gif") as gif:
        assert gif.n_frames == steps
    assert capsys.readouterr().out == ""  # --quiet


def test_seed_then_redraw_from_its_log(tmp_path, capsys):
    first, second = tmp_path / "seed", tmp_path / "again"
    assert main(["--scenario", "seed", "--out", str(first), "--no-gif"]) == 0
    assert "20 steps of 'seed'" in capsys.readouterr().out
    text = (first / "layout.txt").read_text()
    for picture in SEED_PICTURE_STEPS.values():
        assert picture in text
    assert main(["--log", str(first / "run.json"), "--out", str(second), "--no-gif",
                 "--quiet"]) == 0
    for name in ("run.json", "layout.txt", "layout.html", "trace.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in ("timeline.png", "curves.png"):
        a = np.asarray(Image.open(first / name).convert("RGB"))
        b = np.asarray(Image.open(second / name).convert("RGB"))
        assert np.array_equal(a, b), name
    assert not (second / "layout.gif").exists()


def test_bad_log_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    assert main(["--log", str(bad), "--out", str(tmp_path / "o")]) == 1
    assert "cannot read" in capsys.readouterr().err
