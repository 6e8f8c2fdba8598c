"""Load a llama.cpp GGUF file (a ``llama`` architecture) into ``Llama``.

The file is read with the ``gguf`` package, llama.cpp's own Python reader, and every tensor
is dequantized with ``gguf.quants.dequantize``: whatever type that package can dequantize
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ...) loads, into f32 or bf16 parameters.

Two things differ from a Hugging Face checkpoint:

* names: ``token_embd``, ``blk.{i}.attn_q``, ``ffn_gate``, ``output_norm``, ... (mapped below);
  a file without ``output.weight`` ties the output head to the embedding;
* Q and K: llama.cpp's converter permutes the rows of each head of ``q_proj`` and ``k_proj``
  from Hugging Face's rotate-half layout into interleaved pairs. The loader undoes it, with
  the query head count for Q and the KV head count for K, exactly as transformers does.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from paged_jax.model.checkpoint import CheckpointError
from paged_jax.model.config import DTYPES, ModelConfig
from paged_jax.model.llama import MLP, Attention, Linear, LinearPart, Llama, abstract_model

# llama.cpp name (per layer, after "blk.{i}.") -> our parameter's path. Matrices are [out,
# in] in both (numpy's order; GGUF lists the dimensions reversed).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.scale",
    "ffn_norm.weight": "post_attention_layernorm.scale",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_gguf(path):
    """A ``gguf.GGUFReader`` over ``path`` (a reader passes through, so that the model and
    its tokenizer can share one: reading the metadata is the slow part of opening a file).
    The ``gguf`` package is the ``model`` extra."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - the model extra installs it
        raise ImportError("Reading GGUF files needs the gguf package: pip install gguf") from e
    if isinstance(path, gguf.GGUFReader):
        return path
    return gguf.GGUFReader(os.fspath(path))


def gguf_name(reader) -> str:
    """The file an open ``GGUFReader`` reads, for error messages."""
    return str(getattr(reader.data, "filename", None) or "GGUF file")


_REQUIRED = object()  # gguf_value's default: a missing key is an error


def gguf_value(reader, key: str, default=_REQUIRED):
    """The value of metadata ``key`` in an open ``GGUFReader``; ``default`` if the file lacks
    it, or a CheckpointError naming the key when no default is given."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"GGUF file lacks the metadata key {key!r}.")
        return default
    return field.contents()


def config_from_gguf(reader, dtype: str | None = None) -> ModelConfig:
    """``ModelConfig`` from a GGUF file's ``llama.*`` metadata (an open ``GGUFReader``)."""
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"Unsupported GGUF architecture {arch!r}. Supported: ['llama'].")
    heads = int(gguf_value(reader, "llama.attention.head_count"))
    hidden = int(gguf_value(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = (gguf_value(reader, "llama.vocab_size", 0)
             or len(gguf_value(reader, "tokenizer.ggml.tokens")))
    scaling = gguf_value(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise CheckpointError(f"Unsupported GGUF rope scaling {scaling!r}. Supported: none.")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}. Got {dtype!r}.")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf_value(reader, "llama.feed_forward_length")),
        num_layers=int(gguf_value(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_value(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(gguf_value(reader, "llama.attention.key_length", hidden // heads)),
        rms_norm_eps=float(gguf_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_value(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(gguf_value(reader, "llama.context_length", 4096)),
        dtype=dtype or "float32",
        architecture="LlamaForCausalLM",
    )


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [heads * head_dim, in] rows, per head, from
    interleaved pairs back to Hugging Face's two halves."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """A tensor as float32 numpy, in numpy's order (GGUF lists dimensions reversed)."""
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(
            f"Tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize."
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(array, np.float32).reshape(shape)


def _resolve(model: Llama, path: str):
    """The parameter at ``path`` (``layers.0.self_attn.q_proj.weight``: a projection by its
    checkpoint name, fused or not, through ``projection``); a ``Linear``'s ``weight`` is its
    ``checkpoint_weight()``, ``[out, in]`` whatever layout it holds."""
    target = model
    for part in path.split("."):
        if part == "weight" and isinstance(target, Linear | LinearPart):
            return target.checkpoint_weight()
        if isinstance(target, Attention | MLP):
            target = target.projection(part)
        else:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
    return target


def load_gguf(path, dtype: str | None = None) -> Llama:
    """Read a GGUF file (a path, or an open ``gguf.GGUFReader``) into a ``Llama`` with
    parameters in ``dtype`` (default float32).

    Raises:
      CheckpointError: an unsupported architecture, rope scaling or tensor type, or a
        missing, unexpected or mis-shaped tensor; the message names it.
    """
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype)
    model = abstract_model(config)
    expected = {"token_embd.weight": "embed_tokens.embedding", "output_norm.weight": "norm.scale"}
    if not config.tie_word_embeddings:
        expected["output.weight"] = "lm_head.weight"
    for i in range(config.num_layers):
        for name, target in _LAYER_TENSORS.items():
            expected[f"blk.{i}.{name}"] = f"layers.{i}.{target}"
    tensors = {t.name: t for t in reader.tensors}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - {"rope_freqs.weight"})
    if missing or extra:
        raise CheckpointError(
            f"GGUF file {gguf_name(reader)!r} does not match a {config.num_layers}-layer llama: "
            f"missing {missing[:5]}, unexpected {extra[:5]}."
        )
    for name, target in expected.items():
        weight = dequantize_tensor(tensors[name])
        if name.endswith("attn_q.weight"):
            weight = unpermute_rows(weight, config.num_heads)
        elif name.endswith("attn_k.weight"):
            weight = unpermute_rows(weight, config.num_kv_heads)
        var = _resolve(model, target)
        want = tuple(var.get_value().shape)
        if weight.shape != want:
            raise CheckpointError(
                f"Tensor {name!r} has shape {weight.shape}; the model expects {want} for "
                f"{config}."
            )
        var.set_value(jnp.asarray(weight, dtype=config.jnp_dtype))
    return model
