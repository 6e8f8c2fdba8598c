"""The serving steps (prefill, decode), next-token sampling and the decode benchmark."""

from paged_jax.engine.sampling import check_sampling, filtered_logits, sample
from paged_jax.engine.steps import (
    Steps,
    decode_step,
    decode_steps,
    pad_prompts,
    prefill,
    prefill_decode,
    prefill_packed,
    serving_params,
)

__all__ = [
    "Steps",
    "check_sampling",
    "decode_step",
    "decode_steps",
    "filtered_logits",
    "pad_prompts",
    "prefill",
    "prefill_decode",
    "prefill_packed",
    "sample",
    "serving_params",
]
