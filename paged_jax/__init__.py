"""paged_jax: JAX-native PagedAttention.

Bottom up: ``allocator`` (``BlockState`` and its pure ops, plus the seed's eager classes),
``kvcache`` (paged K/V buffers), ``kernels`` (paged attention: Pallas and XLA), ``model`` (a
Flax NNX Llama and checkpoint loading), ``engine`` (jitted prefill and decode steps; the
``LLMEngine`` that serves requests as they come and go; vLLM's ``LLM`` API), ``sharding``
(tensor and data parallel over a ``jax.sharding.Mesh``) and ``viz`` (event log and
pictures).
"""

from paged_jax import allocator, sharding
from paged_jax.allocator import *  # noqa: F403  (the allocator's public names, see its __all__)
from paged_jax.engine import (
    Steps,
    decode_step,
    decode_steps,
    prefill,
    prefill_decode,
    prefill_packed,
)
from paged_jax.engine.data_parallel import DataParallelEngine
from paged_jax.engine.llm import LLM
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import CompletionOutput, RequestOutput, SamplingParams
from paged_jax.kernels import paged_attention, paged_attention_xla
from paged_jax.kvcache import BlockPlan, KVCache, init_cache, plan_blocks
from paged_jax.model import (
    CheckpointError,
    Llama,
    ModelConfig,
    RopeScaling,
    init_model,
    load_checkpoint,
)
from paged_jax.viz import Recorder, RunLog, render_layout

__version__ = "0.1.0"

__all__ = [
    *allocator.__all__,
    "LLM",
    "BlockPlan",
    "CheckpointError",
    "CompletionOutput",
    "DataParallelEngine",
    "KVCache",
    "LLMEngine",
    "Llama",
    "ModelConfig",
    "Recorder",
    "RequestOutput",
    "RopeScaling",
    "RunLog",
    "SamplingParams",
    "Steps",
    "decode_step",
    "decode_steps",
    "init_cache",
    "init_model",
    "load_checkpoint",
    "paged_attention",
    "paged_attention_xla",
    "plan_blocks",
    "prefill",
    "prefill_decode",
    "prefill_packed",
    "render_layout",
    "sharding",
]
