"""The README's test command, which CI runs verbatim (``.ci/run``), ends a run whose worker
crashes or whose test hangs with a failure that names the test, instead of waiting forever.

Each case runs the command's pytest part, as written, over a few throwaway test files in a
folder of their own, against the installed pytest-xdist and pytest-timeout."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# ``.ci/run``'s rule: the first fenced block after the marker, one line of shell.
BLOCK = re.search(r"<!-- test-command -->\s*```\w*\n(.*?)\n```", README.read_text(), re.S)


def pytest_args() -> list[str]:
    """The arguments the README's test command passes to pytest."""
    assert BLOCK, "README.md lost its <!-- test-command --> block"
    for part in BLOCK.group(1).split("&&"):
        words = shlex.split(part)
        if words[1:3] == ["-m", "pytest"]:
            return words[3:]
    raise AssertionError(f"no `python -m pytest` in the test command {BLOCK.group(1)!r}")


PASSING = ("import time\n\ndef test_a():\n    time.sleep(0.2)\n\n"
           "def test_b():\n    time.sleep(0.2)\n")


def run(folder: pathlib.Path, files: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """The test command's pytest over ``files`` (name: source) in ``folder``, with a pytest.ini
    of its own there, so that neither this project's configuration nor its tests are read."""
    for name, source in files.items():
        (folder / name).write_text(source)
    (folder / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    cmd = [sys.executable, "-m", "pytest", *pytest_args(), "-p", "no:cacheprovider", *extra]
    # The limit is what a hang would run into: each case ends in seconds.
    try:
        return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the test command did not end within 120 s: {shlex.join(cmd)}")


def test_a_crashed_worker_fails_the_run(tmp_path):
    # Several files per worker: under --dist loadfile, xdist 3.8 replacing a worker that had
    # finished files before it crashed is what waits forever.
    files = {f"test_f{i}.py": PASSING for i in range(6)}
    files["test_f3.py"] = ("import os, signal\n\ndef test_a():\n    pass\n\n"
                           "def test_crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n"
                           "def test_after():\n    pass\n")
    done = run(tmp_path, files)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "crashed while running 'test_f3.py::test_crash'" in done.stdout, done.stdout


def test_a_hung_test_fails_and_the_run_goes_on(tmp_path):
    files = {"test_a.py": PASSING,
             "test_b.py": "import time\n\ndef test_hang():\n    time.sleep(300)\n\n"
                          "def test_after():\n    pass\n"}
    # The project's limit is minutes; this folder's test hangs for 300 s against 3.
    done = run(tmp_path, files, "-o", "timeout=3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED test_b.py::test_hang - Failed: Timeout (>3.0s)" in done.stdout, done.stdout
    assert "1 failed, 3 passed" in done.stdout, done.stdout
