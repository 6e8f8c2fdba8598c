"""Paged decode attention: a Pallas kernel, a ``jnp`` reference, and a GPU benchmark."""

from paged_jax.kernels.pallas_decode import paged_attention as paged_attention
from paged_jax.kernels.reference import paged_attention_xla as paged_attention_xla

__all__ = ["paged_attention", "paged_attention_xla"]
