"""Runs tests/sharded in subprocesses with 8 virtual CPU devices (XLA_FLAGS must be set
before jax starts, so they cannot share this process). A group passes only if its pytest run
exits 0: a collection failure (e.g. the devices missing), a failed test, or no test run at
all (exit code 5) fails it, with the subprocess's output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_group(path: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags.strip(),
           "PAGED_JAX_SHARDED_TESTS": "1", "JAX_PLATFORMS": "cpu"}
    # The suite's per-test limit (pyproject.toml's timeout) bounds the run: the exception it
    # raises here kills the subprocess.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         path], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"{path}: pytest exited {proc.returncode}\n{proc.stdout[-6000:]}\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


def test_tensor_parallel_steps():
    run_group("tests/sharded/test_tp_steps.py")


def test_engine_on_a_mesh():
    run_group("tests/sharded/test_engine_mesh.py")
