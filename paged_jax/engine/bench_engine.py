"""Engine overhead: ``LLMEngine`` against the raw steps it drives, on the same batch.

``paged-jax bench engine`` serves ``--batch`` chat prompts (``--tokens`` greedy tokens
each, EOS ignored) two ways, both from an empty pool to the last token on the host:

* raw: one ``prefill`` of the whole ragged batch, then ``decode_steps`` dispatches of K
  steps, the tokens brought to the host after each, as a hand-written loop does;
* engine: ``add_request`` for each prompt, then ``step()`` until all are finished. The
  engine adds its scheduling, the per-row budgets and stop ids inside the dispatch, prefix
  caching (hashing every full block; the cache is emptied between rounds so that no round
  starts on cached blocks), its host bookkeeping and the releases.

Both run on the same pool shape (``max_seqs = batch``), so they compile the same model
work. The figure is the engine's time over the raw loop's, the median over ``--rounds``
rounds (each times both, back to back, after a warm-up); goal: at most 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.llm import load_model
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.steps import pad_prompts

GOAL = 1.10
QUESTIONS = (
    "What is the capital of France?", "List three primary colours.",
    "Write one sentence about the sea.", "How many legs does a spider have?",
    "Why is the sky blue?", "Name a planet larger than Earth.", "What do bees make?",
    "Give me a synonym for happy.",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help='a .gguf file, a Hugging Face directory, or "tiny" (default: SmolLM2)')
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per request after "
                   "the first (a multiple of --steps-per-dispatch)")
    p.add_argument("--steps-per-dispatch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    return p


def prompts_for(tokenizer, batch: int, vocab: int) -> list[list[int]]:
    if tokenizer is None:  # token ids for a model without a tokenizer
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab, 20 + 3 * i).tolist() for i in range(batch)]
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]), add_special_tokens=False)
        for i in range(batch)]


def run_raw(engine: LLMEngine, prompts, tokens: int, k: int) -> float:
    """The hand-written loop on a fresh pool of the engine's shape; returns seconds."""
    from paged_jax.allocator import init_state
    from paged_jax.kvcache import init_cache

    kv = init_cache(engine.model_config, engine.cache_config)
    state = init_state(engine.cache_config)
    rows = engine.cache_config.max_seqs
    padded = np.zeros((rows, max(map(len, prompts))), np.int32)
    padded[: len(prompts)] = pad_prompts(prompts, padded.shape[1])
    slots = np.full(rows, -1, np.int32)
    slots[: len(prompts)] = np.arange(len(prompts))
    lens = np.zeros(rows, np.int32)
    lens[: len(prompts)] = [len(p) for p in prompts]
    start = time.perf_counter()
    steps = engine.steps  # the same compiled model work as the engine's
    logits, kv, state, status = steps.prefill(engine.params, kv, state, padded, slots, lens)
    status.raise_if_failed()
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    np.asarray(nxt)
    for _ in range(tokens // k):
        toks, _, kv, state, status = steps.decode_steps(engine.params, kv, state, nxt,
                                                        num_steps=k)
        np.asarray(jax.device_get(toks))
        nxt = toks[-1]
    status.raise_if_failed()
    return time.perf_counter() - start


def run_engine(engine: LLMEngine, prompts, tokens: int) -> float:
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    k = args.steps_per_dispatch
    if args.batch < 1 or args.rounds < 1 or k < 1 or args.tokens < k or args.tokens % k:
        raise SystemExit(f"--batch and --rounds must be >= 1 and --tokens a positive multiple "
                         f"of --steps-per-dispatch ({k}). Got batch {args.batch}, rounds "
                         f"{args.rounds}, tokens {args.tokens}.")
    model, tokenizer = load_model(args.model)
    prompts = prompts_for(tokenizer, args.batch, model.config.vocab_size)
    longest = max(map(len, prompts)) + args.tokens + 1
    # K steps in every dispatch, as the raw loop runs them: the two differ in overhead only.
    engine = LLMEngine(model, tokenizer, max_num_seqs=args.batch, steps_per_dispatch=k,
                       max_dispatch_ms=None,
                       max_model_len=-(-longest // 16) * 16,
                       max_num_batched_tokens=max(16, 1 << (sum(map(len, prompts)) - 1)
                                                  .bit_length()))
    cfg = engine.cache_config
    print(f"paged-jax bench engine: {model.config.num_layers} layers, batch {args.batch}, "
          f"{args.tokens} tokens after the first, K={k}, pool {cfg.num_blocks} blocks of "
          f"{cfg.block_size}, jax {jax.__version__} ({jax.default_backend()})", flush=True)
    run_raw(engine, prompts, args.tokens, k), run_engine(engine, prompts, args.tokens)  # warm-up
    raw, eng = [], []
    for _ in range(args.rounds):
        raw.append(run_raw(engine, prompts, args.tokens, k))
        eng.append(run_engine(engine, prompts, args.tokens))
    ratio = statistics.median(e / r for e, r in zip(eng, raw, strict=True))
    total = args.batch * (args.tokens + 1)
    print(f"{'loop':>8} | {'median s':>9} | {'tok/s':>8}")
    for name, ts in (("raw", raw), ("engine", eng)):
        med = statistics.median(ts)
        print(f"{name:>8} | {med:>9.3f} | {total / med:>8.1f}")
    print(f"engine / raw time: {ratio:.3f} (goal <= {GOAL}: "
          f"{'met' if ratio <= GOAL else 'not met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
