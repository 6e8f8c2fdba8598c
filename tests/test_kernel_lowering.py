"""The Pallas kernel lowers to a CUDA Triton custom call, checked on any machine via jax.export.

Lowering runs JAX's Pallas-to-Triton translation, so shape or op support problems show up here
without a GPU. Compiling the Triton module to a GPU binary is not covered (that needs a GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from paged_jax.kernels import paged_attention

# jaxlib <= 0.10.2 emits the first; later jaxlibs compile Triton at lowering time and emit the
# second. Either one proves the kernel went through the Triton lowering.
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def export_for_cuda(*, dtype, block_size, head_dim, num_q_heads, num_kv_heads, batch,
                    num_blocks, max_blocks_per_seq):
    kv = jax.ShapeDtypeStruct((num_kv_heads, num_blocks, block_size, head_dim), dtype)
    args = (
        jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), dtype),  # q
        kv,  # k_pages
        kv,  # v_pages
        jax.ShapeDtypeStruct((batch, max_blocks_per_seq), jnp.int32),  # block_tables
        jax.ShapeDtypeStruct((batch,), jnp.int32),  # context_lens
    )
    return export_jit_for_cuda(functools.partial(paged_attention, impl="pallas"), *args)


def export_jit_for_cuda(f, *args):
    """``jax.jit(f)`` exported for CUDA, with the Triton custom calls allowed."""
    return jax.export.export(
        jax.jit(f),
        platforms=["cuda"],
        disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS
        ],
    )(*args)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            dict(dtype=jnp.bfloat16, block_size=16, head_dim=128, num_q_heads=32, num_kv_heads=8,
                 batch=4, num_blocks=64, max_blocks_per_seq=16),
            id="bf16-block16-d128-gqa32x8",
        ),
        pytest.param(
            dict(dtype=jnp.float16, block_size=32, head_dim=64, num_q_heads=16, num_kv_heads=1,
                 batch=3, num_blocks=40, max_blocks_per_seq=8),
            id="f16-block32-d64-mqa",
        ),
        pytest.param(
            dict(dtype=jnp.float32, block_size=128, head_dim=256, num_q_heads=4, num_kv_heads=4,
                 batch=2, num_blocks=16, max_blocks_per_seq=4),
            id="f32-block128-d256-mha",
        ),
        pytest.param(
            # The benchmark's largest shape: 17 GiB per page array, so 64-bit offsets.
            dict(dtype=jnp.bfloat16, block_size=16, head_dim=128, num_q_heads=32, num_kv_heads=8,
                 batch=256, num_blocks=256 * 2048, max_blocks_per_seq=2048),
            id="bf16-batch256-ctx32k",
        ),
    ],
)
def test_lowers_to_triton_custom_call(config):
    exported = export_for_cuda(**config)
    text = exported.mlir_module()
    assert any(t in text for t in TRITON_CALL_TARGETS), "no Triton custom call in the module"
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == (config["batch"], config["num_q_heads"],
                                           config["head_dim"])
    assert exported.out_avals[0].dtype == config["dtype"]


def test_decode_step_hands_the_whole_cache_to_the_kernel():
    """The jitted decode step passes each layer's kernel the whole [layers, ...] K/V cache and
    the layer index, never a per-layer slice of it (XLA would copy a slice before the custom
    call: the layer's whole pool, every layer, every step)."""
    from flax import nnx

    from paged_jax.allocator import CacheConfig, init_state
    from paged_jax.engine.step_bodies import decode_step_body
    from paged_jax.kvcache import init_cache
    from paged_jax.model import ModelConfig, init_model

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    graphdef, params = nnx.split(init_model(cfg))
    cache = CacheConfig(num_blocks=48, block_size=16, max_seqs=4, max_blocks_per_seq=8)
    shapes = jax.eval_shape(lambda: (init_cache(cfg, cache), init_state(cache)))
    step = functools.partial(decode_step_body, graphdef, impl="pallas", interpret=False)
    text = export_jit_for_cuda(
        step, params, *shapes, jax.ShapeDtypeStruct((4,), jnp.int32)
    ).mlir_module()
    whole = "tensor<2x2x48x16x64xbf16>"  # [layers, kv heads, blocks, block size, head dim]
    layer_slice = "tensor<1x2x48x16x64xbf16>"
    calls = [line for line in text.splitlines()
             if "custom_call" in line and any(t in line for t in TRITON_CALL_TARGETS)]
    assert calls, "no Triton custom call in the decode step"
    for line in calls:
        operands = line.rsplit(" : (", 1)[1].split(") ->")[0]
        assert operands.count(whole) == 2, operands  # K and V, whole
    assert layer_slice not in text
