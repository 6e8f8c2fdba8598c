"""Block backends for the memory replay's ``Paged`` strategy (``memory.py``).

All three answer the same five calls: ``num_free()``, ``admit([(slot, tokens)])``,
``append(slots)`` (one token each), ``release(slots)`` and ``counts(slots)`` (blocks held), and
carry ``block_size``, ``num_blocks`` and ``max_seqs``.

* ``DeviceBlocks``: the real functional allocator (``admit``, ``append``, ``release`` on a
  ``BlockState``), jitted once per batch width.
* ``SeedBlocks``: the seed write-up's ``BlockAllocator`` and ``RequestState``, verbatim: the
  independent pure-Python model the device's block counts are tested against.
* ``SlotBlocks``: one slot per token state, the physical limit (the seed's ``append_token``
  never allocates at block size 1, so it cannot serve here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import ops, seed_reference
from paged_jax.allocator.memory import Paged, cdiv, check_positive, check_stream
from paged_jax.allocator.state import NULL_BLOCK, CacheConfig, init_state


def padded_width(count: int) -> int:
    """Batch width for ``count`` entries: a power of two (at least 8), so a replay compiles
    each op a handful of times rather than once per batch size."""
    return max(8, 1 << max(count - 1, 0).bit_length())


def pad_ids(ids, fill=-1, width: int | None = None) -> np.ndarray:
    """[width] int32: ``ids``, then ``fill``."""
    width = padded_width(len(ids)) if width is None else width
    out = np.full(width, fill, np.int32)
    out[:len(ids)] = ids
    return out


def _counts(state):
    return state.num_free, jnp.sum(state.block_tables != NULL_BLOCK, axis=1, dtype=jnp.int32)


# One jitted function per op for every DeviceBlocks, so pools of the same shape share their
# compilations. The state is donated: XLA updates it in place.
_admit = jax.jit(ops.admit, donate_argnums=0)
_append_one = jax.jit(lambda state, mask: ops.append(state, mask, 1), donate_argnums=0)
_release = jax.jit(ops.release, donate_argnums=0)
_host_counts = jax.jit(_counts)


class DeviceBlocks:
    """The real allocator: a ``BlockState`` of ``num_blocks`` blocks and ``max_seqs`` rows of
    ``max_blocks_per_seq`` blocks. Every op's status is checked, so a refused op raises."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.config = CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                  max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
        self.block_size, self.num_blocks, self.max_seqs = block_size, num_blocks, max_seqs
        self.state = init_state(self.config)
        self._view = None  # (num_free, [max_seqs] blocks per row) of the current state

    def _run(self, fn, *args):
        self.state, status = fn(self.state, *args)
        status.raise_if_failed()
        self._view = None

    def _host_view(self):
        if self._view is None:
            free, rows = _host_counts(self.state)
            self._view = int(free), np.asarray(rows)
        return self._view

    def num_free(self) -> int:
        return self._host_view()[0]

    def admit(self, items):
        slots, tokens = zip(*items, strict=True)
        width = padded_width(len(slots))
        self._run(_admit, jnp.asarray(pad_ids(slots, -1, width)),
                  jnp.asarray(pad_ids(tokens, 0, width)))

    def append(self, slots):
        mask = np.zeros(self.max_seqs, bool)
        mask[list(slots)] = True
        self._run(_append_one, jnp.asarray(mask))

    def release(self, slots):
        self._run(_release, jnp.asarray(pad_ids(slots)))

    def counts(self, slots) -> list[int]:
        rows = self._host_view()[1]
        return [int(rows[s]) for s in slots]


class SeedBlocks:
    """The seed's allocator: one ``RequestState`` per slot over one ``BlockAllocator``."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int):
        self.block_size, self.num_blocks, self.max_seqs = block_size, num_blocks, max_seqs
        self.allocator = seed_reference.BlockAllocator(num_blocks, block_size)
        self.requests: dict[int, seed_reference.RequestState] = {}

    def num_free(self) -> int:
        return self.allocator.num_free

    def admit(self, items):
        for slot, tokens in items:
            self.requests[slot] = seed_reference.RequestState(slot, tokens, self.allocator)

    def append(self, slots):
        for s in slots:
            self.requests[s].append_token()

    def release(self, slots):
        for s in slots:
            self.requests.pop(s).release()

    def counts(self, slots) -> list[int]:
        return [len(self.requests[s].block_table) for s in slots]


class SlotBlocks:
    """Slot granularity: each request holds exactly its token states."""

    block_size = 1

    def __init__(self, pool_slots: int, max_seqs: int):
        self.num_blocks, self.max_seqs = pool_slots, max_seqs
        self.tokens: dict[int, int] = {}

    def num_free(self) -> int:
        return self.num_blocks - sum(self.tokens.values())

    def admit(self, items):
        for slot, tokens in items:
            self.tokens[slot] = tokens

    def append(self, slots):
        for s in slots:
            self.tokens[s] += 1

    def release(self, slots):
        for s in slots:
            del self.tokens[s]

    def counts(self, slots) -> list[int]:
        return [self.tokens[s] for s in slots]


def paged_strategy(pool_slots: int, block_size: int, stream, backend: str = "device"):
    """A ``Paged`` strategy over ``pool_slots // block_size`` blocks, with a row per request
    of ``stream`` (``(prompt_len, output_len)`` pairs) and room for its longest one.
    ``backend``: ``"device"`` (the real allocator) or ``"seed"`` (the seed's model)."""
    pool_slots = check_positive("pool_slots", pool_slots)
    block_size = check_positive("block_size", block_size)
    pairs = check_stream(stream)
    num_blocks = pool_slots // block_size
    if num_blocks < 1:
        raise ValueError(f"pool_slots {pool_slots} holds no block of block_size {block_size}.")
    max_seqs = min(len(pairs), num_blocks)
    longest = max(p + o for p, o in pairs)
    if backend == "device":
        blocks = DeviceBlocks(num_blocks, block_size, max_seqs, cdiv(longest, block_size))
    elif backend == "seed":
        blocks = SeedBlocks(num_blocks, block_size, max_seqs)
    else:
        raise ValueError(f"backend must be 'device' or 'seed'. Got {backend!r}.")
    return Paged(pool_slots, blocks)


def physical_limit(pool_slots: int, stream):
    """The zero-waste row: ``Paged`` at slot granularity."""
    pool_slots = check_positive("pool_slots", pool_slots)
    return Paged(pool_slots, SlotBlocks(pool_slots, len(check_stream(stream))), "physical-limit")
