"""``paged-jax bench allocator``: one decode step's block bookkeeping, seed loop vs. ours.

For B running sequences, one decode step appends one token to each. The baseline is the seed
write-up's Python loop (``append_token`` per request), run in this same process. Ours, over an
active mask: ``append`` in a K-step ``lax.scan`` (one dispatch), ``reserve_steps`` for all K
steps (one dispatch), and, for reference, one jitted ``append`` dispatch per step. All start
from the same ragged prompts; the block counts must agree with the seed's and the two
one-dispatch forms must produce identical states (both checked). Prints µs per step, ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import seed_reference
from paged_jax.allocator.ops import admit, append, reserve_steps
from paged_jax.allocator.state import CacheConfig, init_state


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prompts(batch: int, prompt: int, block_size: int) -> np.ndarray:
    """Ragged prompts, so that every step some sequences cross a block boundary."""
    return prompt + np.arange(batch) % block_size


def _setup(batch: int, prompt: int, steps: int, block_size: int):
    lens = _prompts(batch, prompt, block_size)
    per_seq = -(-(int(lens.max()) + steps) // block_size)
    cfg = CacheConfig(
        num_blocks=batch * per_seq, block_size=block_size, max_seqs=batch,
        max_blocks_per_seq=per_seq,
    )
    ids = jnp.arange(batch, dtype=jnp.int32)
    state, status = admit(init_state(cfg), ids, jnp.asarray(lens, jnp.int32))
    status.raise_if_failed()
    return cfg, state


def bench_seed(batch: int, prompt: int, steps: int, block_size: int, repeats: int):
    """Seconds per decode step of the seed's per-request Python loop, and its block count."""
    lens = _prompts(batch, prompt, block_size)
    samples = []
    for _ in range(repeats):
        alloc = seed_reference.BlockAllocator(
            batch * -(-(int(lens.max()) + steps) // block_size), block_size
        )
        reqs = [seed_reference.RequestState(i, int(n), alloc) for i, n in enumerate(lens)]
        start = time.perf_counter()
        for _ in range(steps):
            for req in reqs:
                req.append_token()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / steps, sum(len(r.block_table) for r in reqs)


def bench_ours(batch: int, prompt: int, steps: int, block_size: int, repeats: int):
    """Seconds per decode step of: ``append`` in a K-step ``lax.scan`` (one dispatch);
    ``reserve_steps`` for the K steps (one dispatch); one jitted ``append`` per step."""
    cfg, state = _setup(batch, prompt, steps, block_size)
    mask = jnp.ones((cfg.max_seqs,), bool)

    @jax.jit
    def scan_steps(state):
        def body(s, _):
            s, status = append(s, mask, 1)
            return s, status.applied
        s, applied = jax.lax.scan(body, state, None, length=steps)
        return s, jnp.all(applied)

    reserve = jax.jit(lambda s: reserve_steps(s, mask, steps))
    one_step = jax.jit(lambda s: append(s, mask, 1))

    scanned, ok1 = scan_steps(state)
    reserved, status = reserve(state)
    if not (bool(ok1) and bool(status.applied)):
        raise RuntimeError("allocation failed inside the benchmark; pool sized wrongly")
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(reserved), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise RuntimeError("reserve_steps disagrees with successive appends")
    blocks = int(jnp.sum(scanned.block_tables >= 0))
    scan_s = _median_seconds(lambda: jax.block_until_ready(scan_steps(state)), repeats) / steps
    reserve_s = _median_seconds(lambda: jax.block_until_ready(reserve(state)), repeats) / steps

    jax.block_until_ready(one_step(state))

    def per_step():
        s = state
        for _ in range(steps):
            s, _ = one_step(s)
        jax.block_until_ready(s)

    step_s = _median_seconds(per_step, max(1, repeats // 2)) / steps
    return scan_s, reserve_s, step_s, blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-jax bench allocator", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=128, help="K: decode steps per dispatch")
    parser.add_argument("--prompt", type=int, default=20, help="prompt tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    print(f"decode-step bookkeeping, K={args.steps} steps per dispatch, block_size "
          f"{args.block_size}, ragged prompts {args.prompt}..{args.prompt + args.block_size - 1}, "
          f"backend {jax.default_backend()}; µs per step (median of {args.repeats})")
    print(f"{'B':>6} {'seed loop':>10} {'jit/step':>10} {'scan':>10} {'reserve':>10} "
          f"{'seed/scan':>10} {'seed/reserve':>13}")
    for batch in args.batch:
        seed_s, seed_blocks = bench_seed(
            batch, args.prompt, args.steps, args.block_size, args.repeats
        )
        scan_s, reserve_s, step_s, blocks = bench_ours(
            batch, args.prompt, args.steps, args.block_size, args.repeats
        )
        if blocks != seed_blocks:
            raise RuntimeError(f"block counts differ: ours {blocks}, seed {seed_blocks}")
        print(f"{batch:>6} {seed_s * 1e6:>10.2f} {step_s * 1e6:>10.2f} {scan_s * 1e6:>10.2f} "
              f"{reserve_s * 1e6:>10.2f} {seed_s / scan_s:>9.1f}x {seed_s / reserve_s:>12.1f}x",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
