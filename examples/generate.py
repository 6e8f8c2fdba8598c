"""Greedy generation for a ragged batch of prompts: paged prefill, then multi-step decode.

    python examples/generate.py                      # a tiny random Llama (no download)
    python examples/generate.py --checkpoint DIR     # a Hugging Face Llama / Qwen2 directory

Same as ``paged-jax generate``; see ``paged_jax/engine/generate.py``.
"""

from paged_jax.engine.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
