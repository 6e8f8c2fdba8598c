"""Tensor-parallel steps on 8 virtual CPU devices, against the same steps on one device.

tp=2 and tp=4 (and each tp=2 replica of a dp=2 x tp=2 mesh) must give the single-device
prefill logits, K-step decode tokens and logits, and single-step logits within 1e-5 (f32):
a wrong parameter split, a head shard reading another shard's pages, or a missing all-reduce
would be off by O(1). The outputs' shardings are the documented ones, the donated cache is
updated in place on every shard, and bad meshes raise before anything compiles."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from paged_jax import sharding
from paged_jax.allocator import init_state
from paged_jax.engine import Steps
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kvcache import init_cache
from paged_jax.model import init_model
from paged_jax.model.llama import Llama
from tests.compile_log import logged_compiles
from tests.sharded.helpers import CACHE, GQA, STEPS, mesh, run_steps, split_model

ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return split_model()


@pytest.fixture(scope="module")
def reference(model):
    graphdef, params = model
    return run_steps(Steps(graphdef), params)[0]


def assert_same(got, ref):
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    for name in ("prefill", "steps", "step"):
        np.testing.assert_allclose(got[name], ref[name], atol=ATOL, rtol=0, err_msg=name)


def assert_documented_shardings(kv, state, m):
    """The cache split over KV heads (each device holds num_kv_heads / tp of them), the state
    replicated on every device of the mesh."""
    tp = m.shape["tp"]
    for buf in (kv.k, kv.v):
        assert buf.sharding.spec == sharding.CACHE_SPEC == P(None, "tp")
        assert buf.sharding.mesh.devices.tolist() == m.devices.tolist()
        shapes = {s.data.shape for s in buf.addressable_shards}
        assert shapes == {(GQA.num_layers, GQA.num_kv_heads // tp, *buf.shape[2:])}
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated
        assert set(leaf.sharding.device_set) == set(m.devices.flat)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_steps_equal_one_device(model, reference, tp):
    graphdef, params = model
    m = mesh((tp,))
    got, kv, state = run_steps(Steps(graphdef, mesh=m), params)
    assert_same(got, reference)
    assert_documented_shardings(kv, state, m)


def test_each_replica_of_a_dp2_tp2_mesh_equals_one_device(model, reference):
    graphdef, params = model
    replicas = sharding.replica_meshes(mesh((2, 2), ("dp", "tp")))
    assert [r.devices.tolist() for r in replicas] == [
        jax.devices()[0:2], jax.devices()[2:4]]
    for m in replicas:
        got, kv, state = run_steps(Steps(graphdef, mesh=m), params)
        assert_same(got, reference)
        assert_documented_shardings(kv, state, m)


def test_pallas_kernel_runs_per_shard_in_interpret_mode(model, reference):
    graphdef, params = model
    got, _, _ = run_steps(Steps(graphdef, mesh=mesh((2,))), params, impl="pallas",
                          interpret=True)
    assert_same(got, reference)


@pytest.mark.parametrize("fused", [False, True], ids=["five", "fused"])
@pytest.mark.parametrize("in_out", [False, True], ids=["weight", "kernel"])
def test_param_specs_are_megatron_style(in_out, fused):
    """q/k/v and gate/up split over their outputs, o and down over their inputs: the first
    axis of an ``[out, in]`` weight, the second of an ``[in, out]`` kernel, and back. Fused,
    each shard of ``qkv_proj`` holds whole KV heads with their query heads, and each shard of
    ``gate_up_proj`` the gate and up columns of the same slice of ``F``: checked against the
    unsharded projections' slices."""
    model = Llama(GQA, rngs=nnx.Rngs(1), in_out=in_out, fused_projections=fused)
    params = nnx.to_pure_dict(nnx.state(model))
    specs = sharding.param_specs(params)
    attn, mlp = specs["layers"][0]["self_attn"], specs["layers"][0]["mlp"]
    leaf = "kernel" if in_out else "weight"
    out_axis = P(None, "tp") if in_out else P("tp", None)
    in_axis = P("tp", None) if in_out else P(None, "tp")
    column = (("qkv_proj",), ("gate_up_proj",)) if fused else (
        ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    for name in column[0]:
        assert attn[name][leaf] == out_axis
    for name in column[1]:
        assert mlp[name][leaf] == out_axis
    assert attn["o_proj"][leaf] == in_axis
    assert mlp["down_proj"][leaf] == in_axis
    assert specs["embed_tokens"]["embedding"] == specs["lm_head"][leaf] == P()
    placed = sharding.shard_params(params, mesh((4,)))
    if not fused:
        q = placed["layers"][0]["self_attn"]["q_proj"][leaf]  # [Hq * D, E] or [E, Hq * D]
        shard = (2 * GQA.head_dim, GQA.hidden_size)
        assert {s.data.shape for s in q.addressable_shards} == {shard[::-1] if in_out else shard}
        return
    # The reference: the same seed drawn unfused (the same values, part by part).
    plain = Llama(GQA, rngs=nnx.Rngs(1), in_out=in_out, fused_projections=False).layers[0]
    d = GQA.head_dim
    for key, fused_name, parts, width in (
        ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"),
         ((GQA.num_heads // GQA.num_kv_heads) * d, d, d)),  # rows per KV head
        ("mlp", "gate_up_proj", ("gate_proj", "up_proj"), (1, 1)),  # rows per F column
    ):
        weights = [np.asarray(getattr(getattr(plain, key), name).checkpoint_weight()
                              .get_value()) for name in parts]  # [n_i, E] each
        groups = weights[0].shape[0] // width[0]
        shards = sorted(placed["layers"][0][key][fused_name][leaf].addressable_shards,
                        key=lambda s: s.index[1 if in_out else 0].start)
        assert len(shards) == 4
        for i, s in enumerate(shards):
            got = np.asarray(s.data).T if in_out else np.asarray(s.data)  # [rows, E]
            # Shard i: its quarter of the groups, each group's rows of every part in turn.
            want = np.concatenate([w[g * n:(g + 1) * n]
                                   for g in range(i * groups // 4, (i + 1) * groups // 4)
                                   for w, n in zip(weights, width, strict=True)])
            np.testing.assert_array_equal(got, want, err_msg=f"{fused_name} shard {i}")


def shard_pointers(kv):
    return [[s.data.unsafe_buffer_pointer() for s in b.addressable_shards] for b in (kv.k, kv.v)]


@pytest.mark.parametrize("hoist", [True, False])
def test_donated_cache_is_updated_in_place_on_every_shard(model, hoist):
    """Per shard: the compiled decode dispatch aliases each cache buffer to its output and
    copies no cache shard, and a call leaves every shard's buffer where it was (the hoisted
    xla path, partitioned by XLA, and the per-step path under shard_map)."""
    graphdef, params = model
    m = mesh((2,))
    steps = Steps(graphdef, mesh=m, hoist_max_bytes=(1 << 30) if hoist else 0)
    params, kv, state = steps.shard(params, init_cache(GQA, CACHE), init_state(CACHE))
    tokens = np.zeros(CACHE.max_seqs, np.int32)
    lowered = steps.decode_steps_jit.lower(
        params, kv, state, tokens, jax.random.key(0), 0.0, num_steps=STEPS, impl="xla",
        interpret=False, return_logits=False, sample=False)
    hlo = lowered.compile().as_text()
    shard = ",".join(map(str, (GQA.num_layers, GQA.num_kv_heads // 2, *kv.k.shape[2:])))
    entry = hlo[hlo.index("ENTRY"):]
    cache_params = [int(n) for n in re.findall(rf"f32\[{shard}\]\S* parameter\((\d+)\)", entry)]
    assert len(cache_params) == 2, cache_params
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {out}: (param, {}, ..) }
    aliased = {int(n) for n in re.findall(r"\}: \((\d+), \{", header)}
    assert set(cache_params) <= aliased, (cache_params, header[:300])
    copies = [line for line in hlo.splitlines() if " copy(" in line and f"[{shard}]" in line]
    assert not copies, copies[:3]

    before = shard_pointers(kv)
    _, _, out, _, status = steps.decode_steps(params, kv, state,
                                              tokens, num_steps=STEPS, impl="xla")
    assert kv.k.is_deleted() and kv.v.is_deleted()
    assert shard_pointers(out) == before


def _compiles(fn):
    """``fn()``'s exception and the jit compilations it logged."""
    with logged_compiles() as seen, pytest.raises(ValueError) as err:
        fn()
    return str(err.value), seen


@pytest.mark.parametrize("make,message", [
    (lambda: mesh((3,)), r"tp=3 must divide num_kv_heads=4"),
    (lambda: mesh((8,)), r"tp=8 must divide num_kv_heads=4"),
    (lambda: mesh((2,), ("x",)), r"unknown: \['x'\]"),
    (lambda: mesh((2, 2), ("dp", "x")), r"unknown: \['x'\]"),
    (lambda: mesh((2,), ("dp",)), r"needs a 'tp' axis"),
    (lambda: mesh((2, 2), ("dp", "tp")), r"'dp' axis must have size 1. Got dp=2"),
    (lambda: "tp", r"must be a jax.sharding.Mesh. Got str"),
])
def test_bad_meshes_raise_before_compiling(make, message):
    model = init_model(GQA, seed=1)
    err, compiled = _compiles(lambda: LLMEngine(model, mesh=make(), num_blocks=8,
                                                max_model_len=32))
    assert re.search(message, err), err
    assert not compiled, compiled


def test_steps_refuse_a_cache_tp_does_not_split_before_compiling(model):
    graphdef, params = model
    steps = Steps(graphdef, mesh=mesh((8,)))
    kv = init_cache(GQA, CACHE)
    err, compiled = _compiles(lambda: steps.decode_step(params, kv, init_state(CACHE),
                                                        np.zeros(4, np.int32)))
    assert "tp=8 must divide num_kv_heads=4" in err and not compiled
    err, _ = _compiles(lambda: sharding.shard_cache(kv, mesh((3,))))
    assert "tp=3" in err


def test_a_parameter_tp_does_not_divide_is_named():
    model = init_model(GQA.replace(intermediate_size=250), seed=1)
    err, compiled = _compiles(lambda: LLMEngine(model, mesh=mesh((4,)), num_blocks=8,
                                                max_model_len=32))
    assert "tp=4 must divide intermediate_size=250" in err and not compiled
