"""``paged-jax bench memory``: KV memory waste per allocation strategy on ShareGPT requests.

Replays one request stream (``paged_jax.datasets.sample_requests``, token counts from the
default model's tokenizer; ``--synthetic`` draws seeded lengths instead) through every
strategy of ``memory.py`` in the same pool of KV token slots for the same number of steps,
then the two sharing mixes of ``memory_sharing.py``. Prints the tables beside the goals,
and writes ``utilization.png``, ``waste.png`` and ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from paged_jax.allocator.memory import CATEGORIES, WASTE, ContiguousExact, ContiguousMax, replay
from paged_jax.allocator.memory_blocks import paged_strategy, physical_limit
from paged_jax.allocator.memory_sharing import (
    parallel_sampling_blocks,
    reduction,
    reduction_bound,
    system_prompt_blocks,
)

SET_BESIDE = (
    "A tester's run, 2,000 sampled requests, block 16: paged wastes 1.65%, contiguous-max "
    "78.1%.",
    "The vLLM paper: earlier systems use 20.4-38.2% of KV memory for token states, vLLM 96.3%.",
)
GOAL_WASTE, GOAL_CONCURRENCY, GOAL_SHARING = 4.0, 2.5, 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="the shuffle's (or --synthetic's) seed")
    p.add_argument("--roles", default="first-two", choices=("first-two", "human-gpt"),
                   help="first-two: vLLM's turns 0 and 1; human-gpt: the first human turn "
                   "answered by gpt (see paged_jax.datasets.conversation_pair)")
    p.add_argument("--synthetic", type=int, metavar="MAX",
                   help="no ShareGPT: seeded prompt and output lengths, uniform in 4..MAX")
    p.add_argument("--pool-slots", type=int, default=32 * 2048, help="KV token slots in the pool")
    p.add_argument("--steps", type=int, default=1000, help="steps every strategy runs")
    p.add_argument("--max-len", type=int, default=2048, help="contiguous-max's reservation")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--num-system", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="parallel samples per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--out", default="bench_memory_out", help="folder for the PNGs and JSON")
    return p


def load_stream(args, out) -> tuple[list[tuple[int, int]], dict]:
    """``(prompt_len, output_len)`` pairs and what sampling set aside."""
    if args.synthetic is not None:
        if args.synthetic < 4:
            raise ValueError(f"--synthetic MAX must be at least 4. Got {args.synthetic}.")
        rng = np.random.default_rng(args.seed)
        lens = rng.integers(4, args.synthetic + 1, size=(args.num_requests, 2))
        return [(int(p), int(o)) for p, o in lens], {"source": "synthetic", "max": args.synthetic}
    from paged_jax.datasets import sample_requests
    from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

    sample = sample_requests(Tokenizer.from_gguf(default_gguf_path()), args.num_requests,
                             seed=args.seed, roles=args.roles)
    info = {"source": "ShareGPT V3", "roles": sample.roles, "seed": sample.seed,
            "records": sample.records, "gpt_first": sample.gpt_first,
            "no_pair": sample.no_pair, "too_short": sample.too_short,
            "too_long": sample.too_long}
    print(f"ShareGPT: {sample.records} complete records read, {sample.gpt_first} open on a "
          f"non-human turn, {sample.no_pair} without a (prompt, reply) pair under "
          f"roles={sample.roles}; {sample.too_short} too short and {sample.too_long} too long "
          f"dropped before {len(sample.requests)} were kept.", file=out)
    return [(r.prompt_len, r.output_len) for r in sample.requests], info


def _bar(args, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=args.no_progress, file=sys.stderr)


def run_strategies(args, stream) -> list:
    makers = [lambda: ContiguousMax(args.pool_slots, args.max_len),
              lambda: ContiguousExact(args.pool_slots)]
    makers += [lambda bs=bs: paged_strategy(args.pool_slots, bs, stream)
               for bs in args.block_sizes]
    makers.append(lambda: physical_limit(args.pool_slots, stream))
    replays = []
    for make in makers:
        strategy = make()
        with _bar(args, args.steps, strategy.name) as bar:
            replays.append(replay(stream, strategy, args.steps, bar.update))
    return replays


def run_sharing(args, stream) -> dict:
    # Per mix: its run (shared or not, with a progress callback) and reduction_bound's kind
    # and settings.
    system = {"system_len": args.system_len, "num_system": args.num_system}
    mixes = {
        "system-prompt": (lambda share, p: system_prompt_blocks(
            stream, share=share, progress=p, **system), "system", system),
        f"n={args.n} sampling": (lambda share, p: parallel_sampling_blocks(
            stream, share=share, n=args.n, progress=p), "parallel", {"n": args.n}),
    }
    steps = max(o for _, o in stream)
    out = {}
    for name, (run, kind, settings) in mixes.items():
        blocks = {}
        for share in (False, True):
            with _bar(args, steps, f"{name} {'shared' if share else 'private'}") as bar:
                blocks[share] = run(share, bar.update)
        out[name] = reduction(blocks[True], blocks[False])
        out[name]["mean_reduction_bound_percent"] = reduction_bound(stream, kind, **settings)
    return out


def strategy_table(replays) -> list[str]:
    base = next(r for r in replays if r.name == "contiguous-max").summary()
    head = (f"{'strategy':<17}{'waste %':>8}{'reserved':>9}{'internal':>9}{'external':>9}"
            f"{'tokens %':>9}{'peak run':>9}{'x c-max':>8}{'mean run':>9}{'x c-max':>8}"
            f"{'done':>6}{'preempt':>8}")
    lines = [head, "-" * len(head)]
    for r in replays:
        s, w = r.summary(), r.waste_percent()
        lines.append(
            f"{r.name:<17}{w['total']:>8.2f}{w['reserved']:>9.2f}{w['internal']:>9.2f}"
            f"{w['external']:>9.2f}{s['token_state_percent']:>9.2f}{s['peak_running']:>9}"
            f"{s['peak_running'] / base['peak_running']:>8.2f}{s['mean_running']:>9.1f}"
            f"{s['mean_running'] / base['mean_running']:>8.2f}{s['completed']:>6}"
            f"{s['preemptions']:>8}")
    return lines


def goals(replays, sharing) -> list[tuple[str, bool]]:
    by = {r.name: r.summary() for r in replays}
    out = []
    if "paged-16" in by:
        waste = by["paged-16"]["waste_percent"]["total"]
        ratio = by["paged-16"]["peak_running"] / by["contiguous-max"]["peak_running"]
        out.append((f"paged-16 waste {waste:.2f}% <= {GOAL_WASTE}%", waste <= GOAL_WASTE))
        out.append((f"paged-16 peak concurrency {ratio:.2f}x contiguous-max's >= "
                    f"{GOAL_CONCURRENCY}x", ratio >= GOAL_CONCURRENCY))
    for name, red in sharing.items():
        cut = red["mean_reduction_percent"]
        out.append((f"{name}: {cut:.1f}% fewer physical blocks (mean) >= {GOAL_SHARING}% "
                     f"(at most {red['mean_reduction_bound_percent']:.1f}% on this stream)",
                     cut >= GOAL_SHARING))
    return out


def plot(replays, folder: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tokens": "#2b8a3e", "reserved": "#f08c00", "internal": "#e03131",
              "external": "#7048e8", "free": "#dee2e6"}
    fig, axes = plt.subplots(len(replays), 1, figsize=(10, 1.8 * len(replays)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], replays, strict=True):
        share = [100.0 * r.usage[c] / r.pool_slots for c in CATEGORIES]
        ax.stackplot(np.arange(len(r.running)), *share, labels=CATEGORIES,
                     colors=[colors[c] for c in CATEGORIES])
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of pool")
        ax.set_title(r.name, fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", ncol=5, fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("KV pool use over time, same stream and pool per strategy")
    fig.tight_layout()
    paths = [folder / "utilization.png", folder / "waste.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r.name for r in replays]
    bottom = np.zeros(len(replays))
    for c in WASTE:
        values = np.array([r.waste_percent()[c] for r in replays])
        ax.bar(names, values, bottom=bottom, label=c, color=colors[c])
        bottom += values
    for i, total in enumerate(bottom):
        ax.text(i, total + 1, f"{total:.1f}%", ha="center", fontsize=8)
    ax.set_ylabel("% of occupied KV slots wasted")
    ax.set_ylim(0, max(100.0, bottom.max() + 8))
    ax.legend()
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_title("Waste per strategy (reserved, internal and external fragmentation)")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None, out=None) -> int:
    out = sys.stdout if out is None else out
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    stream, info = load_stream(args, out)
    prompts, outputs = np.array(stream).T
    print(f"{len(stream)} requests: prompt mean {prompts.mean():.0f} (max {prompts.max()}), "
          f"output mean {outputs.mean():.0f} (max {outputs.max()}) tokens. Pool "
          f"{args.pool_slots} slots, {args.steps} steps.", file=out)
    replays = run_strategies(args, stream)
    sharing = run_sharing(args, stream)
    print("\n".join(strategy_table(replays)), file=out)
    print("waste % = (reserved + internal + external) / occupied slots, over all steps; "
          "tokens % = 100 - waste %; x c-max = relative to contiguous-max.", file=out)
    print(f"\nSharing (block 16, pool large enough that nothing waits; physical blocks over "
          f"steps 0..{max(outputs) - 1}):", file=out)
    print(f"{'mix':<16}{'private mean':>13}{'shared mean':>12}{'fewer %':>8}{'at most %':>10}"
          f"{'private peak':>13}{'shared peak':>12}{'fewer %':>8}", file=out)
    for name, r in sharing.items():
        print(f"{name:<16}{r['unshared_mean']:>13.0f}{r['shared_mean']:>12.0f}"
              f"{r['mean_reduction_percent']:>8.1f}{r['mean_reduction_bound_percent']:>10.1f}"
              f"{r['unshared_peak']:>13}{r['shared_peak']:>12}"
              f"{r['peak_reduction_percent']:>8.1f}", file=out)
    print("at most % = the mean's reduction with sharing at token granularity (blocks of one "
          "token: no partly filled block, no copy-on-write), the most any block size saves "
          "on this stream.", file=out)
    print("\nTo set beside:", file=out)
    for line in SET_BESIDE:
        print(f"  {line}", file=out)
    print("Goals:", file=out)
    met = goals(replays, sharing)
    for text, ok in met:
        print(f"  [{'met' if ok else 'NOT MET'}] {text}", file=out)
    folder = pathlib.Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = plot(replays, folder)
    results = {"settings": {k: v for k, v in vars(args).items() if k != "no_progress"},
               "stream": info, "strategies": [r.summary() for r in replays],
               "sharing": sharing, "goals": [{"goal": t, "met": ok} for t, ok in met]}
    (folder / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nWrote {', '.join(str(p) for p in paths)} and {folder / 'results.json'} "
          f"({time.perf_counter() - start:.0f} s).", file=out)
    return 0
