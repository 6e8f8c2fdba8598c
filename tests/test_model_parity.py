"""Logit parity with Hugging Face transformers (CPU torch): tiny random Llama / Qwen2 models
are saved with ``save_pretrained`` (safetensors; one sharded), loaded with
``load_checkpoint``, and run through our paged ``prefill`` and decode steps."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # CPU torch 2.13.0, from the test extra
import transformers
from flax import nnx

from paged_jax.allocator import CacheConfig
from paged_jax.engine import decode_steps, pad_prompts, prefill
from paged_jax.kvcache import init_cache
from paged_jax.model import load_checkpoint
from tests.model_helpers import run_greedy, scrambled_state

TOL = 1e-4
NUM_STEPS = 32
VOCAB = 384
PROMPT_LENS = (7, 13)
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so that our positions reach all 3 bands
}
# name -> (architecture, config overrides, save kwargs, decode with the K-step scan)
CASES = {
    "mha_bias": ("llama", dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True,
                               mlp_bias=True), {}, False),
    "gqa_sharded": ("llama", dict(num_attention_heads=4, num_key_value_heads=2),
                    dict(max_shard_size="100KB"), True),
    "mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1), {}, False),
    "tied": ("llama", dict(num_attention_heads=2, num_key_value_heads=1,
                           tie_word_embeddings=True), {}, True),
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2), {}, True),
    "llama3_rope": ("llama", dict(num_attention_heads=2, num_key_value_heads=1,
                                  rope_theta=500000.0, rope_scaling=LLAMA3), {}, False),
}


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):  # no TF32 if this runs on a GPU
        yield


def build_hf(arch: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        head_dim=64, initializer_range=0.2,  # logits of order 1, so 1e-4 is a real bound
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, **overrides)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, **overrides)
        model = transformers.LlamaForCausalLM(cfg)
    return model.eval()


def hf_logits(model, seq) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(seq)[None], dtype=torch.long)).logits[0].numpy()


def hf_greedy(model, prompt, num_new):
    """transformers' generate(do_sample=False): token ids and each step's raw logits."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor(np.asarray(prompt)[None], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt):].numpy()
    return ids, np.stack([s[0].numpy() for s in out.logits])


def check_greedy(ours, theirs, hf_step_logits, label):
    """Equal ids; a divergence is only tolerated (and reported) when transformers' own top-2
    margin at that step is below float noise."""
    mismatch = np.nonzero(ours != theirs)[0]
    if mismatch.size == 0:
        return
    step = int(mismatch[0])
    top2 = np.sort(hf_step_logits[step])[-2:]
    margin = float(top2[1] - top2[0])
    assert margin < TOL, (
        f"{label}: greedy ids diverge at step {step} ({ours[step]} vs {theirs[step]}) with a "
        f"top-2 margin of {margin:.2e}"
    )
    warnings.warn(f"{label}: greedy tie at step {step}, top-2 margin {margin:.2e}", stacklevel=2)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(case, tmp_path):
    arch, overrides, save_kwargs, use_scan = CASES[case]
    hf = build_hf(arch, overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    if save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_checkpoint(tmp_path)
    graphdef, params = nnx.split(model)
    cfg = model.config

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n) for n in PROMPT_LENS]
    slots = np.array([2, 0], np.int32)  # slot 1 stays inactive
    cache = CacheConfig(num_blocks=24, block_size=8, max_seqs=3, max_blocks_per_seq=8)
    state = scrambled_state(cache, seed=3)

    if use_scan:
        kv = init_cache(cfg, cache, fill=jnp.nan)
        logits, kv, state, status = prefill(
            graphdef, params, kv, state, jnp.asarray(pad_prompts(prompts)), jnp.asarray(slots),
            jnp.asarray(PROMPT_LENS), all_logits=True,
        )
        status.raise_if_failed()
        prefill_logits = np.asarray(logits)
        first = np.zeros(cache.max_seqs, np.int32)
        first[slots] = [prefill_logits[i, n - 1].argmax() for i, n in enumerate(PROMPT_LENS)]
        toks, step_logits, kv, state, status = decode_steps(
            graphdef, params, kv, state, jnp.asarray(first), num_steps=NUM_STEPS,
            return_logits=True,
        )
        status.raise_if_failed()
        assert np.all(np.asarray(toks)[:, 1] == -1)  # the inactive slot emits nothing
        step_logits = np.asarray(step_logits)[:, slots]  # [steps, B, V]
        tokens = np.concatenate([first[slots][:, None], np.asarray(toks)[:, slots].T], 1)
    else:
        prefill_logits, step_logits, tokens = run_greedy(
            graphdef, params, cfg, cache, prompts, slots, NUM_STEPS, state=state, fill=np.nan
        )

    for i, prompt in enumerate(prompts):
        n = len(prompt)
        # Prefill logits at every prompt position.
        np.testing.assert_allclose(prefill_logits[i, :n], hf_logits(hf, prompt), atol=TOL, rtol=0)
        # Decode-step logits: step t fed our token t-1 at position n + t - 1.
        ours_seq = np.concatenate([prompt, tokens[i, :NUM_STEPS]])
        reference = hf_logits(hf, ours_seq)[n:]
        np.testing.assert_allclose(step_logits[:, i], reference, atol=TOL, rtol=0)
        # Greedy ids against generate().
        hf_ids, hf_step_logits = hf_greedy(hf, prompt, NUM_STEPS)
        check_greedy(tokens[i, :NUM_STEPS], hf_ids, hf_step_logits, f"{case}[{i}]")


# Two layouts here: the engine adds no per-layout code over the steps, which
# test_prefill_and_decode_match_transformers checks on every layout.
@pytest.mark.parametrize("case", ["gqa_sharded", "tied"])
def test_llm_engine_greedy_matches_transformers_generate(case, tmp_path):
    """``LLM(model=dir)`` serving two ragged prompts together, 32 greedy tokens each, through
    the whole engine (scheduler, chunked prefill, K-step dispatches), against transformers'
    ``generate(do_sample=False)`` one prompt at a time."""
    from paged_jax.engine.llm import LLM
    from paged_jax.engine.params import SamplingParams

    arch, overrides, save_kwargs, _ = CASES[case]
    hf = build_hf(arch, overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    llm = LLM(str(tmp_path), block_size=8, num_blocks=24, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=16, steps_per_dispatch=8)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_STEPS,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        theirs, logits = hf_greedy(hf, prompt, NUM_STEPS)
        check_greedy(np.asarray(out.outputs[0].token_ids), theirs, logits, f"{case} engine")


@pytest.mark.parametrize("fused", [False, True], ids=["three", "gate_up"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mlp_activation_rounds_as_transformers_does(dtype, fused):
    """``MLP`` against transformers' ``LlamaMLP`` with identity projections, so that every
    dot is exact and what is compared is the SwiGLU between them: PyTorch computes a 16-bit
    SiLU in f32 and rounds once, and so must we, bit for bit; with gate and up fused into one
    matmul (each set through its ``projection`` view) as well."""
    from paged_jax.model.config import ModelConfig
    from paged_jax.model.llama import MLP

    width = 64
    cfg = ModelConfig(vocab_size=8, hidden_size=width, intermediate_size=width, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=width, dtype=dtype)
    ours = MLP(cfg, rngs=nnx.Rngs(0), fused=fused)
    eye = np.eye(width, dtype=np.float32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        ours.projection(name).checkpoint_weight().set_value(jnp.asarray(eye, cfg.jnp_dtype))
    theirs = transformers.models.llama.modeling_llama.LlamaMLP(transformers.LlamaConfig(
        hidden_size=width, intermediate_size=width, hidden_act="silu", mlp_bias=False))
    torch_dtype = getattr(torch, dtype)
    with torch.no_grad():
        for proj in (theirs.gate_proj, theirs.up_proj, theirs.down_proj):
            proj.weight.copy_(torch.from_numpy(eye))
    theirs = theirs.to(torch_dtype)
    # Values across SiLU's curve, each exactly representable in bf16.
    x = np.asarray(jnp.asarray(np.random.default_rng(0).normal(0, 3, (3, 5, width)),
                               jnp.bfloat16), np.float32)
    got = np.asarray(ours(jnp.asarray(x, cfg.jnp_dtype)), np.float32)
    with torch.no_grad():
        want = theirs(torch.from_numpy(x).to(torch_dtype)).float().numpy()
    if dtype == "bfloat16":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rms_norm_rounds_as_transformers_does(dtype):
    """``RMSNorm`` against transformers' ``LlamaRMSNorm``: normalized in f32, rounded to the
    input's dtype, then times the weight; bit for bit in bf16."""
    from paged_jax.model.llama import RMSNorm

    width, eps = 96, 1e-5
    rng = np.random.default_rng(1)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # exact in both
    weight, x = bf16(rng.normal(1, 0.3, width)), bf16(rng.normal(0, 2, (3, 7, width)))
    jdtype, torch_dtype = jnp.dtype(dtype), getattr(torch, dtype)
    ours = RMSNorm(width, epsilon=eps, dtype=jdtype, param_dtype=jdtype, rngs=nnx.Rngs(0))
    ours.scale.set_value(jnp.asarray(weight, jdtype))
    theirs = transformers.models.llama.modeling_llama.LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(weight))
        want = theirs.to(torch_dtype)(torch.from_numpy(x).to(torch_dtype)).float().numpy()
    got = np.asarray(ours(jnp.asarray(x, jdtype)), np.float32)
    if dtype == "bfloat16":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
