"""Plain-``jnp`` paged attention: gather the pages, then a masked softmax.

This is the ``impl="xla"`` path of :func:`paged_jax.kernels.paged_attention` (the fast path on
CPU) and the reference the Pallas kernel is checked against. Inputs are validated by the public
wrapper; this module assumes they are well formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# f32 matmuls default to TF32 on recent GPUs; the reference must not.
_EXACT = jax.lax.Precision.HIGHEST


def gather_pages(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    tables: jax.Array,  # [batch, max_blocks] int32; -1 or any out-of-range entry = no block
) -> jax.Array:  # [batch, num_kv_heads, max_blocks * block_size, head_dim]
    """Each row's blocks, in table order. An entry that names no block is never read: it is
    sent out of range, which the gather's fill mode turns into zeros."""
    heads, num_blocks, block_size, head_dim = pages.shape
    batch, max_blocks = tables.shape
    safe = jnp.where((tables >= 0) & (tables < num_blocks), tables, num_blocks)
    kv = jnp.take(pages, safe, axis=1, mode="fill", fill_value=0)  # [H, B, M, bs, D]
    return kv.reshape(heads, batch, max_blocks * block_size, head_dim).swapaxes(0, 1)


@functools.partial(jax.jit, static_argnames=["sm_scale"])
def paged_attention_xla(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # [batch, max_blocks_per_seq] int32, -1 = no block
    context_lens: jax.Array,  # [batch] int32
    *,
    sm_scale: float,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    seq_len = max_blocks_per_seq * block_size

    # A block is read iff its first token is below the length and its entry is in range; every
    # other entry (the -1 sentinel included) becomes `num_blocks`, which the gather's fill mode
    # turns into zeros without reading memory. Tokens of a skipped block count as masked.
    block_pos = jnp.arange(max_blocks_per_seq, dtype=jnp.int32)
    live_block = (
        (block_pos[None, :] * block_size < context_lens[:, None])
        & (block_tables >= 0)
        & (block_tables < num_blocks)
    )  # [batch, max_blocks]
    tables = jnp.where(live_block, block_tables, -1)  # [batch, max_blocks]

    token = jnp.arange(seq_len)
    token_live = (token[None, :] < context_lens[:, None]) & jnp.repeat(
        live_block, block_size, axis=1
    )  # [batch, seq]
    # Slots past the length are zeroed, so whatever they hold (NaN, 1e30) never reaches
    # the output, not even as 0 * NaN.
    live = token_live[:, None, :, None]
    k = jnp.where(live, gather_pages(k_pages, tables), 0)  # [batch, kv, seq, head_dim]
    v = jnp.where(live, gather_pages(v_pages, tables), 0)

    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim)
    logits = jnp.einsum(
        "bkgd,bksd->bkgs", q_grouped, k, preferred_element_type=jnp.float32, precision=_EXACT
    ) * jnp.float32(sm_scale)  # [batch, kv, group, seq]
    logits = jnp.where(token_live[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # context_len == 0: every logit is -inf
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgs,bksd->bkgd", p, v.astype(jnp.float32), precision=_EXACT)
    o = o / jnp.where(denom > 0, denom, 1.0)  # zeros, not NaN, for empty sequences
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
