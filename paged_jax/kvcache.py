"""The paged KV cache: one K and one V buffer shared by every layer, and the memory planner.

Both buffers are ``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``. A block id
names the same block in every layer, so the allocator's ``BlockState`` addresses all layers
at once: a "block" of the seed's arithmetic is ``num_layers`` per-layer pages. Writes scatter
to the ``slot_mapping`` slots (``block * block_size + offset``), indexing the buffer as
``[layer, :, block, offset]``; a ``-1`` slot is sent out of range and dropped, so padding and
inactive rows never write.
Under a jitted step that donates the buffers, every update here happens in place.

On CPU a 16-bit float pool is stored as its bits, ``uint16`` (``KVCache.dtype`` names the
values' dtype): XLA:CPU has no bf16 scatter and rewrites one as a conversion of the whole
buffer to f32 and back, so every write would cost a pass over the pool; a ``uint16`` scatter
writes in place. Readers take the bits as values with ``KVCache.values`` (or pass the pages
on: ``paged_attention`` accepts a 16-bit query's pages as ``uint16`` bits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax.allocator import CacheConfig
from paged_jax.model.config import ModelConfig, cpu_16bit


@struct.dataclass
class KVCache:
    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    # The values' dtype where the buffers hold their bits (uint16); None: the buffers' own.
    dtype: Any = struct.field(pytree_node=False, default=None)

    @property
    def value_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype if self.dtype is not None else self.k.dtype)

    def values(self, pages: jax.Array) -> jax.Array:
        """``pages`` read from ``k`` or ``v`` (any slice or gather) as ``value_dtype``."""
        return as_values(pages, self.value_dtype)

    def stored(self, x: jax.Array) -> jax.Array:
        """``x`` (any float dtype) as ``k`` and ``v`` hold it: rounded to ``value_dtype``,
        then its bits where the buffers hold bits. The inverse of ``values``."""
        x = x.astype(self.value_dtype)
        return x if x.dtype == self.k.dtype else jax.lax.bitcast_convert_type(x, self.k.dtype)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


def storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a pool of ``dtype`` values is kept in on ``platform`` (default: JAX's default
    backend): ``uint16`` for a 16-bit float on CPU (see the module docstring), else ``dtype``."""
    return jnp.dtype(jnp.uint16) if cpu_16bit(dtype, platform) else jnp.dtype(dtype)


def as_values(pages: jax.Array, dtype) -> jax.Array:
    """``pages`` as ``dtype`` values: a bitcast when they are the bits (``uint16``) of a 16-bit
    float ``dtype``, else ``pages`` unchanged."""
    dtype = jnp.dtype(dtype)
    if pages.dtype == dtype or pages.dtype != jnp.uint16 or dtype.itemsize != 2:
        return pages
    return jax.lax.bitcast_convert_type(pages, dtype)


def init_cache(model: ModelConfig, cache: CacheConfig, dtype=None, fill: float = 0.0,
               platform: str | None = None) -> KVCache:
    """Zeroed (or ``fill``-ed, e.g. NaN to poison) K/V buffers for ``cache.num_blocks`` blocks.

    ``dtype``, if given, must be the model's: the steps attend with queries in the model's
    dtype, and both attention paths take q, k and v in one dtype. A mismatch fails here, not
    when a step is traced. The buffers are kept in ``storage_dtype(dtype, platform)``: on CPU
    a bf16 or f16 pool holds its bits as ``uint16`` (``KVCache.dtype`` is then the values'
    dtype); ``platform="gpu"`` keeps the values' own dtype anywhere."""
    shape = (model.num_layers, model.num_kv_heads, cache.num_blocks, cache.block_size,
             model.head_dim)
    if dtype is not None and jnp.dtype(dtype) != model.jnp_dtype:
        raise ValueError(
            f"init_cache: the cache dtype must be the model's ({model.dtype}): attention reads "
            f"queries, keys and values in one dtype. Got {jnp.dtype(dtype).name}."
        )
    dtype = model.jnp_dtype
    storage = storage_dtype(dtype, platform)
    if storage == dtype:
        return KVCache(k=jnp.full(shape, fill, dtype), v=jnp.full(shape, fill, dtype))
    bits = np.asarray(fill, dtype).view(storage)  # the fill value's bit pattern
    return KVCache(k=jnp.full(shape, bits, storage), v=jnp.full(shape, bits, storage),
                   dtype=dtype)


def write(
    kv: KVCache,
    layer: int,
    slots: jax.Array,  # [...] int32 slot ids, -1 = do not write
    k: jax.Array,  # [..., num_kv_heads, head_dim]
    v: jax.Array,  # [..., num_kv_heads, head_dim]
) -> KVCache:
    """Scatter new K/V of one layer into their slots; ``-1`` slots are dropped."""
    num_layers, heads, num_blocks, block_size, head_dim = kv.k.shape
    flat_slots = slots.reshape(-1)
    capacity = num_blocks * block_size
    target = jnp.where(flat_slots >= 0, flat_slots, capacity)  # out of range -> dropped
    if target.shape[0] == 1:
        # XLA rewrites a one-row dropping scatter as select(in_bounds, update_slice, buffer),
        # which copies the whole buffer; a second, always-dropped row keeps it a scatter.
        target = jnp.concatenate([target, jnp.full((1,), capacity, target.dtype)])
        k, v = (jnp.concatenate([x.reshape(1, -1), x.reshape(1, -1)]) for x in (k, v))

    # Index the 5-D buffer itself, not a reshaped [layers, heads, slots, D] view: with one KV
    # head, XLA laid the view's scatter out differently from the buffer (they differ only in
    # a size-1 axis) and copied the whole cache to convert, every step inside a K-step loop.
    block, offset = target // block_size, target % block_size  # a dropped slot: block past end

    def scatter(buf, new):
        new = kv.stored(new.reshape(-1, heads, head_dim))  # [n, heads, head_dim]
        return buf.at[layer, :, block, offset].set(new, mode="drop")

    return kv.replace(k=scatter(kv.k, k), v=scatter(kv.v, v))


def copy_blocks(
    kv: KVCache,
    src: jax.Array,  # [n] int32 block ids, -1 = no copy
    dst: jax.Array,  # [n] int32 block ids, -1 = no copy
) -> KVCache:
    """``block[dst] <- block[src]`` in every layer (the pairs ``copy_on_write`` returns)."""
    live = (src >= 0) & (dst >= 0)
    src = jnp.where(live, src, 0)
    dst = jnp.where(live, dst, kv.num_blocks)

    def copy(buf):
        return buf.at[:, :, dst].set(buf[:, :, src], mode="drop")

    return kv.replace(k=copy(kv.k), v=copy(kv.v))


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """How many KV blocks fit in a memory budget."""

    block_size: int
    bytes_per_block_per_layer: int  # K and V of one block in one layer
    bytes_per_block: int  # ... in every layer: what one block id costs
    num_blocks: int
    memory_bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def cache_config(self, max_seqs: int, max_blocks_per_seq: int) -> CacheConfig:
        return CacheConfig(self.num_blocks, self.block_size, max_seqs, max_blocks_per_seq)


def plan_blocks(
    model: ModelConfig, memory_bytes: int, block_size: int = 16, dtype=None
) -> BlockPlan:
    """Bytes per block and how many blocks fit in ``memory_bytes`` of KV cache.

    The seed's figures, for a Llama-2-7B-shaped model (32 layers, 32 KV heads, head_dim 128)
    in fp16 with 16-token blocks: 256 KB per block per layer, 8 MB per block for 32 layers,
    and about 10,000 blocks in 80 GB:

    >>> llama2_7b = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
    ...     num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, dtype="float16")
    >>> plan = plan_blocks(llama2_7b, memory_bytes=80 * 2**30, block_size=16)
    >>> plan.bytes_per_block_per_layer // 2**10  # KB: 2 (K, V) * 16 * 32 * 128 * 2 bytes
    256
    >>> plan.bytes_per_block // 2**20  # MB
    8
    >>> plan.num_blocks
    10240
    """
    if not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise ValueError(f"memory_bytes must be a non-negative int. Got {memory_bytes!r}.")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int. Got {block_size!r}.")
    itemsize = jnp.dtype(dtype or model.dtype).itemsize
    per_layer = 2 * block_size * model.num_kv_heads * model.head_dim * itemsize
    per_block = per_layer * model.num_layers
    return BlockPlan(
        block_size=block_size,
        bytes_per_block_per_layer=per_layer,
        bytes_per_block=per_block,
        num_blocks=memory_bytes // per_block,
        memory_bytes=memory_bytes,
    )
