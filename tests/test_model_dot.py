"""``dense_dot_general``, the model's matmul, against float64 numpy of the same rounded inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.model import init_model
from paged_jax.model.checkpoint import hf_parameter_map
from paged_jax.model.llama import (
    WEIGHT_LEFT_MAX_ROWS,
    Linear,
    Llama,
    dense_dot_general,
    fused_default,
    in_out_default,
    project,
)
from tests.model_helpers import TINY


def numbers(lhs):
    return (((lhs.ndim - 1,), (0,)), ((), ()))


def ulps_apart(got, want, dtype) -> np.ndarray:
    """How many steps of ``dtype`` separate ``got`` from ``want`` (both rounded to it)."""
    a = np.asarray(got, dtype).view(np.int16).astype(np.int32)
    b = np.asarray(want, dtype).view(np.int16).astype(np.int32)
    return np.abs(a - b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [(1,), (1, 1), (2, 3), (5,)], ids=str)
def test_16_bit_dot_is_the_rounded_exact_product(dtype, rows):
    """f32 accumulation then one rounding: within one step of the float64 product rounded to
    the dtype (a sum that lands on a rounding boundary may go either way)."""
    rng = np.random.default_rng(len(rows) + rows[-1])
    x = jnp.asarray(rng.normal(size=(*rows, 96)), dtype)
    w = jnp.asarray(rng.normal(size=(96, 40)) * 0.1, dtype)
    got = jax.jit(lambda x, w: dense_dot_general(x, w, numbers(x)))(x, w)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (*rows, 40)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert ulps_apart(got, want.astype(dtype), dtype).max() <= 1


@pytest.mark.parametrize("columns", [1, 3])
def test_weight_on_the_left_is_the_rounded_exact_product(columns):
    """``weight @ x.T`` (the tied projection's orientation), one column padded on CPU."""
    rng = np.random.default_rng(columns)
    w = jnp.asarray(rng.normal(size=(40, 96)) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(columns, 96)), jnp.bfloat16)
    got = dense_dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (40, columns)
    want = np.asarray(w, np.float64) @ np.asarray(x, np.float64).T
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def dot_lhs_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The left operand's shape of every dot_general in ``fn``'s traced program."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [tuple(e.invars[0].aval.shape) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [(1,), (2, 3), (WEIGHT_LEFT_MAX_ROWS,),
                                  (WEIGHT_LEFT_MAX_ROWS + 1,)], ids=str)
def test_projection_is_x_times_weight_transposed_either_way_round(dtype, rows):
    """``project(x, weight [out, in])`` against float64 ``x @ weight.T``; on CPU a bf16 weight
    goes on the left of the dot for up to WEIGHT_LEFT_MAX_ROWS rows, and only then."""
    rng = np.random.default_rng(sum(rows))
    x = jnp.asarray(rng.normal(size=(*rows, 96)), dtype)
    w = jnp.asarray(rng.normal(size=(40, 96)) * 0.1, dtype)
    got = jax.jit(lambda x, w: project(x, w, preferred_element_type=jnp.float32))(x, w)
    assert got.shape == (*rows, 40) and got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    left = (jax.default_backend() == "cpu" and dtype == jnp.bfloat16
            and np.prod(rows) <= WEIGHT_LEFT_MAX_ROWS)
    # (dense_dot_general pads a single bf16 row to two: the left operand is then [2, 96].)
    padded = (2, 96) if dtype == jnp.bfloat16 and np.prod(rows) == 1 else x.shape
    assert dot_lhs_shapes(project, x, w) == ([w.shape] if left else [padded])
    plain = lambda x, w: project(x, w, dot_general=jax.lax.dot_general,  # noqa: E731
                                 weight_left_rows=0)
    assert dot_lhs_shapes(plain, x, w) == [x.shape]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [(1,), (2, 3), (8,)], ids=str)
def test_projection_of_an_in_out_weight_is_x_times_weight(dtype, rows):
    """``project(x, kernel [in, out], in_out=True)`` against float64 ``x @ kernel``: one dot
    with the activations on the left, whatever the dtype and rows."""
    rng = np.random.default_rng(sum(rows))
    x = jnp.asarray(rng.normal(size=(*rows, 96)), dtype)
    kernel = jnp.asarray(rng.normal(size=(96, 40)) * 0.1, dtype)
    got = jax.jit(lambda x, k: project(x, k, preferred_element_type=jnp.float32,
                                       in_out=True))(x, kernel)
    assert got.shape == (*rows, 40) and got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    padded = (2, 96) if dtype == jnp.bfloat16 and np.prod(rows) == 1 else x.shape
    assert dot_lhs_shapes(lambda x, k: project(x, k, in_out=True), x, kernel) == [padded]


def test_in_out_is_the_default_for_f32_on_cpu_only():
    assert in_out_default(jnp.float32, "cpu")
    assert not in_out_default(jnp.bfloat16, "cpu") and not in_out_default(jnp.float16, "cpu")
    assert not in_out_default(jnp.float32, "gpu") and not in_out_default(jnp.float32, "tpu")
    assert init_model(TINY).in_out == (jax.default_backend() == "cpu")


def test_linear_holds_its_weight_either_way_and_shows_it_out_by_in():
    """An ``in_out`` ``Linear`` holds ``kernel [in, out]``; ``checkpoint_weight()`` reads and
    writes it as ``[out, in]``, and the layer computes ``x @ weight.T`` either way."""
    kw = dict(use_bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    a, b = Linear(6, 4, **kw, in_out=False), Linear(6, 4, **kw, in_out=True)
    assert a.weight.get_value().shape == (4, 6) and b.kernel.get_value().shape == (6, 4)
    assert not hasattr(a, "kernel") and not hasattr(b, "weight")
    w = np.arange(24, dtype=np.float32).reshape(4, 6) / 24  # [out, in]
    for lin in (a, b):
        lin.checkpoint_weight().set_value(w)
        lin.bias.set_value(jnp.arange(4.0))
        np.testing.assert_array_equal(np.asarray(lin.checkpoint_weight().get_value()), w)
    np.testing.assert_array_equal(np.asarray(b.kernel.get_value()), w.T)
    x = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + np.arange(4.0)
    for lin in (a, b):
        np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x)), np.float64), want,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_one_seed_one_model_in_either_layout(tied):
    """The same seed draws the same weights whichever the layout (seen through
    ``hf_parameter_map``, the checkpoints' names and shapes), and the two forward passes
    agree to f32 summation order."""
    config = TINY.replace(tie_word_embeddings=tied)
    models = [Llama(config, rngs=nnx.Rngs(3), in_out=flag) for flag in (False, True)]
    params = [hf_parameter_map(m) for m in models]
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        np.testing.assert_array_equal(np.asarray(params[0][name].get_value()),
                                      np.asarray(params[1][name].get_value()), err_msg=name)
    tokens = jnp.asarray(np.arange(12).reshape(2, 6) * 37 % 256, jnp.int32)
    out, ref = (np.asarray(m(tokens)[0], np.float64) for m in models)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_fused_projections_are_the_default_for_f32_on_cpu_only():
    assert fused_default(jnp.float32, "cpu")
    assert not fused_default(jnp.bfloat16, "cpu") and not fused_default(jnp.float32, "gpu")
    for config in (TINY, TINY.replace(dtype="bfloat16")):
        model = init_model(config)
        want = config.dtype == "float32" and jax.default_backend() == "cpu"
        assert model.fused_projections == want
        assert hasattr(model.layers[0].self_attn, "qkv_proj") == want
        assert hasattr(model.layers[0].mlp, "gate_up_proj") == want


@pytest.mark.parametrize("in_out", [False, True], ids=["weight", "kernel"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_one_seed_one_model_fused_or_not(bias, in_out):
    """The same seed draws the same weights fused or not (seen through ``hf_parameter_map``,
    the checkpoints' names and shapes; the fused ones through ``PartParam`` views), and the
    two forward passes agree to f32 summation order. Biases (Qwen2's q/k/v) are set to
    distinct values through the views first, so their split is checked too."""
    config = TINY.replace(qkv_bias=bias, mlp_bias=bias)
    models = [Llama(config, rngs=nnx.Rngs(3), in_out=in_out, fused_projections=flag)
              for flag in (False, True)]
    assert not hasattr(models[1].layers[0].self_attn, "q_proj")
    params = [hf_parameter_map(m) for m in models]
    assert params[0].keys() == params[1].keys()
    rng = np.random.default_rng(4)
    for name in params[0]:
        if name.endswith(".bias"):
            value = rng.normal(size=params[0][name].get_value().shape).astype(np.float32)
            for p in params:
                p[name].set_value(jnp.asarray(value))
        np.testing.assert_array_equal(np.asarray(params[0][name].get_value()),
                                      np.asarray(params[1][name].get_value()), err_msg=name)
    tokens = jnp.asarray(np.arange(12).reshape(2, 6) * 37 % 256, jnp.int32)
    out, ref = (np.asarray(m(tokens)[0], np.float64) for m in models)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("in_out", [False, True], ids=["weight", "kernel"])
def test_fused_linear_interleaves_its_parts_by_group(in_out):
    """A ``Linear`` of parts ``(4, 2, 2)`` in 2 groups holds its ``[out, in]`` rows as
    ``[p0 rows 0-1, p1 row 0, p2 row 0, p0 rows 2-3, p1 row 1, p2 row 1]``; ``split`` of its
    output is each part's ``x @ w_i.T + b_i`` (float64 numpy). In an abstract layer (as a
    loader finds it) a part never set reads NaN, and setting each part fills the whole."""
    kw = dict(use_bias=True, dtype=jnp.float32, groups=2, in_out=in_out)
    lin = Linear(6, (4, 2, 2), rngs=nnx.Rngs(0), **kw)
    rng = np.random.default_rng(5)
    ws = [rng.normal(size=(n, 6)).astype(np.float32) for n in (4, 2, 2)]
    bs = [rng.normal(size=n).astype(np.float32) for n in (4, 2, 2)]
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        lin.part(i).checkpoint_weight().set_value(w)
        lin.part(i).bias.set_value(b)
    want = np.concatenate([ws[0][:2], ws[1][:1], ws[2][:1], ws[0][2:], ws[1][1:], ws[2][1:]])
    np.testing.assert_array_equal(np.asarray(lin.checkpoint_weight().get_value()), want)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(lin.part(i).checkpoint_weight().get_value()), w)
    x = rng.normal(size=(3, 6)).astype(np.float32)
    for got, w, b in zip(lin.split(lin(jnp.asarray(x))), ws, bs, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64),
                                   x.astype(np.float64) @ w.T.astype(np.float64) + b,
                                   rtol=1e-6, atol=1e-6)
    abstract = nnx.eval_shape(lambda: Linear(6, (4, 2, 2), rngs=nnx.Rngs(0), **kw))
    abstract.part(1).checkpoint_weight().set_value(ws[1])
    half = np.asarray(abstract.checkpoint_weight().get_value())
    assert np.isnan(half).sum() == 6 * 6 and not np.isnan(half[[2, 6]]).any()
    for i in (0, 2):
        abstract.part(i).checkpoint_weight().set_value(ws[i])
    np.testing.assert_array_equal(np.asarray(abstract.checkpoint_weight().get_value()), want)


def test_fused_linear_and_projection_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"groups=3 must divide every part of out_features "
                                         r"\(4, 2, 2\)"):
        Linear(6, (4, 2, 2), use_bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0), groups=3)
    attn = init_model(TINY).layers[0].self_attn
    with pytest.raises(ValueError, match="Attention has no projection 'x_proj'"):
        attn.projection("x_proj")


def test_one_row_equals_that_row_of_a_two_row_product():
    """On CPU a single row goes through a two-row dot; its result is that dot's row."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(1, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 48)), jnp.bfloat16)
    one = dense_dot_general(x, w, numbers(x))
    two = dense_dot_general(jnp.concatenate([x, x]), w, numbers(x))
    np.testing.assert_array_equal(np.asarray(one[0], np.float32), np.asarray(two[0], np.float32))


def test_f32_operands_take_lax_dot_general_unchanged():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(1, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    np.testing.assert_array_equal(dense_dot_general(x, w, numbers(x)),
                                  jax.lax.dot_general(x, w, numbers(x)))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
@pytest.mark.parametrize("batch", [1, 3])
def test_logits_of_a_bf16_model_are_f32_never_rounded_to_bf16(batch, tied):
    """The output projection of bf16 weights gives f32 logits straight from its f32
    accumulator: within f32 summation error of float64 numpy, far inside bf16's steps (a
    rounding to bf16 would turn near-ties into exact ties for the argmax)."""
    model = init_model(TINY.replace(dtype="bfloat16", tie_word_embeddings=tied), seed=2)
    assert (model.lm_head is None) == tied
    h = jnp.asarray(np.random.default_rng(9).normal(size=(batch, 128)), jnp.bfloat16)
    graphdef, params = nnx.split(model)
    got = jax.jit(lambda p, h: nnx.merge(graphdef, p).logits(h))(params, h)
    assert got.dtype == jnp.float32 and got.shape == (batch, 256)
    weight = (model.embed_tokens.embedding.get_value() if tied
              else model.lm_head.weight.get_value())  # [V, E]
    want = np.asarray(h, np.float64) @ np.asarray(weight, np.float64).T
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    rounded = want.astype(jnp.bfloat16).astype(np.float64)
    assert np.abs(rounded - want).max() > 100 * np.abs(np.asarray(got) - want).max()


def test_cpu_16bit_paths_change_speed_not_values():
    """The embedding gathered as bits equals ``nnx.Embed``'s rows exactly; the whole forward
    with and without ``cpu_16bit_paths`` agrees to bf16 rounding (the dots accumulate in
    different orders), both near the same weights run in f32."""
    from paged_jax.model.llama import Llama
    from tests.model_helpers import dense_logits

    config = TINY.replace(dtype="bfloat16", tie_word_embeddings=True)
    fast = init_model(config, seed=4)
    plain = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), cpu_16bit_paths=False))
    nnx.update(plain, nnx.state(fast))
    tokens = jnp.asarray(np.arange(12).reshape(2, 6) * 37 % 256, jnp.int32)
    np.testing.assert_array_equal(np.asarray(fast.embed(tokens), np.float32),
                                  np.asarray(fast.embed_tokens(tokens), np.float32))
    # [out, in] weights and five matmuls a layer, the state's structure of the bf16 model's
    # (f32 on CPU holds them [in, out] and fused by default).
    f32 = Llama(TINY.replace(tie_word_embeddings=True), rngs=nnx.Rngs(0), in_out=False,
                fused_projections=False)
    nnx.update(f32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(fast)))
    seq = np.arange(1, 20) * 7 % 256
    ref = dense_logits(*nnx.split(f32), seq)
    for model in (fast, plain):
        got = dense_logits(*nnx.split(model), seq)
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 0.05
