"""Shared by the model, kvcache and engine tests: tiny configs, a jitted dense reference, and
a driver that runs prompts through ``prefill`` and greedy ``decode_step``s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import decode_step, pad_prompts, prefill
from paged_jax.kvcache import init_cache
from paged_jax.model import ModelConfig

TINY = ModelConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64,
)
DENSE_LEN = 64  # the dense reference pads every sequence to this length: one compilation


@functools.partial(jax.jit, static_argnums=0)
def _dense(graphdef, params, tokens):  # [B, T] -> [B, T, V]
    return nnx.merge(graphdef, params)(tokens)[0]


def dense_logits(graphdef, params, seq) -> np.ndarray:
    """Our own no-cache forward pass over one sequence: [len(seq), V] f32 logits. Padding
    after the sequence cannot change its logits (causal mask)."""
    seq = np.asarray(seq, np.int32)
    assert len(seq) <= DENSE_LEN
    padded = np.zeros((1, DENSE_LEN), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_dense(graphdef, params, jnp.asarray(padded)))[0, : len(seq)]


def scrambled_state(cache: CacheConfig, seed: int = 0):
    """A fresh pool whose free list is a random permutation: block tables come out permuted."""
    state = init_state(cache)
    perm = np.random.default_rng(seed).permutation(cache.num_blocks).astype(np.int32)
    return state.replace(free_list=jnp.asarray(perm))


def run_greedy(graphdef, params, model_config, cache, prompts, slots, num_steps, *, state=None,
               fill=0.0, impl="auto", interpret=False):
    """Prefill ``prompts`` into ``slots`` then ``num_steps`` greedy decode steps.

    Returns (prefill logits [B, T, V], per-step logits [num_steps, B, V], tokens [B, steps+1]).
    """
    kv = init_cache(model_config, cache, fill=fill)
    state = init_state(cache) if state is None else state
    lens = np.array([len(p) for p in prompts], np.int32)
    logits, kv, state, status = prefill(
        graphdef, params, kv, state, jnp.asarray(pad_prompts(prompts)), jnp.asarray(slots),
        jnp.asarray(lens), all_logits=True,
    )
    status.raise_if_failed()
    prefill_logits = np.asarray(logits)
    rows = np.asarray(slots)
    tokens = np.zeros(cache.max_seqs, np.int32)
    tokens[rows] = prefill_logits[np.arange(len(prompts)), lens - 1].argmax(-1)
    emitted, step_logits = [tokens[rows].copy()], []
    for _ in range(num_steps):
        logits, kv, state, status = decode_step(
            graphdef, params, kv, state, jnp.asarray(tokens), impl=impl, interpret=interpret
        )
        status.raise_if_failed()
        logits = np.asarray(logits)[rows]
        step_logits.append(logits)
        tokens[rows] = logits.argmax(-1)
        emitted.append(tokens[rows].copy())
    return prefill_logits, np.stack(step_logits) if step_logits else None, np.stack(emitted, 1)
