"""The paged K/V buffers: slot writes and block copies against numpy, and the planner."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax.kvcache as kvcache
from paged_jax.allocator import CacheConfig
from paged_jax.kvcache import KVCache, copy_blocks, init_cache, plan_blocks, write
from tests.model_helpers import TINY
from tests.test_pool_scaling import compiled_hlo

CACHE = CacheConfig(num_blocks=6, block_size=8, max_seqs=2, max_blocks_per_seq=3)


def random_cache(seed=0) -> KVCache:
    rng = np.random.default_rng(seed)
    kv = init_cache(TINY, CACHE)
    return KVCache(k=jnp.asarray(rng.normal(size=kv.k.shape), jnp.float32),
                   v=jnp.asarray(rng.normal(size=kv.v.shape), jnp.float32))


def test_init_cache_layout():
    kv = init_cache(TINY, CACHE, fill=np.nan)
    assert kv.k.shape == (2, 2, 6, 8, 64) == kv.v.shape  # [L, Hkv, blocks, block_size, D]
    assert kv.k.dtype == jnp.float32 and bool(jnp.isnan(kv.k).all())
    assert init_cache(TINY, CACHE, dtype="float32").k.dtype == jnp.float32
    # A cache in another dtype than the model's could never be attended: refused here.
    with pytest.raises(ValueError, match=r"must be the model's \(float32\).*Got bfloat16"):
        init_cache(TINY, CACHE, dtype=jnp.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_pool_is_kept_as_its_bits_on_cpu(dtype):
    model = TINY.replace(dtype=dtype)
    kv = init_cache(model, CACHE, fill=np.nan)  # this suite runs on CPU
    assert kv.k.dtype == kv.v.dtype == jnp.uint16 and kv.value_dtype == jnp.dtype(dtype)
    nan_bits = np.asarray(np.nan, jnp.dtype(dtype)).view(np.uint16)
    assert (np.asarray(kv.k) == nan_bits).all() and bool(jnp.isnan(kv.values(kv.k)).all())
    native = init_cache(model, CACHE, platform="gpu")  # what a GPU pool holds
    assert native.k.dtype == jnp.dtype(dtype) and native.value_dtype == jnp.dtype(dtype)
    assert kvcache.storage_dtype("float32") == jnp.float32
    assert kvcache.storage_dtype(dtype, "cuda") == jnp.dtype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_write_lands_the_rounded_values_in_place(dtype):
    """Against numpy (ml_dtypes) rounding of the f32 inputs: the bits pool holds exactly the
    rounded values, and the compiled write never converts the whole buffer (what XLA:CPU
    does to a bf16 scatter: a pass over the pool per write)."""
    rng = np.random.default_rng(4)
    kv = init_cache(TINY.replace(dtype=dtype), CACHE)
    slots = np.array([[3, 17, -1], [47, -1, 8]], np.int32)
    k = rng.normal(size=(2, 3, 2, 64)).astype(np.float32)
    v = rng.normal(size=(2, 3, 2, 64)).astype(np.float32)
    want_k = np.zeros(kv.k.shape, jnp.dtype(dtype))
    want_v = want_k.copy()
    for b, t in zip(*np.nonzero(slots >= 0), strict=True):
        s = slots[b, t]
        want_k[1, :, s // 8, s % 8] = k[b, t].astype(jnp.dtype(dtype))
        want_v[1, :, s // 8, s % 8] = v[b, t].astype(jnp.dtype(dtype))
    step = jax.jit(write, static_argnums=1, donate_argnums=0)
    hlo = compiled_hlo(step.lower(kv, 1, jnp.asarray(slots), k, v))
    shape = ",".join(map(str, kv.k.shape))
    hlo_name = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert f"f32[{shape}]" not in hlo and f"{hlo_name}[{shape}]" not in hlo
    pointer = kv.k.unsafe_buffer_pointer()
    out = step(kv, 1, jnp.asarray(slots), k, v)
    assert out.k.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(out.k), want_k.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(out.values(out.v)), want_v)
    copied = jax.jit(copy_blocks)(out, jnp.array([0], jnp.int32), jnp.array([5], jnp.int32))
    want_k[:, :, 5] = want_k[:, :, 0]
    assert copied.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(copied.values(copied.k)), want_k)


@pytest.mark.parametrize("layer", [0, 1])
def test_write_puts_each_token_at_its_slot_and_drops_minus_one(layer):
    kv = random_cache()
    rng = np.random.default_rng(1)
    slots = np.array([[3, 17, -1], [47, -1, 8]], np.int32)  # [B, T]
    k = rng.normal(size=(2, 3, 2, 64)).astype(np.float32)  # [B, T, Hkv, D]
    v = rng.normal(size=(2, 3, 2, 64)).astype(np.float32)
    want_k, want_v = np.array(kv.k), np.array(kv.v)
    for b in range(2):
        for t in range(3):
            s = slots[b, t]
            if s >= 0:
                want_k[layer, :, s // 8, s % 8] = k[b, t]
                want_v[layer, :, s // 8, s % 8] = v[b, t]
    out = jax.jit(write, static_argnums=1)(kv, layer, jnp.asarray(slots), k, v)
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)


def test_copy_blocks_copies_every_layer_and_skips_minus_one():
    kv = random_cache(2)
    src, dst = np.array([4, -1, 0]), np.array([1, 3, -1])
    out = jax.jit(copy_blocks)(kv, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    want = np.array(kv.k)
    want[:, :, 1] = want[:, :, 4]
    np.testing.assert_array_equal(np.asarray(out.k), want)
    want = np.array(kv.v)
    want[:, :, 1] = want[:, :, 4]
    np.testing.assert_array_equal(np.asarray(out.v), want)


def test_write_is_in_place_under_donation():
    kv = random_cache(3)
    pointer = kv.k.unsafe_buffer_pointer()
    step = jax.jit(write, static_argnums=1, donate_argnums=0)
    out = step(kv, 1, jnp.array([5], jnp.int32), jnp.ones((1, 2, 64)), jnp.ones((1, 2, 64)))
    assert kv.k.is_deleted() and kv.v.is_deleted()
    assert out.k.unsafe_buffer_pointer() == pointer


def test_plan_blocks_docstring_reproduces_the_seed_figures():
    results = doctest.testmod(kvcache, extraglobs={"ModelConfig": type(TINY)}, verbose=False)
    assert results.attempted >= 4 and results.failed == 0


def test_plan_blocks_arithmetic():
    plan = plan_blocks(TINY, memory_bytes=10 * 2**20, block_size=16)
    per_layer = 2 * 16 * TINY.num_kv_heads * TINY.head_dim * 4
    assert plan.bytes_per_block_per_layer == per_layer
    assert plan.bytes_per_block == per_layer * TINY.num_layers
    assert plan.num_blocks == 10 * 2**20 // plan.bytes_per_block
    assert plan.num_tokens == plan.num_blocks * 16
    assert plan.cache_config(4, 8) == CacheConfig(plan.num_blocks, 16, 4, 8)
    assert plan_blocks(TINY, 10 * 2**20, 16, dtype="bfloat16").num_blocks == 2 * plan.num_blocks
    with pytest.raises(ValueError, match="memory_bytes"):
        plan_blocks(TINY, -1)
