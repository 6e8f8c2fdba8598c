"""The README's quick starts run as written: every ```python block, each in a fresh namespace,
in the order the README gives them. A block that raises fails the test."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_quick_starts():
    assert len(BLOCKS) >= 3, "the README lost its python quick starts"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_quick_start_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": f"readme_block_{index}"})
