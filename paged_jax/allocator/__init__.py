"""The functional block allocator: ``BlockState`` and pure, batched, jittable ops."""

from paged_jax.allocator.claim import bad_tokens, claim_feeding, claim_steps
from paged_jax.allocator.facade import BlockAllocator, RequestState
from paged_jax.allocator.invariants import assert_invariants, check_invariants
from paged_jax.allocator.loose import allocate_blocks, free_blocks, share_blocks
from paged_jax.allocator.ops import (
    admit,
    admit_cached,
    append,
    copy_on_write,
    fork,
    move_slots,
    release,
    reserve_steps,
    share_prefix,
    slot_mapping,
)
from paged_jax.allocator.state import (
    NULL_BLOCK,
    BlockState,
    CacheConfig,
    blocks_of,
    free_list_order,
    init_state,
)
from paged_jax.allocator.status import Code, OutOfBlocksError, Status

__all__ = [
    "NULL_BLOCK",
    "BlockAllocator",
    "BlockState",
    "CacheConfig",
    "Code",
    "OutOfBlocksError",
    "RequestState",
    "Status",
    "admit",
    "admit_cached",
    "allocate_blocks",
    "append",
    "assert_invariants",
    "bad_tokens",
    "blocks_of",
    "check_invariants",
    "claim_feeding",
    "claim_steps",
    "copy_on_write",
    "fork",
    "free_blocks",
    "free_list_order",
    "init_state",
    "move_slots",
    "release",
    "reserve_steps",
    "share_blocks",
    "share_prefix",
    "slot_mapping",
]
