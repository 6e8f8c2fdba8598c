"""The Llama-family model: config, Flax NNX module, Hugging Face checkpoint loading."""

from paged_jax.model.checkpoint import CheckpointError, load_checkpoint
from paged_jax.model.config import DEFAULT_MODEL, ModelConfig, RopeScaling
from paged_jax.model.llama import Llama, abstract_model, causal_attend, init_model

__all__ = [
    "DEFAULT_MODEL",
    "CheckpointError",
    "Llama",
    "ModelConfig",
    "RopeScaling",
    "abstract_model",
    "causal_attend",
    "init_model",
    "load_checkpoint",
]
