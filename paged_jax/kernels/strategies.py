"""Decode attention strategies: how a decode step's attention reads the paged cache.

A strategy is what the engine's decode steps plug into the model's ``attend`` callback. For a
dispatch of ``num_steps`` steps it gives ``(attention_at, extra)``: ``attention_at(t, live_t)``
is step ``t``'s ``attention(layer, q, k, v, kv, extra) -> (out, extra)`` (q ``[S, Hq, D]``, k
and v ``[S, Hkv, D]`` the step's new keys and values, already written to ``kv``; out ``[S,
Hq, D]``), ``live_t`` ([S] bool) the rows still going at step ``t``, and ``extra`` the state
the strategy threads through the layers and steps beside the cache.

* ``per_step``: every step runs ``paged_attention`` over the pool (Pallas or xla).
* ``hoisted``: the xla path with each row's context gathered once per dispatch
  (``paged-jax bench decode`` measures what that saves).

``decode_strategy`` picks one. ``kv`` is a ``KVCache`` (``k`` and ``v`` ``[layers, kv_heads,
num_blocks, block_size, head_dim]``).

The xla path's cost grows with the table it gathers, not with the tokens it holds: a table of
``max_blocks_per_seq`` blocks costs the same whether its rows hold 10 tokens or 2,000. So it
reads only the first ``w`` columns of the table, ``w`` the smallest of ``context_widths``
that covers the longest live row, chosen inside the step by ``by_context_width`` (a
``lax.switch``: every width is compiled into the one executable, and a step runs one). The
prefill's attention (``engine.step_bodies``) does the same. The Pallas kernel reads each
row's live blocks only, so it needs none of this.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from paged_jax.allocator.primitives import cdiv
from paged_jax.kernels.pallas_decode import paged_attention, resolve_impl
from paged_jax.kernels.reference import attend_segments, gather_context
from paged_jax.sharding import per_head_shard

# The default for context_widths' bucket_tokens: the narrowest table the xla path attends over
# is this many tokens; wider ones double up to max_blocks_per_seq.
CONTEXT_BUCKET_TOKENS = 256

# The default for decode_strategy's hoist_max_bytes: above this many bytes of gathered context
# (keys and values of every layer), the xla K-step path gathers per step instead of once per
# dispatch: the copy would cost more memory than the gathers it saves are worth.
HOIST_MAX_BYTES = 256 << 20


def context_widths(max_blocks: int, block_size: int,
                   bucket_tokens: int = CONTEXT_BUCKET_TOKENS) -> tuple[int, ...]:
    """The table widths, in blocks, the xla path may attend over: ``ceil(bucket_tokens /
    block_size)`` blocks, doubled while under two thirds of ``max_blocks``, then
    ``max_blocks`` itself (always the last; a width just under it would be one more
    compiled branch for almost no saving). ``bucket_tokens`` 0 gives ``(max_blocks,)``: the
    whole table."""
    if bucket_tokens < 0:
        raise ValueError(f"bucket_tokens must be >= 0. Got {bucket_tokens!r}.")
    widths = []
    w = cdiv(bucket_tokens, block_size) if bucket_tokens else max_blocks
    while 3 * w < 2 * max_blocks:
        widths.append(w)
        w *= 2
    return (*widths, max_blocks)


def by_context_width(context_lens, block_size: int, widths: tuple[int, ...], attend):
    """``attend(w)`` for the smallest ``w`` of ``widths`` whose ``w * block_size`` tokens
    cover every row's ``context_lens`` ([S] int, traced), through one ``lax.switch``: every
    branch is compiled, one runs. ``attend(w)`` must give the same shapes for every ``w``;
    the tokens past a row's length are masked in each, so any width that covers them gives
    the same values, up to float summation order."""
    if len(widths) == 1:
        return attend(widths[0])
    need = cdiv(jnp.max(context_lens), block_size)  # blocks the longest row reaches
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), need.astype(jnp.int32))
    index = jnp.minimum(index, len(widths) - 1)  # the whole table, at the worst
    return jax.lax.switch(index, [lambda w=w: attend(w) for w in widths])


def paged_step(block_tables, context_lens, *, impl: str, interpret: bool, mesh=None,
               widths: tuple[int, ...] | None = None):
    """The attention of one step over the pool: ``paged_attention`` of each row's first
    ``context_lens`` tokens (the new one included), no extra state. With a ``mesh``, each tp
    shard attends its own heads over its own pages (``sharding.per_head_shard``): XLA cannot
    partition the Pallas kernel, and the xla path needs no communication either. With
    ``widths`` (``context_widths``; the xla path), it reads only the table's first columns
    that cover the longest row (``by_context_width``).

    Args:
      block_tables: [S, max_blocks_per_seq] int32.
      context_lens: [S] int32, 0 for rows that attend to nothing.
    """

    def attention(layer, q, k, v, kv, extra):
        # The whole cache and the layer index, not kv.k[layer]: the kernel reads the layer
        # in place, where a slice would be copied before the Pallas call.
        def attend(q, k_pages, v_pages, tables, lens):  # q [S, Hq, D] -> [S, Hq, D]
            def at_width(w):
                return paged_attention(q, k_pages, v_pages, tables[:, :w], lens, impl=impl,
                                       interpret=interpret, layer=layer)

            if widths is None:
                return at_width(tables.shape[1])
            return by_context_width(lens, k_pages.shape[3], widths, at_width)

        if mesh is not None:
            attend = per_head_shard(attend, mesh)
        return attend(q, kv.k, kv.v, block_tables, context_lens), extra

    return attention


def per_step(block_tables, start, *, impl: str, interpret: bool, mesh=None,
             widths: tuple[int, ...] | None = None):
    """Every step gathers and attends over the pool: step ``t`` of row ``r`` reads its
    ``start[r] + t + 1`` tokens. ``block_tables`` [S, M] int32, ``start`` [S] int32 (each
    row's length before the dispatch); ``mesh`` and ``widths`` as in ``paged_step``.
    Returns ``(attention_at, ())``."""

    def attention_at(t, live_t):
        lens = jnp.where(live_t, start + t + 1, 0)  # [S]
        return paged_step(block_tables, lens, impl=impl, interpret=interpret, mesh=mesh,
                          widths=widths)

    return attention_at, ()


def hoisted(kv, block_tables, start, live, num_steps: int):
    """The xla path's steps with each row's context gathered once per dispatch.

    Under the scan the pool changes only at the K new slots, so each layer's context (the
    ``start`` [S] tokens the ``live`` [S] rows held before this dispatch) is gathered and
    masked once, up front. Step ``t``'s attention also keeps its new K/V in ``extra``
    (``[layers, rows, kv_heads, K, head_dim]`` keys and values) and attends over the gathered
    context plus the kept tokens ``0..t``: one gather per layer per dispatch instead of K.
    It gathers the whole table: ``decode_strategy`` hoists only tables of one width.
    Returns ``(attention_at, extra)``.
    """
    layers, heads, _, _, head_dim = kv.k.shape
    rows = start.shape[0]
    context = []  # per layer: k, v [rows, heads, T, D], live [rows, T]
    for layer in range(layers):
        k, v, live_t = gather_context(kv.k[layer], kv.v[layer], block_tables,
                                      jnp.where(live, start, 0))
        context.append((kv.values(k), kv.values(v), live_t))
    shape = (layers, rows, heads, num_steps, head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim)  # paged_attention's default, which per_step uses

    def attention_at(t, live_t):
        # A row still going at step t went at every step before it: its kept tokens 0..t
        # are its own.
        new_live = (jnp.arange(num_steps)[None, :] <= t) & live[:, None]  # [rows, K]

        def attention(layer, q, k, v, kv, extra):
            # Kept as the pool keeps them (a 16-bit dtype's bits on CPU), for the pool's
            # reason: XLA:CPU would convert a bf16 buffer to f32 and back around each update.
            new_k, new_v = (
                jax.lax.dynamic_update_slice(
                    buf, kv.stored(x[None, :, :, None]), (layer, 0, 0, t, 0)
                )
                for buf, x in zip(extra, (k, v), strict=True)
            )
            # The new values past step t are still the zeros they started as: finite.
            segments = [context[layer],
                        (kv.values(new_k[layer]), kv.values(new_v[layer]), new_live)]
            return attend_segments(q, segments, sm_scale=sm_scale), (new_k, new_v)

        return attention

    return attention_at, (jnp.zeros(shape, kv.k.dtype), jnp.zeros(shape, kv.v.dtype))


def hoisted_bytes(kv, block_tables) -> int:
    """Bytes ``hoisted`` gathers: every row's whole table, keys and values, all layers
    (``block_tables`` [S, M])."""
    layers, heads, _, block_size, head_dim = kv.k.shape
    tokens = block_tables.shape[0] * block_tables.shape[1] * block_size
    return 2 * layers * heads * tokens * head_dim * kv.k.dtype.itemsize


def xla_widths(kv, block_tables, impl: str,
               bucket_tokens: int = CONTEXT_BUCKET_TOKENS) -> tuple[int, ...] | None:
    """``context_widths`` for a decode step over ``block_tables`` [S, M] where ``impl``
    resolves to the xla path; None where it resolves to the Pallas kernel."""
    resolved = resolve_impl(impl, batch=block_tables.shape[0], head_dim=kv.k.shape[-1],
                            block_size=kv.k.shape[3])
    if resolved != "xla":
        return None
    return context_widths(block_tables.shape[1], kv.k.shape[3], bucket_tokens)


def decode_strategy(kv, block_tables, start, live, num_steps: int, *, impl: str,
                    interpret: bool, hoist_max_bytes: int = HOIST_MAX_BYTES,
                    bucket_tokens: int = CONTEXT_BUCKET_TOKENS, mesh=None):
    """The strategy a dispatch of ``num_steps`` runs: ``hoisted`` on the xla path (``impl``
    "xla", or "auto" off GPU) when ``num_steps > 1``, the table has one width
    (``context_widths(..., bucket_tokens)``: no wider than the bucket, or ``bucket_tokens``
    0) and ``hoisted_bytes`` is at most ``hoist_max_bytes``; ``per_step`` otherwise, reading
    the table by width on the xla path. A hoisted context keeps the whole table's shape
    whatever width a dispatch needs, and filling it costs more than the per-step gathers it
    saves (``paged-jax bench decode``'s wide tables time both). The results are the same
    either way, up to float summation order. With a ``mesh``, ``hoisted`` is partitioned by
    XLA (its gathers and softmax are per head) and ``per_step`` runs per shard
    (``paged_step``). Returns ``(attention_at, extra)``."""
    widths = xla_widths(kv, block_tables, impl, bucket_tokens)
    if (num_steps > 1 and widths is not None and len(widths) == 1
            and hoisted_bytes(kv, block_tables) <= hoist_max_bytes):
        return hoisted(kv, block_tables, start, live, num_steps)
    return per_step(block_tables, start, impl=impl, interpret=interpret, mesh=mesh,
                    widths=widths)
