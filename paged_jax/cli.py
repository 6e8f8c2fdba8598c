"""The ``paged-jax`` command line: ``demo``, ``viz``, ``generate``, ``serve`` and ``bench``.

Each subcommand imports its implementation lazily so that ``paged-jax --help`` is instant.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from paged_jax.walkthrough import run_walkthrough

    run_walkthrough(out=sys.stdout)
    return 0


def _viz(args: argparse.Namespace) -> int:
    from paged_jax.viz.cli import main as viz_main

    return viz_main(args.rest)


def _serve(args: argparse.Namespace) -> int:
    from paged_jax.server.cli import main as serve_main

    return serve_main(args.rest)


def _generate(args: argparse.Namespace) -> int:
    from paged_jax.engine.generate import main as generate_main

    return generate_main(args.rest)


BENCHMARKS = {
    "allocator": "paged_jax.allocator.bench",
    "kernel": "paged_jax.kernels.bench",
    "decode": "paged_jax.engine.bench",
    "engine": "paged_jax.engine.bench_engine",
    "memory": "paged_jax.allocator.bench_memory",
    "serve": "paged_jax.engine.bench_serve",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(BENCHMARKS[args.what]).main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="replay the seed walkthrough: requests A, B, C, a prefix")
    demo.set_defaults(func=_demo)

    viz = sub.add_parser(
        "viz", help="record a scenario or load a log; write every view", add_help=False
    )
    viz.add_argument("rest", nargs=argparse.REMAINDER, help="see `paged-jax viz --help`")
    viz.set_defaults(func=_viz)

    gen = sub.add_parser(
        "generate", help="prefill + multi-step decode for a ragged batch", add_help=False
    )
    gen.add_argument("rest", nargs=argparse.REMAINDER, help="see `paged-jax generate --help`")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the engine", add_help=False
    )
    serve.add_argument("rest", nargs=argparse.REMAINDER, help="see `paged-jax serve --help`")
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks that print ratios against a same-run baseline")
    bench.add_argument("what", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the chosen benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # Subcommands with options of their own get everything after their name untouched.
    if argv[:1] == ["viz"]:
        return _viz(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["generate"]:
        return _generate(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["serve"]:
        return _serve(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHMARKS:
        return _bench(argparse.Namespace(what=argv[1], rest=argv[2:]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
