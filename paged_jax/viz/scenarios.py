"""Recorded runs to look at: the seed's, prefix sharing, fork with copy-on-write, random.

``seed`` drives the facade exactly as the seed write-up (and ``paged-jax demo``) does; the
others drive the pure ops through ``RecordingPool``. Each returns a ``RunLog``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.allocator.facade import BlockAllocator, RequestState
from paged_jax.allocator.state import CacheConfig
from paged_jax.viz.log import RunLog
from paged_jax.viz.pool import RecordingPool
from paged_jax.viz.recorder import Recorder

# Pools shared between scenarios, so each op compiles once per pool.
SMALL_POOL = CacheConfig(24, 4, max_seqs=8, max_blocks_per_seq=12)
TINY_POOL = CacheConfig(12, 4, max_seqs=6, max_blocks_per_seq=6)

# Steps of the seed scenario whose pictures the seed write-up prints.
SEED_PICTURES = {"after initial allocation": 3, "after B finishes": 14, "shared prompt": 17,
                 "after D and the prompt finish": 19}


def seed() -> RunLog:
    """The seed's run: A (40), B (24), C (50) arrive in a 20-block pool; A generates 10 tokens;
    B finishes; D and E share a 32-token system prompt (every sharer counted); D and the
    prompt finish. One step per line of the seed's code."""
    rec = Recorder("seed")
    allocator = BlockAllocator(num_blocks=20, block_size=16)
    rec.capture_allocator(
        allocator, title="allocator = BlockAllocator(num_blocks=20, block_size=16)"
    )
    reqs = {}
    for rid, prompt_len in (("A", 40), ("B", 24), ("C", 50)):
        reqs[rid] = RequestState(request_id=rid, prompt_len=prompt_len, allocator=allocator)
        rec.capture_allocator(
            allocator, title=f'req_{rid.lower()} = RequestState(request_id="{rid}", '
            f"prompt_len={prompt_len}, allocator=allocator)"
        )
    for _ in range(10):
        reqs["A"].append_token()
        rec.capture_allocator(
            allocator, title=f"req_a.append_token()  # A now has {reqs['A'].num_tokens} tokens"
        )
    reqs["B"].release()
    rec.capture_allocator(allocator, title="req_b.release()")

    sys_blocks = [allocator.allocate(), allocator.allocate()]
    rec.capture_allocator(
        allocator, title="sys_prompt_blocks = [allocator.allocate(), allocator.allocate()]"
    )
    tables: dict[str, list[int]] = {}
    for name in ("D", "E"):
        tables[name] = sys_blocks + [allocator.allocate()]
        for b in sys_blocks:
            allocator.share(b)
        rec.capture_allocator(
            allocator, tables=tables,
            title=f"req_{name.lower()}_table = sys_prompt_blocks + [allocator.allocate()]; "
            "share() each prompt block",
        )
    for b in tables.pop("D"):
        allocator.free(b)
    rec.capture_allocator(
        allocator, tables=tables, title="D finishes: free(b) for b in req_d_table"
    )
    for b in sys_blocks:
        allocator.free(b)
    rec.capture_allocator(
        allocator, tables=tables,
        title="the prompt's own reference: free(b) for b in sys_prompt_blocks",
    )
    return rec.log


def prefix_sharing() -> RunLog:
    """A system prompt S (2 full blocks) shared by A, B, C; later requests miss once the
    prompt is evicted."""
    pool = RecordingPool(SMALL_POOL, scenario="prefix-sharing")
    pool.admit(["S"], [8])
    pool.capture("admit S: an 8-token system prompt (2 blocks)")
    for name, own in (("A", 5), ("B", 3), ("C", 6)):
        pool.share_prefix(["S"], [name], 2, prefix_hit=True)
        pool.append([name], own)
        pool.capture(f"{name} arrives: prefix hit on S's 2 blocks, +{own} own tokens")
    for i in range(3):
        pool.append(["A", "B", "C"])
        pool.capture(f"decode step {i + 1}: A, B, C +1 token")
    pool.release(["B"])
    pool.capture("B finishes")
    pool.release(["S"], kind="evict", detail="prompt cache entry dropped")
    pool.capture("S evicted from the prefix cache: A and C keep its blocks alive")
    pool.admit(["D"], [10])
    pool.capture("D arrives: prefix miss, 10 tokens in 3 fresh blocks")
    pool.release(["A"])
    pool.capture("A finishes")
    pool.release(["C"])
    pool.capture("C finishes: the prompt's blocks are free at last")
    return pool.log


def fork_cow() -> RunLog:
    """Parallel sampling: P forks into P, Q, R sharing a half-full block; the first write
    copies it for all but the last writer."""
    pool = RecordingPool(TINY_POOL, scenario="fork-cow")
    pool.admit(["P"], [6])
    pool.capture("admit P: 6 tokens (block 1 half full)")
    pool.fork(["P", "P"], ["Q", "R"])
    pool.capture("fork P -> Q, R: all three share both blocks")
    pool.copy_on_write(["P", "Q", "R"], [6, 6, 6])
    pool.append(["P", "Q", "R"])
    pool.capture("each writes token 6: P and Q copy the shared block, R keeps it")
    for i in range(2):
        pool.append(["P", "Q", "R"])
        pool.capture(f"decode step {i + 2}: P, Q, R +1 token")
    pool.release(["Q"])
    pool.capture("Q finishes (lowest score)")
    pool.fork(["R"], ["S"])
    pool.capture("fork R -> S")
    pool.copy_on_write(["S"], [pool.length("S")])
    pool.append(["R", "S"])
    pool.capture("R and S decode: S writes into the shared last block, so copies it")
    pool.release(["P", "R", "S"])
    pool.capture("P, R, S finish")
    return pool.log


@dataclasses.dataclass(frozen=True)
class _Workload:
    """How busy a random run is: its pool, and how requests come and go each step."""

    config: CacheConfig
    num_requests: int | None  # stop admitting after this many; None: no limit
    arrivals: int  # arrival attempts per step, each with probability 0.4
    finish_p: float  # each step, a random request finishes with this probability ...
    finish_each: bool  # ... or (at scale) every live request does, independently
    prompt: tuple[int, int]  # prompt lengths drawn from [low, high)


def _workload(num_blocks: int | None, num_requests: int | None) -> _Workload:
    if num_blocks is None and num_requests is None:
        return _Workload(SMALL_POOL, None, 1, 0.25, False, (3, 14))
    num_blocks = SMALL_POOL.num_blocks if num_blocks is None else num_blocks
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 8:
        raise ValueError(f"num_blocks must be an int >= 8. Got {num_blocks!r}.")
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1
    ):
        raise ValueError(f"num_requests must be a positive int or None. Got {num_requests!r}.")
    # About 35 requests run at once per 2,000 blocks (arrivals / finish_p), each holding
    # about 40 blocks (prompts up to 3/4 of a 96-block table): most of the pool is in use,
    # and arrivals sometimes have to wait or preempt.
    max_seqs = min(256, max(8, num_blocks // 32))
    blocks_per_seq = max(4, min(96, num_blocks // 4))
    config = CacheConfig(num_blocks, 4, max_seqs=max_seqs, max_blocks_per_seq=blocks_per_seq)
    high = max(4, config.max_tokens_per_seq * 3 // 4)
    return _Workload(config, num_requests, max(1, max_seqs // 8), 0.06, True, (3, high))


def random_run(
    steps: int = 40, seed: int = 0, num_blocks: int | None = None,
    num_requests: int | None = None,
) -> RunLog:
    """A seeded workload with every event kind: arrivals (some hitting a prefix cache),
    decoding, forks with copy-on-write, finishes, preemption and cache eviction.

    By default a 24-block pool (``SMALL_POOL``). ``num_blocks`` and/or ``num_requests`` make
    it a run at scale: a pool of ``num_blocks`` blocks (of 4 tokens) with about one running
    request per 32 blocks, several arrivals per step, and at least ``steps`` steps, more if
    needed until ``num_requests`` requests have arrived.
    """
    work = _workload(num_blocks, num_requests)
    rng = np.random.default_rng(seed)
    cfg = work.config
    max_len = cfg.max_tokens_per_seq - cfg.block_size  # a request this long finishes
    pool = RecordingPool(cfg, scenario="random")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    counter = 0
    arrived = 0
    cache: list[int] = []  # first blocks of finished requests, held like a prefix cache

    def fresh_name() -> str:  # unique over the run, so no name means two requests
        nonlocal counter
        counter += 1
        i = counter - 1
        return alphabet[i % len(alphabet)] + (str(i // len(alphabet)) if i >= len(alphabet) else "")

    def evict_until(need: int) -> None:
        while pool.num_free < need and cache:
            block = cache.pop(0)
            pool.drop([block], evict=True, detail="prefix cache")
            done.append(f"evict block {block}")

    def decode_need(names: list[str]) -> int:
        """Blocks the next token can take: a fresh block, or a copy of a shared one."""
        need = 0
        for n in names:
            i, offset = divmod(pool.length(n), cfg.block_size)
            need += offset == 0 or pool.ref_count(pool.table(n)[i]) > 1
        return need

    def wants_more() -> bool:
        return work.num_requests is None or arrived < work.num_requests

    step = 0
    while step + 1 < steps or (work.num_requests is not None and wants_more()):
        step += 1
        done: list[str] = []
        veterans = set(pool.live)  # held blocks in the last snapshot: may be preempted
        live = pool.live
        finishing = [n for n in live if pool.length(n) >= max_len]
        if work.finish_each:
            finishing += [n for n in live if rng.random() < work.finish_p]
        elif live and rng.random() < work.finish_p:
            finishing.append(str(rng.choice(live)))
        for finish in dict.fromkeys(finishing):
            first = pool.table(finish)[:1]
            if first and len(cache) < 3:
                pool.hold(first)
                cache.extend(first)
            pool.release([finish])
            done.append(f"{finish} finishes")
        # A newcomer (arrival or fork child) joins only if every running request, itself
        # included, can still take a block for its next token: newcomers are never preempted.
        for _ in range(work.arrivals):
            if not (wants_more() and len(pool.live) < cfg.max_seqs - 2 and rng.random() < 0.4):
                continue
            name = fresh_name()
            donors = [n for n in pool.live if pool.length(n) >= 2 * cfg.block_size]
            if donors and rng.random() < 0.4:
                donor = str(rng.choice(donors))
                evict_until(len(pool.live) + 1)
                if pool.num_free >= len(pool.live) + 1:
                    pool.share_prefix([donor], [name], 1, prefix_hit=True)
                    done.append(f"{name} arrives, prefix hit on {donor}")
                    arrived += 1
            else:
                prompt = int(rng.integers(*work.prompt))
                need = -(-prompt // cfg.block_size) + len(pool.live) + 1
                evict_until(need)
                if pool.num_free >= need:
                    pool.admit([name], [prompt])
                    done.append(f"{name} arrives ({prompt} tokens)")
                    arrived += 1
        live = pool.live
        if live and len(live) < cfg.max_seqs and rng.random() < 0.15:
            parent = str(rng.choice(live))
            evict_until(len(live) + 1)
            if pool.num_free >= len(live) + 1:
                child = fresh_name()
                pool.fork([parent], [child])
                done.append(f"fork {parent} -> {child}")
        decoding = pool.live
        if decoding:
            # Preempt the newest veteran (never the oldest request) until every token fits.
            while pool.num_free < decode_need(decoding):
                evict_until(decode_need(decoding))
                victims = [n for n in decoding[1:] if n in veterans]
                if pool.num_free >= decode_need(decoding) or not victims:
                    break
                pool.preempt([victims[-1]])
                done.append(f"preempt {victims[-1]}")
                decoding = pool.live
            positions = [pool.length(n) for n in decoding]
            writes = [(n, p) for n, p in zip(decoding, positions, strict=True)
                      if p % cfg.block_size]
            if writes:
                copies = pool.copy_on_write([n for n, _ in writes], [p for _, p in writes])
                done += [f"{n} copies block {s} -> {d}" for n, s, d in copies]
            pool.append(decoding)
            done.append("decode " + _names(decoding))
        pool.capture(f"step {step}: " + ("; ".join(done) or "nothing runs"))
    return pool.log


def _names(names: list[str]) -> str:
    """``ABK`` for one-letter names, ``A1 B1 K1`` for longer ones, a count past a dozen."""
    if len(names) > 12:
        return f"{len(names)} requests"
    return ("" if all(len(n) == 1 for n in names) else " ").join(names)


SCENARIOS = {
    "seed": seed,
    "prefix-sharing": prefix_sharing,
    "fork-cow": fork_cow,
    "random": random_run,
}
