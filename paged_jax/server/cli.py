"""``paged-jax serve``: the OpenAI-compatible server over the engine (``server.app``).

    paged-jax serve                                  # SmolLM2-135M-Instruct on 127.0.0.1:8000
    paged-jax serve --model path/to/model.gguf --port 8080 --api-key sk-local
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'

It binds to 127.0.0.1 unless ``--host`` says otherwise. ``--api-key`` (or the environment
variable ``PAGED_JAX_API_KEY``) makes every endpoint but ``/health`` ask for
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import os
import pathlib

from paged_jax.engine.scheduler import (
    DEFAULT_MAX_DISPATCH_MS,
    POLICIES,
    max_dispatch_ms_flag,
    prefill_budget_flag,
)

__all__ = ["build_parser", "main", "model_name"]

API_KEY_ENV = "PAGED_JAX_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help='a .gguf file, a Hugging Face directory or "tiny" (default: SmolLM2)')
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the file or directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-tokens-while-decoding", type=int, default=0,
                   help="the chunk budget of an iteration that also decodes, which bounds "
                   "the inter-token latency's tail (at most --max-num-batched-tokens); 0: "
                   "--max-num-batched-tokens")
    p.add_argument("--one-dispatch", action="store_true",
                   help="one dispatch per decoding iteration: at most one prompt's prefill "
                   "chunk an iteration with decode rows, run with the decode step (LLMEngine's "
                   "one_prefill_chunk and decode_with_prefill). With a small "
                   "--prefill-tokens-while-decoding it bounds the inter-token latency's "
                   "tail; while rows decode, prompts are prefilled one after another, "
                   "and --warmup compiles a prefill_decode shape per chunk width and "
                   "decode row count")
    p.add_argument("--no-condense-slots", action="store_true",
                   help="leave decode rows in the slots they were admitted to (LLMEngine's "
                   "condense_slots), rather than moving them down below the power of two "
                   "that covers their count before a decode dispatch")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--steps-per-dispatch", type=int, default=8)
    p.add_argument("--steps-while-prefilling", type=int, default=1,
                   help="decode steps per dispatch in an iteration that prefills (at most "
                   "--steps-per-dispatch)")
    p.add_argument("--max-dispatch-ms", type=float, default=DEFAULT_MAX_DISPATCH_MS,
                   help="decode --steps-while-prefilling steps per dispatch wherever K steps "
                   "took longer than this (LLMEngine's max_dispatch_ms); 0: K whenever "
                   "nothing is prefilled")
    p.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="admission order; shortest_first takes the requests that arrived "
                   "together shortest prompt first")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--blocks-history", type=int, default=256,
                   help="engine steps the /blocks page keeps (0: no page)")
    p.add_argument("--warmup", action="store_true",
                   help="compile every prefill shape and the greedy decode dispatches before "
                   "serving, so that no request waits for a compilation (minutes for a real "
                   "model on a CPU)")
    return p


def model_name(model: str | None) -> str:
    """The default served name: the model file's or directory's name, without ``.gguf``."""
    if model is None:
        from paged_jax.model.tokenizer import default_gguf_path

        model = os.fspath(default_gguf_path())
    name = pathlib.Path(model).name
    return name.removesuffix(".gguf") or model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        raise SystemExit(f"--port must be in [0, 65536), got {args.port}")
    try:
        max_dispatch_ms = max_dispatch_ms_flag(args.max_dispatch_ms)
        prefill_budget = prefill_budget_flag(args.prefill_tokens_while_decoding,
                                             args.max_num_batched_tokens)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    import uvicorn

    from paged_jax.engine.llm import LLM
    from paged_jax.server.app import ServerConfig, build_app

    config = ServerConfig(model_name=args.served_model_name or model_name(args.model),
                          api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                          blocks_history=args.blocks_history)
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              prefill_tokens_while_decoding=prefill_budget,
              steps_per_dispatch=args.steps_per_dispatch,
              steps_while_prefilling=args.steps_while_prefilling,
              max_dispatch_ms=max_dispatch_ms,
              decode_with_prefill=args.one_dispatch, one_prefill_chunk=args.one_dispatch,
              condense_slots=not args.no_condense_slots,
              scheduling_policy=args.scheduling_policy,
              enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
              kv_cache_bytes=args.kv_cache_mib << 20)
    if args.warmup:
        from paged_jax.engine.warmup import warm_up

        shapes = warm_up(llm.engine)
        print(f"compiled {shapes} prefill shapes and the greedy decode dispatches", flush=True)
    print(f"paged-jax serve: {config.model_name} on http://{args.host}:{args.port} "
          f"({llm.engine.cache_config.num_blocks} blocks of {args.block_size}, "
          f"max_num_seqs {args.max_num_seqs}; API key {'on' if args.api_key else 'off'})",
          flush=True)
    uvicorn.run(build_app(llm.engine, config), host=args.host, port=args.port,
                log_level="info")
    return 0
