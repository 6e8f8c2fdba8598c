"""The engine serving the real default model (SmolLM2-135M-Instruct from its GGUF file):
greedy chat answers equal transformers' ``generate`` on the same weights, and stop strings
cut real text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx

from paged_jax.engine.bench_model import QUESTIONS
from paged_jax.engine.llm import LLM
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.steps import Steps

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def steps(smollm2):
    """One compiled Steps for both tests' engines (equal shapes share executables)."""
    return Steps(nnx.split(smollm2.ours)[0])


def engine(smollm2, steps) -> LLM:
    return LLM.from_model(smollm2.ours, smollm2.tokenizer, block_size=16, num_blocks=64,
                          max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
                          steps=steps)


def test_greedy_chat_answers_equal_transformers_generate(smollm2, steps):
    """Four chat prompts, the last three served together after the first (their prompts
    share the template's system prompt, so they start on its cached blocks), 32 greedy tokens
    or EOS, against ``generate(do_sample=False)`` one prompt at a time."""
    llm = engine(smollm2, steps)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.chat(convs[:1], params, use_tqdm=False)
    outs += llm.chat(convs[1:], params, use_tqdm=False)
    tok = smollm2.tokenizer
    for conv, out in zip(convs, outs, strict=True):
        ids = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            seq = smollm2.theirs.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                          do_sample=False, eos_token_id=tok.eos_token_id,
                                          attention_mask=torch.ones((1, len(ids)), dtype=int))
        theirs = seq[0, len(ids):].tolist()
        c = out.outputs[0]
        assert c.token_ids == theirs, (conv, c.text)
        assert c.finish_reason == ("stop" if theirs[-1] == tok.eos_token_id else "length")
        assert c.text == tok.decode([t for t in theirs if t != tok.eos_token_id])
    assert llm.stats().prefix_cache_hit_rate > 0


def test_stop_strings_end_real_answers(smollm2, steps):
    llm = engine(smollm2, steps)
    (free,) = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                       SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    text = free.outputs[0].text
    word = text.split()[2]  # "The capital of France is Paris." -> "of"
    (cut,) = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                      SamplingParams(temperature=0.0, max_tokens=24, stop=[word]),
                      use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.text == text[: text.index(word)]
    # The tokens kept are the free run's, up to the one that completed the stop string.
    assert c.token_ids == free.outputs[0].token_ids[: len(c.token_ids)]
    assert word in smollm2.tokenizer.decode(c.token_ids)
    assert word not in smollm2.tokenizer.decode(c.token_ids[:-1])
    assert np.isfinite(cut.metrics.ttft)
