"""Shared by the sharded tests: the tiny GQA Llama (8 query heads over 4 KV heads, so tp=2 and
tp=4 split whole groups), Auto-axis meshes over the first devices, and one driver that runs
prefill, a K-step decode and a single decode step through a ``Steps``."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import Steps, pad_prompts
from paged_jax.kvcache import init_cache
from paged_jax.model import init_model
from tests.model_helpers import TINY

GQA = TINY.replace(num_heads=8, num_kv_heads=4, num_layers=1)  # one layer: compiles fast
CACHE = CacheConfig(num_blocks=32, block_size=8, max_seqs=4, max_blocks_per_seq=8)
LENS = (5, 11, 3)
STEPS = 3


def mesh(shape, names=("tp",)):
    """A mesh over the first prod(shape) devices, every axis Auto."""
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


def split_model(config=GQA, seed=1):
    graphdef, params = nnx.split(init_model(config, seed=seed))
    return graphdef, nnx.to_pure_dict(params)


def prompts(lens=LENS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, GQA.vocab_size, n).tolist() for n in lens]


def run_steps(steps: Steps, params, *, impl="xla", interpret=False, config=GQA):
    """Prefill ``prompts()`` into slots 0..2, ``STEPS`` greedy steps in one ``decode_steps``
    dispatch, then one ``decode_step``. Returns a dict of host arrays (prefill logits [B, T,
    V], the dispatch's tokens [STEPS, S] and logits [STEPS, S, V], the step's logits [S, V])
    and the final (kv, state)."""
    params, kv, state = steps.shard(params, init_cache(config, CACHE), init_state(CACHE))
    ps = prompts()
    lens = np.array([len(p) for p in ps], np.int32)
    rows = np.arange(len(ps), dtype=np.int32)
    logits, kv, state, status = steps.prefill(params, kv, state, pad_prompts(ps), rows, lens,
                                              all_logits=True)
    status.raise_if_failed()
    first = np.zeros(CACHE.max_seqs, np.int32)
    first[rows] = np.asarray(logits)[rows, lens - 1].argmax(-1)
    toks, step_logits, kv, state, status = steps.decode_steps(
        params, kv, state, first, num_steps=STEPS, return_logits=True, impl=impl,
        interpret=interpret)
    status.raise_if_failed()
    last, kv, state, status = steps.decode_step(params, kv, state, np.asarray(toks)[-1],
                                                impl=impl, interpret=interpret)
    status.raise_if_failed()
    out = dict(prefill=np.asarray(logits), tokens=np.asarray(toks),
               steps=np.asarray(step_logits)[:, rows], step=np.asarray(last)[rows])
    return out, kv, state
