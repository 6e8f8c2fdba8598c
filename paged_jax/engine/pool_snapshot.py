"""``PoolSnapshot``: the block arithmetic the scheduler plans an iteration with.

``LLMEngine.step`` takes one at the start of each iteration: a host copy of the pool's
reference counts, held flags, block tables and free count, plus the prefix cache's blocks.
It is the ``scheduler.BlockCounter`` the plan is made against, and it keeps what the plan's
admissions need afterwards (each admitted sequence's prefix-cache hit and its lookup
record). Reading the device state once per iteration keeps the scheduler's many questions
on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.allocator import BlockState
from paged_jax.allocator.primitives import cdiv
from paged_jax.engine.prefix_cache import Lookup, PrefixCache
from paged_jax.engine.scheduler import Sequence

__all__ = ["PoolSnapshot"]


@dataclasses.dataclass
class PoolSnapshot:
    """The pool at the start of an iteration, answering ``BlockCounter``'s questions.

    ``held_alone`` drops the released sequence's references from ``ref``, so later answers
    in the same plan (a fork's siblings, the eviction count) see the release. ``lookup``
    records each queued sequence's hit in ``hits`` (block ids) and ``lookups`` (the record),
    keyed by ``id(seq)``.
    """

    block_size: int
    prefix_cache: PrefixCache | None  # None: prefix caching off
    ref: np.ndarray  # [num_blocks] int32, reference counts (held ones included)
    held: np.ndarray  # [num_blocks] bool, held by the prefix cache
    tables: np.ndarray  # [max_seqs, max_blocks_per_seq] int32
    num_free: int
    evictable: set[int]  # cached blocks only the prefix cache references
    hits: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    lookups: dict[int, Lookup] = dataclasses.field(default_factory=dict)

    @classmethod
    def take(cls, state: BlockState, prefix_cache: PrefixCache, block_size: int,
             enable_prefix_caching: bool = True) -> PoolSnapshot:
        """Copy ``state`` to the host (one transfer) beside the prefix cache's blocks."""
        ref, held, tables, num_free = (np.array(x) for x in jax.device_get(
            (state.ref_counts, state.held, state.block_tables, state.num_free)))
        evictable = {b for b in prefix_cache.blocks() if ref[b] == 1}
        return cls(block_size, prefix_cache if enable_prefix_caching else None, ref, held,
                   tables, int(num_free), evictable)

    def free(self) -> int:
        return self.num_free + len(self.evictable)

    def decode_need(self, seq: Sequence, steps: int) -> int:
        bs, length = self.block_size, seq.cached
        need = cdiv(length + steps, bs) - cdiv(length, bs)
        if length % bs:
            block = self.tables[seq.slot, length // bs]
            need += int(self.ref[block] > 1)  # a copy on write
        return need

    def lookup(self, seq: Sequence) -> int:
        if self.prefix_cache is None:
            return 0
        blocks, record = self.prefix_cache.lookup(seq.target)
        self.hits[id(seq)] = blocks
        self.lookups[id(seq)] = record
        return record.hit_tokens

    def prefill_need(self, seq: Sequence, upto: int) -> int:
        need = cdiv(upto, self.block_size) - cdiv(seq.cached, self.block_size)
        if seq.slot is None:  # an admission: its hit's evictable blocks leave the free count
            need += sum(b in self.evictable for b in self.hits.get(id(seq), ()))
        return need

    def held_alone(self, seq: Sequence) -> int:
        row = self.tables[seq.slot, : cdiv(seq.cached, self.block_size)]
        # Freed, or left evictable, where this sequence is the block's only table reference.
        freed = int(sum(self.ref[b] - self.held[b] == 1 for b in row))
        self.ref[row] -= 1
        return freed
