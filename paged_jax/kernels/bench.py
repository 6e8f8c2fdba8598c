"""Decode-attention benchmark: our Pallas kernel, JAX's Pallas kernel and the xla reference.

``paged-jax bench kernel`` on a GPU times bf16, 32 query / 8 KV heads, head_dim 128, block 16,
batch {1, 8, 64, 256} x context {512, 4096, 32768}, every sequence full. Each row prints the
median time per call, the KV bytes read per second, that rate as a percent of a device-to-device
copy bandwidth measured in the same run (bytes read + written), the physical limit (KV bytes /
copy bandwidth) and the speed ratio against JAX's kernel (> 1: ours is faster).

Timing runs a jitted loop on the device over several copies of q/K/V (cycled so the L2 cache
never holds the next call's data), with an optimisation barrier so no call is hoisted or merged.
``--quick`` runs tiny shapes with interpret-mode Pallas so the script can be smoke-tested on CPU;
its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.kernels.pallas_decode import paged_attention

L2_DEFEAT_BYTES = 256 * 2**20  # cycle copies until this much KV is in flight (H200 L2: ~50 MB)
MAX_COPIES = 8
CALLS_PER_ITERATION = 16  # amortises the per-iteration cost of the device loop
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-jax bench kernel", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, interpret-mode Pallas: a CPU smoke test")
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes")
    parser.add_argument("--context", type=int, nargs="+", help="context lengths (tokens)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--impls", nargs="+", default=["ours", "jax", "xla"],
                        choices=["ours", "jax", "xla"])
    parser.add_argument("--max-copies", type=int,
                        help=f"copies of q/K/V cycled against L2 caching (default {MAX_COPIES})")
    parser.add_argument("--time-budget", type=float, default=270,
                        help="seconds after which the remaining shapes are skipped")
    parser.add_argument("--rounds", type=int, help="timed rounds per row (median is printed)")
    parser.add_argument("--round-ms", type=float, help="target duration of one timed round")
    return parser


def device_loop(
    fn: Callable, copies: list[tuple], calls_per_iteration: int
) -> tuple[Callable[[int], float], int]:
    """`run(reps)` times `reps` device-side iterations over all copies; also calls per rep."""
    inner = max(1, math.ceil(calls_per_iteration / len(copies)))

    @jax.jit
    def loop(copies, reps):
        def body(i, acc):
            for _ in range(inner):
                for q, *rest in copies:
                    # The barrier ties each call to the previous result: nothing is hoisted,
                    # merged or overlapped (which could also multiply the xla path's memory).
                    q, _ = lax.optimization_barrier((q, acc))
                    acc = acc + fn(q, *rest).astype(jnp.float32).sum()
            return acc

        return lax.fori_loop(0, reps, body, jnp.float32(0))

    def run(reps: int) -> float:
        start = time.perf_counter()
        loop(copies, jnp.int32(reps)).block_until_ready()
        return time.perf_counter() - start

    return run, inner * len(copies)


def median_seconds_per_call(run, calls_per_rep: int, rounds: int, round_s: float) -> float:
    run(1)  # compile
    once = run(1)
    reps = max(1, min(10_000, round(round_s / max(once, 1e-6))))
    return statistics.median(run(reps) for _ in range(rounds)) / (reps * calls_per_rep)


def copy_bandwidth(num_bytes: int, rounds: int, round_s: float) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = jnp.zeros((num_bytes // 4,), jnp.uint32)
    loop = jax.jit(lambda x, reps: lax.fori_loop(0, reps, lambda i, y: y + 1, x))

    def run(reps):
        start = time.perf_counter()
        loop(x, jnp.int32(reps)).block_until_ready()
        return time.perf_counter() - start

    return 2 * x.nbytes / median_seconds_per_call(run, 1, rounds, round_s)


def make_inputs(key, *, batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """Full sequences whose blocks are laid out in a random order."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    kv_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    q = jax.random.normal(kq, (batch, num_q_heads, head_dim), dtype)
    k_pages = jax.random.normal(kk, kv_shape, dtype)
    v_pages = jax.random.normal(kv, kv_shape, dtype)
    tables = jax.random.permutation(kp, num_blocks).astype(jnp.int32)
    tables = tables.reshape(batch, blocks_per_seq)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, tables, lens


def implementations(interpret: bool, blocks_per_seq: int, head_dim: int) -> dict:
    """name -> (the timed function, the same function checked against xla)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged

    k_splits = 16  # JAX's default; it must divide the blocks per sequence
    while blocks_per_seq % k_splits:
        k_splits //= 2
    jax_fn = functools.partial(jax_paged, k_splits=k_splits, interpret=interpret)
    ours = functools.partial(paged_attention, impl="pallas", interpret=interpret)
    xla = functools.partial(paged_attention, impl="xla")
    scale = 1 / math.sqrt(head_dim)
    return {
        "ours": (ours, ours),
        # JAX's kernel applies no softmax scale; it gets a pre-scaled q for the check only.
        "jax": (jax_fn, lambda q, *rest: jax_fn(q * scale, *rest)),
        "xla": (xla, xla),
    }


def device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


@dataclasses.dataclass(frozen=True)
class Settings:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: jnp.dtype
    impls: tuple[str, ...]
    interpret: bool
    rounds: int
    round_s: float
    max_copies: int
    calls_per_iteration: int
    memory_budget: float  # bytes the inputs and the xla path's temporaries may take
    bandwidth: float  # measured copy bandwidth, bytes/s


def settings_from(args: argparse.Namespace) -> tuple[Settings, list[int], list[int]]:
    """The settings, batch sizes and contexts that `args` asks for."""
    if args.quick:
        batches, contexts = args.batch or [1, 4], args.context or [64, 256]
        heads = (8, 2, 64)
        rounds, round_ms, copy_bytes = args.rounds or 2, args.round_ms or 1, 2**22
        max_copies, calls_per_iteration = args.max_copies or 2, 1
    else:
        batches, contexts = args.batch or [1, 8, 64, 256], args.context or [512, 4096, 32768]
        heads = (args.q_heads, args.kv_heads, args.head_dim)
        rounds, round_ms, copy_bytes = args.rounds or 7, args.round_ms or 20, 2**30
        max_copies, calls_per_iteration = args.max_copies or MAX_COPIES, CALLS_PER_ITERATION
    memory = device_memory_bytes()
    settings = Settings(
        *heads, block_size=args.block_size, dtype=jnp.dtype(DTYPES[args.dtype]),
        impls=tuple(args.impls), interpret=args.quick, rounds=rounds, round_s=round_ms / 1e3,
        max_copies=max_copies, calls_per_iteration=calls_per_iteration,
        memory_budget=0.85 * memory if memory else math.inf,
        bandwidth=copy_bandwidth(copy_bytes, rounds, round_ms / 1e3),
    )
    return settings, batches, contexts


def bench_shape(key, batch: int, context: int, cfg: Settings) -> list[str]:
    """Times every implementation on one (batch, context); returns the printed rows."""
    row = f"{batch:>5} {context:>7}"
    if context % cfg.block_size:
        return [f"{row}  skipped: context not a multiple of the block size"]
    kv_bytes = 2 * cfg.num_kv_heads * batch * context * cfg.head_dim * cfg.dtype.itemsize
    num_copies = max(1, min(cfg.max_copies, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
    if math.isfinite(cfg.memory_budget):
        num_copies = min(num_copies, int(cfg.memory_budget // kv_bytes))
    if num_copies < 1:
        return [f"{row}  skipped: {kv_bytes / 2**30:.1f} GiB of KV does not fit"]
    copies = [
        make_inputs(jax.random.fold_in(key, c), batch=batch, context=context,
                    num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, block_size=cfg.block_size, dtype=cfg.dtype)
        for c in range(num_copies)
    ]
    impls = implementations(cfg.interpret, context // cfg.block_size, cfg.head_dim)
    # The xla path materialises the gathered K/V and an f32 V: about 3x the KV bytes.
    xla_bytes = (num_copies + 3) * kv_bytes
    xla_fits = xla_bytes <= cfg.memory_budget
    reference = impls["xla"][0](*copies[0]).astype(jnp.float32) if xla_fits else None

    times, errors = {}, {}
    for name in cfg.impls:
        if name == "xla" and not xla_fits:
            continue
        timed, checked = impls[name]
        if reference is not None:
            out = checked(*copies[0]).astype(jnp.float32)
            errors[name] = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
        run, calls = device_loop(timed, copies, cfg.calls_per_iteration)
        times[name] = median_seconds_per_call(run, calls, cfg.rounds, cfg.round_s)

    rows = []
    limit_us = kv_bytes / cfg.bandwidth * 1e6
    for name in cfg.impls:
        if name not in times:
            rows.append(f"{row} {name:>4}  skipped: needs ~{xla_bytes / 2**30:.0f} GiB")
            continue
        seconds = times[name]
        rate = kv_bytes / seconds
        vs_jax = f"{times['jax'] / seconds:.2f}x" if "jax" in times else ""
        err = f"{errors[name]:.1e}" if name in errors else ""
        rows.append(
            f"{row} {name:>4} {seconds * 1e6:>10.1f} {rate / 1e9:>8.1f} "
            f"{100 * rate / cfg.bandwidth:>5.1f}% {limit_us:>9.1f} {vs_jax:>7} {err:>10}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if jax.default_backend() != "gpu" and not args.quick:
        print("no GPU: running the --quick configuration (interpret-mode Pallas)")
        args.quick = True
    cfg, batches, contexts = settings_from(args)

    note = "  [interpret-mode Pallas: timings mean nothing]" if cfg.interpret else ""
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}){note}")
    print(f"{args.dtype}, {cfg.num_q_heads} q heads / {cfg.num_kv_heads} kv heads, head_dim "
          f"{cfg.head_dim}, block {cfg.block_size}; copy bandwidth "
          f"{cfg.bandwidth / 1e9:.0f} GB/s (read + write)")
    header = (f"{'batch':>5} {'context':>7} {'impl':>4} {'µs':>10} {'GB/s':>8} {'%copy':>6} "
              f"{'limit µs':>9} {'vs JAX':>7} {'err vs xla':>10}")
    print(header)
    print("-" * len(header))

    key = jax.random.key(0)
    started = time.perf_counter()
    for batch in batches:
        for context in contexts:
            if time.perf_counter() - started > args.time_budget:
                print(f"{batch:>5} {context:>7}  skipped: past --time-budget {args.time_budget}s")
                continue
            for line in bench_shape(key, batch, context, cfg):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
