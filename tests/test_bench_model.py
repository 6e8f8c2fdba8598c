"""``paged-jax bench decode --model smollm2``, on SmolLM2's first two layers: the table it
prints parses, and the greedy ids it decodes on both sides equal a cache-free greedy loop over
transformers' forward (an independent reference for the paged_jax side and for the
benchmark's DynamicCache loop)."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine import bench, bench_model
from paged_jax.engine.steps import Steps, serving_params
from paged_jax.kvcache import init_cache
from paged_jax.model.llama import Llama
from tests.model_helpers import TINY

ROW = re.compile(r"^\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+)x\s+(met|not met) \| "
                 r"(\d+)/(\d+) of (\d+) tokens")


def test_bench_decode_smollm2_prints_a_table_and_the_reference_tokens(capsys,
                                                                      smollm2_two_layers):
    """Batch 2, two chat prompts of different lengths: a ragged paged batch; also in tables
    of 512 tokens, read by context width and whole. On SmolLM2's first two layers (its
    weights, tokenizer and shapes), which compile in a fraction of the whole model's time:
    the benchmark builds a dozen programs."""
    tokens = 8
    models = smollm2_two_layers  # loaded once for the session
    assert bench_model.main(["--batch", "2", "--tokens", str(tokens), "--rounds", "1",
                             "--prefill-tokens", "48", "--table-tokens", "512",
                             "--show-tokens"], models=models) == 0
    out = capsys.readouterr().out
    rows = [m for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) == 1, out
    batch, ours, theirs, ratio, verdict, agree, of, new = rows[0].groups()
    assert (int(batch), int(of), int(new)) == (2, 2, tokens + 1)
    ours, theirs, ratio = float(ours), float(theirs), float(ratio)
    assert ours > 0 and theirs > 0
    # The rates are printed to 0.05 and the ratio to 0.005: it lies within what they allow.
    assert (ours - 0.05) / (theirs + 0.05) - 0.005 <= ratio <= (
        (ours + 0.05) / max(theirs - 0.05, 1e-9) + 0.005)
    assert (verdict == "met") == (ratio >= bench_model.GOAL)
    # The memory floor: the weights' size counted from the config (tied: the embedding is
    # the output matrix too), and its batch line's ratios from the figures printed.
    c = models.ours.config
    layer = (c.hidden_size * c.num_heads * c.head_dim * 2  # q and o
             + c.hidden_size * c.num_kv_heads * c.head_dim * 2  # k and v
             + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    n_params = c.vocab_size * c.hidden_size + c.num_layers * layer + c.hidden_size
    assert f"memory floor: a decode step reads all {n_params * 4 / 1e6:.0f} MB of weights" in out
    floor = re.search(r"batch 2: at most ([\d.]+) tok/s, ([\d.]+)x transformers; paged_jax "
                      r"runs at (\d+)% of it", out)
    top, x, pct = float(floor[1]), float(floor[2]), int(floor[3])
    assert x == pytest.approx(top / theirs, abs=0.01 + 0.05 * top / theirs ** 2)
    assert pct == pytest.approx(100 * ours / top, abs=1.5)
    # The matmul floor: 7 projections a layer in 4 matmuls (q/k/v and gate/up fused on CPU,
    # 7 elsewhere) and the vocabulary projection; its batch line's figures agree with each
    # other and with the table's.
    assert models.ours.fused_projections == (jax.default_backend() == "cpu")
    per_layer = 4 if models.ours.fused_projections else 7
    assert f"matmul floor: a step's {per_layer * c.num_layers + 1} matmuls alone" in out
    mm = re.search(r"batch 2: ([\d.]+) ms, at most ([\d.]+) tok/s, ([\d.]+)x transformers; "
                   r"paged_jax runs at (\d+)% of it", out)
    assert mm, out
    ms, top, x, pct = float(mm[1]), float(mm[2]), float(mm[3]), int(mm[4])
    assert top == pytest.approx(2e3 / ms, rel=0.01 + 0.05 / ms)
    assert x == pytest.approx(top / theirs, abs=0.01 + 0.05 * top / theirs ** 2)
    assert pct == pytest.approx(100 * ours / top, abs=1.5)
    # f32 on CPU holds the weights [in, out]; the run times them [out, in] too, with the
    # same tokens.
    assert models.ours.in_out == (jax.default_backend() == "cpu")
    if models.ours.in_out:
        held = re.search(r"batch 2: ([\d.]+) tok/s; \[in, out\] ([\d.]+)x that \((\d)/2 rows",
                         out)
        assert held and float(held[1]) > 0, out
        assert float(held[2]) == pytest.approx(ours / float(held[1]), rel=0.02)
        assert held[3] == "2", out
    if models.ours.fused_projections:  # and unfused, with the same tokens
        five = re.search(r"batch 2: ([\d.]+) tok/s; fused ([\d.]+)x that \((\d)/2 rows", out)
        assert five and float(five[1]) > 0, out
        assert float(five[2]) == pytest.approx(ours / float(five[1]), rel=0.02)
        assert five[3] == "2", out
    # In 512-token tables: the wide table by context width against the whole, and the tight
    # table against it, each ratio from the rates printed; the same tokens on all three.
    wide = re.search(r"batch 2: ([\d.]+) tok/s reading the columns that cover the rows \(the "
                     r"default: 256 tokens, doubled as needed\), ([\d.]+) tok/s reading the "
                     r"whole table "
                     r"\(context_bucket_tokens=0\): by context width ([\d.]+)x that; the "
                     r"tight table ([\d.]+)x the wide one \((\d)/2 rows token-equal\)", out)
    assert wide and "block tables of 512 tokens" in out, out
    by_width, whole, x, tight = map(float, wide.groups()[:4])
    assert x == pytest.approx(by_width / whole, rel=0.02)
    assert tight == pytest.approx(ours / by_width, rel=0.02)
    assert wide[5] == "2", out
    sides = ("paged_jax", "transformers", "wide_table", "wide_table_whole")
    ids = {(name, row): list(map(int, line.split(":")[1].split()))
           for line in out.splitlines()
           for name in sides for row in (0, 1)
           if line.startswith(f"batch 2 row {row} {name}:")}

    prompts = bench_model.prompt_ids(models.tokenizer, 2)
    assert len(prompts[0]) != len(prompts[1])
    for row, prompt in enumerate(prompts):
        # The reference: transformers without any cache, the whole sequence through the model
        # for every new token, EOS ignored (generate()'s min_new_tokens would forbid it).
        seq = list(prompt)
        with torch.inference_mode():
            for _ in range(tokens + 1):
                seq.append(int(models.theirs(torch.tensor([seq])).logits[0, -1].argmax()))
        ref = seq[len(prompt):]
        for name in sides:
            assert ids[name, row] == ref, (name, row)
    assert int(agree) == 2

    # The prefill line: its ratios from the times printed, every side's first new token the
    # argmax of transformers' cache-free forward of the prompt.
    prompt = bench_model.long_prompt(models.tokenizer, 48)
    assert len(prompt) == 48 and prompt[:len(prompts[0])] == prompts[0]
    pre = re.search(r"prefill of one 48-token prompt \(the chat prompts' ids repeated\), "
                    r"fastest of 1: paged_jax ([\d.]+) ms, transformers ([\d.]+) ms "
                    r"\(([\d.]+)x\); first new token the same on all sides", out)
    assert pre, out

    def check_ratio(x, num_ms, den_ms):  # times printed to 0.05 ms, the ratio to 0.005
        assert x == pytest.approx(num_ms / den_ms, abs=0.01 + 0.1 * num_ms / den_ms ** 2)

    ours_ms, theirs_ms, x = map(float, pre.groups())
    check_ratio(x, theirs_ms, ours_ms)
    ablation = re.search(r"kv_head_attention=False\): ([\d.]+) ms; a pair of dots per KV head "
                         r"([\d.]+)x that", out)
    assert ablation, out
    check_ratio(float(ablation[2]), float(ablation[1]), ours_ms)
    wide_pre = re.search(r"the same prefill in a block table of 512 tokens: ([\d.]+) ms by "
                         r"context width, ([\d.]+) ms reading the whole table "
                         r"\(context_bucket_tokens=0\): by context width ([\d.]+)x faster", out)
    assert wide_pre, out
    by_width_ms, whole_ms, x = map(float, wide_pre.groups())
    check_ratio(x, whole_ms, by_width_ms)
    with torch.inference_mode():
        first = int(models.theirs(torch.tensor([prompt])).logits[0, -1].argmax())
    got = bench_model.PagedRunner(models.ours, [prompt], 0, 1, 16, "auto").first_token()[0]
    assert got == first


@pytest.mark.parametrize(("args", "message"), [
    (["--tokens", "12"], r"--tokens must be a positive multiple of --steps-per-dispatch \(8\)"
                         r"\. Got 12\."),
    (["--batch", "1", "9"], r"--batch sizes must be in 1\.\.8\. Got \[9\]\."),
    (["--prefill-tokens", "-1"], r"--prefill-tokens must be >= 0\. Got -1\."),
    (["--table-tokens", "-5"], r"--table-tokens must be >= 0\. Got -5\."),
    (["--checkpoint", "/nonexistent/model.gguf"], r"/nonexistent/model\.gguf does not exist"),
])
def test_bench_decode_hands_a_real_model_to_bench_model_which_checks_its_flags(args, message):
    # Refused before anything loads: the message comes from bench_model's checks.
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "smollm2", *args] if "--checkpoint" not in args else args)


def test_bench_decode_in_bf16_runs_both_sides_on_the_same_rounded_weights(capsys,
                                                                         smollm2_two_layers):
    """``--dtype bfloat16``: both sides hold the GGUF's weights rounded to bf16, bit for bit
    (transformers' model cast from the session's f32 one, as ``from_pretrained(dtype=...)``
    casts the same dequantised tensors); the table and the ablation lines parse."""
    import copy

    from paged_jax.model.gguf import load_gguf, open_gguf

    smollm2 = smollm2_two_layers  # SmolLM2's first two layers, as in the f32 test
    ours = load_gguf(open_gguf(smollm2.path), "bfloat16")
    theirs = copy.deepcopy(smollm2.theirs).to(torch.bfloat16)
    for name in ("q_proj", "k_proj"):  # the two llama.cpp permutes
        want = getattr(theirs.model.layers[0].self_attn, name).weight.detach().float().numpy()
        got = ours.layers[0].self_attn.projection(name).checkpoint_weight().get_value()
        assert got.dtype == "bfloat16" and (got.astype("float32") == want).all(), name
    models = bench_model.Models(smollm2.path, smollm2.tokenizer, ours, theirs)
    with pytest.raises(ValueError, match="--dtype float32 is not the loaded models' bfloat16"):
        bench_model.main(["--batch", "1"], models=models)
    assert bench_model.main(["--batch", "2", "--tokens", "8", "--rounds", "1",
                             "--dtype", "bfloat16", "--prefill-tokens", "0",
                             "--table-tokens", "0"], models=models) == 0
    out = capsys.readouterr().out
    assert "prefill of one" not in out
    assert "bfloat16 on both sides" in out
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(ours)))  # tied: all read
    assert (f"reads all {weight_bytes / 1e6:.0f} MB of weights" in out
            and "a jitted sum over f32 arrays of the same bytes" in out), out
    rows = [m for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) == 1 and rows[0][1] == "2", out
    plain = re.search(r"batch 2: ([\d.]+) tok/s; with them ([\d.]+)x that \((\d)/2 rows", out)
    assert plain and float(plain[1]) > 0, out
    assert float(plain[2]) == pytest.approx(float(rows[0][2]) / float(plain[1]), rel=0.02)
    right = re.search(r"batch 2: ([\d.]+) tok/s; on the left ([\d.]+)x that \((\d)/2 rows", out)
    assert right and float(right[1]) > 0, out
    assert float(right[2]) == pytest.approx(float(rows[0][2]) / float(right[1]), rel=0.02)
    # bf16 keeps five matmuls a layer; the run times them fused as well.
    assert not ours.fused_projections
    other = re.search(r"batch 2: ([\d.]+) tok/s; five matmuls ([\d.]+)x that \((\d)/2 rows",
                      out)
    assert other and float(other[1]) > 0, out
    assert float(other[2]) == pytest.approx(float(rows[0][2]) / float(other[1]), rel=0.02)
    once = re.search(r"batch 2: ([\d.]+) tok/s; made once ([\d.]+)x that \((\d)/2 rows", out)
    assert once and float(once[1]) > 0, out
    assert float(once[2]) == pytest.approx(float(rows[0][2]) / float(once[1]), rel=0.02)
    assert once[3] == "2", out  # the same rows gathered either way: the same tokens
    write = re.search(r"256 MiB bfloat16 pool: ([\d.]+) ms kept as uint16 bits, ([\d.]+) ms "
                      r"stored as bfloat16", out)
    assert write and float(write[1]) > 0 and float(write[2]) > 0, out


def batch_free_dots(jaxpr: jex.Jaxpr, found: collections.Counter) -> collections.Counter:
    """Every ``dot_general`` of ``jaxpr`` and the jaxprs inside it (jit, scan, cond, ...)
    without batch dimensions (the projections; attention's dots batch over rows or heads),
    counted by operand shapes and dtypes, contracted axes and result type."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval for v in eqn.invars)
            if not lb:
                found[(lhs.shape, str(lhs.dtype), rhs.shape, str(rhs.dtype), tuple(lc),
                       tuple(rc), str(eqn.params["preferred_element_type"]))] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jex.ClosedJaxpr):
                    batch_free_dots(sub.jaxpr, found)
                elif isinstance(sub, jex.Jaxpr):
                    batch_free_dots(sub, found)
    return found


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "five"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_matmul_floor_makes_exactly_the_decode_steps_projections(dtype, batch, fused):
    """``step_matmuls`` (what ``MatmulFloor`` times) makes the same matmuls as the
    ``decode_step`` it bounds: the same operand shapes, layouts and dtypes, as many of each
    (a bf16 row padded to two, the weight on the left, included). The reference is the
    decode step's own jaxpr. Fused, a layer makes four matmuls rather than seven."""
    cfg = dataclasses.replace(TINY, dtype=dtype)
    model = Llama(cfg, rngs=nnx.Rngs(0), fused_projections=fused)
    graphdef, state = nnx.split(model)
    cache = CacheConfig(num_blocks=8, block_size=16, max_seqs=batch, max_blocks_per_seq=2)
    step = Steps(graphdef).decode_step_jit.trace(
        serving_params(model), init_cache(cfg, cache), init_state(cache),
        jnp.zeros((batch,), jnp.int32), impl="xla", interpret=False)
    want = batch_free_dots(step.jaxpr.jaxpr, collections.Counter())
    assert sum(want.values()) == (4 if fused else 7) * cfg.num_layers + 1
    assert bench_model.matmuls_per_step(model) == sum(want.values())
    x = jnp.zeros((batch, 1, cfg.hidden_size), cfg.jnp_dtype)
    floor = jax.make_jaxpr(lambda s, x: bench_model.step_matmuls(nnx.merge(graphdef, s), x))
    assert batch_free_dots(floor(state, x).jaxpr, collections.Counter()) == want
