"""What the engine tells its listeners: KV block events in vLLM's names and fields, enriched,
and the scheduling events the pictures draw.

KV cache events (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, with their
fields: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``) carry what
vLLM's lack: the physical ``block_ids``, the ``request_id`` and the blocks' ``ref_counts``
when the event happened. Hashes are the first 8 bytes of the prefix cache's sha256 chain
hashes, as unsigned ints (vLLM publishes int hashes too).

Scheduling events: ``Admitted`` (with its prefix-cache ``Lookup``), ``Forked``, ``Moved``,
``Preempted``, ``Finished`` (a sequence released its slot: its finish reason, or
``"abort"``) and ``StepDone``, published after every ``LLMEngine.step`` with the
``BlockState`` it left and which slot holds which request, for a recorder to snapshot.

    engine.add_listener(events.append)          # any callable taking one event
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "Admitted",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Finished",
    "Forked",
    "Moved",
    "Preempted",
    "StepDone",
    "hash_int",
]


def hash_int(digest: bytes) -> int:
    """A chain hash as vLLM's events carry it: an unsigned 64-bit int."""
    return int.from_bytes(digest[:8], "big")


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Full blocks entered in the prefix cache (vLLM's fields first)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    request_id: str | None = None
    ref_counts: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: list[int]
    block_ids: list[int] = dataclasses.field(default_factory=list)
    ref_counts: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was emptied (``LLMEngine.reset_prefix_cache``)."""


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A sequence took ``slot``, starting on ``hit_blocks`` cached blocks (``lookup`` says
    why the hit stopped; None with prefix caching off)."""

    request_id: str
    index: int
    slot: int
    hit_blocks: list[int]
    lookup: Any = None


@dataclasses.dataclass(frozen=True)
class Forked:
    """A request's completions forked after its prefill: ``child_slots`` share every block of
    ``parent_slot``."""

    request_id: str
    parent_slot: int
    child_slots: list[int]


@dataclasses.dataclass(frozen=True)
class Moved:
    """A sequence moved from ``from_slot`` to ``to_slot`` before a decode dispatch
    (``LLMEngine``'s ``condense_slots``): its table row and length, not its blocks."""

    request_id: str
    index: int
    from_slot: int
    to_slot: int


@dataclasses.dataclass(frozen=True)
class Preempted:
    """A sequence gave up ``slot`` and ``blocks`` to make room; it is queued again."""

    request_id: str
    index: int
    slot: int
    blocks: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    """A sequence released ``slot`` and ``blocks``, which held ``tokens`` tokens
    (``reason``: stop, length, abort). The blocks are the table as the step left it: a
    decode dispatch may have claimed some of them (or copied one on write) before the
    sequence finished in it."""

    request_id: str
    index: int
    slot: int
    blocks: list[int]
    reason: str
    tokens: int


@dataclasses.dataclass(frozen=True)
class StepDone:
    """The end of one ``step``: the ``BlockState`` it left, ``slots`` (slot -> (request id,
    completion index)) and the counts of what it ran (an iteration, or the part of one that
    ``LLMEngine``'s ``deliver_each_prefill`` returns after)."""

    step: int
    state: Any
    slots: dict[int, tuple[str, int]]
    prefill_tokens: int
    decode_rows: int
    copies: int
