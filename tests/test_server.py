"""``paged-jax serve`` through real clients on 127.0.0.1: the official ``openai`` client, httpx,
Prometheus' parser and headless Chromium. The model is a small random Llama with SmolLM2's
real tokenizer and chat template (from its GGUF file), so prompts and answers are text; the
reference for every answer is ``LLM.generate`` (or ``LLM.chat``) of the same prompt alone, on
an engine of the same configuration."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import types
import warnings

import httpx
import jax
import numpy as np
import openai
import pytest
from flax import nnx
from prometheus_client.parser import text_string_to_metric_families

from paged_jax.engine import events as ev
from paged_jax.engine.llm import LLM
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.warmup import packed_widths, prefill_shapes
from paged_jax.model import ModelConfig, init_model
from paged_jax.model.tokenizer import Tokenizer, default_gguf_path
from paged_jax.server.app import ServerConfig, build_app
from paged_jax.server.metrics import delivery_gaps
from paged_jax.server.thread import running

ENGINE = dict(block_size=16, num_blocks=1024, max_num_seqs=8, max_model_len=1024,
              max_num_batched_tokens=128, steps_per_dispatch=4)
MODEL = "tiny-smollm2-vocab"
TIE = 1e-4  # a greedy difference where the reference's top-2 margin is below this is a tie
TIMEOUT = 120  # every load test ends by itself within this


@pytest.fixture(scope="module")
def parts():
    tok = Tokenizer.from_gguf(default_gguf_path())
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                      tie_word_embeddings=True)
    return init_model(cfg, seed=0), tok


@pytest.fixture(scope="module")
def served(parts):
    """(server thread, its engine, the events it published, a reference LLM)."""
    model, tok = parts
    llm = LLM.from_model(model, tok, **ENGINE)
    events = []
    llm.engine.add_listener(events.append)
    ref = LLM.from_model(model, tok, steps=llm.engine.steps, **ENGINE)
    app = build_app(llm.engine, ServerConfig(model_name=MODEL))
    with running(app) as url:
        yield types.SimpleNamespace(
            url=url, engine=llm.engine, events=events, ref=ref,
            aengine=app.state.server.aengine,
            client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def idle_and_clean(s) -> None:
    """No request is left, the allocator's invariants hold, and the only blocks in use are
    those the prefix cache keeps: no finished or aborted request holds one."""
    def check(engine):
        engine.check()
        return engine.stats(), jax.device_get(engine.state.active)

    stats, active = s.aengine.call_from_thread(check)
    assert stats.running == stats.waiting == 0, stats
    assert not np.asarray(active).any()
    assert stats.blocks_used == stats.blocks_cached, stats


def top2_margin(parts, ids: list[int]) -> float:
    """The reference model's top-2 logit margin after ``ids`` (a dense forward pass)."""
    model, _ = parts
    logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, np.asarray([ids], np.int32)))
    top = np.sort(logits[0, -1])[-2:]
    return float(top[1] - top[0])


def compare(parts, prompt_ids, got_ids, want_ids, ties: list) -> None:
    """``got_ids == want_ids``, unless they part where the reference's margin is a tie."""
    if got_ids == want_ids:
        return
    k = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids, strict=False)) if a != b),
             min(len(got_ids), len(want_ids)))
    margin = top2_margin(parts, list(prompt_ids) + list(want_ids[:k]))
    assert margin < TIE, f"greedy tokens differ at {k} with a top-2 margin of {margin}"
    ties.append((k, margin))


# -- the official client ---------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_with_the_openai_client(served, parts):
    r = served.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                              temperature=0)
    want = served.ref.chat(MESSAGES, greedy(24), use_tqdm=False)[0]
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    idle_and_clean(served)


def test_streamed_chat_equals_the_non_streamed_one(served):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0)
    whole = served.client.chat.completions.create(**kw)
    chunks = list(served.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    # K = 4 tokens per dispatch: 30 tokens come in several chunks, not one.
    assert len(deltas) >= 30 // ENGINE["steps_per_dispatch"]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completion_with_n_2(served):
    prompt = "Once upon a time"
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=2,
                                         temperature=1.0, seed=7)
    want = served.ref.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=7,
                                                      max_tokens=12), use_tqdm=False)[0]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.text for o in want.outputs]
    assert r.choices[0].text != r.choices[1].text  # two draws, not one twice
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    idle_and_clean(served)


def test_a_stop_string_ends_the_stream_where_it_ends_the_whole_answer(served):
    """The stop string straddles two chunks: the stream must hold back its first part until
    it knows whether the string completes."""
    kw = dict(model=MODEL, prompt="The weather today", max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in served.client.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].text]
    text = "".join(pieces)
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    whole = served.client.completions.create(**kw, stop=stop)
    streamed = "".join(c.choices[0].text for c in served.client.completions.create(
        **kw, stop=stop, stream=True) if c.choices)
    assert whole.choices[0].text == text[: text.find(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].text


# -- many clients at once --------------------------------------------------------------------

PROMPTS = [f"Question {i}: tell me about the number {i * 7 + 3} and its neighbours."
           for i in range(32)]


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of one streamed completion."""
    text, ids, finish = [], [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text.append(choice["text"])
            ids.extend(choice["token_ids"])
            finish = choice["finish_reason"] or finish
    return "".join(text), ids, finish


def test_32_concurrent_streams_each_equal_the_prompt_alone(served, parts):
    peak = []
    served.engine.add_listener(
        lambda e: peak.append(len(e.slots)) if isinstance(e, ev.StepDone) else None)

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT) as client:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 10 + i % 7,
                       "temperature": 0, "stream": True, "return_token_ids": True}
                      for i, p in enumerate(PROMPTS)]
            return await asyncio.wait_for(
                asyncio.gather(*(_stream(client, b) for b in bodies)), TIMEOUT)

    results = asyncio.run(run())
    ties = []
    for i, (prompt, (text, ids, finish)) in enumerate(zip(PROMPTS, results, strict=True)):
        want = served.ref.generate(prompt, greedy(10 + i % 7), use_tqdm=False)[0]
        compare(parts, want.prompt_token_ids, ids, want.outputs[0].token_ids, ties)
        if ids == want.outputs[0].token_ids:
            assert text == want.outputs[0].text
            assert finish == want.outputs[0].finish_reason
    if ties:
        warnings.warn(f"greedy ties (position, margin) left unchecked: {ties}", stacklevel=1)
    # They ran as one batch: the engine's 8 rows filled up with requests from many clients.
    assert max(peak) == ENGINE["max_num_seqs"]
    idle_and_clean(served)


def test_disconnected_clients_abort_and_free_their_blocks(served):
    """8 clients leave mid-stream (each asked for 600 tokens); 4 others finish unaffected."""
    finished = []
    served.engine.add_listener(
        lambda e: finished.append((e.request_id, e.reason)) if isinstance(e, ev.Finished)
        else None)
    done_before = served.aengine.call_from_thread(lambda e: len(e.finished_metrics))

    async def leave(client, i) -> str:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 600, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):  # the first chunk: it is running; now leave
                    return json.loads(line.removeprefix("data: "))["id"].removeprefix("cmpl-")
        raise AssertionError("the stream ended before its first chunk")

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT) as client:
            stay = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0,
                     "stream": True, "return_token_ids": True} for p in PROMPTS[:4]]
            return await asyncio.wait_for(asyncio.gather(
                asyncio.gather(*(leave(client, 8 + i) for i in range(8))),
                asyncio.gather(*(_stream(client, b) for b in stay))), TIMEOUT)

    left, stayed = asyncio.run(run())
    served.aengine.call_from_thread(lambda e: None)  # one step boundary after the last abort
    gone = {f"{base}-0" for base in left}
    assert len(gone) == 8
    reasons = {rid: reason for rid, reason in finished if rid in gone}
    assert set(reasons.values()) <= {"abort"}, reasons  # none ran to its 600 tokens
    for prompt, (_, ids, _) in zip(PROMPTS[:4], stayed, strict=True):
        assert ids == served.ref.generate(prompt, greedy(12), use_tqdm=False)[0] \
            .outputs[0].token_ids
    new = served.aengine.call_from_thread(lambda e: [rid for rid, _ in
                                                     e.finished_metrics[done_before:]])
    assert len(new) == 4 and not set(new) & gone
    idle_and_clean(served)


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(served):
    finished = []
    served.engine.add_listener(
        lambda e: finished.append(e.reason) if isinstance(e, ev.Finished) else None)
    done_before = served.aengine.call_from_thread(lambda e: len(e.finished_metrics))
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 990, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.3)
    deadline = TIMEOUT
    while served.aengine.call_from_thread(lambda e: e.has_unfinished_requests()):
        deadline -= 0.1
        assert deadline > 0, "the request was not aborted"
        asyncio.run(asyncio.sleep(0.1))
    assert finished == ["abort"]  # it did not run to its 990 tokens
    assert served.aengine.call_from_thread(lambda e: len(e.finished_metrics)) == done_before
    idle_and_clean(served)


def test_several_prompts_in_one_completion_request(served):
    prompts = ["Hello there", "A list of fruits:"]
    r = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2,
                                         temperature=0)
    want = served.ref.generate(prompts, greedy(6, n=2), use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.text for w in want for o in w.outputs]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


# -- bad input -------------------------------------------------------------------------------

BAD = [  # (body changes, the field the 400 names, a piece of its message)
    ({"max_tokens": -5}, "max_tokens", "-5"),
    ({"temperature": -0.5}, "temperature", "-0.5"),
    ({"top_p": 0}, "top_p", "0"),
    ({"n": 0}, "n", "0"),
    ({"model": "gpt-9"}, "model", "gpt-9"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt", "1000000000"),
    ({"max_tokens": 5000}, "prompt", "5000"),  # can never fit max_model_len 1024
]


@pytest.mark.parametrize("change,param,piece", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_field_gets_a_400_that_names_it(served, change, param, piece):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and piece in err["message"], err
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(**body)
    idle_and_clean(served)  # nothing was queued


def test_unknown_fields_are_ignored_and_the_server_keeps_serving(served):
    r = httpx.post(f"{served.url}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
        "frequency_penalty": 0.0, "user": "someone", "logit_bias": {}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    bad = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{served.url}/health").status_code == 200


# -- metrics ---------------------------------------------------------------------------------

def test_metrics_parse_and_match_the_engine(served):
    served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=9,
                                     temperature=0)
    text = httpx.get(f"{served.url}/metrics", timeout=TIMEOUT).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(name, **labels):
        return samples[("paged_jax:" + name, tuple(sorted(labels.items())))]

    stats, ms = served.aengine.call_from_thread(
        lambda e: (e.stats(), [m for _, m in e.finished_metrics]))
    assert value("num_requests_running") == stats.running
    assert value("num_requests_waiting") == stats.waiting
    assert value("kv_cache_usage_perc") == pytest.approx(stats.block_occupancy)
    assert value("kv_cache_token_usage_perc") == pytest.approx(stats.token_occupancy)
    assert value("kv_cache_blocks", state="used") == stats.blocks_used
    assert value("kv_cache_blocks", state="free") == stats.blocks_free
    assert value("kv_cache_blocks", state="cached") == stats.blocks_cached
    assert value("prefix_cache_queries_total") == stats.prefix_cache_queries > 0
    assert value("prefix_cache_hits_total") == stats.prefix_cache_hits
    assert value("num_preemptions_total") == stats.preemptions
    # The histograms hold every finished request's figures, from the engine's own times.
    assert value("time_to_first_token_seconds_count") == stats.finished == len(ms)
    assert value("time_to_first_token_seconds_sum") == pytest.approx(sum(m.ttft for m in ms))
    gaps = [g for m in ms for g in delivery_gaps(m.token_times)]
    assert value("inter_token_latency_seconds_count") == len(gaps)
    assert value("inter_token_latency_seconds_sum") == pytest.approx(sum(gaps))
    assert value("e2e_request_latency_seconds_count") == len(ms)


# -- the block page --------------------------------------------------------------------------

def test_blocks_page_renders_live_in_chromium_with_no_other_request(served):
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("PAGED_JAX_CHROMIUM", "/usr/bin/chromium")
    assert os.path.exists(chromium) or shutil.which(chromium), f"no Chromium at {chromium}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", "--disable-sync"]
    served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5)
    stats = served.aengine.call_from_thread(lambda e: e.stats())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page()
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{served.url}/blocks")
        page.wait_for_selector("#grid")
        label = page.text_content("#label")
        data = page.evaluate("D")
        browser.close()
    assert not errors, errors
    assert set(requests) == {f"{served.url}/blocks"}, requests  # reloads are the page itself
    last = len(data["steps"]) - 1
    assert label == f"step {last} / {last}"  # a live page opens on the newest step
    assert data["refresh"] > 0 and data["numBlocks"] == ENGINE["num_blocks"]
    assert data["steps"][-1]["numFree"] == stats.blocks_free


# -- who may call it -------------------------------------------------------------------------

def test_api_key_and_body_limit(parts, served):
    model, tok = parts
    llm = LLM.from_model(model, tok, steps=served.engine.steps, **ENGINE)
    app = build_app(llm.engine, ServerConfig(model_name=MODEL, api_key="sk-right",
                                             max_request_bytes=2048, blocks_history=0))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with running(app) as base:
        url = f"{base}/v1/completions"
        assert httpx.post(url, json=body).status_code == 401
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200  # no key needed
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0) \
                .completions.create(**body)
        right = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-right", max_retries=0)
        assert right.completions.create(**body).usage.completion_tokens == 2
        key = {"Authorization": "Bearer sk-right"}
        big = {**body, "prompt": "x" * 4000}
        r = httpx.post(url, json=big, headers=key)
        assert r.status_code == 413 and "2048" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 512):
                yield data[i:i + 512]

        assert httpx.post(url, content=chunks(), headers={
            **key, "Content-Type": "application/json"}).status_code == 413
        assert right.completions.create(**body).usage.completion_tokens == 2  # still serving
        assert httpx.get(f"{base}/blocks", headers=key).status_code == 404


def test_the_serve_command_serves_token_ids_and_reads_its_key_from_the_environment():
    """``paged-jax serve --model tiny --warmup`` as a user starts it: it compiles before it
    listens; a random model without a tokenizer takes token ids; PAGED_JAX_API_KEY guards
    it."""
    import re
    import subprocess
    import sys
    import time

    env = {**os.environ, "PAGED_JAX_API_KEY": "sk-env", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "paged_jax.cli", "serve", "--model", "tiny", "--port", "0",
           "--max-model-len", "64", "--kv-cache-mib", "4", "--max-num-seqs", "2",
           "--max-num-batched-tokens", "32", "--warmup"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline, seen = time.monotonic() + TIMEOUT, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if found or (not line and proc.poll() is not None):
                break
        assert found, "".join(seen)
        shapes = len(prefill_shapes(2, 32)) + len(packed_widths(32))
        assert f"compiled {shapes} prefill shapes" in "".join(seen)
        url, key = found.group(1), {"Authorization": "Bearer sk-env"}
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=key).json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"{url}/v1/completions", headers=key, timeout=TIMEOUT, json={
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
        chat = httpx.post(f"{url}/v1/chat/completions", headers=key, json={
            "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("value", ["-5", "inf"])
def test_serve_refuses_a_bad_max_dispatch_ms_before_loading_anything(value):
    from paged_jax.server import cli as server_cli

    with pytest.raises(SystemExit, match=r"--max-dispatch-ms must be >= 0 and finite \(0: off\), "
                       f"got {float(value)}"):
        server_cli.main(["--max-dispatch-ms", value])


def test_serve_refuses_a_bad_prefill_budget_before_loading_anything():
    from paged_jax.server import cli as server_cli

    with pytest.raises(SystemExit, match=r"--prefill-tokens-while-decoding must be in \[0, "
                       r"--max-num-batched-tokens=512\] \(0: the same\), got 513"):
        server_cli.main(["--prefill-tokens-while-decoding", "513"])


@pytest.mark.parametrize("flag", [True, False])
def test_serve_one_dispatch_and_no_condense_slots_reach_the_engine(monkeypatch, flag):
    """``--one-dispatch`` reaches the engine as both settings, and the engine made from
    them merges the chunk with the decode step; without it both stay off.
    ``--no-condense-slots`` turns ``condense_slots`` off; without it, it stays on."""
    import uvicorn

    from paged_jax.engine import llm as llm_module
    from paged_jax.server import app as app_module
    from paged_jax.server import cli as server_cli

    made = []

    class Made(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.engine)

    monkeypatch.setattr(llm_module, "LLM", Made)
    monkeypatch.setattr(app_module, "build_app", lambda engine, config: None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    argv = ["--model", "tiny", "--max-model-len", "64", "--kv-cache-mib", "4",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    assert server_cli.main(argv + ["--one-dispatch", "--no-condense-slots"] * flag) == 0
    (engine,) = made
    assert engine.condense_slots is not flag
    assert engine.decode_with_prefill is flag
    assert engine.scheduler.one_prefill_chunk is flag
    assert engine.scheduler.first_tokens_first is not flag
