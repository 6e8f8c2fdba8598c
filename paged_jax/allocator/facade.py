"""The seed's ``BlockAllocator`` and ``RequestState``, eager and backed by ``BlockState``.

Same methods and attributes as the seed, so the seed's code runs unchanged, with three
deliberate differences:

* ``free_blocks[0]`` is handed out next and freed blocks join the end (the seed pops from the
  end yet draws A in blocks 0, 1, 2; ours matches the pictures).
* Misuse raises ``ValueError`` instead of corrupting counts: freeing a block with no
  outstanding ``allocate()``/``share()`` reference, releasing a request twice, negative lengths.
* Running out raises ``OutOfBlocksError`` (a ``RuntimeError``, as in the seed) and changes
  nothing: a request that cannot get all its blocks gets none.
"""

from __future__ import annotations

import jax
import numpy as np

from paged_jax.allocator import loose, ops
from paged_jax.allocator.state import CacheConfig, blocks_of, free_list_order, init_state

_admit = jax.jit(ops.admit)
_append = jax.jit(ops.append, static_argnames="num_tokens")
_release = jax.jit(ops.release)
_allocate = jax.jit(loose.allocate_blocks, static_argnums=1)
_share = jax.jit(loose.share_blocks)
_free = jax.jit(loose.free_blocks)


class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens.

    ``max_seqs`` bounds how many ``RequestState``s may be live at once and
    ``max_blocks_per_seq`` (default: the whole pool) how long each may grow.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        max_seqs: int = 64,
        max_blocks_per_seq: int | None = None,
    ):
        self.block_size = block_size
        self.state = init_state(
            CacheConfig(num_blocks, block_size, max_seqs, max_blocks_per_seq or num_blocks)
        )
        self.requests: dict[int, RequestState] = {}  # live requests by sequence slot

    def allocate(self) -> int:
        state, blocks, status = _allocate(self.state, 1)
        status.raise_if_failed()
        self.state = state
        return int(blocks[0])

    def free(self, block_id: int):
        state, status = _free(self.state, self._block(block_id))
        status.raise_if_failed()
        self.state = state

    def share(self, block_id: int):
        """Increment ref count for copy-on-write sharing."""
        state, status = _share(self.state, self._block(block_id))
        status.raise_if_failed()
        self.state = state

    @property
    def num_free(self) -> int:
        return int(self.state.num_free)

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids, the next to be handed out first (a copy)."""
        return free_list_order(self.state)

    @property
    def ref_counts(self) -> list[int]:
        return np.asarray(self.state.ref_counts).tolist()

    @property
    def labels(self) -> dict[int, str]:
        """Sequence slot -> first character of its request id, for ``render_layout``."""
        return {slot: str(req.request_id)[:1] for slot, req in self.requests.items()}

    def _block(self, block_id) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise ValueError(f"block_id must be an int. Got {block_id!r}.")
        if not 0 <= block_id < self.state.config.num_blocks:
            raise ValueError(
                f"block_id {block_id} is out of range; expected 0 <= id < "
                f"{self.state.config.num_blocks}."
            )
        return int(block_id)

    def _free_slot(self) -> int:
        active = np.asarray(self.state.active)
        free = np.flatnonzero(~active)
        if free.size == 0:
            raise RuntimeError(f"All {active.size} sequence slots are in use (max_seqs).")
        return int(free[0])


class RequestState:
    """One request's block table, kept in a sequence slot of the allocator's state."""

    def __init__(self, request_id, prompt_len: int, allocator: BlockAllocator):
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)):
            raise ValueError(f"prompt_len must be an int. Got {prompt_len!r}.")
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0. Got {prompt_len}.")
        self.request_id = request_id
        self.allocator = allocator
        self.slot = allocator._free_slot()
        state, status = _admit(allocator.state, self.slot, prompt_len)
        status.raise_if_failed()
        allocator.state = state
        allocator.requests[self.slot] = self
        self.released = False

    @property
    def num_tokens(self) -> int:
        return int(self.allocator.state.seq_lens[self.slot]) if not self.released else 0

    @property
    def block_table(self) -> list[int]:
        return [] if self.released else blocks_of(self.allocator.state, self.slot)

    def append_token(self):
        """Called after each decode step."""
        self._check_live("append_token")
        state, status = _append(self.allocator.state, self.slot, num_tokens=1)
        status.raise_if_failed()
        self.allocator.state = state

    def release(self):
        """Free all blocks when request completes."""
        self._check_live("release")
        state, status = _release(self.allocator.state, self.slot)
        status.raise_if_failed()
        self.allocator.state = state
        del self.allocator.requests[self.slot]
        self.released = True

    def _check_live(self, what: str):
        if self.released:
            raise ValueError(f"{what}: request {self.request_id!r} was already released.")
