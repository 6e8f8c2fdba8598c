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
    f = functools.partial(paged_attention, impl="pallas")
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
