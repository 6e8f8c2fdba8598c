"""The seed write-up's scenario, replayed on ``paged_jax`` picture for picture.

Requests A (40 tokens), B (24) and C (50) arrive in a 20-block pool; A generates 10 tokens;
B finishes; then two requests D and E share a 32-token system prompt. Each step prints the
seed's code line, then what it produced, in the seed's ``# ...`` comment format.
"""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np

from paged_jax.allocator import seed_reference
from paged_jax.allocator.facade import BlockAllocator, RequestState
from paged_jax.allocator.ops import slot_mapping
from paged_jax.viz.ascii import render_layout


def _picture(allocator: BlockAllocator, **kwargs) -> str:
    text = render_layout(allocator.state, labels=allocator.labels, **kwargs)
    return "\n".join("# " + line for line in text.splitlines())


def _refs(allocator: BlockAllocator, blocks: list[int]) -> list[int]:
    return [allocator.ref_counts[b] for b in blocks]


def run_walkthrough(out: TextIO | None = None) -> BlockAllocator:
    """Print the walkthrough to ``out`` (default stdout); returns the final allocator."""
    out = sys.stdout if out is None else out

    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=out)

    say("allocator = BlockAllocator(num_blocks=20, block_size=16)")
    allocator = BlockAllocator(num_blocks=20, block_size=16)
    arrivals = [("A", 40, "(needs 3 blocks: ceil(40/16))"), ("B", 24, "(needs 2 blocks)"),
                ("C", 50, "(needs 4 blocks)")]
    reqs = {}
    for rid, prompt_len, needs in arrivals:
        say("", f"# Request {rid} arrives: {prompt_len} tokens prompt {needs}")
        say(f'req_{rid.lower()} = RequestState(request_id="{rid}", prompt_len={prompt_len}, '
            "allocator=allocator)")
        reqs[rid] = RequestState(request_id=rid, prompt_len=prompt_len, allocator=allocator)
        say(f"# Block table: {str(reqs[rid].block_table):<16}Free: {allocator.num_free} blocks")

    say("", "# GPU memory layout after initial allocation:", _picture(allocator))

    say("", "# A generates 10 more tokens (now 50 total, needs 4th block)",
        "for _ in range(10):", "    req_a.append_token()")
    before = set(reqs["A"].block_table)
    for _ in range(10):
        reqs["A"].append_token()
    (new_block,) = set(reqs["A"].block_table) - before
    say(f"# A's block table: {reqs['A'].block_table}   (block {new_block} allocated for overflow)")

    say("", "# B finishes. Release its blocks.", "req_b.release()")
    freed = reqs["B"].block_table
    reqs["B"].release()
    say(f"# Blocks {' and '.join(map(str, freed))} return to free list",
        f"# Free list, next to be handed out first: {allocator.free_blocks}")
    say("", "# GPU memory layout after B finishes:", _picture(allocator), "#")
    a_blocks = reqs["A"].block_table
    say(f"# Note: A's blocks are NOT contiguous! Blocks {','.join(map(str, a_blocks[:-1]))} "
        f"and {a_blocks[-1]}.")

    _kernel_lookup(allocator, reqs["A"], say)
    _prefix_sharing(allocator, say)
    return allocator


def _kernel_lookup(allocator: BlockAllocator, req: RequestState, say) -> None:
    bs = allocator.block_size
    positions = np.array([[42, req.num_tokens - 1]], np.int32)
    slots = np.asarray(slot_mapping(allocator.state, np.array([req.slot]), positions))[0]
    say("", "# How the kernel finds a token: block_table[pos // block_size], offset pos % "
        "block_size")
    for pos, slot in zip(positions[0], slots, strict=True):
        block = req.block_table[pos // bs]
        say(f"# A's token {pos}: block_table[{pos // bs}] = block {block}, offset {pos % bs} "
            f"-> physical slot {slot} (= {block} * {bs} + {pos % bs})")


def _prefix_sharing(allocator: BlockAllocator, say) -> None:
    say("", "# Copy-on-write for prefix sharing: D and E share a 32-token system prompt",
        "sys_prompt_blocks = [allocator.allocate(), allocator.allocate()]")
    sys_blocks = [allocator.allocate(), allocator.allocate()]
    say(f"# sys_prompt_blocks = {sys_blocks}   ref counts {_refs(allocator, sys_blocks)}: "
        "the prompt's own reference")

    say("", "req_d_table = sys_prompt_blocks + [allocator.allocate()]",
        "for b in sys_prompt_blocks:", "    allocator.share(b)  # ref_count goes to 2")
    d_table = sys_blocks + [allocator.allocate()]
    for b in sys_blocks:
        allocator.share(b)
    say(f"# D's table: {d_table}   shared ref counts {_refs(allocator, sys_blocks)}")

    say("", "req_e_table = sys_prompt_blocks + [allocator.allocate()]",
        "for b in sys_prompt_blocks:",
        "    allocator.share(b)  # ref_count goes to 3: the seed leaves this call out")
    e_table = sys_blocks + [allocator.allocate()]
    for b in sys_blocks:
        allocator.share(b)
    say(f"# E's table: {e_table}   shared ref counts {_refs(allocator, sys_blocks)}")

    tables = {"D": d_table, "E": e_table}
    say("", "# GPU memory layout with the shared prompt ([*] = shared, ref count > 1):",
        _picture(allocator, tables=tables))
    say(f"# Memory saved: {len(sys_blocks)} blocks (the shared prefix)")

    say("", *_seed_slip(), "")
    say("# D finishes: drop one reference per block of its table",
        "for b in req_d_table:", "    allocator.free(b)")
    for b in d_table:
        allocator.free(b)
    del tables["D"]
    say(f"# Shared ref counts {_refs(allocator, sys_blocks)}; block {d_table[-1]} is free again")
    say("# The prompt's own reference is dropped too:",
        "for b in sys_prompt_blocks:", "    allocator.free(b)")
    for b in sys_blocks:
        allocator.free(b)
    say(f"# Ref counts {_refs(allocator, sys_blocks)}: E still owns its prompt blocks",
        _picture(allocator, tables=tables))


def _seed_slip() -> list[str]:
    """Replay the seed's own code to show what its missing ``share()`` does."""
    seed = seed_reference.BlockAllocator(num_blocks=4, block_size=16)
    sys_blocks = [seed.allocate(), seed.allocate()]
    d_table = sys_blocks + [seed.allocate()]
    for b in sys_blocks:
        seed.share(b)
    e_table = sys_blocks + [seed.allocate()]
    counts = [seed.ref_counts[b] for b in sys_blocks]
    for b in d_table:  # D finishes
        seed.free(b)
    for b in sys_blocks:  # the prompt's own reference goes
        seed.free(b)
    reused = seed.allocate()
    return [
        "# The seed's version stops at ref count 2 because E never calls share(). Three tables",
        "# (the prompt, D, E) then hold two references. Replaying the seed's own allocator",
        f"#   in a fresh 4-block pool: after E joins, ref counts = {counts} (should be [3, 3])",
        f"#   D and the prompt release -> the seed frees blocks {sys_blocks} while E still reads",
        f"#   them (E's table: {e_table}); the next allocate() returns block {reused}, and the",
        "#   new owner's KV overwrites E's system prompt. Counting every sharer avoids this.",
    ]


def main() -> int:
    run_walkthrough()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
