"""``masked_attention``, one pair of dots per KV head (the default) and through
``jax.nn.dot_product_attention``, against float64 numpy GQA attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.model.llama import masked_attention


def numpy_attention(q, k, v, mask):
    """float64 GQA attention: query head h uses KV head h // (Hq // Hkv); masked keys are
    left out. A row with no key at all is padding, whose output nothing reads: NaN here,
    so that the comparisons below leave it out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq, num_heads, dim = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(num_heads):
            kv = h // group
            scores = q[b, :, h] @ k[b, :, kv].T / np.sqrt(dim)  # [T, S]
            for t in range(seq):
                live = np.flatnonzero(mask[b, t])
                if live.size == 0:
                    out[b, t, h] = np.nan
                    continue
                p = np.exp(scores[t, live] - scores[t, live].max())
                out[b, t, h] = (p / p.sum()) @ v[b, live, kv]
    return out


def inputs(batch, seq, context, num_heads, num_kv, dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, num_heads, dim)).astype(np.float32)
    k = rng.standard_normal((batch, context, num_kv, dim)).astype(np.float32)
    v = rng.standard_normal((batch, context, num_kv, dim)).astype(np.float32)
    # Each row continues a context of its own length, causally; the keys past it hold NaN,
    # as a never-written block of the pool may.
    cached = rng.integers(0, context - seq + 1, batch)
    positions = cached[:, None] + np.arange(seq)[None]  # [B, T]
    mask = np.arange(context)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    mask[-1, -1] = False  # a padding row: no key at all
    for b in range(batch):  # keys no query of the row sees
        k[b, positions[b, -1] + 1:] = np.nan
        v[b, positions[b, -1] + 1:] = np.nan
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(mask)


@pytest.mark.parametrize("shape", [
    (1, 16, 16, 9, 3, 64),  # SmolLM2's heads, a fresh prompt
    (3, 5, 24, 9, 3, 64),   # ragged rows continuing a context
    (2, 4, 12, 4, 4, 8),    # one query head per KV head
    (2, 3, 8, 8, 1, 16),    # all query heads on one KV head
])
@pytest.mark.parametrize("per_kv_head", [True, False])
def test_matches_float64_numpy(shape, per_kv_head):
    q, k, v, mask = inputs(*shape, jnp.float32)
    got = jax.jit(masked_attention, static_argnames="per_kv_head")(
        q, k, v, mask, per_kv_head=per_kv_head)
    want = numpy_attention(q, np.nan_to_num(np.asarray(k), nan=0.0),
                            np.nan_to_num(np.asarray(v), nan=0.0), np.asarray(mask))
    assert got.shape == q.shape and got.dtype == q.dtype
    assert np.isfinite(np.asarray(got)).all()
    read = ~np.isnan(want)
    np.testing.assert_allclose(np.asarray(got)[read], want[read], atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_kv_head_equals_dot_product_attention(dtype):
    """The two formulations compute the same products in f32: f32 results agree to the
    last bits; bf16 ones to one bf16 rounding of the output."""
    q, k, v, mask = inputs(3, 8, 40, 9, 3, 64, dtype, seed=1)
    ours = np.asarray(jax.jit(masked_attention)(q, k, v, mask), np.float32)
    theirs = np.asarray(jax.jit(lambda *a: masked_attention(*a, per_kv_head=False))(
        q, k, v, mask), np.float32)
    tol = 2e-6 if dtype == jnp.float32 else 2 ** -7  # bf16: 8 significant bits
    np.testing.assert_allclose(ours, theirs, atol=tol, rtol=tol)
    want = numpy_attention(q, np.nan_to_num(np.asarray(k, np.float32), nan=0.0),
                           np.nan_to_num(np.asarray(v, np.float32), nan=0.0),
                           np.asarray(mask))
    read = ~np.isnan(want)
    np.testing.assert_allclose(ours[read], want[read], atol=4 * tol, rtol=4 * tol)
