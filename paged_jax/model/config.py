"""``ModelConfig``: the static shape of a Llama-family decoder, buildable from a HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")


def cpu_16bit(dtype, platform: str | None = None) -> bool:
    """Whether ``dtype`` is a 16-bit float on XLA:CPU (``platform``, default JAX's default
    backend), where the pool (``paged_jax.kvcache``) and the model (``paged_jax.model.llama``)
    take the paths that keep such arrays fast."""
    dtype = jnp.dtype(dtype)
    return (dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
            and (platform or jax.default_backend()) == "cpu")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling (``rope_type="llama3"``), or plain ``"linear"``."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Frozen and hashable: static under ``jax.jit``.

    Covers Llama 1/2/3 (GQA/MQA, llama3 rope scaling, tied embeddings) and Qwen2 (q/k/v bias).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets qkv_bias and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # parameters, activations and the KV cache
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int. Got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "Number of Q heads must be divisible by number of KV heads. Got "
                f"{self.num_heads} and {self.num_kv_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE. Got {self.head_dim}.")
        if jnp.dtype(self.dtype).name not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}. Got {self.dtype!r}.")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type must be 'linear' or 'llama3'. "
                f"Got {scaling.rope_type!r}."
            )

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike, dtype: str | None = None):
        """From a Hugging Face ``config.json`` (a dict, the file, or its directory).

        ``dtype`` defaults to the checkpoint's own (``dtype``/``torch_dtype``), else float32.
        Raises ``ValueError`` for an architecture or option we do not implement.
        """
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                hf = json.load(f)
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {arch!r} (model_type {hf.get('model_type')!r}). "
                f"Supported: {list(SUPPORTED_ARCHITECTURES)}."
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu'. Got {hf['hidden_act']!r}.")
        if hf.get("use_sliding_window"):
            raise ValueError("Sliding-window attention (use_sliding_window=true) is unsupported.")
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests theta and scaling in rope_parameters; older ones do not.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        rope = {**scaling, **rope}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Unsupported rope_type {rope_type!r}. Supported: {list(SUPPORTED_ROPE_TYPES)}."
            )
        rope_scaling = None
        if rope_type == "linear":
            rope_scaling = RopeScaling("linear", factor=float(rope["factor"]))
        elif rope_type == "llama3":
            rope_scaling = RopeScaling(
                "llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        if dtype is None:
            dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
            dtype = dtype if dtype in DTYPES else "float32"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            dtype=dtype,
            architecture=arch,
        )


# The model used when no checkpoint is given (weights cannot be downloaded here): a 2-layer
# GQA Llama, random weights. ``paged-jax generate`` and ``--scenario engine`` run it.
DEFAULT_MODEL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=64)
