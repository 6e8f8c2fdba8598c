"""Automatic prefix caching: the host-side index of cached blocks (plain Python).

Every full block of a sequence gets a chained hash, ``sha256(parent hash + its token ids)``,
so a block's hash names its whole prefix. ``PrefixCache`` maps hashes to the physical blocks
that hold them; the engine keeps each cached block alive with one held reference in the
``BlockState`` (``share_blocks``) and drops it on eviction (``free_blocks``).

* **Lookup** walks a new sequence's full blocks from the start and stops at the first miss.
  A hit also compares the stored token ids, so a hash collision can never serve another
  prefix's KV. It never covers the whole target: the last token is always computed, for its
  logits. Each lookup leaves a ``Lookup`` record saying why it stopped (vLLM users ask for
  this: its issue #43711): ``"partial block"`` (the rest of the target does not fill a
  block), ``"evicted"`` (this prefix was cached once and evicted), ``"different tokens"``
  (never cached, or a hash match whose tokens differ), or ``"whole target"``.
* **Eviction** takes blocks no sequence references (only the cache's own reference is left)
  in least-recently-used order. Evicting a block also forgets every cached block whose chain
  runs through it: they could never be hit again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["Lookup", "PrefixCache", "block_hashes"]

ROOT = b""  # the parent hash of a sequence's first block


def _hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained hashes of ``tokens``' full blocks."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What one lookup found: ``hit_blocks`` cached blocks (``hit_tokens`` tokens) and why it
    stopped there."""

    hit_blocks: int
    hit_tokens: int
    target_tokens: int
    reason: str


@dataclasses.dataclass
class _Entry:
    block: int
    parent: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    """Hash -> block index, LRU over the blocks. Knows nothing of JAX: the engine applies
    what it decides (holding a newly cached block, freeing an evicted one)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.entries: dict[bytes, _Entry] = {}
        self.by_block: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.evicted: set[bytes] = set()
        self.hits = 0  # tokens served from the cache
        self.queries = 0  # tokens looked up (targets less their last token)
        self.last_lookup: Lookup | None = None
        self.last_evicted: dict[int, bytes] = {}  # block -> hash, of the latest evict()

    def __len__(self) -> int:
        return len(self.entries)

    def blocks(self) -> list[int]:
        return list(self.by_block)

    def lookup(self, tokens: Sequence[int]) -> tuple[list[int], Lookup]:
        """The cached blocks that hold ``tokens``' longest cached prefix of whole blocks,
        short of the last token, and the record of why the walk stopped."""
        bs = self.block_size
        usable = (len(tokens) - 1) // bs  # whole blocks before the last token
        found, parent, reason = [], ROOT, None
        for j in range(usable):
            chunk = tuple(int(t) for t in tokens[j * bs:(j + 1) * bs])
            h = _hash(parent, chunk)
            entry = self.entries.get(h)
            if entry is None or entry.tokens != chunk or entry.parent != parent:
                reason = "evicted" if h in self.evicted else "different tokens"
                break
            found.append(entry.block)
            parent = h
        if reason is None:
            reason = "partial block" if len(tokens) - 1 - usable * bs > 0 else "whole target"
        for block in found:
            self.lru.move_to_end(block)
        self.queries += max(len(tokens) - 1, 0)
        self.hits += len(found) * bs
        self.last_lookup = Lookup(len(found), len(found) * bs, len(tokens), reason)
        return found, self.last_lookup

    def insert(self, parent: bytes, tokens: Sequence[int], block: int) -> tuple[bytes, bool]:
        """Record that ``block`` holds ``tokens`` (a full block) after ``parent``. Returns
        ``(hash, new)``: ``new`` is False when that prefix is already cached (in this block
        or another), and then the caller holds nothing."""
        chunk = tuple(int(t) for t in tokens)
        h = _hash(parent, chunk)
        # A block whose parent is not cached could never be hit (lookups walk from the
        # root); refusing it keeps every entry after its parent, which eviction relies on.
        if h in self.entries or block in self.by_block or (
                parent != ROOT and parent not in self.entries):
            return h, False
        self.entries[h] = _Entry(block, parent, chunk)
        self.by_block[block] = h
        self.lru[block] = None
        self.evicted.discard(h)
        return h, True

    def evict(self, count: int, evictable: set[int]) -> list[int]:
        """Up to ``count`` blocks from ``evictable`` (cached blocks no sequence references),
        least recently used first; they leave the index, and so does every cached block whose
        chain ran through them (returned too: their held references go as well)."""
        chosen = [b for b in self.lru if b in evictable][:count]
        gone = set(chosen)
        self.last_evicted = {}
        if chosen:
            dead = {self.by_block[b] for b in chosen}
            # Children after parents: insertion order is chain order for each sequence.
            for h, entry in list(self.entries.items()):
                if entry.parent in dead:
                    dead.add(h)
                    gone.add(entry.block)
            for h in dead:
                entry = self.entries.pop(h)
                self.last_evicted[entry.block] = h
                del self.by_block[entry.block]
                self.lru.pop(entry.block, None)
                self.evicted.add(h)
        return sorted(gone)

    def clear(self) -> list[int]:
        """Forget every entry; returns the blocks whose held references the caller drops."""
        blocks = sorted(self.by_block)
        self.evicted.update(self.entries)
        self.entries.clear()
        self.by_block.clear()
        self.lru.clear()
        return blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
