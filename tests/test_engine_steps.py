"""The jitted steps against our own dense, no-cache forward pass: ragged and packed prefill, prefix
sharing, copy-on-write after a fork, decode (xla and interpret-mode Pallas), the K-step scan;
plus the promises: one compilation, buffers donated and updated in place, all-or-nothing."""

from __future__ import annotations

import copy

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.allocator import (
    CacheConfig,
    Code,
    OutOfBlocksError,
    admit,
    allocate_blocks,
    assert_invariants,
    claim_steps,
    fork,
    init_state,
    release,
    share_prefix,
)
from paged_jax.engine import decode_step, decode_steps, pad_prompts, prefill
from paged_jax.engine.step_bodies import decode_step_body
from paged_jax.engine.steps import HOIST_MAX_BYTES, Steps, prefill_decode, prefill_packed
from paged_jax.kernels import strategies
from paged_jax.kvcache import KVCache, copy_blocks, init_cache
from paged_jax.model import init_model
from tests.allocator_helpers import assert_matches_model
from tests.model_helpers import TINY, dense_logits, run_greedy, scrambled_state
from tests.reference_allocator import ModelAllocator
from tests.test_pool_scaling import compiled_hlo, pool_sized_work

TOL = 1e-4
CACHE = CacheConfig(num_blocks=40, block_size=8, max_seqs=4, max_blocks_per_seq=8)


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(init_model(TINY, seed=3))


def prompts_of(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n) for n in lens]


def check_against_dense(graphdef, params, prompts, prefill_logits, step_logits, tokens):
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        seq = np.concatenate([prompt, tokens[i, :-1]])
        ref = dense_logits(graphdef, params, seq)
        np.testing.assert_allclose(prefill_logits[i, :n], ref[:n], atol=TOL, rtol=0)
        if step_logits is not None:
            np.testing.assert_allclose(step_logits[:, i], ref[n:], atol=TOL, rtol=0)


@pytest.mark.parametrize("impl,num_steps", [("xla", 12), ("pallas", 2)])
def test_paged_equals_dense_with_permuted_tables_and_poisoned_free_blocks(
    split_model, impl, num_steps
):
    graphdef, params = split_model
    prompts = prompts_of([5, 17, 9])
    slots = np.array([3, 0, 2], np.int32)
    state = scrambled_state(CACHE, seed=1)
    prefill_logits, step_logits, tokens = run_greedy(
        graphdef, params, TINY, CACHE, prompts, slots, num_steps, state=state, fill=np.nan,
        impl=impl, interpret=impl == "pallas",
    )
    assert np.isfinite(step_logits).all()
    check_against_dense(graphdef, params, prompts, prefill_logits, step_logits, tokens)


def test_block_tables_really_are_permuted(split_model):
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), scrambled_state(CACHE, seed=1)
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.zeros((1, 30), jnp.int32),
                                   jnp.array([0]), jnp.array([30]))
    table = np.asarray(state.block_tables[0, :4])
    assert (np.diff(table) != 1).any(), table
    assert_invariants(state)


def test_prefill_with_shared_prefix_computes_only_the_suffix(split_model):
    graphdef, params = split_model
    base = prompts_of([20], seed=4)[0]
    kv, state = init_cache(TINY, CACHE, fill=np.nan), scrambled_state(CACHE, seed=2)
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(base[None]),
                                   jnp.array([0]), jnp.array([20]))
    status.raise_if_failed()
    # Slot 1 shares 2 full blocks (16 tokens); slot 2 shares 3 blocks, the last one partly
    # filled (20 tokens), so its first write must copy that block first.
    state, st = share_prefix(state, jnp.array([0, 0]), jnp.array([1, 2]), jnp.array([2, 3]))
    st.raise_if_failed()
    shared_last = int(state.block_tables[2, 2])
    suffixes = prompts_of([6, 4], seed=5)
    logits, kv, state, status = prefill(
        graphdef, params, kv, state, jnp.asarray(pad_prompts(suffixes)), jnp.array([1, 2]),
        jnp.array([6, 4]), jnp.array([True, True]), all_logits=True,
    )
    status.raise_if_failed()
    assert_invariants(state)
    assert list(np.asarray(state.seq_lens[:3])) == [20, 22, 24]
    assert int(state.block_tables[2, 2]) != shared_last  # copied on write
    assert int(state.block_tables[0, 2]) == shared_last  # the owner keeps the original
    for i, (cached, suffix) in enumerate([(16, suffixes[0]), (20, suffixes[1])]):
        ref = dense_logits(graphdef, params, np.concatenate([base[:cached], suffix]))
        np.testing.assert_allclose(np.asarray(logits[i, : len(suffix)]), ref[cached:],
                                   atol=TOL, rtol=0)
    # The owner's blocks are intact: its next token still matches the dense pass.
    tokens = jnp.zeros(CACHE.max_seqs, jnp.int32).at[0].set(7)
    logits, kv, state, status = decode_step(graphdef, params, kv, state, tokens)
    status.raise_if_failed()
    ref = dense_logits(graphdef, params, np.concatenate([base, [7]]))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[-1], atol=TOL, rtol=0)


def test_decode_after_fork_copies_the_shared_block(split_model):
    graphdef, params = split_model
    base = prompts_of([12], seed=6)[0]
    kv, state = init_cache(TINY, CACHE, fill=np.nan), scrambled_state(CACHE, seed=3)
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(base[None]),
                                   jnp.array([1]), jnp.array([12]))
    state, st = fork(state, jnp.array([1]), jnp.array([3]))
    st.raise_if_failed()
    tokens = jnp.array([0, 11, 0, 22], jnp.int32)
    logits, kv, state, status = decode_step(graphdef, params, kv, state, tokens)
    status.raise_if_failed()
    assert_invariants(state)
    assert int(state.block_tables[1, 1]) != int(state.block_tables[3, 1])
    assert int(state.block_tables[1, 0]) == int(state.block_tables[3, 0])  # still shared
    for row, tok in [(1, 11), (3, 22)]:
        ref = dense_logits(graphdef, params, np.concatenate([base, [tok]]))
        np.testing.assert_allclose(np.asarray(logits[row]), ref[-1], atol=TOL, rtol=0)


def test_one_compilation_for_any_mix_of_sequences(split_model):
    graphdef, params = split_model
    traced = jax.jit(
        chex.assert_max_traces(decode_step_body, n=1),
        static_argnames=("graphdef", "impl", "interpret"), donate_argnames=("kv", "state"),
    )
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    tokens = jnp.zeros(CACHE.max_seqs, jnp.int32)
    for slot, n in [(0, 3), (2, 30), (3, 8), (1, 1)]:
        _, kv, state, status = prefill(graphdef, params, kv, state, jnp.zeros((1, 32), jnp.int32),
                                       jnp.array([slot]), jnp.array([n]))
        _, kv, state, status = traced(graphdef, params, kv, state, tokens, impl="xla",
                                      interpret=False)
        status.raise_if_failed()
    state, _ = release(state, jnp.array([2, 0]))
    _, kv, state, status = traced(graphdef, params, kv, state, tokens, impl="xla",
                                  interpret=False)
    status.raise_if_failed()
    assert list(np.asarray(state.seq_lens)) == [0, 3, 0, 11]


def test_steps_donate_and_update_in_place(split_model):
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    pointers = (kv.k.unsafe_buffer_pointer(), kv.v.unsafe_buffer_pointer())
    old_kv, old_state = kv, state
    _, kv, state, _ = prefill(graphdef, params, kv, state, jnp.ones((2, 5), jnp.int32),
                              jnp.array([0, 1]), jnp.array([5, 3]))
    for run in ("decode_step", "decode_steps"):
        assert old_kv.k.is_deleted() and old_kv.v.is_deleted()
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old_state))
        assert (kv.k.unsafe_buffer_pointer(), kv.v.unsafe_buffer_pointer()) == pointers
        old_kv, old_state = kv, state
        tokens = jnp.ones(CACHE.max_seqs, jnp.int32)
        if run == "decode_step":
            _, kv, state, _ = decode_step(graphdef, params, kv, state, tokens)
        else:
            _, _, kv, state, _ = decode_steps(graphdef, params, kv, state, tokens, num_steps=3)
    assert old_kv.k.is_deleted() and (kv.k.unsafe_buffer_pointer(), kv.v.unsafe_buffer_pointer())\
        == pointers


def snapshot(tree):
    return jax.tree.map(np.array, tree)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_out_of_blocks_changes_nothing(split_model):
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    _, kv, state, _ = prefill(graphdef, params, kv, state, jnp.ones((2, 8), jnp.int32),
                              jnp.array([0, 1]), jnp.array([8, 5]))
    state, _, st = allocate_blocks(state, int(state.num_free))  # drain the pool
    st.raise_if_failed()
    before_kv, before_state = snapshot(kv), snapshot(state)
    # Slot 0 needs a new block for its 9th token: the whole step is refused.
    _, kv, state, status = decode_step(graphdef, params, kv, state, jnp.ones(4, jnp.int32))
    assert not bool(status.applied)
    assert int(status.code[0]) == Code.OUT_OF_BLOCKS and int(status.code[1]) == Code.NOT_APPLIED
    assert_same((kv, state), (before_kv, before_state))
    # A prefill that cannot be served leaves everything as it was, too.
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.ones((1, 8), jnp.int32),
                                   jnp.array([2]), jnp.array([8]))
    assert not bool(status.applied)
    assert_same((kv, state), (before_kv, before_state))
    # The K-step form stops at the failing step: no tokens from there on.
    toks, _, kv, state, status = decode_steps(graphdef, params, kv, state,
                                              jnp.ones(4, jnp.int32), num_steps=2)
    assert (np.asarray(toks) == -1).all() and not bool(status.applied)
    assert_same((kv, state), (before_kv, before_state))
    # A loop that feeds those -1s back unread gets a refusal, not a step over token -1.
    toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, toks[-1], num_steps=2)
    assert list(np.asarray(status.code)) == [Code.BAD_TOKEN, Code.BAD_TOKEN, Code.NOT_APPLIED,
                                             Code.NOT_APPLIED]
    assert (np.asarray(toks) == -1).all()
    assert_same((kv, state), (before_kv, before_state))


@pytest.mark.parametrize("bad_token", [-1, TINY.vocab_size])
def test_tokens_outside_the_vocabulary_are_refused_inside_jit(split_model, bad_token):
    """Inside jit a token id outside the vocabulary would silently embed some other row (-1
    wraps to the last); the steps refuse the whole call through the status instead."""
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    tokens = pad_prompts([[1, 2, 3], [4, 5]], width=4)
    tokens[1, 1] = bad_token
    before = snapshot((kv, state))
    _, kv, state, status = prefill(graphdef, params, kv, state, tokens, jnp.array([0, 1]),
                                   jnp.array([3, 2]))
    assert list(np.asarray(status.code)) == [Code.NOT_APPLIED, Code.BAD_TOKEN]
    assert_same((kv, state), before)
    with pytest.raises(ValueError, match=r"prefill failed, state unchanged: seq 1 \(entry 1\) "
                       rf"feeds token id {bad_token} at position 1; expected 0 <= token < "
                       rf"{TINY.vocab_size} \(vocab_size\)"):
        status.raise_if_failed()
    # Only a row's first num_tokens are read: padding past them may hold anything.
    tokens[1, 1], tokens[1, 2:] = 5, bad_token
    _, kv, state, status = prefill(graphdef, params, kv, state, tokens, jnp.array([0, 1]),
                                   jnp.array([3, 2]))
    status.raise_if_failed()

    # Slots 0 and 1 are active; 2 and 3 are not, and what they are fed is never read.
    for run in ("decode_step", "decode_steps"):
        before = snapshot((kv, state))
        feed = np.array([7, bad_token, bad_token, 9], np.int32)
        if run == "decode_step":
            _, kv, state, status = decode_step(graphdef, params, kv, state, feed)
        else:
            toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, feed,
                                                      num_steps=3)
            assert (np.asarray(toks) == -1).all()
        assert list(np.asarray(status.code)) == [Code.NOT_APPLIED, Code.BAD_TOKEN,
                                                 Code.NOT_APPLIED, Code.NOT_APPLIED]
        assert_same((kv, state), before)
        # The id, and the position it would have been written at: slot 1's length.
        position = 2 if run == "decode_step" else 3
        assert int(state.seq_lens[1]) == position
        with pytest.raises(ValueError, match=rf"{run} failed, state unchanged: seq 1 \(entry 1\)"
                           rf" feeds token id {bad_token} at position {position}; expected"):
            status.raise_if_failed()
        feed[1] = TINY.vocab_size - 1  # the inactive rows keep their bad ids
        if run == "decode_step":
            _, kv, state, status = decode_step(graphdef, params, kv, state, feed)
        else:
            _, _, kv, state, status = decode_steps(graphdef, params, kv, state, feed,
                                                   num_steps=3)
        status.raise_if_failed()


@pytest.mark.parametrize("num_steps", [1, 3, 8])
def test_step_bookkeeping_matches_the_model_allocator(num_steps):
    """The allocator half of ``decode_step`` (``num_steps == 1``) and ``decode_steps``: its
    fast path (no new block, no shared write) and its slow path (new blocks, copy-on-write
    after a fork, out of blocks, a table's end) against the model allocator, which runs the
    same requests as ``num_steps`` appends and then a copy-on-write of each first write."""
    cfg = CacheConfig(num_blocks=20, block_size=4, max_seqs=4, max_blocks_per_seq=6)
    claim = jax.jit(claim_steps, static_argnums=2)
    rng = np.random.default_rng(num_steps)
    model = ModelAllocator(cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq)
    state = init_state(cfg)
    labels = np.arange(cfg.num_blocks, dtype=np.float32)  # block b holds the value labels[b]
    kv = KVCache(*(jnp.broadcast_to(jnp.asarray(labels)[None, None, :, None, None],
                                    (1, 1, cfg.num_blocks, cfg.block_size, 1)),) * 2)
    seen = {"fast": 0, "slow": 0, "cow": 0, "refused": 0}
    for _ in range(150):
        free_slots = [s for s in range(cfg.max_seqs) if s not in model.tables]
        live = sorted(model.tables)
        op = rng.choice(["admit", "fork", "release"] + ["step"] * 4)
        if op == "admit" and free_slots:
            slot, n = int(rng.choice(free_slots)), int(rng.integers(1, 10))
            state, st = admit(state, jnp.array([slot]), jnp.array([n]))
            assert np.asarray(st.code).tolist() == model.admit([slot], [n])
        elif op == "fork" and free_slots and live:
            parent, child = int(rng.choice(live)), int(rng.choice(free_slots))
            state, st = fork(state, jnp.array([parent]), jnp.array([child]))
            assert np.asarray(st.code).tolist() == model.share([parent], [child])
        elif op == "release" and live:
            slot = int(rng.choice(live))
            state, st = release(state, jnp.array([slot]))
            assert np.asarray(st.code).tolist() == model.release([slot])
        elif op == "step":
            before = copy.deepcopy(model)
            old_lens = [model.lens[s] for s in live]
            ok = all(c == 0 for _ in range(num_steps) for c in model.append(live, [1] * len(live)))
            src = dst = []
            if ok:
                codes, src, dst = model.copy_on_write(live, old_lens)
                ok = all(c == 0 for c in codes)
            if not ok:
                model = before
            grew = ok and (len(before.free) != len(model.free) or any(s >= 0 for s in src))
            seen["refused" if not ok else "slow" if grew else "fast"] += 1
            state, (src_ids, dst_ids), status = claim(state, state.active, num_steps)
            kv = copy_blocks(kv, src_ids, dst_ids)
            assert bool(status.applied) == ok
            for s, d in zip(src, dst, strict=True):
                if s >= 0:
                    labels[d] = labels[s]
                    seen["cow"] += 1
            np.testing.assert_array_equal(np.asarray(kv.k)[0, 0, :, :, 0],
                                          np.repeat(labels[:, None], cfg.block_size, 1))
        assert_matches_model(state, model)
    assert min(seen.values()) > 0, seen


def test_decode_steps_greedy_equals_single_steps_and_sampling_is_keyed(split_model):
    graphdef, params = split_model
    prompts = prompts_of([4, 11], seed=8)
    slots = np.array([1, 2], np.int32)
    _, _, want = run_greedy(graphdef, params, TINY, CACHE, prompts, slots, 6)

    def run(temperature, key, params=params):
        kv, state = init_cache(TINY, CACHE), init_state(CACHE)
        logits, kv, state, _ = prefill(graphdef, params, kv, state,
                                       jnp.asarray(pad_prompts(prompts)), jnp.asarray(slots),
                                       jnp.array([4, 11]))
        first = jnp.zeros(4, jnp.int32).at[slots].set(jnp.argmax(logits, -1).astype(jnp.int32))
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, first,
                                                  jax.random.key(key), temperature, num_steps=6)
        status.raise_if_failed()
        assert list(np.asarray(state.seq_lens[slots])) == [4 + 6, 11 + 6]
        return np.asarray(toks)

    greedy = run(0.0, 0)
    np.testing.assert_array_equal(greedy[:, slots].T, want[:, 1:])
    # The steps take the parameters as the nnx.State or as its plain dict (cheaper per call).
    np.testing.assert_array_equal(run(0.0, 0, nnx.to_pure_dict(params)), greedy)
    assert (greedy[:, [0, 3]] == -1).all()
    hot_a, hot_b, hot_c = run(5.0, 1), run(5.0, 1), run(5.0, 2)
    np.testing.assert_array_equal(hot_a, hot_b)
    assert (hot_a != hot_c).any()
    assert ((hot_a[:, slots] >= 0) & (hot_a[:, slots] < TINY.vocab_size)).all()


def prefill_rows(graphdef, params, prompts, slots, cache=CACHE):
    """A fresh pool with ``prompts`` prefilled into ``slots``; returns (kv, state, first
    tokens [max_seqs], the slots' first greedy tokens)."""
    kv, state = init_cache(TINY, cache), init_state(cache)
    logits, kv, state, status = prefill(graphdef, params, kv, state,
                                        jnp.asarray(pad_prompts(prompts)), jnp.asarray(slots),
                                        jnp.array([len(p) for p in prompts]))
    status.raise_if_failed()
    first = jnp.zeros(cache.max_seqs, jnp.int32).at[slots].set(
        jnp.argmax(logits, -1).astype(jnp.int32))
    return kv, state, first


def test_steps_object_equals_the_module_functions(split_model):
    """``Steps(graphdef)``'s methods are the module functions with the graph bound: the same
    tokens, logits and state for prefill and decode_steps (greedy; sampled with no key, which
    draws with ``jax.random.key(0)`` in both). Both wrap the same step bodies, which every
    other test here runs through the module functions. A bad ``hoist_max_bytes`` is refused
    at construction."""
    graphdef, params = split_model
    runner = Steps(graphdef)
    prompts, slots = prompts_of([4, 9], seed=21), np.array([0, 2], np.int32)
    width = jnp.asarray(pad_prompts(prompts))

    def run(prefill_fn, steps_fn):
        kv, state = init_cache(TINY, CACHE), init_state(CACHE)
        logits, kv, state, status = prefill_fn(params, kv, state, width, jnp.asarray(slots),
                                               jnp.array([4, 9]))
        status.raise_if_failed()
        first = jnp.zeros(4, jnp.int32).at[slots].set(jnp.argmax(logits, -1).astype(jnp.int32))
        out = [np.asarray(logits)]
        for kwargs in (dict(), dict(temperature=3.0)):
            toks, lg, kv, state, status = steps_fn(params, kv, state, first, num_steps=3,
                                                   return_logits=True, **kwargs)
            status.raise_if_failed()
            out += [np.asarray(toks), np.asarray(lg)]
        return out + [np.asarray(state.seq_lens), np.asarray(state.block_tables)]

    def bind(f):
        return lambda *a, **k: f(graphdef, *a, **k)

    got = run(runner.prefill, runner.decode_steps)
    want = run(bind(prefill), bind(decode_steps))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    # The keyless draw is key(0)'s: the second and third dispatches start from different
    # states, so compare a keyless and a key(0) dispatch from one state.
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    _, kv, state, _ = runner.prefill(params, kv, state, width, jnp.asarray(slots),
                                     jnp.array([4, 9]))
    first = jnp.ones(4, jnp.int32)
    copy = jax.tree.map(jnp.copy, (kv, state))
    keyless = runner.decode_steps(params, kv, state, first, None, 3.0, num_steps=4)[0]
    keyed = decode_steps(graphdef, params, *copy, first, jax.random.key(0), 3.0, num_steps=4)[0]
    np.testing.assert_array_equal(np.asarray(keyless), np.asarray(keyed))
    with pytest.raises(ValueError, match=r"hoist_max_bytes must be an int >= 0\. Got -1\."):
        Steps(graphdef, hoist_max_bytes=-1)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError,
                           match=rf"context_bucket_tokens must be an int >= 0\. Got {bad!r}\."):
            Steps(graphdef, context_bucket_tokens=bad)


@pytest.mark.parametrize("num_steps", [1, 9])
def test_rows_stop_inside_the_dispatch_at_their_budget_or_stop_id(split_model, num_steps):
    """Per-row budgets and stop ids against the unrestricted run: each row emits the same
    tokens up to its end (its budget, or the first stop id, which is emitted) and -1 after;
    its length and blocks grow by its budget only (the model allocator's appends)."""
    graphdef, params = split_model
    prompts = prompts_of([4, 11, 7], seed=8)
    slots = np.array([1, 2, 0], np.int32)
    kv, state, first = prefill_rows(graphdef, params, prompts, slots)
    free = int(state.num_free)
    full, _, _, _, status = decode_steps(graphdef, params, kv, state, first, num_steps=num_steps)
    status.raise_if_failed()
    full = np.asarray(full)
    budgets = np.zeros(CACHE.max_seqs, np.int32)
    budgets[slots] = [num_steps, max(num_steps - 3, 0), min(2, num_steps)]
    stop = np.full((CACHE.max_seqs, 2), -1, np.int32)
    stop_at = min(1, num_steps - 1)  # row in slot 1 stops on the id it emits at this step
    stop[1, 1] = full[stop_at, 1]
    kv, state, first = prefill_rows(graphdef, params, prompts, slots)
    toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, first,
                                              num_steps=num_steps, budgets=jnp.asarray(budgets),
                                              stop_ids=jnp.asarray(stop))
    status.raise_if_failed()
    toks = np.asarray(toks)
    first_stop = int(np.flatnonzero(full[:, 1] == stop[1, 1])[0])
    ends = {1: first_stop + 1, 2: budgets[2], 0: budgets[0], 3: 0}
    model = ModelAllocator(CACHE.num_blocks, CACHE.block_size, CACHE.max_seqs,
                           CACHE.max_blocks_per_seq)
    model.admit(list(slots), [len(p) for p in prompts])
    for t in range(num_steps):
        model.append([int(s) if budgets[s] > t else -1 for s in slots], [1] * len(slots))
    for row, end in ends.items():
        np.testing.assert_array_equal(toks[:end, row], full[:end, row])
        assert (toks[end:, row] == -1).all(), (row, toks[:, row])
    lens = np.asarray(state.seq_lens)
    for s, p in zip(slots, prompts, strict=True):
        assert lens[s] == len(p) + budgets[s]
    assert int(state.num_free) == free - sum(
        -(-(len(p) + budgets[s]) // CACHE.block_size) - -(-len(p) // CACHE.block_size)
        for s, p in zip(slots, prompts, strict=True))
    assert_matches_model(state, model)


def test_seeded_rows_draw_by_seed_and_position_not_by_row(split_model):
    """With per-row seeds, a row's sampled tokens depend on its seed and context only: the
    same prompt and seed in two slots, beside different neighbours, give the same tokens; a
    different seed gives others."""
    graphdef, params = split_model
    a, b = prompts_of([6, 9], seed=2)

    def run(prompts, slots, seeds):
        kv, state, first = prefill_rows(graphdef, params, prompts, np.array(slots, np.int32))
        row_seeds = np.zeros(CACHE.max_seqs, np.int32)
        row_seeds[slots] = seeds
        toks, _, _, _, status = decode_steps(graphdef, params, kv, state, first, None, 3.0,
                                             num_steps=6, seeds=jnp.asarray(row_seeds))
        status.raise_if_failed()
        return np.asarray(toks)

    one = run([a, b], [0, 3], [7, 1])
    two = run([b, a, a], [1, 2, 0], [5, 7, 8])
    np.testing.assert_array_equal(one[:, 0], two[:, 2])
    assert (one[:, 0] != two[:, 0]).any()


def test_row_controls_are_checked_before_tracing(split_model):
    graphdef, params = split_model
    kv, state, first = prefill_rows(graphdef, params, prompts_of([3]), np.array([0], np.int32))
    bad = [
        (dict(budgets=np.zeros(3, np.int32)), "budgets must be a [4] int array"),
        (dict(budgets=np.array([1, 0, 0, 9], np.int32)), "budgets must be in 0..num_steps (4). "
                                                         "Got 9 at row 3"),
        (dict(stop_ids=np.zeros(4, np.int32)), "stop_ids must be a [4, M] int array"),
        (dict(seeds=np.zeros(4, np.float32)), "seeds must be a [4] int array"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace(".", r"\.")):
            decode_steps(graphdef, params, kv, state, first, num_steps=4, **kwargs)
    assert int(state.seq_lens[0]) == 3  # nothing was donated or changed


@pytest.mark.parametrize("hoist", [True, False])
def test_decode_steps_equal_single_steps_through_forks_and_poison(split_model, monkeypatch,
                                                                  hoist):
    """K steps in one dispatch against K ``decode_step`` calls, with permuted tables, NaN in
    every unwritten slot and a forked row whose first write lands in a shared, partly filled
    block (copy-on-write inside the dispatch): the same tokens and state, logits within float
    noise, and the same cache contents; and logits equal to the dense, no-cache pass. Both
    forms of the xla path: the context gathered once per dispatch, and per step (forced by a
    zero ``hoist_max_bytes``)."""
    graphdef, params = split_model
    # A Steps of its own traces afresh, so the spy sees which form this trace takes.
    runner = Steps(graphdef, hoist_max_bytes=HOIST_MAX_BYTES if hoist else 0)
    taken = []
    real = strategies.hoisted
    monkeypatch.setattr(strategies, "hoisted", lambda *a: taken.append(1) or real(*a))

    prompts = prompts_of([5, 11], seed=12)
    kv, state = init_cache(TINY, CACHE, fill=np.nan), scrambled_state(CACHE, seed=5)
    logits, kv, state, status = prefill(graphdef, params, kv, state,
                                        jnp.asarray(pad_prompts(prompts)), jnp.array([0, 1]),
                                        jnp.array([5, 11]))
    status.raise_if_failed()
    state, status = fork(state, jnp.array([1]), jnp.array([3]))  # shares 11 tokens: 8 + 3
    status.raise_if_failed()
    first = np.argmax(np.asarray(logits), -1).astype(np.int32)
    tokens = np.array([first[0], first[1], 0, (first[1] + 1) % TINY.vocab_size], np.int32)
    rows, num_steps = [0, 1, 3], 5

    ref_kv, ref_state = jax.tree.map(jnp.copy, (kv, state))
    ref_tokens, ref_logits, feed = [], [], jnp.asarray(tokens)
    for _ in range(num_steps):
        step_logits, ref_kv, ref_state, status = decode_step(graphdef, params, ref_kv, ref_state,
                                                             feed)
        status.raise_if_failed()
        feed = jnp.argmax(step_logits, -1).astype(jnp.int32)
        ref_logits.append(np.asarray(step_logits)[rows])
        ref_tokens.append(np.asarray(feed)[rows])

    toks, got_logits, kv, state, status = runner.decode_steps(
        params, kv, state, jnp.asarray(tokens), num_steps=num_steps, return_logits=True,
    )
    status.raise_if_failed()
    assert len(taken) == int(hoist)
    np.testing.assert_array_equal(np.asarray(toks)[:, rows], np.stack(ref_tokens))
    assert (np.asarray(toks)[:, 2] == -1).all()
    np.testing.assert_allclose(np.asarray(got_logits)[:, rows], np.stack(ref_logits),
                               atol=1e-5, rtol=0)
    # And against the dense, no-cache pass over each row's whole sequence (row 3 is row 1's
    # prompt with its own continuation).
    emitted = np.asarray(toks)
    for row, prompt in ((0, prompts[0]), (1, prompts[1]), (3, prompts[1])):
        seq = np.concatenate([prompt, [tokens[row]], emitted[:-1, row]])
        want = dense_logits(graphdef, params, seq)[len(prompt):]
        np.testing.assert_allclose(np.asarray(got_logits)[:, row], want, atol=TOL, rtol=0)
    # The dispatch claims all its blocks before the copy-on-write, single steps claim them
    # step by step: the same tables up to the names of the blocks, and the same contents.
    got_tables, want_tables = np.asarray(state.block_tables), np.asarray(ref_state.block_tables)
    rename = {}
    for g, w in zip(got_tables.ravel(), want_tables.ravel(), strict=True):
        assert (g < 0) == (w < 0) and rename.setdefault(g, w) == w
    assert len(set(rename.values())) == len(rename)  # a bijection
    np.testing.assert_array_equal(np.asarray(state.seq_lens), np.asarray(ref_state.seq_lens))
    assert int(state.num_free) == int(ref_state.num_free)
    refs, want_refs = np.asarray(state.ref_counts), np.asarray(ref_state.ref_counts)
    assert all(refs[g] == want_refs[w] for g, w in rename.items() if g >= 0)
    for row in rows:
        n = int(state.seq_lens[row])
        for got, want in ((kv.k, ref_kv.k), (kv.v, ref_kv.v)):
            got_row, want_row = (  # [layers, heads, blocks, block_size, D] -> first n tokens
                np.asarray(x)[:, :, t[row, : -(-n // CACHE.block_size)]]
                .reshape(TINY.num_layers, TINY.num_kv_heads, -1, TINY.head_dim)[:, :, :n]
                for x, t in ((got, got_tables), (want, want_tables))
            )
            assert np.isfinite(got_row).all()
            np.testing.assert_allclose(got_row, want_row, atol=1e-5, rtol=0)


def test_bench_baseline_is_the_same_model_and_main_runs(split_model, capsys):
    from paged_jax.engine import bench

    graphdef, params = split_model
    cache = CacheConfig(num_blocks=8, block_size=8, max_seqs=2, max_blocks_per_seq=4)
    state, st = jax.jit(lambda s: admit(s, jnp.arange(2), 0))(init_state(cache))
    first = jnp.array([5, 9], jnp.int32)
    paged, _, _, _, status = decode_steps(graphdef, params, init_cache(TINY, cache), state,
                                          first, num_steps=8)
    status.raise_if_failed()
    shape = (TINY.num_layers, 2, TINY.num_kv_heads, 32, TINY.head_dim)
    dense = (jnp.zeros(shape), jnp.zeros(shape))
    contiguous, _, lens = bench.contiguous_jit(graphdef)(params, dense, jnp.zeros(2, jnp.int32),
                                                         first, num_steps=8)
    np.testing.assert_array_equal(np.asarray(contiguous), np.asarray(paged))
    assert list(np.asarray(lens)) == [8, 8]

    assert bench.main(["--batch", "1", "--context", "8", "--tokens", "8", "--rounds", "1",
                       "--layers", "1", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "paged K=1" in out and "geometric mean: K=8 / K=1" in out


# Every form with two KV heads; with one (the size-1 dimension), the single step and the
# batched K-step loop.
@pytest.mark.parametrize("kv_heads,max_seqs,form,dtype", [
    (2, 1, "step", "float32"), (2, 1, "scan", "float32"), (2, 4, "scan", "float32"),
    (2, 4, "scan per step", "float32"), (1, 1, "step", "float32"), (1, 4, "scan", "float32"),
    (2, 4, "step", "bfloat16"), (2, 4, "scan", "bfloat16")])
def test_compiled_steps_never_copy_the_kv_buffers(kv_heads, max_seqs, form, dtype):
    """In place beyond pointer identity: the optimised HLO has no copy of a whole K/V buffer
    (nor of its per-layer flat view), in the single step or inside the K-step loop (context
    gathered once per dispatch, or per step). With one KV head (MQA) the buffer has a size-1
    axis, which XLA once laid out differently inside the loop, copying the cache every step.
    A bf16 pool (kept as its bits on CPU) is neither copied nor converted to f32 and back, as
    XLA:CPU does to every bf16 scatter."""
    config = TINY.replace(num_kv_heads=kv_heads, dtype=dtype)
    graphdef, params = nnx.split(init_model(config, seed=3))
    runner = Steps(graphdef, hoist_max_bytes=0 if form == "scan per step" else HOIST_MAX_BYTES)
    cache = CacheConfig(num_blocks=8 * max_seqs, block_size=8, max_seqs=max_seqs,
                        max_blocks_per_seq=8)
    kv, state = init_cache(config, cache), init_state(cache)
    tokens = jnp.zeros(max_seqs, jnp.int32)
    if form == "step":
        lowered = runner.decode_step_jit.lower(params, kv, state, tokens, impl="xla",
                                               interpret=False)
    else:
        lowered = runner.decode_steps_jit.lower(
            params, kv, state, tokens, jax.random.key(0), 0.0, num_steps=4,
            impl="xla", interpret=False, return_logits=False, sample=False,
        )
    hlo = compiled_hlo(lowered)
    full = ",".join(map(str, kv.k.shape))
    flat = f"{config.num_layers},{kv_heads},{cache.num_blocks * cache.block_size},"
    copies = [line.strip() for line in hlo.splitlines()
              if (" copy(" in line or " convert(" in line)
              and (f"[{full}]" in line or f"[{flat}" in line)]
    if dtype != "float32":  # any whole-buffer f32 value: the scatter's round trip
        copies += [line.strip() for line in hlo.splitlines() if f"= f32[{full}]" in line]
    assert not copies, copies[:3]


def test_bfloat16_model_runs_paged_like_its_dense_pass():
    model = init_model(TINY.replace(dtype="bfloat16"), seed=5)
    graphdef, params = nnx.split(model)
    prompts = prompts_of([6, 10], seed=9)
    prefill_logits, step_logits, tokens = run_greedy(
        graphdef, params, model.config, CACHE, prompts, np.array([0, 1]), 3, fill=np.nan
    )
    assert init_cache(model.config, CACHE).value_dtype == jnp.bfloat16
    for i, prompt in enumerate(prompts):
        ref = dense_logits(graphdef, params, np.concatenate([prompt, tokens[i, :-1]]))
        got = np.concatenate([prefill_logits[i, : len(prompt)], step_logits[:, i]])
        scale = np.abs(ref).max()
        # bf16 rounding differs between the paths; a wrong cache would be off by O(scale).
        np.testing.assert_allclose(got, ref, atol=0.05 * scale, rtol=0)


def test_bad_inputs_are_refused(split_model):
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    with pytest.raises(ValueError, match=r"\[max_seqs\] = \[4\]"):
        decode_step(graphdef, params, kv, state, jnp.zeros(3, jnp.int32))
    # After a call that passed, bad shapes and dtypes are still refused.
    _, kv, state, _ = decode_step(graphdef, params, kv, state, np.zeros(4, np.int32))
    for bad in (np.zeros(4, np.float32), np.zeros(3, np.int32), [0.5] * 4):
        with pytest.raises(ValueError, match=r"\[max_seqs\] = \[4\] int array"):
            decode_step(graphdef, params, kv, state, bad)
        with pytest.raises(ValueError, match=r"\[max_seqs\] = \[4\] int array"):
            decode_steps(graphdef, params, kv, state, bad, num_steps=2)
    with pytest.raises(ValueError, match="num_tokens must be a \\[batch\\]"):
        prefill(graphdef, params, kv, state, jnp.zeros((2, 4), jnp.int32), jnp.array([0, 1]),
                jnp.array([4]))
    with pytest.raises(ValueError, match=r"extend must be a \[batch\] bool array .* Got int32"):
        prefill(graphdef, params, kv, state, jnp.zeros((2, 4), jnp.int32), jnp.array([0, 1]),
                jnp.array([4, 4]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"The KV cache .* must hold the BlockState's 40 blocks "
                       r"of 8 tokens"):
        other = init_cache(TINY, CacheConfig(num_blocks=40, block_size=4, max_seqs=4,
                                             max_blocks_per_seq=8))
        decode_step(graphdef, params, other, state, np.zeros(4, np.int32))


def test_prefill_refusals_name_their_values(split_model):
    """Each refusal says which row and which numbers, and changes nothing."""
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)  # tables hold 8 * 8 = 64 tokens
    cases = [
        # More new tokens than the row holds, and none at all.
        ((2, 4), [0, 1], [4, 5], None, [Code.NOT_APPLIED, Code.BAD_NUM_TOKENS],
         r"seq 1 \(entry 1\) brings 5 new tokens; expected 1 to 4, the width of its tokens row"),
        ((2, 4), [0, 1], [0, 4], None, [Code.BAD_NUM_TOKENS, Code.NOT_APPLIED],
         r"seq 0 \(entry 0\) brings 0 new tokens; expected 1 to 4"),
        # A prompt longer than the table: the length and the table's capacity.
        ((1, 65), [2], [65], None, [Code.BAD_LENGTH],
         r"seq 2 \(entry 0\) would hold 65 tokens; expected 0 to 64, what its table holds "
         r"\(max_blocks_per_seq \* block_size\)"),
        # Extending a slot that holds nothing.
        ((1, 4), [3], [4], [True], [Code.SEQ_INACTIVE], r"seq 3 \(entry 0\) is not active"),
    ]
    for shape, ids, n, extend, codes, message in cases:
        before = snapshot((kv, state))
        _, kv, state, status = prefill(graphdef, params, kv, state, jnp.ones(shape, jnp.int32),
                                       jnp.array(ids), jnp.array(n),
                                       None if extend is None else jnp.array(extend))
        assert list(np.asarray(status.code)) == codes, message
        assert_same((kv, state), before)
        with pytest.raises(ValueError, match="prefill failed, state unchanged: " + message):
            status.raise_if_failed()


def test_prefill_into_an_occupied_slot_is_refused_unless_extending(split_model):
    """A plain prefill into an active slot would glue a second prompt onto the first; it is
    refused, and ``extend`` continues the sequence, equal to one prefill of both parts."""
    graphdef, params = split_model
    first, second = prompts_of([11, 6], seed=9)
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(first[None]),
                                   jnp.array([1]), jnp.array([11]))
    status.raise_if_failed()
    before = snapshot((kv, state))
    _, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(second[None]),
                                   jnp.array([1]), jnp.array([6]))
    assert list(np.asarray(status.code)) == [Code.SEQ_ACTIVE]
    assert_same((kv, state), before)
    with pytest.raises(ValueError, match=r"seq 1 \(entry 0\) is already active; expected a "
                       r"free \(inactive\) slot \(mark the row in extend to continue"):
        status.raise_if_failed()
    logits, kv, state, status = prefill(graphdef, params, kv, state, jnp.asarray(second[None]),
                                        jnp.array([1]), jnp.array([6]), jnp.array([True]),
                                        all_logits=True)
    status.raise_if_failed()
    assert int(state.seq_lens[1]) == 17
    ref = dense_logits(graphdef, params, np.concatenate([first, second]))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[11:], atol=TOL, rtol=0)


def test_steps_hash_the_graphdef_once_not_per_call(split_model, monkeypatch):
    """jit hashes static arguments on every call, and hashing a GraphDef walks the whole graph
    (more than a small model's decode step): a ``Steps`` closes over its graph, so no call
    after the first (which traces) hashes it. The module functions, which take the graph as
    a static argument, hash it per call: the count they add shows the counter works."""
    graphdef, params = split_model
    calls = []
    original = type(graphdef).__hash__

    def counting_hash(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(type(graphdef), "__hash__", counting_hash)
    runner = Steps(graphdef)
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    tokens = jnp.zeros(CACHE.max_seqs, jnp.int32)

    def five_calls(kv, state):
        _, kv, state, status = runner.prefill(params, kv, state, jnp.ones((1, 5), jnp.int32),
                                              jnp.array([0]), jnp.array([5]))
        status.raise_if_failed()
        for _ in range(3):
            _, kv, state, status = runner.decode_step(params, kv, state, tokens)
            status.raise_if_failed()
        _, _, kv, state, status = runner.decode_steps(params, kv, state, tokens, num_steps=2)
        status.raise_if_failed()
        state, status = release(state, jnp.array([0]))
        return kv, state

    kv, state = five_calls(kv, state)  # traces and compiles
    traced = len(calls)
    kv, state = five_calls(kv, state)
    assert len(calls) == traced, f"GraphDef hashed {len(calls) - traced} times over 5 calls"
    for _ in range(2):
        _, kv, state, _ = decode_step(graphdef, params, kv, state, tokens)
    assert len(calls) >= traced + 2


def test_shapes_only_the_kernel_refuses_decode_on_the_xla_path():
    """head_dim 16 and block_size 3 are outside the Pallas kernel's tiles, not the model's:
    every step runs them on the xla path (``auto`` falls back to it), greedy tokens equal our
    dense pass, and ``impl="pallas"`` refuses before tracing, naming the value."""
    small = TINY.replace(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    graphdef, params = nnx.split(init_model(small, seed=4))
    cache = CacheConfig(num_blocks=30, block_size=3, max_seqs=2, max_blocks_per_seq=8)
    prompts = prompts_of([5, 7], seed=11)

    def greedy_reference(prompt, count):
        seq = list(prompt)
        for _ in range(count):
            seq.append(int(np.argmax(dense_logits(graphdef, params, seq)[-1])))
        return seq[len(prompt):]

    expected = [greedy_reference(p, 5) for p in prompts]
    for impl in ("xla", "auto"):
        _, _, tokens = run_greedy(graphdef, params, small, cache, prompts, [0, 1], 4, impl=impl)
        assert tokens.tolist() == expected, impl
    for num_steps in (1, 2):
        kv, state = init_cache(small, cache), init_state(cache)
        logits, kv, state, status = prefill(graphdef, params, kv, state,
                                            jnp.asarray(pad_prompts(prompts)), jnp.array([0, 1]),
                                            jnp.array([5, 7]))
        status.raise_if_failed()
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, first,
                                                  num_steps=num_steps)
        status.raise_if_failed()
        got = np.concatenate([np.asarray(first)[None], np.asarray(toks)]).T
        assert got.tolist() == [e[: num_steps + 1] for e in expected], num_steps
        message = r"impl=\"pallas\" cannot run this shape: head_dim must be one of .* Got 16\."
        with pytest.raises(ValueError, match=message):
            decode_steps(graphdef, params, kv, state, first, num_steps=num_steps, impl="pallas")
        with pytest.raises(ValueError, match=message):
            decode_step(graphdef, params, kv, state, first, impl="pallas", interpret=True)


@pytest.mark.parametrize("free", [0, 1, 2])
def test_shared_writers_with_a_tight_pool_match_the_model_allocator(free):
    """Two holders of one shared, partly filled block both write into it: one copy is enough
    (the last writer keeps the original), though the step's cheap bound counts two. With one
    or two free blocks the step runs; with none it is refused, state and cache unchanged."""
    cfg = CacheConfig(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4)
    claim = jax.jit(claim_steps, static_argnums=2)
    model = ModelAllocator(cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq)
    state, _ = admit(init_state(cfg), jnp.array([0]), jnp.array([6]))  # 2 blocks, 2 tokens in
    model.admit([0], [6])
    state, _ = fork(state, jnp.array([0]), jnp.array([1]))
    model.share([0], [1])
    state, _, st = allocate_blocks(state, int(state.num_free) - free)
    st.raise_if_failed()
    model.allocate(cfg.num_blocks - 2 - free)
    labels = np.arange(cfg.num_blocks, dtype=np.float32)
    kv = KVCache(*(jnp.broadcast_to(jnp.asarray(labels)[None, None, :, None, None],
                                    (1, 1, cfg.num_blocks, cfg.block_size, 1)),) * 2)
    before = snapshot((kv, state))
    expected = model.append([0, 1], [1, 1])
    codes, src, dst = model.copy_on_write([0, 1], [6, 6])
    ok = all(c == 0 for c in expected + codes)
    state, (src_ids, dst_ids), status = claim(state, state.active, 1)
    kv = copy_blocks(kv, src_ids, dst_ids)
    assert bool(status.applied) == ok == (free > 0)
    if not ok:
        assert Code.OUT_OF_BLOCKS in np.asarray(status.code).tolist()
        assert_same((kv, state), before)
        return
    assert_matches_model(state, model)
    assert sum(s >= 0 for s in src) == 1  # one copy, not two
    for s, d in zip(src, dst, strict=True):
        if s >= 0:
            labels[d] = labels[s]
    np.testing.assert_array_equal(np.asarray(kv.k)[0, 0, :, :, 0],
                                  np.repeat(labels[:, None], cfg.block_size, 1))


@pytest.mark.parametrize("num_steps", [1, 8])
def test_compiled_steps_do_no_pool_sized_work(num_steps):
    """A decode step's bookkeeping is O(batch): in the compiled step, with its state donated,
    nothing outside an in-place scatter produces the pool-sized state buffer (no copy, no
    select against the input state), in every branch."""
    small = TINY.replace(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                         head_dim=8, intermediate_size=64)
    graphdef, params = nnx.split(init_model(small, seed=0))
    cfg = CacheConfig(num_blocks=20_000, block_size=16, max_seqs=8, max_blocks_per_seq=8)
    kv, state = init_cache(small, cfg), init_state(cfg)
    tokens = jnp.zeros(cfg.max_seqs, jnp.int32)
    runner = Steps(graphdef)
    if num_steps == 1:
        lowered = runner.decode_step_jit.lower(params, kv, state, tokens, impl="xla",
                                               interpret=False)
    else:
        lowered = runner.decode_steps_jit.lower(
            params, kv, state, tokens, None, None, num_steps=num_steps,
            impl="xla", interpret=False, return_logits=False, sample=False)
    assert pool_sized_work(compiled_hlo(lowered), state.buffers[0].shape[0]) == []


@pytest.mark.parametrize("num_steps", [1, 5])
def test_rows_runs_the_first_slots_only(split_model, num_steps):
    """``rows=2``: slots 0 and 1 decode as the dense forward pass says (greedy logits), and
    as sampled by seed and position, with per-row controls; slot 3, active past ``rows``,
    emits -1, keeps its length and claims no block (the model allocator's appends)."""
    graphdef, params = split_model
    prompts = prompts_of([5, 12, 9], seed=31)
    slots = np.array([1, 0, 3], np.int32)
    kv, state, first = prefill_rows(graphdef, params, prompts, slots)
    toks, logits, kv, state, status = decode_steps(graphdef, params, kv, state, first,
                                                   num_steps=num_steps, return_logits=True,
                                                   rows=2)
    status.raise_if_failed()
    toks, logits = np.asarray(toks), np.asarray(logits)
    assert toks.shape == (num_steps, CACHE.max_seqs)
    assert (toks[:, 2:] == -1).all() and not logits[:, 2:].any()
    for slot, prompt in ((1, prompts[0]), (0, prompts[1])):
        seq = np.concatenate([prompt, [int(first[slot])], toks[:-1, slot]])
        ref = dense_logits(graphdef, params, seq)[len(prompt):]
        np.testing.assert_allclose(logits[:, slot], ref, atol=TOL, rtol=0)
        np.testing.assert_array_equal(toks[:, slot], ref.argmax(-1))
    model = ModelAllocator(CACHE.num_blocks, CACHE.block_size, CACHE.max_seqs,
                           CACHE.max_blocks_per_seq)
    model.admit(list(slots), [len(p) for p in prompts])
    for _ in range(num_steps):
        model.append([1, 0], [1, 1])
    assert int(state.seq_lens[3]) == len(prompts[2])
    assert_matches_model(state, model)

    # Sampled, seeded, with per-row temperature and filters: the first two slots draw what
    # they draw with every slot computed.
    temps = np.array([0.7, 1.3, 0.0, 2.0], np.float32)
    top_k = np.array([0, 5, 0, 3], np.int32)
    top_p = np.array([0.9, 1.0, 1.0, 0.5], np.float32)
    seeds = np.array([3, 4, 5, 6], np.int32)
    drawn = []
    for rows in (None, 2):
        kv, state, first = prefill_rows(graphdef, params, prompts, slots)
        out, _, _, _, status = decode_steps(graphdef, params, kv, state, first, None, temps,
                                            top_k=top_k, top_p=top_p, num_steps=num_steps,
                                            seeds=seeds, rows=rows)
        status.raise_if_failed()
        drawn.append(np.asarray(out))
    np.testing.assert_array_equal(drawn[1][:, :2], drawn[0][:, :2])
    assert (drawn[1][:, 2:] == -1).all() and (drawn[0][:, 3] >= 0).all()


@pytest.mark.parametrize("rows", [0, 5, True, 2.0])
def test_bad_rows_are_refused_before_tracing(split_model, rows):
    graphdef, params = split_model
    kv, state, first = prefill_rows(graphdef, params, prompts_of([3]), np.array([0], np.int32))
    with pytest.raises(ValueError, match=rf"rows must be None or an int in 1\.\.max_seqs \(4\)\. "
                                         rf"Got {rows!r}\."):
        decode_steps(graphdef, params, kv, state, first, num_steps=2, rows=rows)
    assert int(state.seq_lens[0]) == 3


# ``prefill_packed``: the first chunks of several prompts in one row of tokens, against the
# dense forward pass, the row ``prefill`` on the same chunks, and its refusals.


def empty_slots(state, ids):
    """``ids`` admitted with no tokens, as the engine's ``admit_cached`` leaves a prompt
    without a prefix-cache hit."""
    state, status = admit(state, jnp.array(ids), jnp.zeros(len(ids), jnp.int32))
    status.raise_if_failed()
    return state


def packed(prompts, width, fill=0):
    tokens = np.full(width, fill, np.int32)
    tokens[: sum(map(len, prompts))] = np.concatenate(prompts)
    return tokens


@pytest.mark.parametrize("lens, width", [([5, 11, 1], 32), ([3, 9, 8, 12], 32)])
def test_packed_rows_equal_the_dense_pass_and_decode_on(split_model, lens, width):
    """Each row's logits equal its prompt's dense pass; the K/V it wrote (into scrambled
    tables over a NaN-filled pool) carry a decode step to the dense pass's next logits.
    Padding past the rows holds an id outside the vocabulary, never read."""
    graphdef, params = split_model
    prompts = prompts_of(lens, seed=len(lens))
    ids = [2, 0, 3, 1][: len(lens)]
    kv, state = init_cache(TINY, CACHE, fill=np.nan), scrambled_state(CACHE, seed=2)
    state = empty_slots(state, ids)
    rows = CACHE.max_seqs
    logits, kv, state, status = prefill_packed(
        graphdef, params, kv, state, packed(prompts, width, fill=TINY.vocab_size + 5),
        np.array(ids + [-1] * (rows - len(ids))), np.array(lens + [0] * (rows - len(ids))))
    status.raise_if_failed()
    assert_invariants(state)
    assert [int(state.seq_lens[i]) for i in ids] == lens
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[i]), dense_logits(graphdef, params,
                                                                        prompt)[-1],
                                   atol=TOL, rtol=0)
    nxt = np.zeros(CACHE.max_seqs, np.int32)
    nxt[ids] = np.arange(len(ids)) + 7
    step_logits, kv, state, status = decode_step(graphdef, params, kv, state, jnp.asarray(nxt))
    status.raise_if_failed()
    for i, prompt in enumerate(prompts):
        ref = dense_logits(graphdef, params, np.concatenate([prompt, [nxt[ids[i]]]]))
        np.testing.assert_allclose(np.asarray(step_logits[ids[i]]), ref[-1], atol=TOL, rtol=0)


def test_packed_equals_the_row_prefill_in_state_and_blocks(split_model):
    """The same chunks through ``prefill`` (rows padded to the widest) and through
    ``prefill_packed`` leave the same ``BlockState`` and the same K/V in every block a row
    holds; a ``Steps`` object's method equals the module function."""
    graphdef, params = split_model
    lens = [7, 2, 12]
    prompts = prompts_of(lens, seed=11)
    ids = [1, 3, 0]
    start = empty_slots(scrambled_state(CACHE, seed=4), ids)
    kv0 = init_cache(TINY, CACHE)
    row_logits, row_kv, row_state, status = prefill(
        graphdef, params, kv0, start, jnp.asarray(pad_prompts(prompts)), jnp.array(ids),
        jnp.array(lens), jnp.ones(3, bool))
    status.raise_if_failed()
    start = empty_slots(scrambled_state(CACHE, seed=4), ids)
    steps = Steps(graphdef)
    logits, kv, state, status = steps.prefill_packed(
        params, init_cache(TINY, CACHE), start, packed(prompts, 32), np.array(ids),
        np.array(lens))
    status.raise_if_failed()
    assert_same(state, row_state)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(row_logits), atol=TOL, rtol=0)
    held = np.unique(np.asarray(state.block_tables)[ids])
    held = held[held >= 0]
    for a, b in ((kv.k, row_kv.k), (kv.v, row_kv.v)):
        np.testing.assert_allclose(np.asarray(a)[:, :, held], np.asarray(b)[:, :, held],
                                   atol=TOL, rtol=0)
    start = empty_slots(scrambled_state(CACHE, seed=4), ids)
    module = prefill_packed(graphdef, params, init_cache(TINY, CACHE), start,
                            packed(prompts, 32), np.array(ids), np.array(lens))
    assert_same(module[1:3], (kv, state))
    np.testing.assert_array_equal(np.asarray(module[0]), np.asarray(logits))


def test_refusals_name_the_row_and_change_nothing(split_model):
    """A slot that already holds tokens, an inactive slot, a row running past the packed
    tokens or bringing none, and an id outside the vocabulary: each refuses the whole call,
    the cache and state exactly as they were."""
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    state = empty_slots(state, [0, 1, 2])
    _, kv, state, status = prefill_packed(graphdef, params, kv, state, np.ones(8, np.int32),
                                          np.array([2]), np.array([3]))
    status.raise_if_failed()  # slot 2 now holds 3 tokens
    bad_token = np.ones(16, np.int32)
    bad_token[6] = TINY.vocab_size
    cases = [
        (np.ones(16, np.int32), [0, 2], [4, 4], [Code.NOT_APPLIED, Code.SEQ_ACTIVE],
         r"seq 2 \(entry 1\) holds 3 tokens; expected an empty slot \(a packed prefill starts "
         r"every row at position 0\)"),
        (np.ones(16, np.int32), [0, 3], [4, 4], [Code.NOT_APPLIED, Code.SEQ_INACTIVE],
         r"seq 3 \(entry 1\) is not active"),
        (np.ones(16, np.int32), [0, 1], [10, 7], [Code.NOT_APPLIED, Code.BAD_NUM_TOKENS],
         r"seq 1 \(entry 1\) brings 7 new tokens; expected 1 to 6, what the packed tokens "
         r"hold from the row's start"),
        (np.ones(16, np.int32), [0, 1], [0, 7], [Code.BAD_NUM_TOKENS, Code.NOT_APPLIED],
         r"seq 0 \(entry 0\) brings 0 new tokens; expected 1 to 16"),
        (bad_token, [0, 1], [4, 5], [Code.NOT_APPLIED, Code.BAD_TOKEN],
         rf"seq 1 \(entry 1\) feeds token id {TINY.vocab_size} at position 2; expected "
         rf"0 <= token < {TINY.vocab_size}"),
    ]
    for tokens, ids, n, codes, message in cases:
        before = snapshot((kv, state))
        _, kv, state, status = prefill_packed(graphdef, params, kv, state, tokens,
                                              np.array(ids), np.array(n))
        assert list(np.asarray(status.code)) == codes, message
        assert_same((kv, state), before)
        with pytest.raises(ValueError, match="prefill_packed failed, state unchanged: "
                           + message):
            status.raise_if_failed()


def test_bad_shapes_are_refused_before_tracing(split_model):
    graphdef, params = split_model
    kv, state = init_cache(TINY, CACHE), init_state(CACHE)
    with pytest.raises(ValueError, match=r"tokens must be a \[T\] int array.*Got int32\(2, 8\)"):
        prefill_packed(graphdef, params, kv, state, np.ones((2, 8), np.int32), np.array([0, 1]),
                       np.array([1, 1]))
    with pytest.raises(ValueError, match=r"num_tokens must be a \[rows\] int array with rows "
                       r"= 2.*Got int64\(3,\)|num_tokens must be a \[rows\] int array with "
                       r"rows = 2.*Got int32\(3,\)"):
        prefill_packed(graphdef, params, kv, state, np.ones(8, np.int32), np.array([0, 1]),
                       np.array([1, 1, 1]))
    with pytest.raises(ValueError, match=r"tokens must be a \[T\] int array.*float32"):
        prefill_packed(graphdef, params, kv, state, np.ones(8, np.float32), np.array([0]),
                       np.array([1]))


# ``prefill_decode``: a prefill and one decode step in one forward pass, against the dense
# pass, against the two steps run one after the other, and its refusals.


def running(graphdef, params, fill=0.0):
    """Slots 0 and 2 holding prompts of 5 and 11 tokens (scrambled tables, a pool of
    ``fill``), slot 1 holding the first 6 tokens of a 14-token prompt, slot 3 empty; returns
    ``(kv, state, prompts, first)``: the three prompts and the first greedy tokens of slots 0
    and 2."""
    prompts = prompts_of([5, 14, 11], seed=21)
    kv, state = init_cache(TINY, CACHE, fill=fill), scrambled_state(CACHE, seed=5)
    logits, kv, state, status = prefill(
        graphdef, params, kv, state, jnp.asarray(pad_prompts([prompts[0], prompts[1][:6],
                                                              prompts[2]])),
        jnp.array([0, 1, 2]), jnp.array([5, 6, 11]))
    status.raise_if_failed()
    first = np.zeros(CACHE.max_seqs, np.int32)
    first[[0, 2]] = np.argmax(np.asarray(logits)[[0, 2]], -1)
    return kv, state, prompts, first


def test_prefill_decode_equals_the_dense_pass(split_model):
    """Slots 0 and 2 decode a token while slot 1 gets its prompt's next 8 tokens and slot 3
    its first 3, over a NaN-filled pool: the decode rows' tokens are the dense pass's argmax,
    the prefill rows' logits its last logits, and a decode step of all four after it gives
    the dense pass's next logits (every K/V landed in its place)."""
    graphdef, params = split_model
    kv, state, prompts, first = running(graphdef, params, fill=np.nan)
    state = empty_slots(state, [3])
    fresh = prompts_of([3], seed=22)[0]
    budgets = np.array([1, 0, 1, 0], np.int32)
    emitted, logits, kv, state, status = prefill_decode(
        graphdef, params, kv, state, pad_prompts([prompts[1][6:], fresh]), np.array([1, 3]),
        np.array([8, 3]), np.array([True, True]), first, budgets=budgets)
    status.raise_if_failed()
    assert list(np.asarray(status.code)) == [Code.OK] * 6
    assert_invariants(state)
    assert np.asarray(state.seq_lens).tolist() == [6, 14, 12, 3]
    seqs = {0: np.append(prompts[0], first[0]), 1: prompts[1], 2: np.append(prompts[2], first[2]),
            3: fresh}
    ref = {s: dense_logits(graphdef, params, seq) for s, seq in seqs.items()}
    for s in (0, 2):
        assert int(emitted[s]) == int(np.argmax(ref[s][-1]))
    assert int(emitted[1]) == int(emitted[3]) == -1
    for row, s in enumerate((1, 3)):
        np.testing.assert_allclose(np.asarray(logits[row]), ref[s][-1], atol=TOL, rtol=0)
    nxt = np.array([int(emitted[0]), 7, int(emitted[2]), 9], np.int32)
    step_logits, kv, state, status = decode_step(graphdef, params, kv, state, jnp.asarray(nxt))
    status.raise_if_failed()
    for s, seq in seqs.items():
        want = dense_logits(graphdef, params, np.append(seq, nxt[s]))[-1]
        np.testing.assert_allclose(np.asarray(step_logits[s]), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("sampled,rows", [(False, None), (True, None), (False, 3),
                                           (True, 2)])
def test_prefill_decode_equals_prefill_then_one_decode_step(split_model, sampled, rows):
    """The same work as ``prefill`` then ``decode_steps(num_steps=1)`` (seeded sampling with
    top-k and top-p, or greedy): the same tokens, the same state, the same K/V in every block
    a row holds; a ``Steps`` object's method equals the module function. With ``rows`` 3 the
    decode computes slots 0..2 only and gives the same; with 2, slot 2 does not decode, as in
    ``decode_steps`` with the same ``rows``."""
    graphdef, params = split_model
    decode_rows = rows
    budgets = np.array([1, 0, 1, 0], np.int32)
    seeds = np.array([3, 0, 8, 0], np.int32)
    rows = (pad_prompts([prompts_of([14], seed=21)[0][6:]]), np.array([1]), np.array([8]),
            np.array([True]))
    draw = (dict(temperature=np.full(4, 0.9, np.float32), top_k=np.full(4, 20, np.int32),
                 top_p=np.full(4, 0.8, np.float32), seeds=seeds) if sampled else {})
    kv, state, _, first = running(graphdef, params)
    want_logits, kv, state, status = prefill(graphdef, params, kv, state, *rows)
    status.raise_if_failed()
    toks, _, want_kv, want_state, status = decode_steps(
        graphdef, params, kv, state, first, num_steps=1, budgets=budgets,
        rows=2 if decode_rows == 2 else None, **draw)
    status.raise_if_failed()
    kv, state, _, first = running(graphdef, params)
    emitted, logits, kv, state, status = Steps(graphdef).prefill_decode(
        params, kv, state, *rows, first, budgets=budgets, rows=decode_rows, **draw)
    status.raise_if_failed()
    np.testing.assert_array_equal(np.asarray(emitted), np.asarray(toks)[0])
    assert (int(emitted[2]) == -1) == (decode_rows == 2)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=TOL, rtol=0)
    assert_same(state, want_state)
    held = np.unique(np.asarray(state.block_tables))
    held = held[held >= 0]
    for a, b in ((kv.k, want_kv.k), (kv.v, want_kv.v)):
        np.testing.assert_allclose(np.asarray(a)[:, :, held], np.asarray(b)[:, :, held],
                                   atol=TOL, rtol=0)
    got = snapshot((emitted, state))
    kv, state, _, first = running(graphdef, params)
    module = prefill_decode(graphdef, params, kv, state, *rows, first, budgets=budgets,
                            rows=decode_rows, **draw)
    assert_same((module[0], module[3]), got)


def test_prefill_decode_refusals_change_nothing(split_model):
    """A slot in both parts, a prefill row into an occupied slot, a decode token outside the
    vocabulary and a pool too small for both parts: each refuses the whole call, naming the
    entry, with the cache and state exactly as they were."""
    graphdef, params = split_model
    kv, state, prompts, first = running(graphdef, params)
    rows = (pad_prompts([prompts[1][6:]]), np.array([1]), np.array([8]))
    bad_token = first.copy()
    bad_token[2] = TINY.vocab_size
    cases = [
        (rows + (np.array([True]),), first, np.array([1, 1, 1, 0]), 4,
         r"seq 1 \(entry 4\) appears more than once in the batch"),
        (rows + (np.array([False]),), first, np.array([1, 0, 1, 0]), 4,
         r"seq 1 \(entry 4\) is already active"),
        (rows + (np.array([True]),), bad_token, np.array([1, 0, 1, 0]), 2,
         rf"seq 2 \(entry 2\) feeds token id {TINY.vocab_size} at position 11"),
    ]
    for args, tokens, budgets, entry, message in cases:
        before = snapshot((kv, state))
        emitted, _, kv, state, status = prefill_decode(graphdef, params, kv, state, *args,
                                                       tokens, budgets=budgets)
        codes = np.asarray(status.code)
        assert codes.shape == (5,) and codes[entry] not in (Code.OK, Code.NOT_APPLIED)
        assert set(np.delete(codes, entry).tolist()) <= {Code.NOT_APPLIED, Code.OK}
        assert not np.asarray(status.applied)
        assert (np.asarray(emitted) == -1).all()
        assert_same((kv, state), before)
        with pytest.raises(ValueError, match="prefill_decode failed, state unchanged: "
                           + message):
            status.raise_if_failed()
    for rows_arg in (0, 5, 2.0):  # checked before tracing
        with pytest.raises(ValueError, match=rf"rows must be None or an int in 1..max_seqs "
                                             rf"\(4\). Got {rows_arg!r}"):
            prefill_decode(graphdef, params, kv, state, *rows, np.array([True]), first,
                           budgets=np.array([1, 0, 1, 0]), rows=rows_arg)
    state, _, st = allocate_blocks(state, int(state.num_free))  # drain the pool
    st.raise_if_failed()
    before = snapshot((kv, state))
    _, _, kv, state, status = prefill_decode(graphdef, params, kv, state, *rows,
                                             np.array([True]), first,
                                             budgets=np.array([1, 0, 1, 0]))
    assert_same((kv, state), before)
    with pytest.raises(OutOfBlocksError):
        status.raise_if_failed()
