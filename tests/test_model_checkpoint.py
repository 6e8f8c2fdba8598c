"""``load_checkpoint`` and ``ModelConfig.from_hf``: round trips, and the errors for bad input.

Checkpoints here are written directly with safetensors from our own random model (no torch),
in Hugging Face's names and layouts; ``test_model_parity.py`` loads real transformers saves.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.flax import save_file

from paged_jax.model import CheckpointError, ModelConfig, init_model, load_checkpoint
from paged_jax.model.checkpoint import hf_parameter_map
from tests.model_helpers import TINY, dense_logits

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32",
}


def hf_tensors(model) -> dict[str, jnp.ndarray]:
    return {name: var.get_value() for name, var in hf_parameter_map(model).items()}


def write_checkpoint(path, tensors, config=HF_CONFIG, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(dict(tensors), str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def source():
    return init_model(TINY, seed=7)


@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip_restores_every_parameter(source, tmp_path, shards):
    write_checkpoint(tmp_path, hf_tensors(source), shards=shards)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == TINY
    want = nnx.to_flat_state(nnx.state(source, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert len(want) == len(got)
    for path, var in want:
        np.testing.assert_array_equal(
            np.asarray(got[path].get_value()), np.asarray(var.get_value()), err_msg=str(path)
        )


def test_bfloat16_checkpoint_loads_as_bfloat16(source, tmp_path):
    tensors = {n: t.astype(jnp.bfloat16) for n, t in hf_tensors(source).items()}
    write_checkpoint(tmp_path, tensors, {**HF_CONFIG, "dtype": "bfloat16"})
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == "bfloat16"
    q = model.layers[0].self_attn.projection("q_proj").checkpoint_weight()
    assert q.get_value().dtype == jnp.bfloat16
    # Against the same bf16-rounded weights run in f32.
    f32 = load_checkpoint(tmp_path, dtype="float32")
    seq = np.arange(1, 20) * 7 % 256
    g, p = nnx.split(model)
    g32, p32 = nnx.split(f32)
    low, ref = dense_logits(g, p, seq), dense_logits(g32, p32, seq)
    assert np.abs(low - ref).max() < 0.05 * np.abs(ref).max() + 0.05


def test_missing_tensor_is_named(source, tmp_path):
    tensors = hf_tensors(source)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*256, 128"):
        load_checkpoint(tmp_path)


def test_extra_tensor_is_named(source, tmp_path):
    tensors = hf_tensors(source)
    tensors["model.layers.0.self_attn.q_proj.bias"] = jnp.zeros((256,))
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"q_proj\.bias \(shape \(256,\)\)"):
        load_checkpoint(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(source, tmp_path):
    tensors = hf_tensors(source)
    tensors["model.norm.weight"] = jnp.ones((127,))
    write_checkpoint(tmp_path, tensors)
    message = r"'model\.norm\.weight' has shape \(127,\).*\(128,\)"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_unsupported_architecture(source, tmp_path):
    write_checkpoint(tmp_path, hf_tensors(source),
                     {**HF_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(tmp_path)


def test_tied_checkpoint_with_a_different_lm_head_is_rejected(tmp_path):
    tied = init_model(TINY.replace(tie_word_embeddings=True), seed=1)
    tensors = hf_tensors(tied)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    write_checkpoint(tmp_path, tensors, {**HF_CONFIG, "tie_word_embeddings": True})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(tmp_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # an identical copy is fine
    write_checkpoint(tmp_path, tensors, {**HF_CONFIG, "tie_word_embeddings": True})
    assert load_checkpoint(tmp_path).lm_head is None


def test_config_from_legacy_and_new_rope_layouts():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    legacy = {**HF_CONFIG, "rope_theta": 500000.0, "rope_scaling": {**llama3}}
    del legacy["rope_parameters"]
    new = {**HF_CONFIG, "rope_parameters": {**llama3, "rope_theta": 500000.0}}
    a, b = ModelConfig.from_hf(legacy), ModelConfig.from_hf(new)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling.factor == 8.0
    assert hash(a) == hash(b)  # static under jit
    qwen = ModelConfig.from_hf({**HF_CONFIG, "architectures": ["Qwen2ForCausalLM"],
                                "attention_bias": False})
    assert qwen.qkv_bias and not qwen.o_bias
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**HF_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 2}})
    with pytest.raises(ValueError, match="divisible"):
        TINY.replace(num_kv_heads=3)
