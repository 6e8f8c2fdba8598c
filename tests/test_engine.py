"""The serving engine on a tiny random Llama, against our own dense no-cache forward pass.

Greedy outputs must be the dense reference's, token for token, however the engine is run:
all requests together or one at a time, a big pool or one small enough to preempt, prefix
caching on or off, K = 1, 3 or 8 steps per dispatch, and each of n = 3 completions."""

from __future__ import annotations

import math
import re
import time

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax.engine import events as ev
from paged_jax.engine.buckets import packed_widths, prefill_buckets
from paged_jax.engine.llm import LLM
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.steps import Steps
from paged_jax.kernels import strategies
from paged_jax.model import init_model
from tests.compile_log import logged_compiles
from tests.model_helpers import DENSE_LEN, TINY, dense_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Most engines here share two pool shapes (64 blocks, or SMALL to force preemption), so that
# they share their compiled steps.
SMALL = 12
LENS = (5, 17, 9, 30, 3, 21)


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=3)


@pytest.fixture(scope="module")
def steps(model):
    """One compiled Steps for every engine here: engines of equal shapes share executables."""
    return Steps(nnx.split(model)[0])


@pytest.fixture(scope="module")
def reference(model):
    """Greedy continuations by the dense forward pass, one sequence at a time."""
    graphdef, params = nnx.split(model)
    memo = {}

    def greedy(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            seq = list(prompt)
            for _ in range(n):
                seq.append(int(np.argmax(dense_logits(graphdef, params, seq)[-1])))
            memo[key] = seq[len(prompt):]
        return memo[key]

    return greedy


def prompts_of(lens, seed=0, vocab=TINY.vocab_size):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def engine(model, steps, **kwargs) -> LLM:
    opts = dict(block_size=8, max_num_seqs=4, max_model_len=DENSE_LEN, num_blocks=64,
                max_num_batched_tokens=32, debug=True, steps=steps)
    return LLM.from_model(model, None, **{**opts, **kwargs})


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(num_blocks=SMALL, steps_per_dispatch=3),  # preempts
    dict(enable_prefix_caching=False, steps_per_dispatch=1),
    dict(steps_per_dispatch=3, steps_while_prefilling=3),  # K even while prefilling
    dict(num_blocks=SMALL, steps_per_dispatch=4, steps_while_prefilling=2),
    dict(num_blocks=SMALL, steps_per_dispatch=3, enable_prefix_caching=False,
         prefill_by_width=False),
    dict(steps_per_dispatch=3, scheduling_policy="shortest_first"),
    # 8 prefill tokens an iteration while rows decode; new rows wait for the next decode.
    dict(num_blocks=SMALL, steps_per_dispatch=3, prefill_tokens_while_decoding=8),
    dict(steps_per_dispatch=3, join_decode=False, first_tokens_first=False),
    dict(num_blocks=SMALL, steps_per_dispatch=3, pack_prefill=False),  # rows by width class
])
def test_greedy_outputs_equal_the_dense_reference(model, steps, reference, kwargs):
    prompts = prompts_of(LENS)
    llm = engine(model, steps, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [[reference(p, 12)] for p in prompts]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        m = o.metrics
        assert 0 <= m.ttft <= m.e2e and len(m.token_times) == 12 and len(m.itl) == 11
        assert m.tpot == pytest.approx((m.token_times[-1] - m.token_times[0]) / 11)
    stats = llm.stats()
    assert stats.finished == len(prompts)
    # Only full cached blocks are left: no internal fragmentation.
    assert stats.token_occupancy * stats.blocks_total == stats.blocks_cached
    assert stats.block_occupancy * stats.blocks_total == stats.blocks_cached
    assert stats.median_ttft == pytest.approx(np.median([o.metrics.ttft for o in outs]))
    if kwargs.get("num_blocks", 64) < 16:
        assert stats.preemptions > 0  # the small pools really preempt
    # Nothing is left held but the prefix cache's blocks.
    assert stats.running == stats.waiting == 0
    assert stats.blocks_used == stats.blocks_cached
    assert (stats.blocks_cached > 0) == llm.engine.enable_prefix_caching


def test_narrow_tables_give_the_dense_reference(model, reference, monkeypatch):
    """Attention over the table's first columns only: with ``context_bucket_tokens=8`` the
    prefill and decode steps read 1, 2, 4 or 8 of the 8 blocks of 8 tokens, whichever covers
    the longest row, in chunked prefills, K-step dispatches and single steps. Every width is
    compiled in (the spy sees the switch traced with all four), no dispatch hoists its
    context (a table of several widths gathers per step), and the greedy outputs are the
    dense reference's."""
    traced, hoisted = [], []
    real, real_hoisted = strategies.by_context_width, strategies.hoisted
    monkeypatch.setattr(strategies, "by_context_width",
                        lambda lens, bs, widths, attend: traced.append(widths)
                        or real(lens, bs, widths, attend))
    monkeypatch.setattr(strategies, "hoisted", lambda *a: hoisted.append(1) or real_hoisted(*a))
    narrow = Steps(nnx.split(model)[0], context_bucket_tokens=8)
    prompts = prompts_of(LENS, seed=4)
    llm = engine(model, narrow, steps_per_dispatch=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [[reference(p, 12)] for p in prompts]
    assert traced and all(w == (1, 2, 4, 8) for w in traced)
    assert not hoisted


@pytest.mark.parametrize("packed, by_width", [(True, True), (False, True), (False, False)])
def test_prefill_chunks_run_packed_or_one_dispatch_per_width_class(model, steps, reference,
                                                                 packed, by_width):
    """Chunks of 5, 30 and 9 tokens that start their prompts, in one iteration, a fourth
    request queued for a slot: packed, one dispatch of their 44 tokens in a row of 64; by
    width, a (2, 16) dispatch for the short ones and a (1, 32) one for the long one (64
    positions); otherwise one (3, 32) dispatch (96; 3 slots). Then the fourth prompt, with
    nothing queued, by width. The outputs are the reference's each way."""
    calls = []
    prompts = prompts_of([5, 30, 9, 7], seed=12)
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=3, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=64, prefill_by_width=by_width,
                    pack_prefill=packed)
    spy_dispatches(eng, steps, calls)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == [
        reference(p, 12) for p in prompts]
    first = [shape for kind, shape in calls if kind != "decode"][:-1]
    assert sorted(first) == ([(64,)] if packed else [(1, 32), (2, 16)] if by_width
                             else [(3, 32)])
    assert [c for c in calls if c[0] != "decode"][-1] == ("prefill", (1, 16))


def split_iteration_engine(model, steps, calls, deliver, join=True):
    """The engine and prompts r0..r4 (6, 30, 5, 9 and 7 tokens) of the tests below: prompts
    of 30, 5 and 9 tokens added together make a (2, 16) and a (1, 32) prefill dispatch
    (chunks by width class, not packed), and no decode runs in a prefill's dispatch. Its
    dispatches are appended to ``calls``."""
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=8, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=64, steps_per_dispatch=2,
                    max_dispatch_ms=None, first_tokens_first=False, debug=True,
                    deliver_each_prefill=deliver, join_decode=join, pack_prefill=False,
                    decode_with_prefill=False)
    spy_dispatches(eng, steps, calls)
    return eng, prompts_of([6, 30, 5, 9, 7], seed=14)


@pytest.mark.parametrize("deliver", [True, False])
def test_each_prefill_dispatch_returns_its_first_tokens(model, steps, reference, deliver):
    """r0 decodes; r1 (30 tokens), r2 (5) and r3 (9) arrive together, so one iteration
    prefills a (1, 32) and a (2, 16) dispatch and decodes r0. The narrower dispatch runs
    first and, with ``deliver_each_prefill``, ``step()`` returns r2's and r3's first tokens
    after it; the next call
    runs the rest of that iteration (r1's prefill, and r0's decode step unless r0 was
    aborted in between, as here) before planning another. Without it one call runs the
    whole iteration. r4 arrives after the first call: it waits for a new plan. The tokens
    are the dense reference's either way."""
    calls = []
    eng, prompts = split_iteration_engine(model, steps, calls, deliver)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    def step():
        before = len(calls)
        new = {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}
        return new, calls[before:]

    eng.add_request("r0", prompts[0], greedy)
    assert step() == ({"r0": 1}, [("prefill", (1, 16))])
    for i in (1, 2, 3):
        eng.add_request(f"r{i}", prompts[i], greedy)
    both = [("prefill", (2, 16)), ("prefill", (1, 32)), ("decode", 1)]
    if deliver:
        assert step() == ({"r2": 1, "r3": 1}, both[:1])
        eng.abort_request("r0")
        eng.add_request("r4", prompts[4], greedy)
        assert step() == ({"r1": 1}, both[1:2])  # r0's decode row left with it
    else:  # r1, r2 and r3 decode in the iteration's dispatch beside r0 (join_decode)
        assert step() == ({"r0": 2, "r1": 2, "r2": 2, "r3": 2}, both)
        eng.abort_request("r0")
        eng.add_request("r4", prompts[4], greedy)
    assert step()[1][0] == ("prefill", (1, 16))  # a new plan: r4's prefill
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert "r0" not in outs
    assert [outs[f"r{i}"] for i in (1, 2, 3, 4)] == [reference(prompts[i], 6)
                                                    for i in (1, 2, 3, 4)]


@pytest.mark.parametrize("join", [True, False])
def test_prompts_that_finish_decode_in_their_iteration_s_dispatch(model, steps, reference,
                                                                 join):
    """r0 decodes; r1 (30 tokens), r2 (5) and r3 (9) arrive together. With ``join_decode``
    the iteration that prefills them decodes them too, in its one decode dispatch beside
    r0: each has two tokens after it. Without it they wait for the next iteration's. The
    tokens are the dense reference's either way."""
    calls = []
    eng, prompts = split_iteration_engine(model, steps, calls, deliver=False, join=join)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    eng.add_request("r0", prompts[0], greedy)
    eng.step()
    for i in (1, 2, 3):
        eng.add_request(f"r{i}", prompts[i], greedy)
    got = {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}
    assert got == ({"r0": 2, "r1": 2, "r2": 2, "r3": 2} if join
                   else {"r0": 2, "r1": 1, "r2": 1, "r3": 1})
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [outs[f"r{i}"] for i in range(4)] == [reference(prompts[i], 6) for i in range(4)]


def test_an_iteration_left_with_only_aborted_rows_is_replanned(model, steps, reference):
    """As above with ``deliver_each_prefill``: after the call that returns r2's and r3's
    first tokens, r0 (its decode row) and r1 (its prefill) are aborted, so nothing of that
    iteration is left to run. The next call plans anew and prefills r4 rather than running
    an empty part; its ``StepDone`` counts r4's tokens."""
    from paged_jax.engine.events import StepDone

    calls, done = [], []
    eng, prompts = split_iteration_engine(model, steps, calls, deliver=True)
    eng.add_listener(lambda e: done.append(e) if isinstance(e, StepDone) else None)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    eng.add_request("r0", prompts[0], greedy)
    eng.step()
    for i in (1, 2, 3):
        eng.add_request(f"r{i}", prompts[i], greedy)
    assert {o.request_id for o in eng.step()} == {"r2", "r3"}
    eng.abort_request("r0")
    eng.abort_request("r1")
    eng.add_request("r4", prompts[4], greedy)
    before = len(calls)
    # r4's first token, and a second from the decode of r2 and r3 it joins.
    assert {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}["r4"] == 2
    assert calls[before] == ("prefill", (1, 16))
    assert done[-1].prefill_tokens == 7
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [outs[f"r{i}"] for i in (2, 3, 4)] == [reference(prompts[i], 6) for i in (2, 3, 4)]


@pytest.mark.parametrize("deliver", [True, False])
def test_queued_requests_pack_new_prompts_beside_a_continuing_chunk(model, steps, reference,
                                                                   deliver):
    """r0 (40 tokens) prefills its first 32, alone, nothing queued: a (1, 32) ``prefill``.
    Then r1 (5), r2 (9) and r3 (6) arrive, r3 queued for a slot (3 slots): the next
    iteration packs r1's and r2's 14 tokens into a row of 16, and r0's last 8 tokens, after
    its cached ones, go in a (1, 16) ``prefill``. The packed dispatch runs first; with
    ``deliver_each_prefill`` ``step()`` returns r1's and r2's first tokens after it, and
    r0's from the next call. The tokens are the dense reference's either way."""
    calls = []
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=3, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=32, debug=True,
                    deliver_each_prefill=deliver)
    spy_dispatches(eng, steps, calls)
    prompts = prompts_of([40, 5, 9, 6], seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    eng.add_request("r0", prompts[0], greedy)
    assert eng.step() == [] and calls == [("prefill", (1, 32))]
    for i in (1, 2, 3):
        eng.add_request(f"r{i}", prompts[i], greedy)
    got = {o.request_id for o in eng.step()}
    if deliver:
        assert got == {"r1", "r2"} and calls[1:] == [("packed", (16,))]
        assert {o.request_id for o in eng.step()} == {"r0"}
    else:
        assert got == {"r0", "r1", "r2"}
    assert calls[1:3] == [("packed", (16,)), ("prefill", (1, 16))]
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [outs[f"r{i}"] for i in range(4)] == [reference(p, 5) for p in prompts]


@pytest.mark.parametrize("policy, order", [("fcfs", ["r0", "r1", "r2", "r3"]),
                                           ("shortest_first", ["r1", "r3", "r2", "r0"])])
def test_requests_added_together_are_admitted_in_the_policy_order(model, steps, reference,
                                                                  policy, order):
    """Prompts of 30, 5, 9 and 5 tokens added before one step: fcfs admits them as added,
    shortest_first by prompt length (equal lengths as added). Outputs are the reference's."""
    from paged_jax.engine.events import Admitted

    prompts = prompts_of([30, 5, 9, 5], seed=21)
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=16, scheduling_policy=policy)
    admitted = []
    eng.add_listener(lambda e: admitted.append(e.request_id) if isinstance(e, Admitted)
                     else None)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert admitted == order
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == [
        reference(p, 12) for p in prompts]


def test_one_request_at_a_time_gives_the_same_outputs(model, steps, reference):
    llm = engine(model, steps)
    for p in prompts_of(LENS[:3], seed=4):
        (out,) = llm.generate([p], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == reference(p, 12)


def test_shared_prefixes_hit_the_cache_and_prefill_only_the_rest(model, steps, reference):
    """Prompts sharing a 24-token prefix (3 blocks): later ones start on the cached blocks,
    and each lookup says why it stopped."""
    (prefix,) = prompts_of([24], seed=9)
    tails = prompts_of([5, 8, 3], seed=10)
    prompts = [prefix + t for t in tails]
    llm = engine(model, steps)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(first + rest) == [[reference(p, 12)] for p in prompts]
    lookups = [record for _, record in llm.engine.lookups]
    assert lookups[0].hit_blocks == 0 and lookups[0].reason == "different tokens"
    for record in lookups[1:]:
        assert record.hit_tokens >= 24
    assert llm.stats().prefix_cache_hit_rate > 0.5


def test_n3_greedy_completions_are_equal_and_sampled_ones_differ_reproducibly(model, steps,
                                                                              reference):
    (p,) = prompts_of([13], seed=5)
    llm = engine(model, steps)
    (out,) = llm.generate([p], SamplingParams(n=3, temperature=0.0, max_tokens=12),
                          use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [reference(p, 12)] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    hot = SamplingParams(n=3, temperature=5.0, max_tokens=10, seed=11)
    (a,) = llm.generate([p], hot, use_tqdm=False)
    (b,) = engine(model, steps).generate([p], hot, use_tqdm=False)  # a fresh engine
    runs = [[c.token_ids for c in a.outputs], [c.token_ids for c in b.outputs]]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3
    assert llm.stats().copy_on_write_copies > 0  # the forks copied their shared last block


def test_seeded_sampling_does_not_depend_on_what_else_is_batched(model, steps):
    a, b, c = prompts_of([7, 12, 20], seed=6)
    hot = SamplingParams(temperature=2.0, top_k=50, top_p=0.9, max_tokens=10, seed=3)
    alone = engine(model, steps).generate([a], hot, use_tqdm=False)[0].outputs[0].token_ids
    crowd = engine(model, steps, steps_per_dispatch=3).generate(
        [b, c, a], [SamplingParams(temperature=1.0, max_tokens=8, seed=1), GREEDY, hot],
        use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone


@pytest.mark.parametrize("k", [3, 8])
def test_stops_inside_the_dispatch_equal_k1(model, steps, reference, k):
    prompts = prompts_of(LENS[:4], seed=7)
    # Stop on the 4th greedy token of the first prompt, wherever it turns up.
    stop_id = reference(prompts[0], 12)[3]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    runs = [token_ids(engine(model, steps, steps_per_dispatch=kk).generate(prompts, params,
                                                                    use_tqdm=False))
            for kk in (1, k)]
    assert runs[0] == runs[1]
    first = runs[0][0][0]
    assert first[-1] == stop_id and stop_id not in first[:-1] and len(first) <= 4


class ByteTokenizer:
    """Token i is byte i (the tiny model's 256-token vocabulary): an obvious reference for
    text and stop strings."""

    eos_token_id = 0

    def encode(self, text):
        return list(text.encode("latin-1"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != 0).decode("latin-1")


def test_stop_strings_cut_the_text_and_the_tokens_after_them(model, steps, reference):
    graphdef, params = nnx.split(model)
    prompt = "The sea "
    ids = ByteTokenizer().encode(prompt)
    greedy = reference(ids, 12)
    text = ByteTokenizer().decode(greedy)
    stop = text[4:6]
    at = text.find(stop)
    llm = LLM.from_model(model, ByteTokenizer(), steps=steps, block_size=8, max_num_seqs=4,
                         max_model_len=DENSE_LEN, num_blocks=64, debug=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text == text[:at]
    # The tokens end with the one that completed the stop string.
    assert c.token_ids == greedy[: at + len(stop)]
    assert out.prompt == prompt and out.prompt_token_ids == ids


@pytest.mark.parametrize("while_decoding, chunks", [(None, 4), (16, 8)])
def test_a_long_prompt_is_chunked_and_never_stalls_running_requests(model, steps,
                                                                     while_decoding, chunks):
    """A 120-token prompt with 32-token chunks (16 with ``prefill_tokens_while_decoding=16``)
    arrives while two requests decode: every iteration of its prefill but the last, both
    still get tokens; the last returns its first token alone (first tokens first), and the
    next gives all three theirs. Its output equals an unchunked run's."""
    short = prompts_of([4, 6], seed=12)
    (long,) = prompts_of([120], seed=13)
    opts = dict(block_size=8, max_num_seqs=4, max_model_len=256, num_blocks=96, debug=True)
    eng = LLMEngine(model, steps=steps, **opts, max_num_batched_tokens=32,
                    prefill_tokens_while_decoding=while_decoding)
    params = SamplingParams(temperature=0.0, max_tokens=120)  # decoding all along
    for i, p in enumerate(short):
        eng.add_request(f"s{i}", p, params)
    eng.step()  # both admitted and prefilled
    eng.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=4))
    delivered = []
    while "long" in eng.requests and not eng.requests["long"].seqs[0].decoding:
        delivered.append({o.request_id for o in eng.step()})
    assert delivered == [{"s0", "s1"}] * (chunks - 1) + [{"long"}]
    # Mid-run: the three sequences' tokens over their blocks (and the cached full ones).
    stats = eng.stats()
    lens = [s.cached for s in eng.scheduler.running]
    assert stats.blocks_used == sum(-(-n // 8) for n in lens)  # nothing shared here
    assert stats.token_occupancy == pytest.approx(sum(lens) / (96 * 8))
    assert stats.block_occupancy > stats.token_occupancy
    last = {o.request_id: o for o in eng.step()}
    assert set(last) == {"s0", "s1", "long"}
    while eng.has_unfinished_requests():
        last.update((o.request_id, o) for o in eng.step())
    assert last["long"].finished
    chunked = last["long"].outputs[0].token_ids
    whole = LLMEngine(model, steps=steps, **opts, max_num_batched_tokens=128)
    whole.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=4))
    while whole.has_unfinished_requests():
        for o in whole.step():
            unchunked = o.outputs[0].token_ids
    assert chunked == unchunked


@pytest.mark.parametrize("with_prefill", [True, False])
def test_a_chunk_and_the_decode_step_beside_it_run_in_one_dispatch(model, steps, reference,
                                                                   with_prefill):
    """A 60-token prompt arrives while a greedy and a seeded top-k/top-p request decode, with
    16-token chunks while rows decode. With ``decode_with_prefill`` each iteration of its
    prefill but the last is one ``prefill_decode`` dispatch, the chunk and both rows' decode
    step; without it, a prefill dispatch and a decode dispatch of one step. The last chunk's
    iteration returns its first token alone (first tokens first). Every request's tokens
    are the same either way, and the greedy ones are the dense reference's."""
    prompts = prompts_of([5, 7, 60], seed=21)
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=32, prefill_tokens_while_decoding=16,
                    debug=True, decode_with_prefill=with_prefill)
    calls = []
    spy_dispatches(eng, steps, calls)
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=14)
    eng.add_request("greedy", prompts[0], SamplingParams(temperature=0.0, max_tokens=14))
    eng.add_request("sampled", prompts[1], sampled)
    eng.step()  # both prefilled
    eng.step()  # and decoding
    eng.add_request("long", prompts[2], SamplingParams(temperature=0.0, max_tokens=4))
    per_step = []
    while not eng.requests["long"].seqs[0].decoding:
        before = len(calls)
        eng.step()
        per_step.append(calls[before:])
    # The last chunk's iteration runs no decode (first tokens first).
    beside = ([("prefill_decode", (1, 16))] if with_prefill
              else [("prefill", (1, 16)), ("decode", 1)])
    assert per_step == [beside] * 3 + [[("prefill", (1, 16))]]
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert outs["greedy"] == reference(prompts[0], 14)
    assert outs["long"] == reference(prompts[2], 4)
    alone = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4,
                      max_model_len=DENSE_LEN, num_blocks=64, max_num_batched_tokens=32)
    alone.add_request("sampled", prompts[1], sampled)
    while alone.has_unfinished_requests():
        for o in alone.step():
            want = o.outputs[0].token_ids
    assert outs["sampled"] == want


@pytest.mark.parametrize("one", [True, False])
def test_one_prefill_chunk_makes_each_decoding_iteration_one_dispatch(model, steps, reference,
                                                                      one):
    """Prompts of 44 and 20 tokens, then one of 6, arrive while two requests decode, with
    16-token chunks while rows decode and ``decode_with_prefill``. The first two prompts,
    added before any row decodes, are prefilled in one dispatch: packed with
    ``one_prefill_chunk`` though none is queued, one row each without it. With
    ``one_prefill_chunk`` every iteration beside the decode rows is one ``prefill_decode``
    dispatch: the first
    chunks too (a packed dispatch of one row, while the others wait), and the last prompt's
    (no first tokens first: its first token comes from that dispatch). Without it, the
    44-token prompt's last 12 tokens and the 20-token one's first 4 share an iteration: two
    dispatches (the new prompt's chunk packed, as a prompt is queued, then the other with
    the decode step); and the last prompt's chunk runs alone (first tokens first). The
    greedy tokens are the dense reference's either way."""
    prompts = prompts_of([5, 7, 44, 20, 6], seed=23)
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=8, max_model_len=DENSE_LEN,
                    num_blocks=64, max_num_batched_tokens=32, prefill_tokens_while_decoding=16,
                    debug=True, decode_with_prefill=True, one_prefill_chunk=one)
    calls = []
    spy_dispatches(eng, steps, calls)
    lengths = [24, 24, 12, 12, 12]  # r0 and r1 decode throughout the others' prefill
    for i in (0, 1):
        eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0,
                                                            max_tokens=lengths[i]))
    eng.step()  # both prefilled together: no row decodes yet
    assert calls == [("packed", (16,)) if one else ("prefill", (2, 16))], calls
    eng.step()  # and decoding
    for i in (2, 3, 4):
        eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0,
                                                            max_tokens=lengths[i]))
    per_step = []
    while not all(eng.requests[f"r{i}"].seqs[0].decoding for i in (2, 3, 4)):
        before = len(calls)
        assert not any(o.finished for o in eng.step())
        per_step.append(calls[before:])
    merged = [("prefill_decode", (1, 16))]
    if one:  # r2: 16, 16, 12; r3: 16, 4; r4: 6
        assert per_step == [merged] * 6, per_step
    else:  # r2: 16, 16, 12 + r3's 4; r3: 16; r4: 6, alone
        assert per_step == [merged] * 2 + [[("packed", (16,)), *merged]] + [
            merged, [("prefill", (1, 16))]], per_step
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert outs == {f"r{i}": reference(prompts[i], n) for i, n in enumerate(lengths)}


def test_compilations_are_bounded_over_a_sharegpt_like_mix(model, steps):
    """Prompt lengths 1..1024 (log-uniform, as ShareGPT's): the prefill executables compiled
    (jax's own compile log) stay within the stated bound."""
    rng = np.random.default_rng(0)
    lens = np.unique(np.exp(rng.uniform(0, np.log(1024), 40)).astype(int).clip(1, 1024))
    llm = LLM.from_model(model, None, steps=steps, block_size=16, max_num_seqs=2,
                         max_model_len=1040,
                         num_blocks=140, max_num_batched_tokens=128)
    with logged_compiles() as logged:
        llm.generate([[1 + i % 7] * int(n) for i, n in enumerate(lens)],
                     SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    compiled = [m for m in logged if "Compiling jit(_prefill" in m]
    bound = len(prefill_buckets(2, 128)) + len(packed_widths(128))
    assert bound == 2 * 4 + 4  # rows 1, 2; widths 16, 32, 64, 128; packed widths the same
    assert 1 <= len(compiled) <= llm.stats().prefill_executables <= bound


def test_random_requests_with_aborts_leak_nothing(model, steps):
    """500 random requests (lengths, n, sampling, aborts) on a tight pool, invariants and
    the host's view checked after every step (debug); afterwards every block is free or
    cached, and every request that was not aborted finished with 1..max_tokens tokens."""
    rng = np.random.default_rng(1)
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=64,
                    num_blocks=SMALL,
                    max_num_batched_tokens=32, steps_per_dispatch=3, debug=True)
    live, made, limits = set(), 0, {}
    while made < 500:
        for _ in range(min(int(rng.integers(0, 3)), 500 - made)):  # up to two per step
            n = int(rng.integers(1, 3))
            p = SamplingParams(n=n, temperature=float(rng.choice([0.0, 1.0])),
                               max_tokens=int(rng.integers(1, 12)), seed=made)
            eng.add_request(f"r{made}", prompts_of([int(rng.integers(1, 30))], seed=made)[0], p)
            live.add(f"r{made}")
            limits[f"r{made}"] = (n, p.max_tokens)
            made += 1
        if live and rng.random() < 0.1:
            victim = sorted(live)[int(rng.integers(len(live)))]
            eng.abort_request(victim)
            live.discard(victim)
        for o in [o for o in eng.step() if o.finished]:
            live.discard(o.request_id)
            n, max_tokens = limits[o.request_id]
            assert len(o.outputs) == n
            for c in o.outputs:
                assert 1 <= len(c.token_ids) <= max_tokens and c.finish_reason in ("stop",
                                                                                   "length")
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)
    assert not live
    stats = eng.stats()
    assert stats.blocks_used == stats.blocks_cached and stats.running == stats.waiting == 0
    eng.check()


def test_bad_requests_are_refused_and_change_nothing(model, steps, reference):
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=64,
                    num_blocks=SMALL,
                    max_num_batched_tokens=32, steps_per_dispatch=3, debug=True)
    tiny_pool = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=64,
                          num_blocks=6)
    (p,) = prompts_of([6], seed=3)
    eng.add_request("ok", p, GREEDY)
    bad = [
        (lambda: eng.abort_request("nope"), KeyError, "No unfinished request 'nope'"),
        (lambda: eng.add_request("e", [], GREEDY), ValueError, "prompt is empty"),
        (lambda: eng.add_request("v", [1, TINY.vocab_size], GREEDY), ValueError,
         f"Prompt token {TINY.vocab_size} at position 1 is outside the vocabulary"),
        (lambda: eng.add_request("ok", p, GREEDY), ValueError, "'ok' is already in use"),
        (lambda: eng.add_request("t", "text", GREEDY), ValueError, "needs a tokenizer"),
        (lambda: eng.add_request("long", [1] * 60, GREEDY), ValueError,
         r"prompt \(60 tokens\) \+ max_tokens \(12\) = 72 exceeds max_model_len 64"),
        (lambda: tiny_pool.add_request("big", [1] * 40, SamplingParams(max_tokens=20, n=4)),
         ValueError, r"prompt \(40 tokens\) \+ max_tokens \(20\) needs 11 blocks with n=4, "
                     r"more than the pool's 6 \(48 tokens\)"),
        (lambda: SamplingParams(max_tokens=0), ValueError, "max_tokens must be an int >= 1"),
        (lambda: SamplingParams(n=0), ValueError, "n must be an int >= 1"),
        (lambda: SamplingParams(temperature=-0.5), ValueError, "temperature must be >= 0"),
        (lambda: SamplingParams(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.5), ValueError,
         r"top_p must be in \(0, 1\] \(1 = off\). Got 1.5"),
    ]
    for call, error, message in bad:
        with pytest.raises(error, match=message):
            call()
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"]
    assert outs[0].outputs[0].token_ids == reference(p, 12)


def test_events_name_every_block_the_engine_stores_removes_and_clears(model, steps):
    """KV events (vLLM's names and fields) against hashes recomputed here with hashlib, and
    the scheduling events of a run that admits on a prefix hit, forks, preempts and evicts."""
    import hashlib

    from paged_jax.engine import events as ev

    seen = []
    eng = LLMEngine(model, steps=steps, block_size=8, max_num_seqs=4, max_model_len=64,
                    num_blocks=SMALL,
                    max_num_batched_tokens=32, steps_per_dispatch=3, debug=True)
    eng.add_listener(seen.append)
    (prefix,) = prompts_of([16], seed=21)
    tails = prompts_of([3, 5, 9, 2], seed=22)
    for i, t in enumerate(tails):
        eng.add_request(f"r{i}", prefix + t, SamplingParams(
            n=2 if i == 1 else 1, temperature=0.0, max_tokens=14))
    steps, lengths = 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:  # a finished sequence cached its prompt and all but its last
                lengths[o.request_id, c.index] = len(o.prompt_token_ids) + len(c.token_ids) - 1
        steps += 1
    eng.reset_prefix_cache()
    finished = [e for e in seen if isinstance(e, ev.Finished)]
    assert sorted((e.request_id, e.index) for e in finished) == sorted(lengths)
    for e in finished:
        assert e.tokens == lengths[e.request_id, e.index], e
        assert len(e.blocks) == -(-e.tokens // 8), e
    kinds = {type(e) for e in seen}
    assert {ev.Admitted, ev.Forked, ev.Preempted, ev.Finished, ev.StepDone, ev.BlockStored,
            ev.BlockRemoved, ev.AllBlocksCleared} <= kinds
    assert sum(isinstance(e, ev.StepDone) for e in seen) == steps
    admitted = [e for e in seen if isinstance(e, ev.Admitted)]
    assert any(e.hit_blocks for e in admitted)
    # One lookup record per admission, even for the sequence that waited (looked up again
    # each step until it fitted), and the hit rate is over those admissions only.
    assert [(rid, r.hit_tokens) for rid, r in eng.lookups] == [
        (e.request_id, e.lookup.hit_tokens) for e in admitted]
    assert eng.stats().prefix_cache_hit_rate == pytest.approx(
        sum(r.hit_tokens for _, r in eng.lookups)
        / sum(r.target_tokens - 1 for _, r in eng.lookups))
    stored = {}
    for e in seen:
        if isinstance(e, ev.BlockStored):
            parent = b"" if e.parent_block_hash is None else stored[e.parent_block_hash][0]
            digest = hashlib.sha256(parent + np.asarray(e.token_ids, np.int64).tobytes())
            assert e.block_hashes == [int.from_bytes(digest.digest()[:8], "big")]
            assert e.block_size == 8 and len(e.token_ids) == 8 and e.ref_counts[0] >= 2
            stored[e.block_hashes[0]] = (digest.digest(), e.block_ids[0])
        elif isinstance(e, ev.BlockRemoved):
            for h, b in zip(e.block_hashes, e.block_ids, strict=True):
                assert stored.pop(h)[1] == b
    assert isinstance(seen[-1], ev.AllBlocksCleared)
    stats = eng.stats()
    assert stats.blocks_cached == 0 and stats.blocks_used == 0


def test_tokens_are_timed_when_the_step_that_made_them_returns(model, steps):
    """A step that runs a prefill (first tokens) and a decode dispatch delivers both when it
    returns: every token it made, the first-token and finish times carry one time, between
    the call and the return (the first token's TTFT includes the decode that followed)."""
    engine = LLMEngine(model, steps=steps, block_size=16, num_blocks=64, max_num_seqs=4,
                       max_model_len=128, max_num_batched_tokens=32, steps_per_dispatch=4,
                       eos_token_id=None, first_tokens_first=False)
    engine.add_request("a", list(range(1, 9)), SamplingParams(temperature=0.0, max_tokens=9))
    seen, mixed = {}, 0
    while engine.has_unfinished_requests() or not seen:
        if len(seen) == 1 and "b" not in engine.requests and "b" not in seen:
            engine.add_request("b", list(range(3, 20)), SamplingParams(temperature=0.0,
                                                                       max_tokens=6))
        before = time.perf_counter()
        outs = engine.step()
        after = time.perf_counter()
        stamps = set()
        started = sum(out.request_id not in seen for out in outs)
        for out in outs:
            m, old = out.metrics, seen.get(out.request_id, 0)
            stamps |= set(m.token_times[old:])
            seen[out.request_id] = len(m.token_times)
            if old == 0:
                assert m.first_token_time == m.token_times[0]
            if out.finished:
                assert m.finished_time == m.token_times[-1]
        assert len(stamps) == 1 and before < stamps.pop() < after
        mixed += len(outs) == 2 and started == 1
    assert mixed  # some step gave b its first token and a its decoded ones
    assert seen == {"a": 9, "b": 6}


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps_while_prefilling=0), "steps_while_prefilling must be a positive int. Got 0."),
    (dict(steps_per_dispatch=4, steps_while_prefilling=5),
     r"steps_while_prefilling must be at most steps_per_dispatch \(4\). Got 5."),
    (dict(scheduling_policy="sjf"),
     r"scheduling_policy must be one of \('fcfs', 'shortest_first'\). Got 'sjf'."),
    *[(dict(max_dispatch_ms=v), "max_dispatch_ms must be a positive finite number of "
       f"milliseconds or None. Got {re.escape(repr(v))}.")
      for v in (0, -5.0, math.inf, True, "100")],
    *[(dict(prefill_tokens_while_decoding=v), r"prefill_tokens_while_decoding must be an "
       rf"int in \[1, max_num_batched_tokens=32\] or None. Got {re.escape(repr(v))}.")
      for v in (0, 33, True, 8.0)],
])
def test_bad_engine_arguments_name_the_value(model, steps, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine(model, steps, **kwargs)


def spy_decode_steps(eng, steps, calls, record=lambda rows, num_steps: (rows, num_steps)):
    """Append ``record(rows, num_steps)`` to ``calls`` for every decode dispatch ``eng``
    makes, before it runs."""
    def spy(*args, rows=None, num_steps, **kwargs):
        calls.append(record(rows, num_steps))
        return steps.decode_steps(*args, rows=rows, num_steps=num_steps, **kwargs)

    eng.steps = type("Spy", (), {"__getattr__": lambda _, n: getattr(steps, n),
                                 "decode_steps": staticmethod(spy)})()


def spy_dispatches(eng, steps, calls):
    """Append ``("prefill", tokens.shape)``, ``("packed", tokens.shape)``,
    ``("prefill_decode", tokens.shape)`` or ``("decode", num_steps)`` to ``calls`` for every
    dispatch ``eng`` makes, in order, before it runs."""
    spy_decode_steps(eng, steps, calls, lambda rows, num_steps: ("decode", num_steps))

    def prefill(params, kv, state, tokens, *args, **kwargs):
        calls.append(("prefill", tokens.shape))
        return steps.prefill(params, kv, state, tokens, *args, **kwargs)

    def prefill_packed(params, kv, state, tokens, *args):
        calls.append(("packed", tokens.shape))
        return steps.prefill_packed(params, kv, state, tokens, *args)

    def prefill_decode(params, kv, state, tokens, *args, **kwargs):
        calls.append(("prefill_decode", tokens.shape))
        return steps.prefill_decode(params, kv, state, tokens, *args, **kwargs)

    eng.steps.prefill, eng.steps.prefill_packed = prefill, prefill_packed
    eng.steps.prefill_decode = prefill_decode


@pytest.mark.parametrize("condense", [False, True])
@pytest.mark.parametrize("budget_ms", [1e-9, 1e9])
def test_decode_dispatches_k_steps_only_where_k_steps_took_at_most_max_dispatch_ms(
        model, steps, reference, budget_ms, condense):
    """All four requests are prefilled in the first iteration, then only decode. A
    dispatch is timed unless it is the first of its shape (rows, steps), which compiles; the
    engine runs K steps until some dispatch was timed. After that, a budget every dispatch
    exceeds gives one step a dispatch, one none exceeds K. The tokens are the dense
    reference's either way. With the rows condensed, the row count is the one they move
    into: it falls as requests finish, and a count not timed yet is bounded by the more rows
    timed, so it runs one step too."""
    llm = engine(model, steps, max_num_seqs=4, steps_per_dispatch=3, max_dispatch_ms=budget_ms,
                 condense_slots=condense)
    calls = []
    spy_decode_steps(llm.engine, steps, calls)
    prompts = prompts_of([4, 9, 6, 3], seed=7)
    lengths = [5, 9, 14, 20]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                  for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [[reference(p, n)] for p, n in zip(prompts, lengths, strict=True)]
    seen, timed, want = set(), set(), []
    for rows, _ in calls:  # a plain model of the choice: any time bounds every row count
        k = 3 if not timed or budget_ms > 1 else 1
        want.append(k)
        if (rows, k) in seen:
            timed.add(rows)
        seen.add((rows, k))
    assert [k for _, k in calls] == want and want[:2] == [3, 3]
    # Slot 3 decodes to the end: uncondensed, every dispatch computes 4 rows.
    assert sorted({rows for rows, _ in calls}) == ([1, 2, 4] if condense else [4])
    if budget_ms < 1:
        assert want.count(1) >= (2 if condense else 10), calls


def test_a_row_count_not_timed_yet_takes_the_time_of_fewer_rows(model, steps, reference):
    """r0 and r1 decode over 2 rows until such a dispatch is timed; then r2 and r3 join, over
    4 rows, a count never timed. A step over more rows takes at least as long, so with a
    budget every dispatch exceeds, each 4-row dispatch is one step from the first on (K = 3
    until a 4-row one was timed, without that bound). The tokens are the dense reference's."""
    llm = engine(model, steps, max_num_seqs=4, steps_per_dispatch=3, max_dispatch_ms=1e-9)
    eng, calls = llm.engine, []
    spy_decode_steps(eng, steps, calls)
    prompts = prompts_of([4, 9, 6, 3], seed=8)
    outs = {}

    def step():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})

    for i in (0, 1):
        eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=30))
    while (2, 1) not in calls:  # the second (2, 3) dispatch was timed: one step from then on
        step()
    assert calls[:2] == [(2, 3), (2, 3)], calls
    before = len(calls)
    for i in (2, 3):
        eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=20))
    while eng.has_unfinished_requests():
        step()
    wide = [k for rows, k in calls[before:] if rows == 4]
    assert len(wide) >= 10 and set(wide) == {1}, calls[before:]
    assert outs == {f"r{i}": reference(prompts[i], n)
                    for i, n in enumerate([30, 30, 20, 20])}


def test_a_row_count_not_timed_yet_takes_the_shortest_time_of_more_rows(model, steps,
                                                                       reference, monkeypatch):
    """On a clock the dispatches set, a step over 4 rows takes 40 ms and over 2 or 1 rows
    30, against a budget of 100 ms per K = 3 steps: 4 rows fit one step a dispatch, fewer
    fit K. The rows condense from 4 to 2 to 1 as requests finish. Each count's choice
    follows a plain model of the rule: K until any dispatch was timed; then a count's own
    last time, or where it has none the shortest of the more rows timed (an upper bound),
    or else the longest of the fewer. So the first 2-row dispatch runs one step (only 4 rows
    were timed, at 40 ms), and 1 row, untimed, runs K (2 rows took 30 ms). The tokens are
    the dense reference's."""
    from paged_jax.engine import llm_engine

    per_step = {4: 0.040, 2: 0.030, 1: 0.030}
    clock = [0.0]
    monkeypatch.setattr(llm_engine, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: clock[0])}))
    llm = engine(model, steps, max_num_seqs=4, steps_per_dispatch=3, max_dispatch_ms=100.0)
    calls = []

    def record(rows, num_steps):
        clock[0] += per_step[rows] * num_steps  # the dispatch's time on the engine's clock
        return rows, num_steps

    spy_decode_steps(llm.engine, steps, calls, record)
    prompts = prompts_of([4, 9, 6, 3], seed=9)
    lengths = [6, 7, 24, 40]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                  for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [[reference(p, n)] for p, n in zip(prompts, lengths, strict=True)]
    seen, timed, want = set(), {}, []
    for rows, _ in calls:
        more = [t for r, t in timed.items() if r > rows]
        t = timed.get(rows, min(more) if more else max(
            (t for r, t in timed.items() if r < rows), default=None))
        k = 3 if t is None or t * 3 * 1e3 <= 100.0 else 1
        want.append(k)
        if (rows, k) in seen:
            timed[rows] = per_step[rows]
        seen.add((rows, k))
    assert [k for _, k in calls] == want, calls
    first = {}
    for rows, k in calls:
        first.setdefault(rows, k)
    assert first == {4: 3, 2: 1, 1: 3}, calls


@pytest.mark.parametrize("first", [True, False])
def test_a_prompt_s_first_token_comes_back_from_its_prefill_alone(model, steps, reference,
                                                                   first):
    """r1 arrives while r0 decodes. With ``first_tokens_first`` the step that prefills r1
    runs no decode dispatch: it returns r1's first token and nothing new for r0, whose next
    token comes in the following step, beside r1's second. Without it, that step also
    decodes r0 one step (in a dispatch of its own). The tokens are the dense reference's
    either way."""
    llm = engine(model, steps, max_num_seqs=4, steps_per_dispatch=2, max_dispatch_ms=None,
                 first_tokens_first=first, decode_with_prefill=False)
    eng, calls = llm.engine, []
    spy_decode_steps(eng, steps, calls)
    prompts = prompts_of([5, 7], seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=9)
    eng.add_request("r0", prompts[0], greedy)

    def step():
        before = len(calls)
        new = {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}
        return new, [k for _, k in calls[before:]]

    assert step() == ({"r0": 1}, [])  # r0's prefill: nothing decodes yet
    assert step() == ({"r0": 3}, [2])
    eng.add_request("r1", prompts[1], greedy)
    if first:
        assert step() == ({"r1": 1}, [])
        assert step() == ({"r0": 5, "r1": 3}, [2])
    else:  # one step beside the prefill, which r1 joins
        assert step() == ({"r0": 4, "r1": 2}, [1])
        assert step() == ({"r0": 6, "r1": 4}, [2])
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
    assert [outs["r0"], outs["r1"]] == [reference(p, 9) for p in prompts]


@pytest.mark.parametrize("bucket", [True, False])
def test_decode_dispatches_compute_the_slots_up_to_the_highest_decoding_one(model, steps,
                                                                            reference, bucket):
    """Requests of different lengths leave their slots as they finish; each decode dispatch
    computes the power of two of rows covering the highest slot that decodes (every slot
    with ``bucket_decode_rows=False``), and the tokens are the dense reference's."""
    llm = engine(model, steps, max_num_seqs=4, steps_per_dispatch=3, bucket_decode_rows=bucket,
                 max_dispatch_ms=None, first_tokens_first=False)
    eng = llm.engine
    calls = []
    spy_decode_steps(eng, steps, calls, lambda rows, num_steps: (
        rows, max(s.slot for s in eng.scheduler.running if s.decoding), num_steps,
        eng.scheduler.prefill_pending()))
    prompts = prompts_of([4, 9, 6, 3, 7, 5], seed=5)
    lengths = [2, 4, 9, 3, 12, 6]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                  for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [[reference(p, n)] for p, n in zip(prompts, lengths, strict=True)]
    for rows, highest, _, _ in calls:
        assert rows == (1 << highest.bit_length() if bucket else 4), (rows, highest)
    # Some dispatch ran on fewer rows than slots, and both dispatch lengths ran.
    assert min(rows for rows, *_ in calls) == (1 if bucket else 4), calls
    assert {k for *_, k, _ in calls} == {1, 3}


def spy_moves_and_rows(eng, steps):
    """``(calls, moved)``: ``(rows, row count)`` of every decode dispatch ``eng`` makes (the
    rows it computes, and its running sequences that decode), and every ``Moved`` event."""
    calls, moved = [], []
    eng.add_listener(lambda e: moved.append(e) if isinstance(e, ev.Moved) else None)
    spy_decode_steps(eng, steps, calls, lambda rows, num_steps: (
        rows, sum(1 for s in eng.scheduler.running if s.decoding and s.remaining)))
    return calls, moved


@pytest.mark.parametrize("condense", [True, False])
def test_condensed_slots_put_the_decode_rows_in_the_lowest_slots(model, steps, reference,
                                                                  condense):
    """Rows left in high slots by shorter requests finishing below them move down before
    their dispatch (``condense_slots``): each decode dispatch then computes the power of two
    covering its row count, not its highest slot. The tokens are the dense reference's, and
    the prefix cache follows the moves: each full block a moved sequence filled is found
    again by a prompt that repeats the sequence."""
    llm = engine(model, steps, max_num_seqs=8, steps_per_dispatch=2, max_dispatch_ms=None,
                 first_tokens_first=False, condense_slots=condense)
    eng = llm.engine
    calls, moved = spy_moves_and_rows(eng, steps)
    prompts = prompts_of([4, 9, 6, 3, 7, 5, 8, 10], seed=6)
    lengths = [2, 3, 2, 4, 3, 2, 3, 17]  # the last, in the highest slot, outlives the rest
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                  for n in lengths], use_tqdm=False)
    want = [reference(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert token_ids(outs) == [[w] for w in want]
    covering = [(rows, 1 << (count - 1).bit_length()) for rows, count in calls]
    if condense:
        assert all(rows == cover for rows, cover in covering), covering
        assert moved
    else:
        assert any(rows > cover for rows, cover in covering), covering
        assert not moved
    eng.lookups.clear()
    again = [p + w[:-1] for p, w in zip(prompts, want, strict=True)]
    llm.generate(again, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    bs = eng.cache_config.block_size
    assert [record.hit_tokens for _, record in eng.lookups] == [
        (len(t) - 1) // bs * bs for t in again]


def test_a_decoding_row_swaps_slots_with_a_prompt_being_prefilled(model, steps, reference):
    """Two slots: when the short request in slot 0 finishes, a long prompt takes slot 0 and
    is prefilled in chunks while the row in slot 1 decodes. The row swaps into slot 0 (a
    dispatch of one row, not two) and the prompt goes on in slot 1, each one's prefix-cache
    chain with it: prompts that repeat them find the blocks they entered, as without the
    move."""
    prompts = prompts_of([4, 5, 40], seed=7)
    lengths = [1, 12, 2]
    want = [reference(p, n) for p, n in zip(prompts, lengths, strict=True)]
    again = [prompts[i] + want[i][:-1] + [7] for i in (1, 2)]
    hits = {}
    for condense in (True, False):
        llm = engine(model, steps, max_num_seqs=2, steps_per_dispatch=1, max_dispatch_ms=None,
                     first_tokens_first=False, prefill_tokens_while_decoding=8,
                     condense_slots=condense)
        eng = llm.engine
        calls, moved = spy_moves_and_rows(eng, steps)
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                      for n in lengths], use_tqdm=False)
        assert token_ids(outs) == [[w] for w in want]
        if condense:
            assert {(e.request_id, e.from_slot, e.to_slot) for e in moved} >= {
                ("req-1", 1, 0), ("req-2", 0, 1)}
            assert all(rows == count for rows, count in calls) and (1, 1) in calls, calls
        else:
            assert not moved and (2, 1) in calls, calls
        eng.lookups.clear()
        llm.generate(again, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        hits[condense] = [record.hit_tokens for _, record in eng.lookups]
    assert hits[True] == hits[False] and min(hits[True]) > 0, hits
