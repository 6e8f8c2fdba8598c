"""paged_attention against a float64 numpy reference, the xla path, and JAX's own kernel.

Like JAX's own kernel test, the test class runs twice: `TestPagedAttention` runs the Pallas
kernel in interpret mode (CPU), and `TestPagedAttentionCompiled` runs it compiled; that one is
marked `gpu` and is skipped only when no GPU is present (`pytest -m gpu` on a GPU machine).
"""

from __future__ import annotations

import functools
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from paged_jax.kernels import paged_attention

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
TOLERANCE = {jnp.dtype(t): tol for t, tol in [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2),
                                              (jnp.float16, 1e-2)]}


# --- the independent reference and the test cases -----------------------------------------


def reference_f64(q, k_pages, v_pages, block_tables, context_lens, sm_scale):
    """Decode attention in float64 numpy, token by token through the block table."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(context_lens)):
        if n == 0:
            continue
        token = np.arange(n)
        blocks = np.asarray(block_tables)[b, token // block_size]
        k = k_pages[:, blocks, token % block_size]  # [kv_heads, n, head_dim]
        v = v_pages[:, blocks, token % block_size]
        logits = np.einsum("hgd,hnd->hgn", q[b].reshape(num_kv_heads, group, head_dim), k)
        logits = logits * sm_scale
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("hgn,hnd->hgd", p, v).reshape(num_q_heads, head_dim)
    return out


def ragged_lengths(block_size, max_blocks_per_seq):
    """0, 1, block_size - 1, block_size, block_size + 1 and the table's full capacity."""
    return [0, 1, block_size - 1, block_size, block_size + 1, max_blocks_per_seq * block_size]


def make_case(seed, *, lengths, block_size, num_kv_heads, group, head_dim, dtype,
              max_blocks_per_seq, spare_blocks=3):
    """Random q/k/v and a randomly permuted block table (padded with -1) for `lengths`."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    used = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(used) + spare_blocks
    # Block 0 is always a spare, so poisoning spares also catches a kernel that falls back
    # to reading block 0 for masked lanes.
    perm = (1 + rng.permutation(num_blocks - 1)).astype(np.int32)
    block_tables = np.full((len(lengths), max_blocks_per_seq), -1, np.int32)
    live_slots = np.zeros((num_blocks, block_size), bool)  # slots that hold a token in range
    owner = np.full(num_blocks, -1)
    start = 0
    for b, (n, count) in enumerate(zip(lengths, used, strict=True)):
        blocks = perm[start : start + count]
        start += count
        block_tables[b, :count] = blocks
        owner[blocks] = b
        for j, blk in enumerate(blocks):
            live_slots[blk, : min(block_size, n - j * block_size)] = True
    kv_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    q = rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)).astype(np.float32)
    k = rng.standard_normal(kv_shape).astype(np.float32)
    v = rng.standard_normal(kv_shape).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        block_tables=jnp.asarray(block_tables),
        context_lens=jnp.asarray(lengths),
        live_slots=live_slots,
        owner=owner,
    )


def inputs(case):
    return [case[name] for name in ("q", "k_pages", "v_pages", "block_tables", "context_lens")]


def poisoned(case, value, where):
    """`case` with `value` in k and v wherever the [num_blocks, block_size] mask `where` is set."""
    def fill(pages):
        arr = np.array(pages.astype(jnp.float32))
        arr[:, where] = value
        return jnp.asarray(arr, pages.dtype)

    return {**case, "k_pages": fill(case["k_pages"]), "v_pages": fill(case["v_pages"])}


def relative_error(out, ref):
    out = np.asarray(out, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# A covering design instead of the full product: every block size meets every GQA ratio
# (1, 4, 8), head dims and dtypes rotate through, so each value of each axis is exercised
# several times at a fraction of the interpret-mode cost.
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = (1, 4, 8)
HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float32, jnp.float16, jnp.bfloat16)
COVERING = [
    pytest.param(bs, g, HEAD_DIMS[(i + j) % 3], DTYPES[(i + 2 * j) % 5],
                 id=f"bs{bs}-g{g}-d{HEAD_DIMS[(i + j) % 3]}-{jnp.dtype(DTYPES[(i + 2 * j) % 5])}")
    for i, bs in enumerate(BLOCK_SIZES)
    for j, g in enumerate(GROUPS)
]


def standard_case(block_size, group, head_dim, dtype, seed=0):
    max_blocks = 4 if block_size >= 32 else 8
    return make_case(
        seed, lengths=ragged_lengths(block_size, max_blocks), block_size=block_size,
        num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype,
        max_blocks_per_seq=max_blocks,
    )


def check_against_reference(case, out, sm_scale=None):
    q = case["q"]
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(q.shape[-1])
    ref = reference_f64(*inputs(case), scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    empty = np.asarray(case["context_lens"]) == 0
    np.testing.assert_array_equal(out[empty], 0)
    assert relative_error(out, ref) < TOLERANCE[q.dtype]


def check_layer_of_a_stacked_cache(attend):
    """``layer=l`` over a [layers, ...] cache gives, bit for bit, what layer l's own pages
    give; the other layers hold NaN, so reading the wrong one cannot go unnoticed."""
    case = standard_case(16, 4, 64, jnp.float32, seed=9)
    want = np.asarray(attend(*inputs(case)))
    nan = jnp.full_like(case["k_pages"], jnp.nan)
    for layer in range(3):
        k, v = ([x if i == layer else nan for i in range(3)]
                for x in (case["k_pages"], case["v_pages"]))
        out = attend(case["q"], jnp.stack(k), jnp.stack(v), case["block_tables"],
                     case["context_lens"], layer=layer)
        np.testing.assert_array_equal(np.asarray(out), want)


# --- the kernel, interpret mode (CPU) and compiled (GPU) ------------------------------------


class TestPagedAttention:
    INTERPRET = True

    def pallas(self, *args, **kwargs):
        return paged_attention(*args, impl="pallas", interpret=self.INTERPRET, **kwargs)

    @pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype"), COVERING)
    def test_matches_reference(self, block_size, group, head_dim, dtype):
        case = standard_case(block_size, group, head_dim, dtype)
        check_against_reference(case, self.pallas(*inputs(case)))

    @pytest.mark.parametrize(
        "tuning",
        [
            dict(num_splits=1),
            dict(num_splits=3),
            dict(num_splits=64),  # capped at the number of KV steps
            dict(pages_per_compute_block=2, num_splits=2),
            dict(block_k=16, num_splits=5),  # a step smaller than a block
        ],
        ids=str,
    )
    def test_tuning_does_not_change_the_result(self, tuning):
        case = standard_case(32, 3, 64, jnp.float32, seed=1)  # 3 q heads per kv head: padded
        check_against_reference(case, self.pallas(*inputs(case), **tuning))

    def test_sm_scale(self):
        case = standard_case(16, 1, 64, jnp.float32, seed=2)
        check_against_reference(case, self.pallas(*inputs(case), sm_scale=0.3), 0.3)

    def test_layer_of_a_stacked_cache(self):
        check_layer_of_a_stacked_cache(self.pallas)

    @pytest.mark.parametrize("value", [np.nan, 1e30], ids=["nan", "1e30"])
    def test_unreferenced_memory_is_never_seen(self, value):
        case = standard_case(16, 4, 64, jnp.bfloat16, seed=3)
        clean = np.asarray(self.pallas(*inputs(case)).astype(jnp.float32))
        dirty = poisoned(case, value, ~case["live_slots"])
        out = np.asarray(self.pallas(*inputs(dirty)).astype(jnp.float32))
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out, clean)

    def test_requests_never_see_each_other(self):
        case = standard_case(8, 8, 128, jnp.float32, seed=4)
        victim = int(np.argmax(np.asarray(case["context_lens"])))
        clean = np.asarray(self.pallas(*inputs(case)))
        dirty = poisoned(case, np.nan, case["owner"] == victim)
        out = np.asarray(self.pallas(*inputs(dirty)))
        others = np.arange(len(out)) != victim
        np.testing.assert_array_equal(out[others], clean[others])

    def test_out_of_range_entries_are_never_dereferenced(self):
        # A -1 (or too large) entry inside a sequence's length is a hole: masked, never read.
        case = standard_case(16, 4, 64, jnp.float32, seed=5)
        tables = np.asarray(case["block_tables"]).copy()
        lengths = np.asarray(case["context_lens"])
        last = int(np.argmax(lengths))
        tables[last, 1] = -1
        tables[last, 2] = case["k_pages"].shape[1] + 7
        holed = {**case, "block_tables": jnp.asarray(tables)}
        out = np.asarray(self.pallas(*inputs(holed)))
        np.testing.assert_allclose(
            out, np.asarray(paged_attention(*inputs(holed), impl="xla")), rtol=1e-5, atol=1e-6
        )
        assert np.isfinite(out).all()

    @pytest.mark.parametrize(
        ("block_size", "num_kv_heads", "group", "dtype"),
        [(16, 2, 4, jnp.float32), (16, 1, 16, jnp.bfloat16)],
        ids=["gqa-f32", "mqa-bf16"],
    )
    def test_matches_jax_pallas_kernel(self, block_size, num_kv_heads, group, dtype):
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

        max_blocks = 8
        case = make_case(
            6, lengths=[0, 17, 128, 64], block_size=block_size, num_kv_heads=num_kv_heads,
            group=group, head_dim=128, dtype=dtype, max_blocks_per_seq=max_blocks,
        )
        # JAX's kernel has no softmax scale and reads whole compute blocks, so it gets
        # sm_scale=1 and a table without -1 entries.
        peer_tables = jnp.maximum(case["block_tables"], 0)
        peer = jax_paged.paged_attention(
            case["q"], case["k_pages"], case["v_pages"], peer_tables, case["context_lens"],
            pages_per_compute_block=2, k_splits=2, interpret=self.INTERPRET,
        )
        ours = self.pallas(*inputs(case), sm_scale=1.0)
        ref = reference_f64(*inputs(case), 1.0)
        peer, ours = (np.asarray(x.astype(jnp.float32)) for x in (peer, ours))
        tol = TOLERANCE[jnp.dtype(dtype)]
        # Compiled, JAX's kernel runs its f32 dots in TF32 (default precision); ours does not.
        peer_tol = tol if self.INTERPRET else max(tol, 1e-2)
        assert relative_error(ours, ref) < tol
        assert relative_error(peer, ref) < peer_tol
        assert relative_error(ours, peer) < peer_tol

    @hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
    @hypothesis.given(
        seed=st.integers(0, 2**16),
        block_size=st.sampled_from(BLOCK_SIZES),
        group=st.sampled_from((1, 3, 4, 8)),
        batch=st.integers(1, 5),
    )
    def test_random_shapes(self, seed, block_size, group, batch):
        rng = np.random.default_rng(seed)
        max_blocks = int(rng.integers(1, 5))
        lengths = rng.integers(0, max_blocks * block_size + 1, size=batch)
        case = make_case(
            seed, lengths=lengths, block_size=block_size, num_kv_heads=int(rng.integers(1, 3)),
            group=group, head_dim=64, dtype=jnp.float32, max_blocks_per_seq=max_blocks,
        )
        out = self.pallas(*inputs(case))
        if lengths.any():
            check_against_reference(case, out)
        else:
            np.testing.assert_array_equal(np.asarray(out), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU: the compiled Triton kernel")
class TestPagedAttentionCompiled(TestPagedAttention):
    INTERPRET = False


# --- the xla path and the public contract ---------------------------------------------------


@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype"), COVERING)
def test_xla_matches_reference(block_size, group, head_dim, dtype):
    case = standard_case(block_size, group, head_dim, dtype)
    check_against_reference(case, paged_attention(*inputs(case), impl="xla"))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pages_given_as_their_uint16_bits(impl, dtype):
    """The CPU pool keeps 16-bit pages as uint16 bits: both paths read them as q's dtype,
    matching the float64 reference and, bit for bit, the same pages given as values."""
    case = standard_case(16, 4, 64, dtype)
    bits = {**case, **{name: jax.lax.bitcast_convert_type(case[name], jnp.uint16)
                       for name in ("k_pages", "v_pages")}}
    out = paged_attention(*inputs(bits), impl=impl, interpret=True)
    check_against_reference(case, out)
    want = paged_attention(*inputs(case), impl=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
    with pytest.raises(ValueError, match="uint16 bits.*Got float32, uint16"):
        paged_attention(case["q"].astype(jnp.float32), *inputs(bits)[1:], impl=impl)


@pytest.mark.parametrize(("block_size", "head_dim"), [(3, 16), (4, 16), (1, 8), (5, 24), (16, 2)])
@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_shapes_only_the_kernel_refuses_run_on_the_xla_path(block_size, head_dim, impl):
    # head_dim and block_size outside the kernel's tiles: "xla" takes them, "auto" falls
    # back to it (on a GPU too), and "pallas" refuses them naming the value.
    case = make_case(3, lengths=ragged_lengths(block_size, 4), block_size=block_size,
                     num_kv_heads=2, group=2, head_dim=head_dim, dtype=jnp.float32,
                     max_blocks_per_seq=4)
    check_against_reference(case, paged_attention(*inputs(case), impl=impl))
    with pytest.raises(ValueError, match=r'impl="pallas" cannot run this shape: (head_dim|'
                       rf"block_size) must be one of .* Got ({head_dim}|{block_size})\."):
        paged_attention(*inputs(case), impl="pallas", interpret=True)


def test_batch_over_the_kernels_grid_runs_on_the_xla_path():
    case = make_case(4, lengths=[1, 17, 5] * 180, block_size=16, num_kv_heads=1, group=2,
                     head_dim=64, dtype=jnp.float32, max_blocks_per_seq=2)
    check_against_reference(case, paged_attention(*inputs(case), impl="auto"))
    with pytest.raises(ValueError, match="batch must be between 1 and 512. Got 540."):
        paged_attention(*inputs(case), impl="pallas", interpret=True)


@pytest.mark.parametrize("value", [np.nan, 1e30], ids=["nan", "1e30"])
def test_xla_unreferenced_memory_is_never_seen(value):
    case = standard_case(32, 8, 128, jnp.bfloat16, seed=7)
    clean = np.asarray(paged_attention(*inputs(case), impl="xla").astype(jnp.float32))
    out = paged_attention(*inputs(poisoned(case, value, ~case["live_slots"])), impl="xla")
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, clean)


def test_xla_layer_of_a_stacked_cache():
    check_layer_of_a_stacked_cache(functools.partial(paged_attention, impl="xla"))


def test_auto_picks_xla_off_gpu_and_works_under_jit():
    case = standard_case(16, 4, 64, jnp.float32, seed=8)
    out = jax.jit(functools.partial(paged_attention, impl="auto"))(*inputs(case))
    expected = paged_attention(*inputs(case), impl="pallas" if HAS_GPU else "xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _good():
    return dict(
        q=jnp.zeros((2, 12, 64), jnp.float32),
        k_pages=jnp.zeros((4, 10, 16, 64), jnp.float32),
        v_pages=jnp.zeros((4, 10, 16, 64), jnp.float32),
        block_tables=jnp.zeros((2, 3), jnp.int32),
        context_lens=jnp.zeros((2,), jnp.int32),
    )


def _with(**changes):
    return {**_good(), **changes}


BAD_INPUTS = [
    (_with(k_pages=jnp.zeros((5, 10, 16, 64)), v_pages=jnp.zeros((5, 10, 16, 64))), {},
     "Number of Q heads must be divisible by number of KV heads. Got 12 and 5."),
    (_with(v_pages=jnp.zeros((4, 10, 32, 64))), {},
     r"must have the same shape. Got \(4, 10, 16, 64\) and \(4, 10, 32, 64\)"),
    (_with(k_pages=jnp.zeros((4, 10, 24, 64)), v_pages=jnp.zeros((4, 10, 24, 64))),
     {"impl": "pallas"}, r"block_size must be one of \(8, 16, 32, 64, 128\). Got 24."),
    (_with(q=jnp.zeros((2, 12, 96)), k_pages=jnp.zeros((4, 10, 16, 96)),
           v_pages=jnp.zeros((4, 10, 16, 96))), {"impl": "pallas"},
     r"head_dim must be one of \(64, 128, 256\). Got 96."),
    (_with(q=jnp.zeros((2, 12, 128))), {}, "head_dim of q must match .* Got 128 and 64."),
    (_with(q=jnp.zeros((2, 12, 64), jnp.int32)), {}, "Got int32"),
    (_with(q=jnp.zeros((2, 12, 64), jnp.bfloat16)), {}, "Got bfloat16, float32 and float32."),
    (_with(q=jnp.zeros((513, 12, 64)), block_tables=jnp.zeros((513, 3), jnp.int32),
           context_lens=jnp.zeros((513,), jnp.int32)), {"impl": "pallas"},
     "batch must be between 1 and 512. Got 513."),
    (_with(q=jnp.zeros((0, 12, 64))), {}, "batch must be at least 1. Got 0."),
    (_with(block_tables=jnp.zeros((3, 3), jnp.int32)), {}, r"Got shape \(3, 3\)"),
    (_with(block_tables=jnp.zeros((2, 3), jnp.int64 if jax.config.x64_enabled else jnp.uint32)),
     {}, "block_tables must be int32. Got u?int"),
    (_with(context_lens=jnp.zeros((3,), jnp.int32)), {}, r"Got \(3,\)"),
    (_with(context_lens=jnp.zeros((2,), jnp.float32)), {},
     "context_lens must be int32. Got float32"),
    (_with(k_pages=jnp.zeros((2, 4, 10, 16, 64)), v_pages=jnp.zeros((2, 4, 10, 16, 64))), {},
     r"\(or, with layer=, \[num_layers, ...\] of those\). Got shape \(2, 4, 10, 16, 64\)"),
    (_good(), {"layer": 0}, r"With layer=, k_pages must be \[num_layers, .* Got shape"),
    (_with(k_pages=jnp.zeros((2, 4, 10, 16, 64)), v_pages=jnp.zeros((2, 4, 10, 16, 64))),
     {"layer": 2}, r"layer must be a Python int in \[0, 2\). Got 2."),
    (_with(k_pages=jnp.zeros((2, 4, 10, 16, 64)), v_pages=jnp.zeros((2, 4, 10, 16, 64))),
     {"layer": jnp.int32(1)}, r"layer must be a Python int in \[0, 2\). Got Array"),
    (_good(), {"impl": "cuda"}, "Got 'cuda'"),
    (_good(), {"sm_scale": -1.0}, "Got -1.0"),
    (_good(), {"num_splits": 0}, "num_splits must be a positive int. Got 0."),
    (_good(), {"block_k": 24}, "block_k must be a power of 2 in .* Got 24."),
    (_good(), {"pages_per_compute_block": 3}, "Got 3."),
    (_good(), {"block_k": 32, "pages_per_compute_block": 2}, "Got 32 and 2."),
    (_good(), {"num_warp": 4}, r"Unknown tuning options \['num_warp'\]"),
    (_with(k_pages=jnp.zeros((4, 10, 8, 64)), v_pages=jnp.zeros((4, 10, 8, 64))),
     {"pages_per_compute_block": 1}, "Got 1 \\* 8 = 8."),
]


@pytest.mark.parametrize(("args", "kwargs", "message"), BAD_INPUTS, ids=lambda x: None)
def test_bad_inputs_name_the_values(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, **kwargs)


def test_bench_smoke(capsys):
    from paged_jax.kernels import bench

    assert bench.main(["--quick", "--batch", "2", "--context", "32", "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {row[2] for row in rows if row[:2] == ["2", "32"]} == {"ours", "jax", "xla"}
