"""``paged-jax bench allocator``: one decode step's block bookkeeping, seed loop vs. ``append``.

For B running sequences, one decode step appends one token to each. The baseline is the seed
write-up's Python loop (``append_token`` per request, run in this same process); ours is
``append`` over an active mask inside ``lax.scan``, K steps per dispatch. Both start from the
same prompts and end with the same block counts (checked). Prints µs per step and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import seed_reference
from paged_jax.allocator.ops import admit, append
from paged_jax.allocator.state import CacheConfig, init_state


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _setup(batch: int, prompt: int, steps: int, block_size: int):
    per_seq = -(-(prompt + steps) // block_size)
    cfg = CacheConfig(
        num_blocks=batch * per_seq, block_size=block_size, max_seqs=batch,
        max_blocks_per_seq=per_seq,
    )
    state, status = admit(init_state(cfg), jnp.arange(batch, dtype=jnp.int32), prompt)
    status.raise_if_failed()
    return cfg, state


def bench_seed(batch: int, prompt: int, steps: int, block_size: int, repeats: int) -> float:
    """Seconds per decode step of the seed's per-request Python loop."""
    def run():
        alloc = seed_reference.BlockAllocator(batch * (-(-(prompt + steps) // block_size)),
                                              block_size)
        reqs = [seed_reference.RequestState(i, prompt, alloc) for i in range(batch)]
        start = time.perf_counter()
        for _ in range(steps):
            for req in reqs:
                req.append_token()
        run.elapsed = time.perf_counter() - start
        run.blocks = sum(len(r.block_table) for r in reqs)

    samples = []
    for _ in range(repeats):
        run()
        samples.append(run.elapsed)
    bench_seed.blocks = run.blocks
    return statistics.median(samples) / steps


def bench_scan(batch: int, prompt: int, steps: int, block_size: int, repeats: int):
    """Seconds per decode step of ``append`` in a K-step ``lax.scan`` (one dispatch), and of
    one jitted ``append`` dispatch per step."""
    cfg, state = _setup(batch, prompt, steps, block_size)
    mask = jnp.ones((cfg.max_seqs,), bool)

    @jax.jit
    def k_steps(state):
        def body(s, _):
            s, status = append(s, mask, 1)
            return s, status.applied
        return jax.lax.scan(body, state, None, length=steps)

    one_step = jax.jit(lambda s: append(s, mask, 1))

    final, applied = jax.block_until_ready(k_steps(state))  # compile + correctness
    if not bool(np.all(applied)):
        raise RuntimeError("append failed inside the benchmark; pool sized wrongly")
    blocks = int(jnp.sum(final.block_tables >= 0))
    scan_s = _median_seconds(lambda: jax.block_until_ready(k_steps(state)), repeats) / steps

    jax.block_until_ready(one_step(state))

    def per_step():
        s = state
        for _ in range(steps):
            s, _ = one_step(s)
        jax.block_until_ready(s)

    step_s = _median_seconds(per_step, max(1, repeats // 2)) / steps
    return scan_s, step_s, blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-jax bench allocator", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=64, help="K: decode steps per dispatch")
    parser.add_argument("--prompt", type=int, default=20, help="prompt tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    print(f"decode-step bookkeeping, {args.steps} steps per dispatch, block_size "
          f"{args.block_size}, prompt {args.prompt}, backend {jax.default_backend()}")
    header = f"{'B':>6} {'seed loop':>12} {'append/step':>12} {'append scan':>12} {'seed/scan':>10}"
    print(header)
    print(f"{'':>6} {'µs/step':>12} {'µs/step':>12} {'µs/step':>12} {'ratio':>10}")
    for batch in args.batch:
        seed_s = bench_seed(batch, args.prompt, args.steps, args.block_size, args.repeats)
        scan_s, step_s, blocks = bench_scan(
            batch, args.prompt, args.steps, args.block_size, args.repeats
        )
        if blocks != bench_seed.blocks:
            raise RuntimeError(f"block counts differ: ours {blocks}, seed {bench_seed.blocks}")
        print(f"{batch:>6} {seed_s * 1e6:>12.2f} {step_s * 1e6:>12.2f} {scan_s * 1e6:>12.2f} "
              f"{seed_s / scan_s:>9.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
