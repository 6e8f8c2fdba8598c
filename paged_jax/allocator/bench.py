"""``paged-jax bench allocator``: one decode step's block bookkeeping, seed loop vs. ours.

For B running sequences, one decode step appends one token to each. The baseline is the seed
write-up's Python loop (``append_token`` per request), run in this same process. Ours, over an
active mask: ``append`` in a K-step ``lax.scan`` (one dispatch), ``reserve_steps`` for all K
steps (one dispatch), and, for reference, one jitted ``append`` dispatch per step. All start
from the same ragged prompts; the block counts must agree with the seed's and the two
one-dispatch forms must produce identical states (both checked). Prints µs per step, ratios.

The state is donated to every call, as the engine's steps donate it, so that XLA updates it in
place; each timed call gets a fresh copy made outside the timer. ``--num-blocks`` repeats the
measurement at several pool sizes (the sizes are measured in turn within each repeat, so they
share the machine's load) and prints each form's cost against its cost at the first size: a
decode step's bookkeeping does O(batch) work, so these ratios stay near 1.
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

FORMS = ("scan", "reserve", "step")


def _prompts(batch: int, prompt: int, block_size: int) -> np.ndarray:
    """Ragged prompts, so that every step some sequences cross a block boundary."""
    return prompt + np.arange(batch) % block_size


def blocks_needed(batch: int, prompt: int, steps: int, block_size: int) -> int:
    """Blocks held after ``steps`` decode steps: the smallest pool the benchmark fits."""
    lens = _prompts(batch, prompt, block_size) + steps
    return int(np.sum(-(-lens // block_size)))


def _blocks_per_seq(batch: int, prompt: int, steps: int, block_size: int) -> int:
    """Table width: room for the longest sequence after ``steps`` steps."""
    return -(-(int(_prompts(batch, prompt, block_size).max()) + steps) // block_size)


def _setup(batch: int, prompt: int, steps: int, block_size: int, num_blocks: int):
    lens = _prompts(batch, prompt, block_size)
    per_seq = _blocks_per_seq(batch, prompt, steps, block_size)
    need = blocks_needed(batch, prompt, steps, block_size)
    if num_blocks < need:
        raise ValueError(
            f"num_blocks {num_blocks} is too small: {batch} sequences of {lens.min()}.."
            f"{lens.max()} tokens need {need} blocks of {block_size} after {steps} steps."
        )
    cfg = CacheConfig(
        num_blocks=num_blocks, block_size=block_size, max_seqs=batch,
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
            batch * _blocks_per_seq(batch, prompt, steps, block_size), block_size
        )
        reqs = [seed_reference.RequestState(i, int(n), alloc) for i, n in enumerate(lens)]
        start = time.perf_counter()
        for _ in range(steps):
            for req in reqs:
                req.append_token()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / steps, sum(len(r.block_table) for r in reqs)


def _forms(mask, steps: int):
    """The three forms, each ``state -> state`` over ``steps`` decode steps, state donated."""

    def scan_steps(state):
        def body(s, _):
            s, status = append(s, mask, 1)
            return s, status.applied
        s, applied = jax.lax.scan(body, state, None, length=steps)
        return s, jnp.all(applied)

    scan = jax.jit(scan_steps, donate_argnums=0)
    reserve = jax.jit(lambda s: reserve_steps(s, mask, steps), donate_argnums=0)
    one_step = jax.jit(lambda s: append(s, mask, 1), donate_argnums=0)

    def per_step(state):
        for _ in range(steps):
            state, _ = one_step(state)
        return state

    return {"scan": scan, "reserve": reserve, "step": per_step}


def _fresh(state):
    """A copy the timed call may consume (donate), made and finished outside the timer."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, state))


def bench_ours(batch: int, prompt: int, steps: int, block_size: int, repeats: int,
               pools: list[int]):
    """Seconds per decode step of each form in ``FORMS`` at each pool size, and the block
    count. Returns ``({(form, pool): seconds}, blocks)``."""
    states = {pool: _setup(batch, prompt, steps, block_size, pool)[1] for pool in pools}
    forms = _forms(jnp.ones((batch,), bool), steps)
    blocks = None
    for state in states.values():
        scanned, ok = forms["scan"](_fresh(state))
        reserved, status = forms["reserve"](_fresh(state))
        stepped = forms["step"](_fresh(state))
        if not (bool(ok) and bool(status.applied)):
            raise RuntimeError("allocation failed inside the benchmark; pool sized wrongly")
        for other in (reserved, stepped):
            for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(other), strict=True):
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    raise RuntimeError("the forms disagree with successive appends")
        blocks = int(jnp.sum(scanned.block_tables >= 0))
    samples = {(form, pool): [] for form in FORMS for pool in pools}
    for _ in range(repeats):
        for pool, state in states.items():
            for form in FORMS:
                fresh = _fresh(state)
                start = time.perf_counter()
                jax.block_until_ready(forms[form](fresh))
                samples[form, pool].append(time.perf_counter() - start)
    return {key: statistics.median(s) / steps for key, s in samples.items()}, blocks


def _num_blocks(text: str) -> list[int]:
    try:
        pools = [int(x) for x in text.split(",")]
    except ValueError:
        pools = []
    if not pools or min(pools) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive pool sizes, e.g. 2048,51200. Got {text!r}."
        )
    return pools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-jax bench allocator", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=128, help="K: decode steps per dispatch")
    parser.add_argument("--prompt", type=int, default=20, help="prompt tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=_num_blocks, default=None,
                        help="pool sizes, comma-separated (default: the smallest pool with a "
                             "full table per sequence); ratios are against the first")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    shape = (args.prompt, args.steps, args.block_size)
    pools = {batch: args.num_blocks or [batch * _blocks_per_seq(batch, *shape)]
             for batch in args.batch}
    for batch in args.batch:  # refuse a pool that is too small before measuring anything
        need = blocks_needed(batch, *shape)
        if min(pools[batch]) < need:
            parser.error(f"--num-blocks {min(pools[batch])} is too small: B={batch} needs {need} "
                         f"blocks of {args.block_size} after {args.steps} steps.")

    print(f"decode-step bookkeeping, K={args.steps} steps per dispatch, block_size "
          f"{args.block_size}, ragged prompts {args.prompt}..{args.prompt + args.block_size - 1}, "
          f"backend {jax.default_backend()}; µs per step (median of {args.repeats})")
    header = (f"{'B':>6} {'blocks':>8} {'seed loop':>10} {'jit/step':>10} {'scan':>10} "
              f"{'reserve':>10} {'seed/scan':>10} {'seed/reserve':>13}")
    if args.num_blocks:
        header += f" {'scan vs first':>14} {'reserve vs first':>17}"
    print(header)
    for batch in args.batch:
        seed_s, seed_blocks = bench_seed(batch, *shape, args.repeats)
        ours, blocks = bench_ours(batch, *shape, args.repeats, pools[batch])
        if blocks != seed_blocks:
            raise RuntimeError(f"block counts differ: ours {blocks}, seed {seed_blocks}")
        first = pools[batch][0]
        for pool in pools[batch]:
            scan_s, reserve_s, step_s = (ours[form, pool] for form in FORMS)
            line = (f"{batch:>6} {pool:>8} {seed_s * 1e6:>10.2f} {step_s * 1e6:>10.2f} "
                    f"{scan_s * 1e6:>10.2f} {reserve_s * 1e6:>10.2f} {seed_s / scan_s:>9.1f}x "
                    f"{seed_s / reserve_s:>12.1f}x")
            if args.num_blocks:
                line += (f" {scan_s / ours['scan', first]:>13.2f}x "
                         f"{reserve_s / ours['reserve', first]:>16.2f}x")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
