"""Temperature, top-k and top-p sampling (``engine/sampling.py``) against a float64 numpy
reference that walks each row's tokens in order, and through ``decode_steps`` and
``paged-jax generate``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.allocator import CacheConfig, admit, init_state
from paged_jax.cli import main
from paged_jax.engine import (
    check_sampling,
    decode_steps,
    filtered_logits,
    sample,
)
from paged_jax.kvcache import init_cache
from paged_jax.model import DEFAULT_MODEL, init_model
from tests.model_helpers import TINY, dense_logits

V = 64
# (temperature, top_k, top_p) per row: greedy, plain temperature, each filter alone, both,
# k at and above the vocabulary, k = 1 and a tiny p.
ROWS = [
    (0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5),
    (2.0, 3, 0.95), (1.0, 1, 1.0), (1.0, 0, 1e-4), (0.5, V, 1.0), (1.0, 100, 0.9),
    (0.0, 4, 0.3), (3.0, 20, 0.7),
]
TEMP = np.array([r[0] for r in ROWS], np.float32)
TOP_K = np.array([r[1] for r in ROWS], np.int32)
TOP_P = np.array([r[2] for r in ROWS], np.float32)


def reference(logits, temperature, top_k, top_p):
    """One row, in float64: (kept [V] bool, probabilities [V], margin). Greedy keeps the first
    argmax. Else top-k keeps the logits >= the k-th largest; then, walking the survivors from
    the most probable (renormalised over them), top-p takes tokens until their sum reaches
    top_p, plus every token tied with the last one taken. ``margin`` is how far the sums met
    on the walk stay from top_p: float32 can only disagree on a walk that comes closer."""
    x = np.asarray(logits, np.float64)
    if temperature == 0:
        kept = np.zeros(len(x), bool)
        kept[int(np.argmax(x))] = True
        return kept, kept.astype(np.float64), np.inf
    x = x / temperature
    kept = np.ones(len(x), bool)
    if 0 < top_k < len(x):
        kept = x >= sorted(x, reverse=True)[top_k - 1]
    margin = np.inf
    if top_p < 1:
        probs = np.where(kept, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        total, last = 0.0, None
        for i in sorted(np.flatnonzero(kept), key=lambda i: -x[i]):
            margin = min(margin, abs(total - top_p))
            if total >= top_p:
                break
            total += probs[i]
            last = x[i]
        kept &= x >= last
    probs = np.where(kept, np.exp(x - x.max()), 0.0)
    return kept, probs / probs.sum(), margin


def tied_logits(seed):
    """[len(ROWS), V] logits on a 0.25 grid: many ties, at the top-k and top-p cuts too."""
    return np.round(np.random.default_rng(seed).normal(0, 1.5, (len(ROWS), V)) * 4) / 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_logits_keep_the_reference_set_with_its_probabilities(seed):
    logits = tied_logits(seed).astype(np.float32)
    got = np.asarray(filtered_logits(jnp.asarray(logits), TEMP, TOP_K, TOP_P))
    got_probs = np.asarray(jax.nn.softmax(jnp.asarray(got), axis=-1))
    for row, (t, k, p) in enumerate(ROWS):
        kept, probs, margin = reference(logits[row], t, k, p)
        assert margin > 1e-5, "an ill-conditioned case: pick another seed"
        np.testing.assert_array_equal(np.isfinite(got[row]), kept, err_msg=str(ROWS[row]))
        np.testing.assert_allclose(got_probs[row], probs, atol=1e-6, rtol=0,
                                   err_msg=str(ROWS[row]))


def test_tokens_tied_at_a_cut_are_all_kept():
    logits = np.full((2, V), -3.0, np.float32)
    logits[:, :5] = [3.0, 2.0, 2.0, 2.0, 1.0]
    # Top-2 ends inside a three-way tie at 2.0; top-p = 0.5 is crossed by the first of them
    # (the top token holds about 0.4 of the mass).
    got = np.asarray(filtered_logits(jnp.asarray(logits), 1.0, np.array([2, 0]),
                                     np.array([1.0, 0.5])))
    for row in range(2):
        np.testing.assert_array_equal(np.flatnonzero(np.isfinite(got[row])), [0, 1, 2, 3])


def test_scalar_parameters_apply_to_every_row():
    logits = tied_logits(3).astype(np.float32)
    got = np.asarray(filtered_logits(jnp.asarray(logits), 0.8, 7, 0.6))
    for row in range(len(logits)):
        kept, _, _ = reference(logits[row], 0.8, 7, 0.6)
        np.testing.assert_array_equal(np.isfinite(got[row]), kept)


def test_samples_stay_in_the_kept_set_at_the_reference_frequencies():
    draws = 4000
    logits = tied_logits(4).astype(np.float32)
    # Every row `draws` times over, so that one call draws them all.
    tiled = np.repeat(logits, draws, axis=0)
    params = [np.repeat(a, draws) for a in (TEMP, TOP_K, TOP_P)]
    tokens = np.asarray(jax.jit(sample)(jnp.asarray(tiled), jax.random.key(7), *params))
    tokens = tokens.reshape(len(ROWS), draws)
    for row, (t, k, p) in enumerate(ROWS):
        kept, probs, _ = reference(logits[row], t, k, p)
        assert kept[tokens[row]].all(), ROWS[row]
        freq = np.bincount(tokens[row], minlength=V) / draws
        # Total variation: about 0.5 * sum(sqrt(2 p / (pi n))) <= 0.04 for 64 tokens at
        # n = 4000; a wrong filter (or none) moves whole tokens' mass.
        assert 0.5 * np.abs(freq - probs).sum() < 0.06, ROWS[row]


def test_top_k_one_and_a_tiny_top_p_are_the_argmax():
    logits = np.random.default_rng(5).normal(0, 1, (6, V)).astype(np.float32)  # no ties
    want = logits.argmax(-1)
    draw = sample
    for top_k, top_p in ((1, 1.0), (0, 1e-6), (3, 1e-6)):
        for seed in range(20):
            got = draw(jnp.asarray(logits), jax.random.key(seed), 2.0, top_k, top_p)
            np.testing.assert_array_equal(np.asarray(got), want)


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = tied_logits(6).astype(np.float32)
    greedy = TEMP == 0
    draw = jax.jit(sample)
    for seed in range(20):
        got = np.asarray(draw(jnp.asarray(logits), jax.random.key(seed), TEMP, TOP_K, TOP_P))
        np.testing.assert_array_equal(got[greedy], logits[greedy].argmax(-1))
    # A Python 0 needs no key and draws nothing.
    np.testing.assert_array_equal(np.asarray(sample(jnp.asarray(logits), None, 0.0, 5, 0.5)),
                                  logits.argmax(-1))


def test_filters_off_as_arrays_draw_what_plain_temperature_draws():
    """All-off arrays take the filtering path and keep every token: the same key gives the
    same tokens as the sort-free path, which is the categorical at that temperature."""
    logits = jnp.asarray(tied_logits(8))
    key = jax.random.key(3)
    plain = sample(logits, key, 1.5)
    np.testing.assert_array_equal(
        sample(logits, key, 1.5, jnp.zeros(len(ROWS), jnp.int32), jnp.ones(len(ROWS))), plain)
    np.testing.assert_array_equal(plain, jax.random.categorical(key, logits / 1.5))


@pytest.mark.parametrize(("args", "message"), [
    ((-0.5, 0, 1.0), "temperature must be >= 0 (0 = greedy). Got -0.5."),
    ((float("nan"), 0, 1.0), "temperature must be >= 0 (0 = greedy). Got nan."),
    ((1.0, -1, 1.0), "top_k must be an int >= 0 (0 = off). Got -1."),
    ((1.0, 2.5, 1.0), "top_k must be an int >= 0 (0 = off). Got 2.5"),
    ((1.0, True, 1.0), "top_k must be an int >= 0 (0 = off). Got True"),
    ((1.0, 0, 0.0), "top_p must be in (0, 1] (1 = off). Got 0.0."),
    ((1.0, 0, 1.5), "top_p must be in (0, 1] (1 = off). Got 1.5."),
    ((1.0, np.array([3, -2, 0]), 1.0), "top_k must be an int >= 0 (0 = off). Got -2 at row 1."),
    ((np.ones(2), 0, 1.0), "temperature must be a scalar or a [3] array (one per row). "
                           "Got shape (2,)."),
])
def test_check_sampling_names_the_bad_value(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sampling(*args, rows=3)
    check_sampling(1.0, np.array([3, 0, 1]), np.array([0.5, 1.0, 1e-3]), rows=3)


CACHE = CacheConfig(num_blocks=40, block_size=8, max_seqs=4, max_blocks_per_seq=8)


# One layer, narrow: the steps compile in a fraction of TINY's time; sampling sees only logits.
SMALL = TINY.replace(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                     intermediate_size=64)


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(init_model(SMALL, seed=3))


def _admitted():
    """Four active sequences of a few (zero) cached tokens: what the steps attend over does
    not matter here, only the logits they return."""
    state, status = admit(init_state(CACHE), jnp.arange(4), jnp.array([4, 3, 6, 2]))
    status.raise_if_failed()
    return init_cache(SMALL, CACHE), state


def test_decode_steps_emit_only_tokens_in_the_kept_set(split_model):
    graphdef, params = split_model
    # Hot enough that an unfiltered draw leaves the top few tokens of 256 most steps.
    temperature = np.array([0.0, 3.0, 3.0, 3.0], np.float32)
    top_k = np.array([0, 3, 0, 1], np.int32)
    top_p = np.array([1.0, 1.0, 0.3, 1.0], np.float32)
    kv, state = _admitted()
    toks, logits, kv, state, status = decode_steps(
        graphdef, params, kv, state, jnp.array([5, 17, 30, 2]), jax.random.key(11), temperature,
        top_k=top_k, top_p=top_p, num_steps=8, return_logits=True)
    status.raise_if_failed()
    toks, logits = np.asarray(toks), np.asarray(logits)  # [K, S], [K, S, V]
    for t in range(toks.shape[0]):
        for row in range(4):
            kept, _, _ = reference(logits[t, row], temperature[row], top_k[row], top_p[row])
            assert kept[toks[t, row]], (t, row, toks[t, row])
    np.testing.assert_array_equal(toks[:, 0], logits[:, 0].argmax(-1))  # the greedy row
    assert len(set(toks[:, 1])) > 1  # row 1 really samples (among three)


def test_decode_steps_compile_the_sort_only_with_filters_and_draw_only_when_sampling(
        split_model):
    """The fast paths are static: a Python temperature of 0 traces no random bits, and Python
    filters off (top_k=0, top_p=1.0) trace no sort, where an array of either does."""
    graphdef, params = split_model
    kv, state = init_cache(SMALL, CACHE), init_state(CACHE)
    tokens = jnp.zeros(CACHE.max_seqs, jnp.int32)

    def jaxpr(temperature, top_k, top_p):
        def run(kv, state, tokens):
            return decode_steps(graphdef, params, kv, state, tokens, jax.random.key(0),
                                temperature, top_k=top_k, top_p=top_p, num_steps=2)[0]
        return str(jax.make_jaxpr(run)(kv, state, tokens))

    def count(primitive, text):  # equations of `primitive` (the allocator sorts too)
        return len(re.findall(rf"= {primitive}\[", text))

    greedy, plain = jaxpr(0.0, 5, 0.5), jaxpr(0.8, 0, 1.0)
    assert count("random_bits", greedy) == 0 < count("random_bits", plain)
    assert count("sort", plain) == count("sort", greedy)
    assert count("sort", jaxpr(0.8, 5, 1.0)) == count("sort", plain) + 1
    assert count("sort", jaxpr(0.8, 0, jnp.ones(4))) == count("sort", plain) + 1


def test_decode_steps_refuse_bad_sampling_parameters(split_model):
    graphdef, params = split_model
    kv, state = init_cache(SMALL, CACHE), init_state(CACHE)
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1] (1 = off). Got 0.0 "
                                                   "at row 2.")):
        decode_steps(graphdef, params, kv, state, jnp.zeros(4, jnp.int32), None, 1.0,
                     top_p=np.array([1.0, 0.5, 0.0, 1.0]), num_steps=2)


def _generated(out: str) -> list[list[int]]:
    return [list(map(int, re.findall(r"\d+", line.split("->")[1])))
            for line in out.splitlines() if "->" in line]


def test_generate_samples_within_the_top_k(capsys):
    """``paged-jax generate --top-k 5 --temperature 1``: every new token, the first (from
    prefill's logits) included, is among the 5 most likely after its prefix (dense pass).
    The prompts and flags are test_generate.py's, so prefill's compilation is shared."""
    prompts = [[5, 17, 300, 2, 9, 44, 1], [100, 3], [7] * 12]
    args = ["generate", "--model", "tiny", "--max-new-tokens", "11", "--steps-per-dispatch",
            "4", "--block-size", "8", "--top-k", "5", "--temperature", "1"]
    for p in prompts:
        args += ["--prompt", " ".join(map(str, p))]
    assert main(args) == 0
    generated = _generated(capsys.readouterr().out)
    assert [len(g) for g in generated] == [11] * 3
    graphdef, params = nnx.split(init_model(DEFAULT_MODEL, seed=0))
    for prompt, got in zip(prompts, generated, strict=True):
        seq = list(prompt)
        for token in got:
            kept, _, _ = reference(dense_logits(graphdef, params, seq)[-1], 1.0, 5, 1.0)
            assert kept[token], (seq, token)
            seq.append(token)
    assert any(g != generated[0] for g in generated) or len(set(generated[0])) > 1


def test_generate_refuses_a_bad_top_p(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "tiny", "--prompt", "1 2", "--top-p", "0"])
    assert "top_p must be in (0, 1] (1 = off). Got 0.0." in capsys.readouterr().err
