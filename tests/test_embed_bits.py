"""The embedding table's bits, made once (``Llama.embedding_bits``, ``serving_params``): rows
gathered from them equal the table's own rows (numpy indexing), the steps give the same
tokens and logits with and without them, and with them no compiled step converts the
whole table."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import Steps, serving_params
from paged_jax.engine.step_inputs import prefill_inputs
from paged_jax.kvcache import init_cache
from paged_jax.model import init_model
from paged_jax.model.llama import Llama
from tests.model_helpers import TINY
from tests.test_pool_scaling import compiled_hlo

BF16 = TINY.replace(dtype="bfloat16")
CACHE = CacheConfig(num_blocks=16, block_size=8, max_seqs=2, max_blocks_per_seq=8)


def test_rows_gathered_from_the_bits_are_the_tables_rows():
    model = init_model(BF16, seed=2)
    table = np.asarray(model.embed_tokens.embedding.get_value())  # [V, E] bfloat16
    bits = model.embedding_bits()
    assert bits.dtype == jnp.uint16 and bits.shape == table.shape
    np.testing.assert_array_equal(np.asarray(bits), table.view(np.uint16))
    tokens = np.array([[0, 255, 7], [7, 7, 128]], np.int32)
    got = jax.jit(model.embed)(jnp.asarray(tokens), bits)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), table[tokens].astype(np.float32))
    # The same rows as the table's bits made inside the call.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(model.embed(jnp.asarray(tokens))))


def test_only_a_model_that_gathers_bits_has_them():
    assert init_model(TINY).embedding_bits() is None  # f32: gathered as it is
    plain = Llama(BF16, rngs=nnx.Rngs(0), cpu_16bit_paths=False)
    assert plain.embedding_bits() is None and "embed_bits" not in serving_params(plain)
    assert "embed_bits" not in serving_params(init_model(TINY))


def test_bits_of_another_shape_are_refused():
    model = init_model(BF16, seed=2)
    with pytest.raises(ValueError, match=r"embed_bits must be the embedding's bits, uint16 "
                       r"\(256, 128\)\. Got uint16 \(255, 128\)"):
        model.embed(jnp.zeros((1, 2), jnp.int32), jnp.zeros((255, 128), jnp.uint16))
    with pytest.raises(ValueError, match=r"Got int16 \(256, 128\)"):
        model.embed(jnp.zeros((1, 2), jnp.int32), jnp.zeros((256, 128), jnp.int16))


def _greedy(steps, params, prompts):
    """Prefill ``prompts`` and decode 4 greedy tokens in one K=4 dispatch: (prefill logits
    [B, V], tokens [4, B], step logits [4, B, V])."""
    kv, state = init_cache(BF16, CACHE), init_state(CACHE)
    width = max(map(len, prompts))
    padded = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    logits, kv, state, status = steps.prefill(params, kv, state, padded, np.arange(2),
                                              np.array([len(p) for p in prompts]))
    status.raise_if_failed()
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    toks, step_logits, kv, state, status = steps.decode_steps(
        params, kv, state, nxt, num_steps=4, return_logits=True)
    status.raise_if_failed()
    return np.asarray(logits), np.asarray(toks), np.asarray(step_logits)


def test_steps_give_the_same_values_with_the_bits_made_once():
    model = init_model(BF16, seed=4)
    steps = Steps(nnx.split(model)[0])
    prompts = [[5, 9, 200, 31, 7], [1, 2, 3]]
    with_bits = _greedy(steps, serving_params(model), prompts)
    without = _greedy(steps, nnx.to_pure_dict(nnx.state(model)), prompts)
    for a, b in zip(with_bits, without, strict=True):
        np.testing.assert_array_equal(a, b)


def test_with_the_bits_no_step_converts_the_table():
    """The point of making them once: a step given them has no whole-table bitcast (XLA:CPU
    compiles one into a copy of the table per dispatch); without them it has."""
    model = init_model(BF16, seed=4)
    steps = Steps(nnx.split(model)[0])
    # The table reinterpreted as bits: an instruction whose result is the whole u16 table.
    table = re.compile(rf"= u16\[{BF16.vocab_size},{BF16.hidden_size}\]\S* bitcast-convert\(")

    def table_converts(params) -> list[str]:
        kv, state = init_cache(BF16, CACHE), init_state(CACHE)
        args = prefill_inputs(kv, state, np.zeros((2, 4), np.int32), np.arange(2),
                              np.array([4, 2]), None)
        prefill = steps.prefill_jit.lower(params, kv, state, *args, all_logits=False)
        decode = steps.decode_steps_jit.lower(
            params, kv, state, jnp.zeros(2, jnp.int32), jax.random.key(0), 0.0, num_steps=4,
            impl="xla", interpret=False, return_logits=False, sample=False)
        return [line.strip() for lowered in (prefill, decode)
                for line in compiled_hlo(lowered).splitlines()
                if table.search(line)]

    assert table_converts(nnx.to_pure_dict(nnx.state(model)))  # the check can see one
    assert not table_converts(serving_params(model))
