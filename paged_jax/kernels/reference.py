"""Plain-``jnp`` paged attention: gather the pages, then a masked softmax.

This is the ``impl="xla"`` path of :func:`paged_jax.kernels.paged_attention` (the fast path on
CPU) and the reference the Pallas kernel is checked against. Inputs are validated by the public
wrapper; this module assumes they are well formed. Its two halves are public to the engine:
``gather_context`` (tables to a masked, gathered context) and ``attend_segments`` (one softmax
over several such key/value segments), which the K-step decode uses to gather each row's
context once per dispatch instead of once per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax.kvcache import as_values

# f32 matmuls default to TF32 on recent GPUs; the reference must not.
_EXACT = jax.lax.Precision.HIGHEST


def gather_pages(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    tables: jax.Array,  # [batch, max_blocks] int32; -1 or any out-of-range entry = no block
) -> jax.Array:  # [batch, num_kv_heads, max_blocks * block_size, head_dim]
    """Each row's blocks, in table order.

    An entry that names no block (-1, or out of range) is clamped into the pool: its tokens
    hold some other block's data, and the caller must mask them (both callers do: a dead
    key's logit becomes -inf, a dead value is zeroed). Clamping, not a gather in ``fill``
    mode, because the fill adds a select to every element; and the gather copies whole
    ``block_size * head_dim`` rows straight into the output layout, so no transpose follows.
    """
    heads, num_blocks, block_size, head_dim = pages.shape
    batch, max_blocks = tables.shape
    rows = pages.reshape(heads * num_blocks, block_size * head_dim)  # a view: no copy
    head = jnp.arange(heads, dtype=jnp.int32)[None, :, None] * num_blocks
    index = head + jnp.clip(tables, 0, num_blocks - 1)[:, None, :]  # [batch, heads, max_blocks]
    out = rows.at[index].get(mode="clip")  # [batch, heads, max_blocks, block_size * head_dim]
    return out.reshape(batch, heads, max_blocks * block_size, head_dim)


def gather_context(
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # [batch, max_blocks_per_seq] int32, -1 = no block
    context_lens: jax.Array,  # [batch] int32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's first ``context_lens`` tokens, gathered into table order.

    Returns ``(k, v, live)``: ``k`` and ``v`` ``[batch, num_kv_heads, max_blocks * block_size,
    head_dim]`` and ``live`` ``[batch, max_blocks * block_size]`` bool. Keys are left as read:
    a dead slot's logit is replaced by -inf, whatever the key holds. Values past the length
    are zeroed, so whatever they hold (NaN, 1e30) never reaches an output, not even as 0 * NaN.
    """
    num_blocks, block_size = k_pages.shape[1:3]
    max_blocks_per_seq = block_tables.shape[1]
    # A block is live iff its first token is below the length and its entry is in range; every
    # token of any other block (the -1 sentinel included) is masked, whatever it reads.
    block_pos = jnp.arange(max_blocks_per_seq, dtype=jnp.int32)
    live_block = (
        (block_pos[None, :] * block_size < context_lens[:, None])
        & (block_tables >= 0)
        & (block_tables < num_blocks)
    )  # [batch, max_blocks]
    token = jnp.arange(max_blocks_per_seq * block_size)
    live = (token[None, :] < context_lens[:, None]) & jnp.repeat(
        live_block, block_size, axis=1
    )  # [batch, seq]
    k = gather_pages(k_pages, block_tables)  # [batch, kv, seq, head_dim]
    v = jnp.where(live[:, None, :, None], gather_pages(v_pages, block_tables), 0)
    return k, v, live


def attend_segments(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    segments,  # sequence of (k, v, live): [batch, num_kv_heads, n_i, head_dim] x2, [batch, n_i]
    *,
    sm_scale: float,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
    """One softmax over the keys of all ``segments``, as if concatenated, without concatenating.

    Each segment's ``v`` must be finite where ``live`` is false (``gather_context`` zeroes it).
    A row with no live key gets zeros, not NaN.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = segments[0][0].shape[1]
    q_grouped = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    # Queries times keys, logits [batch, kv, group, n_i] with the key axis minor: XLA:CPU's
    # dot library runs decode's many small per-(row, head) products faster in this order
    # than keys times queries.
    logits = [
        jnp.where(
            live[:, None, None, :],
            jnp.einsum("bkgd,bksd->bkgs", q_grouped, k, preferred_element_type=jnp.float32,
                       precision=_EXACT) * jnp.float32(sm_scale),
            -jnp.inf,
        )  # [batch, kv, group, n_i]
        for k, _, live in segments
    ]
    m = functools.reduce(jnp.maximum, [jnp.max(x, axis=3, keepdims=True) for x in logits])
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # no live key: every logit is -inf
    p = [jnp.exp(x - m) for x in logits]
    denom = functools.reduce(jnp.add, [jnp.sum(x, axis=3) for x in p])  # [batch, kv, group]
    o = functools.reduce(jnp.add, [
        jnp.einsum("bkgs,bksd->bkgd", x, v.astype(jnp.float32), precision=_EXACT)
        for x, (_, v, _) in zip(p, segments, strict=True)
    ])
    o = o / jnp.where(denom > 0, denom, 1.0)[..., None]  # zeros, not NaN, for empty sequences
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


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
    k, v, live = gather_context(k_pages, v_pages, block_tables, context_lens)
    # Pages kept as uint16 bits (the CPU pool) are read as q's dtype once gathered.
    context = (as_values(k, q.dtype), as_values(v, q.dtype), live)
    return attend_segments(q, [context], sm_scale=sm_scale)
