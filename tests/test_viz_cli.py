"""``paged-jax viz``: every view written; a saved log redraws the same views."""

from __future__ import annotations

import json

import numpy as np
import pytest
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


def test_random_at_scale_brings_every_request_through_a_big_pool():
    from paged_jax.viz import scenarios

    log = scenarios.random_run(num_blocks=2000, num_requests=200)
    assert log.config.num_blocks == 2000
    held = {n for s in log.snapshots for n, r in s.requests().items() if r.table}
    arrivals = {n for n in held if not any(
        e.kind == "fork" and e.request == n for e in log.events)}
    assert len(arrivals) >= 200, len(arrivals)
    peak = max(int((s.ref_counts > 0).sum()) for s in log.snapshots)
    assert peak >= 1000, peak  # at least half the pool in use at the busiest step
    assert scenarios.random_run().config == scenarios.SMALL_POOL  # the default is unchanged


def test_scale_flags_are_checked(tmp_path, capsys):
    assert main(["--scenario", "seed", "--blocks", "100", "--out", str(tmp_path)]) == 2
    assert "--blocks and --requests apply to --scenario random" in capsys.readouterr().err
    assert main(["--scenario", "random", "--blocks", "3", "--out", str(tmp_path)]) == 2
    assert "num_blocks must be an int >= 8. Got 3" in capsys.readouterr().err


def test_model_flag_is_checked(tmp_path, capsys):
    assert main(["--scenario", "seed", "--model", "tiny", "--out", str(tmp_path)]) == 2
    assert "--model applies to --scenario engine, not 'seed'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--scenario", "engine", "--model", "big", "--out", str(tmp_path)])
    assert "invalid choice: 'big'" in capsys.readouterr().err
    from paged_jax.viz.cli import ENGINE_MODELS
    from paged_jax.viz.engine_run import MODELS

    assert ENGINE_MODELS == MODELS  # the flag offers what engine_run serves
