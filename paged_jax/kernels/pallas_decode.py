"""Paged decode attention: a Pallas (Triton) kernel, its jitted wrapper, and the public entry.

One program handles one (sequence, KV head, split): all query heads that share the KV head
are stacked into one ``[block_h, head_dim]`` tile, so every KV byte is read from memory once.
The program walks its slice of the sequence ``block_k`` tokens at a time with an online softmax
in f32 and writes an unnormalised partial output with its running max and denominator, all in
f32; a small ``jnp`` epilogue merges the splits (flash-decoding). The loop bound comes from
``context_len``: no step runs, and no load is issued, for a token at or past the length, and a
block-table entry that is -1 (or otherwise out of range) is never dereferenced.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paged_jax.kernels.reference import paged_attention_xla
from paged_jax.kvcache import as_values

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_BATCH = 512
TUNING_KNOBS = ("num_splits", "block_k", "pages_per_compute_block", "num_warps", "num_stages")

MIN_DOT_ROWS = 16  # tl.dot needs every tile dimension >= 16
NUM_SMS = 132  # H200 / H100 SXM; the split heuristic aims for about two programs per SM
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more to merge than it saves
KV_TILE_BYTES = 16 * 1024  # per K (and per V) tile: keeps pipelined stages well inside smem

_LOG2E = math.log2(math.e)
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so empty splits merge without inf - inf
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_EXACT = lax.Precision.HIGHEST  # IEEE f32 dots instead of TF32; no effect on 16-bit inputs


def _paged_attention_kernel(
    context_len_ref,  # [1] int32
    block_table_ref,  # [padded_blocks_per_seq] int32, -1 = no block
    q_ref,  # [block_h, head_dim]
    k_pages_ref,  # [num_blocks, block_size, head_dim]
    v_pages_ref,  # [num_blocks, block_size, head_dim]
    o_ref,  # [block_h, head_dim] f32, this split's unnormalised output
    m_ref,  # [block_h] f32, this split's running max of the logits, in log2 units
    l_ref,  # [block_h] f32, this split's softmax denominator
    *,
    sm_scale: float,
    block_k: int,
    tokens_per_split: int,
):
    num_blocks, block_size, head_dim = k_pages_ref.shape
    block_h = q_ref.shape[0]
    start = pl.program_id(2) * tokens_per_split
    end = jnp.minimum(start + tokens_per_split, context_len_ref[0])
    num_steps = pl.cdiv(jnp.maximum(end - start, 0), block_k)

    q = q_ref[...]
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]  # [1, head_dim]

    def step(i, carry):
        o, m, l = carry
        token = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        in_len = token < end
        block = plgpu.load(block_table_ref.at[lax.div(token, block_size)], mask=in_len, other=-1)
        live = in_len & (block >= 0) & (block < num_blocks)  # [block_k]
        # Dead lanes are masked out of the loads (no memory access) and get a harmless index.
        rows = jnp.broadcast_to(jnp.where(live, block, 0)[:, None], (block_k, head_dim))
        slots = jnp.broadcast_to(lax.rem(token, block_size)[:, None], (block_k, head_dim))
        cols = jnp.broadcast_to(dims, (block_k, head_dim))
        live_2d = jnp.broadcast_to(live[:, None], (block_k, head_dim))
        k = plgpu.load(k_pages_ref.at[rows, slots, cols], mask=live_2d, other=0)  # [block_k, d]
        v = plgpu.load(v_pages_ref.at[rows, slots, cols], mask=live_2d, other=0)  # [block_k, d]

        s = plgpu.dot(q, k, trans_b=True, precision=_EXACT) * (sm_scale * _LOG2E)  # [h, block_k]
        s = jnp.where(live[None, :], s, _MASK_VALUE)
        m_next = jnp.maximum(m, s.max(axis=1))  # [block_h]
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])  # [block_h, block_k]
        l_next = alpha * l + p.sum(axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=_EXACT)  # [block_h, head_dim]
        return alpha[:, None] * o + pv, m_next, l_next

    init = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), _M_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, num_steps, step, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "layer", "num_splits", "block_k", "num_warps", "num_stages",
                     "interpret"],
)
def paged_attention_pallas(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim], or with [layers] first
    v_pages: jax.Array,  # the same shape as k_pages
    block_tables: jax.Array,  # [batch, max_blocks_per_seq] int32, -1 = no block
    context_lens: jax.Array,  # [batch] int32
    *,
    sm_scale: float,
    layer: int | None = None,
    num_splits: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
    """The kernel launch plus the f32 split merge. Expects inputs checked by `paged_attention`.

    With ``layer``, the pages carry a leading layer axis and the kernel reads layer ``layer``
    in place: the whole cache is the custom call's operand, so no per-layer slice (which XLA
    would copy before the call) is ever made.
    """
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0  # a reshape: no copy
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    block_h = max(MIN_DOT_ROWS, pl.next_power_of_2(group))

    capacity = max_blocks_per_seq * block_size
    tokens_per_split = pl.cdiv(pl.cdiv(capacity, num_splits), block_k) * block_k
    num_splits = pl.cdiv(capacity, tokens_per_split)
    padded_blocks = pl.cdiv(num_splits * tokens_per_split, block_size)

    q_tiles = q.reshape(batch, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    tables = jnp.pad(
        block_tables, ((0, 0), (0, padded_blocks - max_blocks_per_seq)), constant_values=-1
    )
    # Lengths past the table's capacity are cut to it, so the padding above is never live.
    lens = jnp.clip(context_lens, 0, capacity)

    kernel = functools.partial(
        _paged_attention_kernel,
        sm_scale=sm_scale,
        block_k=block_k,
        tokens_per_split=tokens_per_split,
    )
    partial_shape = (batch, num_kv_heads, num_splits, block_h)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),  # context_lens
            pl.BlockSpec((None, padded_blocks), lambda b, h, s: (b, 0)),  # block_tables
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
            pl.BlockSpec(
                (None, None, num_blocks, block_size, head_dim),
                lambda b, h, s: (layer, h, 0, 0, 0),
            ),  # k_pages
            pl.BlockSpec(
                (None, None, num_blocks, block_size, head_dim),
                lambda b, h, s: (layer, h, 0, 0, 0),
            ),  # v_pages
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),  # o
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),  # m
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),  # l
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_{block_h=}_{block_k=}_{num_splits=}",
    )(lens, tables, q_tiles, k_pages, v_pages)

    # Flash-decoding merge, in f32 (JAX's kernel stores its partial outputs in q's dtype).
    weight = jnp.exp2(m - m.max(axis=2, keepdims=True))  # [batch, kv, splits, block_h]
    denom = jnp.sum(l * weight, axis=2)  # [batch, kv, block_h]
    out = jnp.sum(o * weight[..., None], axis=2)  # [batch, kv, block_h, head_dim]
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]  # context_len == 0 -> zeros
    return out[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def default_block_k(head_dim: int, dtype, max_tokens: int) -> int:
    """Tokens per KV step: the largest power of two whose K tile fits `KV_TILE_BYTES`."""
    fit = KV_TILE_BYTES // (head_dim * jnp.dtype(dtype).itemsize)
    block_k = min(128, max(MIN_DOT_ROWS, 1 << (fit.bit_length() - 1)))
    return min(block_k, max(MIN_DOT_ROWS, pl.next_power_of_2(max_tokens)))


def default_num_splits(batch: int, num_kv_heads: int, max_tokens: int, block_k: int) -> int:
    """Splits of the sequence so that about two programs land on every SM."""
    wanted = pl.cdiv(2 * NUM_SMS, batch * num_kv_heads)
    worth_it = pl.cdiv(max_tokens, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worth_it, pl.cdiv(max_tokens, block_k)))


def _is_power_of_2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _check_layer(k_pages, layer) -> None:
    if layer is None:
        if k_pages.ndim != 4:
            raise ValueError(
                "k_pages must be [num_kv_heads, num_blocks, block_size, head_dim] (or, with "
                f"layer=, [num_layers, ...] of those). Got shape {k_pages.shape}."
            )
        return
    if k_pages.ndim != 5:
        raise ValueError(
            "With layer=, k_pages must be [num_layers, num_kv_heads, num_blocks, block_size, "
            f"head_dim]. Got shape {k_pages.shape}."
        )
    if not isinstance(layer, numbers.Integral) or isinstance(layer, bool) or not (
        0 <= layer < k_pages.shape[0]
    ):
        raise ValueError(
            f"layer must be a Python int in [0, {k_pages.shape[0]}). Got {layer!r}."
        )


def _check_inputs(q, k_pages, v_pages, block_tables, context_lens, impl, sm_scale,
                  layer=None) -> None:
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla'. Got {impl!r}.")
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim]. Got shape {q.shape}.")
    _check_layer(k_pages, layer)
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must have the same shape. Got {k_pages.shape} and "
            f"{v_pages.shape}."
        )
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, head_dim_kv = k_pages.shape[-4:]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16. Got {q.dtype}.")
    bits_ok = q.dtype.itemsize == 2  # a 16-bit query's pages may come as their uint16 bits
    if any(p.dtype != q.dtype and not (bits_ok and p.dtype == jnp.uint16)
           for p in (k_pages, v_pages)):
        raise ValueError(
            f"q, k_pages and v_pages must share a dtype (a 16-bit q's pages may also be its "
            f"uint16 bits). Got {q.dtype}, {k_pages.dtype} and {v_pages.dtype}."
        )
    if head_dim != head_dim_kv:
        raise ValueError(
            f"head_dim of q must match that of k_pages/v_pages. Got {head_dim} and {head_dim_kv}."
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            "Number of Q heads must be divisible by number of KV heads. Got "
            f"{num_q_heads} and {num_kv_heads}."
        )
    if batch < 1:
        raise ValueError(f"batch must be at least 1. Got {batch}.")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks_per_seq >= 1]. "
            f"Got shape {block_tables.shape}."
        )
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32. Got {block_tables.dtype}.")
    if context_lens.shape != (batch,):
        raise ValueError(
            f"context_lens must have shape (batch,) = ({batch},). Got {context_lens.shape}."
        )
    if context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be int32. Got {context_lens.dtype}.")
    if sm_scale is not None and not (
        isinstance(sm_scale, numbers.Real)
        and not isinstance(sm_scale, bool)
        and math.isfinite(sm_scale)
        and sm_scale > 0
    ):
        raise ValueError(f"sm_scale must be a positive finite Python number. Got {sm_scale!r}.")


def _resolve_tuning(q, k_pages, block_tables, tuning: dict) -> dict:
    """Fills in the knobs the caller left out and checks the ones given."""
    unknown = sorted(set(tuning) - set(TUNING_KNOBS))
    if unknown:
        raise ValueError(f"Unknown tuning options {unknown}. Known: {list(TUNING_KNOBS)}.")
    batch, _, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape[-4:]
    max_tokens = block_tables.shape[1] * block_size

    block_k = tuning.get("block_k")
    pages = tuning.get("pages_per_compute_block")
    if block_k is not None and pages is not None:
        raise ValueError(
            f"Give block_k or pages_per_compute_block, not both. Got {block_k} and {pages}."
        )
    if pages is not None:
        if not _is_power_of_2(pages):
            raise ValueError(f"pages_per_compute_block must be a power of 2. Got {pages!r}.")
        block_k = pages * block_size
        if block_k < MIN_DOT_ROWS:
            raise ValueError(
                f"pages_per_compute_block * block_size must be >= {MIN_DOT_ROWS}. "
                f"Got {pages} * {block_size} = {block_k}."
            )
    if block_k is None:
        block_k = default_block_k(head_dim, q.dtype, max_tokens)
    elif not (_is_power_of_2(block_k) and MIN_DOT_ROWS <= block_k <= 512):
        raise ValueError(f"block_k must be a power of 2 in [16, 512]. Got {block_k!r}.")

    num_splits = tuning.get("num_splits")
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_tokens, block_k)
    elif not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int. Got {num_splits!r}.")
    # More splits than KV steps would leave splits with nothing to do.
    num_splits = min(num_splits, pl.cdiv(max_tokens, block_k))

    num_warps = tuning.get("num_warps", 4)
    if not (_is_power_of_2(num_warps) and num_warps <= 32):
        raise ValueError(f"num_warps must be a power of 2 up to 32. Got {num_warps!r}.")
    num_stages = tuning.get("num_stages", 2)
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be a positive int. Got {num_stages!r}.")
    return dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def pallas_unsupported(batch: int, head_dim: int, block_size: int) -> str | None:
    """Why the Pallas kernel cannot take these shapes (a sentence naming the values), or None.

    The xla path takes any of them; only the kernel's tiles constrain them: ``tl.dot`` needs
    tiles of at least 16 rows and power-of-2 sizes, so ``head_dim`` must be one of
    ``SUPPORTED_HEAD_DIMS`` and ``block_size`` one of ``SUPPORTED_BLOCK_SIZES``; the grid
    holds at most ``MAX_BATCH`` sequences."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim must be one of {SUPPORTED_HEAD_DIMS}. Got {head_dim}."
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block_size must be one of {SUPPORTED_BLOCK_SIZES}. Got {block_size}."
    if not 1 <= batch <= MAX_BATCH:
        return f"batch must be between 1 and {MAX_BATCH}. Got {batch}."
    return None


def resolve_impl(impl: str, *, batch: int, head_dim: int, block_size: int) -> str:
    """The implementation that runs: ``"auto"`` is ``"pallas"`` on a GPU backend when the
    kernel takes the shapes (``pallas_unsupported``), ``"xla"`` otherwise; ``"pallas"`` on
    shapes the kernel cannot take raises ``ValueError`` naming them; ``"xla"`` as given."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla'. Got {impl!r}.")
    reason = pallas_unsupported(batch, head_dim, block_size)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and reason is None else "xla"
    if impl == "pallas" and reason is not None:
        raise ValueError(f'impl="pallas" cannot run this shape: {reason} impl="xla" (or '
                         f'"auto", which falls back to it) takes any head_dim and block_size.')
    return impl


def paged_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # [batch, max_blocks_per_seq] int32, padded with -1
    context_lens: jax.Array,  # [batch] int32
    *,
    impl: str = "auto",
    interpret: bool = False,
    sm_scale: float | None = None,
    layer: int | None = None,
    **tuning: int,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
      q: the queries, ``[batch, num_q_heads, head_dim]``.
      k_pages, v_pages: the cache, ``[num_kv_heads, num_blocks, block_size, head_dim]`` (the
        head-major layout of ``jax.experimental.pallas.ops.gpu.paged_attention``), in q's
        dtype or, for a bf16/f16 q, as its ``uint16`` bits (the CPU pool's storage; see
        ``paged_jax.kvcache``). The xla path reads the bits of the pages it gathers; the
        Pallas path converts the whole pages first (the CPU pool is for interpret mode).
      block_tables: int32 ``[batch, max_blocks_per_seq]``; entry ``j`` of row ``b`` is the block
        that holds tokens ``j * block_size ...`` of sequence ``b``. Pad with -1. A -1 (or any
        out-of-range) entry's tokens count as masked, as do those at or past ``context_len``.
        The kernel never reads them at all; the xla path gathers whole table rows, clamping
        such entries into the pool, and masks what it read.
      context_lens: int32 ``[batch]``; 0 gives a zero output.
      impl: ``"pallas"`` (the kernel), ``"xla"`` (gather + masked softmax in ``jnp``) or
        ``"auto"`` (pallas on GPU for the shapes the kernel takes, xla otherwise; see
        ``pallas_unsupported``). The xla path takes any ``head_dim`` and ``block_size``.
      interpret: run the Pallas kernel in interpret mode (CPU-capable, slow).
      sm_scale: softmax scale, ``1 / sqrt(head_dim)`` by default.
      layer: a Python int. With it, ``k_pages``/``v_pages`` are the whole multi-layer cache,
        ``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``, and layer ``layer``
        is attended. The kernel then reads that layer in place; passing ``k_pages[layer]``
        instead would hand the custom call a slice, which XLA would have to materialise (a
        copy of the layer's whole pool) before every call.
      **tuning: Pallas-only knobs, each chosen automatically when left out:
        ``num_splits`` (split-K partitions of the sequence; capped at the number of KV steps),
        ``block_k`` (tokens per KV step, a power of 2 >= 16) or equivalently
        ``pages_per_compute_block`` (``block_k = pages * block_size``), ``num_warps``,
        ``num_stages``.

    Raises:
      ValueError: on malformed shapes, dtypes or options, or ``impl="pallas"`` on shapes the
        kernel cannot take, before anything is traced.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, context_lens, impl, sm_scale, layer)
    batch, _, head_dim = q.shape
    impl = resolve_impl(impl, batch=batch, head_dim=head_dim, block_size=k_pages.shape[-2])
    knobs = _resolve_tuning(q, k_pages, block_tables, tuning)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if impl == "xla":
        if layer is not None:  # the slice fuses into the xla path's gather: no copy
            k_pages, v_pages = k_pages[layer], v_pages[layer]
        return paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, sm_scale=scale)
    k_pages, v_pages = as_values(k_pages, q.dtype), as_values(v_pages, q.dtype)
    return paged_attention_pallas(
        q, k_pages, v_pages, block_tables, context_lens, sm_scale=scale, layer=layer,
        interpret=interpret, **knobs,
    )
