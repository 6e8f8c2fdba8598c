"""``paged-jax viz``: record a scenario (or load a saved log) and write every view.

    paged-jax viz --scenario seed --out out/seed
    paged-jax viz --scenario random --blocks 2000 --requests 200 --out out/big
    paged-jax viz --scenario engine --out out/engine            # SmolLM2 through LLMEngine
    paged-jax viz --scenario engine --model tiny --out out/tiny  # the tiny random Llama
    paged-jax viz --log out/seed/run.json --out out/again

Writes into ``--out``: ``run.json`` (the event log), ``layout.txt`` (the terminal view of every
step), ``steps/step_NNN.png`` and ``layout.gif`` (per-step pictures), ``timeline.png``,
``curves.png``, ``layout.html`` (offline, interactive) and ``trace.json`` (Perfetto).
"""

from __future__ import annotations

import argparse
import os
import sys

SCENARIO_CHOICES = ("seed", "prefix-sharing", "fork-cow", "random", "engine")
ENGINE_MODELS = ("smollm2", "tiny")  # engine_run.MODELS, without importing the engine here


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-jax viz", description="Record a run and draw its block layout, every view."
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=SCENARIO_CHOICES, help="record this scenario")
    src.add_argument("--log", metavar="FILE", help="redraw a saved event log (run.json)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--steps", type=int, default=40, help="random: number of steps")
    parser.add_argument("--seed", type=int, default=0, help="random: RNG seed")
    parser.add_argument("--blocks", type=int, default=None, metavar="N",
                        help="random: a pool of N blocks (default: the 24-block pool)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="random: bring N requests through the pool (runs past --steps "
                        "until they have all arrived)")
    parser.add_argument("--model", choices=ENGINE_MODELS, default=None,
                        help="engine: the model served (default smollm2, SmolLM2-135M-Instruct "
                        "on chat prompts; tiny: a random Llama on token ids)")
    parser.add_argument("--no-gif", action="store_true",
                        help="skip the per-step PNGs and the GIF (the slow part)")
    parser.add_argument("--play", action="store_true",
                        help="also step through the run in the terminal (rich live view)")
    parser.add_argument("--delay", type=float, default=0.8, help="--play: seconds per step")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no listing")
    return parser


def record(scenario: str, steps: int = 40, seed: int = 0, blocks: int | None = None,
           requests: int | None = None, model: str | None = None, progress: bool = False):
    """The ``RunLog`` of ``scenario``; ``steps``, ``blocks`` and ``requests`` shape ``random``,
    ``model`` (``"smollm2"``, the default, or ``"tiny"``) is what ``engine`` serves, with a
    progress bar if ``progress``."""
    from paged_jax.viz import scenarios

    if scenario != "random" and (blocks is not None or requests is not None):
        raise ValueError(f"--blocks and --requests apply to --scenario random, not {scenario!r}.")
    if scenario != "engine" and model is not None:
        raise ValueError(f"--model applies to --scenario engine, not {scenario!r}.")

    if scenario == "engine":
        from paged_jax.viz import engine_run

        return engine_run.engine_run(model=model or "smollm2", seed=seed, progress=progress)
    if scenario == "random":
        return scenarios.random_run(steps=steps, seed=seed, num_blocks=blocks,
                                    num_requests=requests)
    return scenarios.SCENARIOS[scenario]()


def write_views(log, out: str, *, gif: bool = True, progress: bool = True) -> list[str]:
    """Write every view of ``log`` into ``out``; returns the paths written."""
    from paged_jax.viz import curves, html, perfetto, terminal, timeline

    os.makedirs(out, exist_ok=True)
    paths = []

    def path(name):
        paths.append(os.path.join(out, name))
        return paths[-1]

    log.save(path("run.json"))
    with open(path("layout.txt"), "w") as f:
        f.write(terminal.render_run(log))
    html.save_html(log, path("layout.html"))
    perfetto.save_trace(log, path("trace.json"))
    timeline.save_timeline(log, path("timeline.png"))
    curves.save_curves(log, path("curves.png"))
    if gif:
        frames = os.path.join(out, "steps")
        os.makedirs(frames, exist_ok=True)
        timeline.save_gif(log, path("layout.gif"), frames_dir=frames, progress=progress)
        paths.append(frames + os.sep)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log is not None:
        from paged_jax.viz.log import RunLog

        try:
            log = RunLog.load(args.log)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"paged-jax viz: cannot read {args.log}: {err}", file=sys.stderr)
            return 1
    else:
        try:
            log = record(args.scenario, args.steps, args.seed, args.blocks, args.requests,
                         args.model, progress=not args.quiet)
        except ValueError as err:
            print(f"paged-jax viz: {err}", file=sys.stderr)
            return 2
    try:
        paths = write_views(log, args.out, gif=not args.no_gif, progress=not args.quiet)
    except ImportError as err:
        print(f"paged-jax viz: {err}. The pictures need the images extra: "
              "pip install 'paged-jax[images]'", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{log.num_steps} steps of '{log.scenario or args.log}' ->")
        for p in paths:
            print("  " + p)
    if args.play:
        from paged_jax.viz.terminal import play

        play(log, delay=args.delay)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
