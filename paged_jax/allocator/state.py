"""The allocator's state: one immutable pytree of fixed-shape arrays, plus static config.

Layout of the free list
-----------------------
The free list is a ring buffer ``free_list[num_blocks]``. The free blocks are, in hand-out
order, ``free_list[(free_head + i) % num_blocks]`` for ``i < num_free``; every other entry is
``NULL_BLOCK``. Allocation takes from the head and released blocks join the tail, so:

* a fresh pool hands out ``0, 1, 2, ...`` (lowest-numbered first, as in the seed's pictures);
* a freed block is reused only after every block that was already free (first in, first out,
  like vLLM's free-block queue). Recently freed blocks, and whatever KV they still hold,
  stay untouched for as long as possible.

Both ends move by O(batch) work per op: nothing shifts the whole list.

The sentinel
------------
``NULL_BLOCK = -1`` pads block tables and the free list. It is never a block id: every op masks
it before any gather or scatter (scatters send it to an out-of-range index with
``mode="drop"``), and ``slot_mapping`` turns it into a ``-1`` slot rather than an address.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paged_jax.allocator.packed import Packed

NULL_BLOCK = -1


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Static shape of the paged KV cache. Frozen and hashable: never traced.

    Attributes:
      num_blocks: physical blocks in the pool.
      block_size: tokens per block.
      max_seqs: sequence slots (rows of the block tables).
      max_blocks_per_seq: columns of the block tables; a sequence holds at most
        ``max_blocks_per_seq * block_size`` tokens.
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 64
    max_blocks_per_seq: int = 64

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_seqs", "max_blocks_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be a positive int. Got {value!r}.")
        if self.num_blocks >= 2**31 // max(self.block_size, 1):
            raise ValueError(
                f"num_blocks * block_size must fit in int32 slots. Got {self.num_blocks} * "
                f"{self.block_size}."
            )

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size


class BlockState(Packed):
    """Who owns which physical block. Every field has a fixed shape, so one compiled step
    serves any mix of sequences.

    Fields (read by name; stored back to back in two int32 ``buffers``, see ``packed.py``, so
    that a jitted step moves two arrays for the whole state instead of eight: the per-block
    arrays and the tables in one, the per-sequence arrays and scalars in the other):

    * ``ref_counts``: [num_blocks] int32;
    * ``held``: [num_blocks] int32, references held outside any table (facade, cache);
    * ``block_tables``: [max_seqs, max_blocks_per_seq] int32, NULL_BLOCK-padded;
    * ``seq_lens``: [max_seqs] int32, tokens per sequence;
    * ``active``: [max_seqs] bool;
    * ``free_list``: [num_blocks] int32 ring buffer, NULL_BLOCK outside the window;
    * ``free_head``: [] int32, ring index of the next block to hand out;
    * ``num_free``: [] int32;

    and the static ``config: CacheConfig``. Build one with keywords (``BlockState(ref_counts=
    ..., config=...)``); ``state.replace(seq_lens=...)`` returns an updated copy.

    Invariants (see ``check_invariants``): a block is free (ref 0, exactly once in the free
    list) or in use; ``ref_counts == table references + held``; an active sequence of length
    ``L`` has exactly ``ceil(L / block_size)`` leading non-null table entries.
    """

    FIELDS = (
        ("ref_counts", jnp.int32),
        ("held", jnp.int32),
        ("block_tables", jnp.int32),
        ("seq_lens", jnp.int32),
        ("active", jnp.bool_),
        ("free_list", jnp.int32),
        ("free_head", jnp.int32),
        ("num_free", jnp.int32),
    )
    # Per-block arrays and the tables in one buffer, per-sequence arrays and scalars in the
    # other (see ``packed.py``): a late read of a length or a count then never copies the pool.
    GROUPS = (
        ("ref_counts", "held", "block_tables", "free_list"),
        ("seq_lens", "active", "free_head", "num_free"),
    )
    STATIC = ("config",)
    __slots__ = ()

    def _shapes(self):
        n, s, m = self.config.num_blocks, self.config.max_seqs, self.config.max_blocks_per_seq
        return (n,), (n,), (s, m), (s,), (s,), (n,), (), ()


def init_state(config: CacheConfig) -> BlockState:
    """An empty pool: every block free, in ascending order; no sequence active."""
    if not isinstance(config, CacheConfig):
        raise TypeError(f"init_state expects a CacheConfig. Got {type(config).__name__}.")
    n, s, m = config.num_blocks, config.max_seqs, config.max_blocks_per_seq
    return BlockState(
        ref_counts=jnp.zeros((n,), jnp.int32),
        held=jnp.zeros((n,), jnp.int32),
        block_tables=jnp.full((s, m), NULL_BLOCK, jnp.int32),
        seq_lens=jnp.zeros((s,), jnp.int32),
        active=jnp.zeros((s,), bool),
        free_list=jnp.arange(n, dtype=jnp.int32),
        free_head=jnp.zeros((), jnp.int32),
        num_free=jnp.asarray(n, jnp.int32),
        config=config,
    )


def free_list_order(state: BlockState) -> list[int]:
    """The free blocks in hand-out order (host copy; eager use only)."""
    ring = np.asarray(state.free_list)
    head, count = int(state.free_head), int(state.num_free)
    return ring[(head + np.arange(count)) % ring.shape[0]].tolist()


def blocks_of(state: BlockState, seq_id: int) -> list[int]:
    """The non-null entries of one sequence's block table (host copy; eager use only)."""
    row = np.asarray(state.block_tables[seq_id])
    return [int(b) for b in row if b != NULL_BLOCK]
