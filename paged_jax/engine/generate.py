"""Greedy generation for a ragged batch of prompts: paged prefill, then multi-step decode.

    paged-jax generate                      # a tiny random Llama (no download)
    paged-jax generate --checkpoint DIR     # a Hugging Face Llama / Qwen2 directory

Prompts are token ids (there is no tokenizer here): ``--prompt "1 2 3" --prompt "4 5"``, or
random ones. Every prompt is prefilled in one ragged ``prefill`` call into its own sequence
slot; then ``decode_steps`` produces ``--steps-per-dispatch`` tokens per host round trip until
``--max-new-tokens`` are out.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import decode_steps, pad_prompts, prefill
from paged_jax.kvcache import init_cache, plan_blocks
from paged_jax.model import DEFAULT_MODEL, init_model, load_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="paged-jax generate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a Hugging Face checkpoint directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype")
    parser.add_argument("--prompt", action="append", help="space-separated token ids")
    parser.add_argument("--num-prompts", type=int, default=3, help="random prompts if none")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--steps-per-dispatch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = load_checkpoint(args.checkpoint, args.dtype) if args.checkpoint else init_model(
        DEFAULT_MODEL.replace(dtype=args.dtype or "float32"), seed=args.seed
    )
    cfg = model.config
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)  # cheaper for jit to flatten on every dispatch
    rng = np.random.default_rng(args.seed)
    if args.prompt:
        prompts = [np.array([int(t) for t in p.split()], np.int32) for p in args.prompt]
    else:
        prompts = [rng.integers(0, cfg.vocab_size, rng.integers(3, 20)).astype(np.int32)
                   for _ in range(args.num_prompts)]
    lens = np.array([len(p) for p in prompts], np.int32)

    # The first new token comes from prefill's logits; the rest from K-step dispatches.
    k = args.steps_per_dispatch
    dispatches = math.ceil(max(args.max_new_tokens - 1, 0) / k)
    max_blocks = math.ceil((lens.max() + dispatches * k) / args.block_size)
    cache = CacheConfig(num_blocks=len(prompts) * max_blocks, block_size=args.block_size,
                        max_seqs=len(prompts), max_blocks_per_seq=max_blocks)
    plan = plan_blocks(cfg, memory_bytes=0, block_size=args.block_size)
    print(f"model: {cfg.architecture}, {cfg.num_layers} layers, {cfg.num_heads}/"
          f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {cfg.dtype}")
    print(f"cache: {cache.num_blocks} blocks of {cache.block_size} tokens, "
          f"{plan.bytes_per_block} bytes per block (all layers)")

    kv, state = init_cache(cfg, cache), init_state(cache)
    tokens = pad_prompts(prompts)
    slots = jnp.arange(len(prompts), dtype=jnp.int32)
    start = time.perf_counter()
    logits, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(tokens), slots,
                                        jnp.asarray(lens))
    status.raise_if_failed()
    key = jax.random.key(args.seed)
    key, sub = jax.random.split(key)
    if args.temperature > 0:
        nxt = jax.random.categorical(sub, logits / args.temperature).astype(jnp.int32)
    else:
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = [np.asarray(nxt)[:, None]]
    for _ in range(dispatches):
        key, sub = jax.random.split(key)
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, nxt, sub,
                                                  args.temperature, num_steps=k)
        toks = jax.device_get(toks)  # one host round trip per dispatch
        if toks.min() < 0:  # every row is active: -1 means the step did not run
            status.raise_if_failed()
        out.append(toks.T)
        nxt = toks[-1]
    generated = np.concatenate(out, axis=1)[:, : args.max_new_tokens]
    seconds = time.perf_counter() - start
    for i, p in enumerate(prompts):
        print(f"[{i}] prompt {p.tolist()}")
        print(f"    -> {generated[i].tolist()}")
    print(f"{generated.size} tokens in {seconds:.2f}s (compilation included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
