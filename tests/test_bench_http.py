"""``paged-jax bench serve --http`` (``server.bench_http``) on a tiny random Llama saved by
transformers: every request streams to completion through the real server, with the greedy
tokens the in-process ``PagedServer`` makes for the same requests, timed where the client
saw them; the CLI runs the system; the HTTP goal line, checked by hand."""

import math

import pytest

from paged_jax.engine import bench_serve
from paged_jax.engine.serve_metrics import Request, Timing
from paged_jax.server import bench_client
from paged_jax.server.bench_http import HttpServer

SEQS = 4
# Arrivals far enough apart that the server takes the requests in this order (the client-side
# test pairs each with the engine's own record by arrival order).
SPACED = (0.0, 0.1, 0.2, 0.3, 0.4)


def _args(*extra):
    return bench_serve.build_parser().parse_args(
        ["--max-num-batched-tokens", "32", "--steps-per-dispatch", "2", "--kv-cache-mib", "1",
         *extra])


def _workload(arrivals):
    # Prompts of 7..19 tokens and 3..6 output tokens: several chunks per prompt, K=2 dispatches.
    return [Request(tuple((7 * i + j) % 256 for j in range(7 + 3 * i)), 3 + i % 4, t)
            for i, t in enumerate(arrivals)]


@pytest.fixture(scope="module")
def served(tiny_hf_dir):
    """Per workload (all at once, spaced): the requests, the in-process timings, the HTTP
    timings and the HTTP engine's records of the timed pass; and the HTTP server."""
    ours, _, _ = bench_serve.load(str(tiny_hf_dir))
    paged = bench_serve.PagedServer(ours, _args(), max_len=32)
    http = HttpServer(ours, _args(), 32, steps=paged.steps)
    out = {}
    for name, arrivals in (("inf", (0.0,) * 6), ("spaced", SPACED)):
        reqs = _workload(arrivals)
        timings = http.serve(reqs, SEQS)
        records = [m for _, m in http.paged.engine(SEQS).finished_metrics[-len(reqs):]]
        out[name] = reqs, paged.serve(reqs, SEQS), timings, records, list(http.engine_side)
    return out, http


@pytest.mark.parametrize("workload", ["inf", "spaced"])
def test_http_tokens_and_times(served, workload):
    out, http = served
    reqs, in_process, timings, _, _ = out[workload]
    start = timings[0].arrival - reqs[0].arrival
    for r, ref, t in zip(reqs, in_process, timings, strict=True):
        assert t.tokens == ref.tokens  # greedy does not depend on the batch or the transport
        assert len(t.tokens) == len(t.token_times) == r.output_len
        assert t.prompt_len == len(r.prompt)
        assert t.arrival == pytest.approx(start + r.arrival, abs=1e-9)  # the scheduled one
        assert t.arrival < t.token_times[0]
        assert t.token_times == sorted(t.token_times) and t.token_times[-1] <= t.finish
    assert not http.app(SEQS).state.server.aengine.running  # uvicorn shut the loop down


def test_times_are_the_clients(served):
    """Each token reached the client after the engine stamped it, and a request finished
    at the client after it finished in the engine."""
    _, _, timings, records, engine_side = served[0]["spaced"]
    records = sorted(records, key=lambda m: m.arrival_time)
    # engine_side is the engine's record of each request, paired by its completion id.
    for e, m, t in zip(engine_side, records, timings, strict=True):
        assert (e.arrival, e.token_times, e.finish) == (m.arrival_time, list(m.token_times),
                                                        m.finished_time)
        assert e.tokens == t.tokens and e.ttft < t.ttft
    for t, m in zip(timings, records, strict=True):
        assert len(m.token_times) == len(t.token_times)
        assert t.arrival <= m.arrival_time
        assert all(c > e for c, e in zip(t.token_times, m.token_times, strict=True))
        assert t.finish > m.finished_time
    # A chunk's tokens share its time, as one dispatch's share the engine's stamp.
    for t, m in zip(timings, records, strict=True):
        assert ([a == b for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
                == [a == b for a, b in zip(m.token_times, m.token_times[1:], strict=False)])


def test_a_refused_request_names_itself(served):
    _, http = served
    too_long = Request(tuple(range(40)), 3)  # 43 tokens > max_model_len 32
    with pytest.raises(RuntimeError, match=r"request 1: HTTP 400"):
        http.serve([_workload([0.0])[0], too_long], SEQS)
    assert not http.app(SEQS).state.server.aengine.running


def test_the_client_runs_in_a_process_of_its_own(served, monkeypatch):
    """The server's process never runs the client's replay (it would share the server's
    interpreter lock); the child's results come back whole."""
    out, http = served
    reqs, in_process, _, _, _ = out["spaced"]

    def in_this_process(*args, **kwargs):
        raise AssertionError("the client replayed in the server's process")

    monkeypatch.setattr(bench_client, "replay", in_this_process)
    timings = http.serve(reqs, SEQS)
    assert [t.tokens for t in timings] == [t.tokens for t in in_process]
    assert all(isinstance(x, float) for t in timings for x in (t.arrival, *t.token_times))


def test_a_client_that_cannot_connect_says_so():
    import socket

    with socket.socket() as sock:  # bound, not listening: a connection is refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="the benchmark client failed: ConnectError"):
            bench_client.replay_in_subprocess(url, [Request((1, 2, 3), 2)], "m")


def test_cli_runs_the_http_system(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf_dir), "--dataset", "random", "--num-prompts", "4",
            "--random-input-len", "16", "--max-output-len", "4", "--max-num-seqs", str(SEQS),
            "--request-rate", "inf", "--max-num-batched-tokens", "32", "--steps-per-dispatch",
            "2", "--kv-cache-mib", "1", "--systems", "paged_jax", "--http",
            "--blocks-history", "0", "--repeats", "2", "--out", str(out)]
    assert bench_serve.main(argv) == 0
    import json

    results = json.loads((out / "serve.json").read_text())["results"]
    assert [r["system"] for r in results] == ["paged_jax", bench_serve.HTTP]
    for r in results:
        assert r["completed"] == 4 and r["output_tokens"] == 16
        assert r["greedy_agree"] == 4
        # Two timed runs each; the reported figures are their medians.
        assert len(r["repeats"]) == 2
        # The HTTP runs carry their engine's timing of the same requests: never later.
        assert ("engine_side" in r) == (r["system"] != "paged_jax")
        if "engine_side" in r:
            assert r["engine_side"]["ttft_ms"]["p50"] < r["ttft_ms"]["p50"]
        for key in ("duration_s", "output_throughput"):
            assert r[key] == pytest.approx(sum(x[key] for x in r["repeats"]) / 2)
        assert r["ttft_ms"]["p50"] == pytest.approx(
            sum(x["ttft_ms"]["p50"] for x in r["repeats"]) / 2)
        # Pooled: the 8 requests of both repeats taken together.
        assert r["pooled"]["requests"] == 8
        assert min(x["ttft_ms"]["p50"] for x in r["repeats"]) <= r["pooled"]["ttft_ms"]["p50"]
        assert r["pooled"]["ttft_ms"]["p50"] <= max(x["ttft_ms"]["p99"] for x in r["repeats"])
    printed = capsys.readouterr().out
    assert "rate inf, max_num_seqs 4: HTTP vs in-process: TTFT p50 " in printed
    assert "; pooled over repeats (8 / 8 requests): TTFT p50 " in printed


def _result(system, ttft, itl, m=16):
    return {"system": system, "rate": math.inf, "max_num_seqs": m, "output_throughput": 1.0,
            "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl, "p99": itl}}


def test_http_goal_by_hand():
    results = [_result("paged_jax", 200.0, 40.0), _result(bench_serve.HTTP, 210.0, 46.0),
               _result("paged_jax", 100.0, 50.0, m=4), _result(bench_serve.HTTP, 90.0, 55.0, m=4),
               _result("paged_jax", 100.0, None, m=1), _result(bench_serve.HTTP, 120.0, None, m=1),
               _result(bench_serve.HTTP, 100.0, 10.0, m=8)]  # no paged_jax to compare with
    http_lines = [x for x in bench_serve.goals(results) if "HTTP" in x]
    # 210/200 = +5%, 46/40 = +15% > 10%; 90/100 = -10%, 55/50 = +10% (at the goal); 120/100.
    assert http_lines == [
        "rate inf, max_num_seqs 1: HTTP vs in-process: TTFT p50 +20.0%, ITL p50 n/a "
        "(goal <= 10%: not met)",
        "rate inf, max_num_seqs 4: HTTP vs in-process: TTFT p50 -10.0%, ITL p50 +10.0% "
        "(goal <= 10%: met)",
        "rate inf, max_num_seqs 16: HTTP vs in-process: TTFT p50 +5.0%, ITL p50 +15.0% "
        "(goal <= 10%: not met)"]


def test_median_summary_by_hand():
    runs = [{"completed": 4, "duration_s": 3.0, "ttft_ms": {"p50": 10.0, "p99": 30.0},
             "itl_ms": {"p50": None}, "label": "a"},
            {"completed": 4, "duration_s": 1.0, "ttft_ms": {"p50": 50.0, "p99": 20.0},
             "itl_ms": {"p50": 7.0}, "label": "b"},
            {"completed": 4, "duration_s": 2.0, "ttft_ms": {"p50": 20.0, "p99": 10.0},
             "itl_ms": {"p50": 9.0}, "label": "c"}]
    assert bench_serve.median_summary(runs) == {
        "completed": 4.0, "duration_s": 2.0, "ttft_ms": {"p50": 20.0, "p99": 20.0},
        "itl_ms": {"p50": None}, "label": "a"}
    assert isinstance(bench_serve.median_summary(runs)["completed"], int)
    assert bench_serve.median_summary(runs[:1]) == runs[0]


def test_http_goal_against_its_own_engine_by_hand():
    http = {**_result(bench_serve.HTTP, 210.0, 46.0),
            "engine_side": {"ttft_ms": {"p50": 200.0}, "itl_ms": {"p50": 44.0}}}
    # 210/200 = +5%, 46/44 = +4.5%: within 10% of its engine; +15% ITL against in-process.
    assert bench_serve.http_goal(_result("paged_jax", 200.0, 40.0), http) == (
        "HTTP vs in-process: TTFT p50 +5.0%, ITL p50 +15.0% (goal <= 10%: not met); HTTP vs "
        "its engine, same requests: TTFT p50 +5.0%, ITL p50 +4.5% (met)")


def test_http_goal_paired_by_repeat_by_hand():
    # The machine slowed down between repeats: in-process TTFT 100, 200, 300 ms, and HTTP
    # 105, 330, 315 ms. Each system's median (200 against 315 ms) compares runs of
    # different repeats; the pairs (1.05, 1.65, 1.05) do not.
    paged = {**_result("paged_jax", 200.0, 40.0),
             "repeats": [_result("paged_jax", t, 40.0) for t in (100.0, 200.0, 300.0)]}
    http = {**_result(bench_serve.HTTP, 315.0, 41.0),
            "repeats": [_result(bench_serve.HTTP, t, i)
                        for t, i in ((105.0, 40.0), (330.0, 41.0), (315.0, 42.0))]}
    assert bench_serve.http_goal(paged, http) == (
        "HTTP vs in-process: TTFT p50 +57.5%, ITL p50 +2.5% (goal <= 10%: not met); paired by "
        "repeat (median of 3): TTFT p50 +5.0%, ITL p50 +2.5% (met)")
    http["repeats"][0] = _result(bench_serve.HTTP, 120.0, 40.0)  # TTFT 1.20, 1.65, 1.05
    assert bench_serve.http_goal(paged, http).endswith(
        "paired by repeat (median of 3): TTFT p50 +20.0%, ITL p50 +2.5% (not met)")
    http["repeats"][1] = _result(bench_serve.HTTP, 330.0, None)  # a repeat without an ITL
    assert bench_serve.http_goal(paged, http).endswith(
        "paired by repeat (median of 3): TTFT p50 +20.0%, ITL p50 n/a (not met)")


def test_pooled_latency_by_hand():
    # Two repeats of two requests: TTFTs 1, 4 and 2, 10 s; one-token ITLs 1, 3 and 5, 7 s.
    def timing(ttft, gap):
        return Timing(0.0, [ttft, ttft + gap], ttft + gap, 3, [1, 2])

    pooled = bench_serve.pooled_latency([timing(1, 1), timing(4, 3), timing(2, 5),
                                         timing(10, 7)])
    assert pooled["requests"] == 4
    assert pooled["ttft_ms"]["p50"] == pytest.approx(3000.0)  # median of 1, 2, 4, 10 s
    assert pooled["itl_ms"]["p50"] == pytest.approx(4000.0)   # median of 1, 3, 5, 7 s
    assert pooled["ttft_ms"]["mean"] == pytest.approx(4250.0)
    assert set(pooled) == {"requests", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def test_http_goal_pooled_by_hand():
    # One slow repeat on the HTTP side moves the pairs' median but not the pooled median.
    paged = {**_result("paged_jax", 200.0, 40.0),
             "repeats": [_result("paged_jax", t, 40.0) for t in (100.0, 200.0, 300.0)],
             "pooled": {"requests": 48, "ttft_ms": {"p50": 200.0}, "itl_ms": {"p50": 40.0}}}
    http = {**_result(bench_serve.HTTP, 330.0, 41.0),
            "repeats": [_result(bench_serve.HTTP, t, 41.0) for t in (150.0, 330.0, 315.0)],
            "pooled": {"requests": 48, "ttft_ms": {"p50": 216.0}, "itl_ms": {"p50": 42.0}}}
    # Pairs 1.5, 1.65, 1.05: +50%; pooled 216/200 = +8%, 42/40 = +5%.
    assert bench_serve.http_goal(paged, http) == (
        "HTTP vs in-process: TTFT p50 +65.0%, ITL p50 +2.5% (goal <= 10%: not met); paired by "
        "repeat (median of 3): TTFT p50 +50.0%, ITL p50 +2.5% (not met); pooled over repeats "
        "(48 / 48 requests): TTFT p50 +8.0%, ITL p50 +5.0% (met)")


def test_bad_server_options_name_themselves():
    with pytest.raises(ValueError, match="blocks-history"):
        bench_serve.check_args(_args("--blocks-history", "-1"))
    with pytest.raises(ValueError, match="blocks_history"):
        HttpServer(None, _args(), 32, options={"blocks_history": -1})
    with pytest.raises(ValueError, match="--repeats must be >= 1, got 0"):
        bench_serve.check_args(_args("--repeats", "0"))
    with pytest.raises(TypeError, match="no_such_field"):
        HttpServer(None, _args(), 32, options={"no_such_field": 1})
