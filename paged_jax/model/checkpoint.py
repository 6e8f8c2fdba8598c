"""Load a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` directory into ``Llama``.

A directory holds ``config.json`` and one or more ``*.safetensors`` files; a sharded one also
has ``model.safetensors.index.json`` whose ``weight_map`` names each tensor's file. Every
tensor's name and shape is checked against the model before any data is read.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import (
    Linear,
    LinearPart,
    Llama,
    PartParam,
    TransposedParam,
    abstract_model,
)

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older exports contain; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match the model: names the tensor and the shapes."""


def hf_parameter_map(model: Llama) -> dict[str, nnx.Variable | TransposedParam | PartParam]:
    """Hugging Face tensor name -> our parameter, seen in the same shape (a ``Linear``'s
    ``checkpoint_weight()``: PyTorch's ``[out, in]``, whatever layout the model holds, and
    a fused projection's part as ``PartParam`` views). Each value has ``get_value()`` and
    ``set_value()``."""
    out: dict[str, nnx.Variable | TransposedParam | PartParam] = {
        "model.embed_tokens.weight": model.embed_tokens.embedding,
        "model.norm.weight": model.norm.scale,
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.checkpoint_weight()

    def linear(prefix: str, lin: Linear | LinearPart):
        out[prefix + ".weight"] = lin.checkpoint_weight()
        if lin.bias is not None:
            out[prefix + ".bias"] = lin.bias

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer.input_layernorm.scale
        out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.scale
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{p}.self_attn.{name}", layer.self_attn.projection(name))
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear(f"{p}.mlp.{name}", layer.mlp.projection(name))
    return out


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index if there is one."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"No *.safetensors files in {path!r}.")
    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                where[name] = file
    return where


def _shape_of(file: str, name: str) -> tuple[int, ...]:
    with safe_open(file, framework="flax") as f:
        return tuple(f.get_slice(name).get_shape())


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None) -> Llama:
    """Read a Hugging Face checkpoint directory, or a llama.cpp ``.gguf`` file (see
    ``paged_jax.model.gguf``), into a ``Llama`` (parameters in ``dtype``, default: the
    checkpoint's own, float32 if unknown).

    Raises:
      ValueError: unsupported architecture or options (from ``ModelConfig.from_hf``).
      CheckpointError: a missing, unexpected or mis-shaped tensor; the message names it.
    """
    path = os.fspath(path)
    if path.endswith(".gguf"):
        from paged_jax.model.gguf import load_gguf  # gguf.py imports this module

        return load_gguf(path, dtype)
    config = ModelConfig.from_hf(path, dtype=dtype)
    model = abstract_model(config)
    expected = hf_parameter_map(model)
    files = _tensor_files(path)
    present = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    # A tied checkpoint may still carry lm_head.weight; it must then equal the embedding.
    tied_copy = config.tie_word_embeddings and "lm_head.weight" in present
    if tied_copy:
        present.discard("lm_head.weight")

    missing = sorted(set(expected) - present)
    if missing:
        shapes = [_expected_shape(expected[n]) for n in missing[:5]]
        raise CheckpointError(
            f"Checkpoint {path!r} lacks {len(missing)} tensor(s) the model needs: "
            + ", ".join(f"{n} (expected shape {s})" for n, s in zip(missing, shapes, strict=False))
        )
    extra = sorted(present - set(expected))
    if extra:
        raise CheckpointError(
            f"Checkpoint {path!r} has {len(extra)} tensor(s) the model does not use: "
            + ", ".join(f"{n} (shape {_shape_of(files[n], n)})" for n in extra[:5])
        )
    for name, var in expected.items():
        want, got = _expected_shape(var), _shape_of(files[name], name)
        if want != got:
            raise CheckpointError(
                f"Tensor {name!r} has shape {got}; the model expects {want} for {config}."
            )

    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                expected[name].set_value(jnp.asarray(_load(f, name), dtype=config.jnp_dtype))
    if tied_copy:
        with safe_open(files["lm_head.weight"], framework="flax") as f:
            head = _load(f, "lm_head.weight")
        if not np.array_equal(np.asarray(head, np.float32),
                              np.asarray(model.embed_tokens.embedding.get_value(), np.float32)):
            raise CheckpointError(
                "Checkpoint has tie_word_embeddings=true but a 'lm_head.weight' that differs "
                "from 'model.embed_tokens.weight'."
            )
    return model


def _expected_shape(var: nnx.Variable | TransposedParam) -> tuple[int, ...]:
    return tuple(var.get_value().shape)


def _load(f, name: str) -> jax.Array:
    return f.get_tensor(name)  # framework="flax": bfloat16 needs no torch
