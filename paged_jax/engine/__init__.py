"""The serving steps (prefill, decode) and the decode benchmark."""

from paged_jax.engine.steps import decode_step, decode_steps, pad_prompts, prefill

__all__ = ["decode_step", "decode_steps", "pad_prompts", "prefill"]
