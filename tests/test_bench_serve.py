"""``paged-jax bench serve`` end to end on a tiny random Llama saved by transformers: every
server completes every request with exactly its output length, greedy tokens agree across the
three servers, the figures are consistent with the workload, and the files are written."""

import json
import math
import re

import pytest
import torch

from paged_jax.engine import bench_serve
from paged_jax.engine.serve_metrics import Request
from paged_jax.model.llama import init_model
from tests.model_helpers import TINY


@pytest.mark.parametrize("systems, rates", [
    (bench_serve.SYSTEMS, ("inf", "50")),
    (("paged_jax", *bench_serve.ABLATIONS), ("inf",))], ids=["the servers", "the ablations"])
def test_sweep_on_a_tiny_model(tiny_hf_dir, tmp_path, systems, rates):
    """The benchmark as run by default (its three servers, at two rates), then paged_jax
    beside each of its ablations; the first is the issue's "serve benchmark on the tiny
    model" (pytest --durations reports its time)."""
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf_dir), "--dataset", "random", "--num-prompts", "6",
            "--random-input-len", "24", "--max-output-len", "5", "--max-num-seqs", "4",
            "--request-rate", *rates, "--max-num-batched-tokens", "32",
            "--steps-per-dispatch", "2", "--out", str(out), "--systems", *systems]
    assert bench_serve.main(argv) == 0
    report = json.loads((out / "serve.json").read_text())
    assert (out / "serve.png").stat().st_size > 10_000
    spent = report["run_time_s"]  # paged_jax compiled and served untimed within the run
    assert 0 < spent["warm_up"] and 0 < spent["untimed"]
    assert spent["warm_up"] + spent["untimed"] < spent["total"]
    results = report["results"]
    runs = {(r["rate"], r["max_num_seqs"], r["system"]) for r in results}
    assert runs == {(rate if rate == "inf" else float(rate), 4, s) for rate in rates
                    for s in systems}
    for r in results:
        assert r["completed"] == 6
        assert r["output_tokens"] == 6 * 5  # EOS ignored: exactly max-output-len each
        assert 6 * 12 <= r["prompt_tokens"] <= 6 * 24
        # Greedy decoding does not depend on the batch: every server makes the same tokens.
        assert r["greedy_agree"] == 6, r
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["output_throughput"] == pytest.approx(30 / r["duration_s"])
        assert 1 <= r["peak_concurrency"] <= 6
        if r["rate"] == "inf":  # all six are in flight from the start
            assert r["peak_concurrency"] == 6


@pytest.mark.parametrize("systems", [["generate"], ["paged_jax_uncondensed", "generate"]])
def test_the_tokens_reference_is_the_first_paged_jax_server(tiny_hf_dir, tmp_path, capsys,
                                                           systems):
    """The tokens are compared with the first paged_jax server's (paged_jax, or else the
    first ablation run); where none runs (a peer alone), the table and ``serve.json`` say
    there is nothing to compare with."""
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf_dir), "--dataset", "random", "--num-prompts", "3",
            "--random-input-len", "24", "--max-output-len", "3", "--max-num-seqs", "4",
            "--request-rate", "inf", "--max-num-batched-tokens", "32",
            "--steps-per-dispatch", "2", "--out", str(out),
            "--systems", *systems]
    assert bench_serve.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if re.match(r"\s+inf\s+4 ", line)]
    assert [line.split()[2] for line in rows] == systems
    report = json.loads((out / "serve.json").read_text())
    reference = None if systems == ["generate"] else systems[0]
    assert report["greedy_reference"] == reference
    want = None if reference is None else 3
    assert [line.split("|")[-1].strip() for line in rows] == (
        ["-"] if reference is None else ["3/3"] * 2), rows
    assert (f"greedy tokens equal {reference}'s" in printed) is (reference is not None)
    for r in report["results"]:
        assert r["greedy_agree"] == want
        assert r["completed"] == 3 and r["output_tokens"] == 3 * 3, r


def test_sweep_in_bf16_serves_the_same_rounded_weights(tiny_hf_dir, tmp_path, capsys):
    """``--dtype bfloat16``: both sides hold the checkpoint's weights rounded to bf16, bit for
    bit; every server completes every request with exactly its output length; the compute
    floor is a bf16 matmul's."""
    ours, tok, theirs = bench_serve.load(str(tiny_hf_dir), "bfloat16")
    assert theirs.dtype == torch.bfloat16
    for name in ("q_proj", "o_proj"):
        want = getattr(theirs.model.layers[1].self_attn, name).weight.detach().float().numpy()
        got = ours.layers[1].self_attn.projection(name).checkpoint_weight().get_value()
        assert got.dtype == "bfloat16" and (got.astype("float32") == want).all(), name
    with pytest.raises(ValueError, match="--dtype float32 is not the loaded model's bfloat16"):
        bench_serve.main(["--model", str(tiny_hf_dir)], loaded=(ours, tok, theirs))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf_dir), "--dataset", "random", "--num-prompts", "6",
            "--random-input-len", "24", "--max-output-len", "5", "--max-num-seqs", "4",
            "--request-rate", "inf", "--max-num-batched-tokens", "32",
            "--steps-per-dispatch", "2", "--out", str(out), "--dtype", "bfloat16",
            "--systems", "paged_jax", "generate_batch", "generate"]
    assert bench_serve.main(argv, loaded=(ours, tok, theirs)) == 0
    printed = capsys.readouterr().out
    assert "vocab 256, bfloat16;" in printed and "the fastest bfloat16 matmul" in printed
    report = json.loads((out / "serve.json").read_text())
    assert report["args"]["dtype"] == "bfloat16"
    assert {r["system"] for r in report["results"]} == set(bench_serve.SYSTEMS)
    for r in report["results"]:
        assert r["completed"] == 6 and r["output_tokens"] == 6 * 5, r


def test_static_batches_take_what_has_arrived(tiny_hf_dir):
    """generate's batches: arrival order, at most the limit, only what has arrived."""
    ours, tok, theirs = bench_serve.load(str(tiny_hf_dir))
    server = bench_serve.StaticServer(theirs, pad_id=0)
    reqs = [Request((1, 2, 3), 3, 0.0), Request((4, 5), 3, 0.0), Request((6, 7, 8, 9), 2, 0.0),
            Request((3, 3), 4, 5.0)]
    timings = server.serve(reqs, max_num_seqs=2)
    # Batches {0, 1}, {2} (limit 2), then {3} once it arrives at 5 s.
    assert timings[0].finish == timings[1].finish < timings[2].finish < timings[3].finish
    assert timings[3].token_times[0] >= timings[3].arrival >= timings[2].finish - 5.0
    assert [len(t.tokens) for t in timings] == [3, 3, 2, 4]
    # The reference: each prompt alone through generate.
    for r, t in zip(reqs, timings, strict=True):
        alone = theirs.generate(torch.tensor([r.prompt]), max_new_tokens=r.output_len,
                                do_sample=False, eos_token_id=-1, pad_token_id=0)
        assert alone[0, len(r.prompt):].tolist() == t.tokens


def _result(system, m, throughput, ttft, itl=(100.0, 250.0), tpot=50.0):
    return {"system": system, "rate": math.inf, "max_num_seqs": m,
            "output_throughput": throughput, "ttft_ms": {"p50": ttft},
            "tpot_ms": {"p50": tpot}, "itl_ms": {"p50": itl[0], "p99": itl[1]}}


def test_goals_by_hand():
    results = [_result("paged_jax", 16, 60.0, 500.0), _result("generate_batch", 16, 10.0, 400.0),
               _result("generate", 16, 40.0, 900.0),
               _result(bench_serve.ONE_PREFILL, 16, 30.0, 1000.0),
               _result("paged_jax_all_rows", 16, 48.0, 550.0, tpot=75.0),
               _result("paged_jax_whole_budget", 16, 61.0, 450.0, itl=(80.0, 500.0)),
               _result("paged_jax", 1, 20.0, 100.0, itl=(100.0, 400.0)),
               _result("generate", 1, 1.0, 300.0)]
    lines = bench_serve.goals(results)
    assert lines == [
        "rate inf, max_num_seqs 1: TTFT p50 100 ms vs transformers' best 300 ms (met); "
        "ITL p99/p50 4.00 (goal <= 3.0: not met)",
        "rate inf, max_num_seqs 16: throughput 6.00x generate_batch (goal >= 5.0x: met); "
        "throughput 1.50x generate (goal >= 2.0x: not met); TTFT p50 500 ms vs "
        "transformers' best 400 ms (not met); ITL p99/p50 2.50 (goal <= 3.0: met); prefill "
        "by width vs one prefill dispatch: output throughput 2.00x, TTFT p50 2.00x lower, "
        "TPOT p50 1.00x lower, ITL p99 1.00x lower; decode rows bucketed vs every slot: "
        "output throughput 1.25x, TTFT p50 1.10x lower, TPOT p50 1.50x lower, ITL p99 1.00x "
        "lower; a smaller chunk budget while rows decode vs max_num_batched_tokens "
        "throughout: output throughput 0.98x, TTFT p50 0.90x lower, TPOT p50 1.00x lower, "
        "ITL p99 2.00x lower",
        # Then each ablation that ran, against the goals on its own: 30 / 10 and 30 / 40;
        # 1,000 ms against min(400, 900); 250 / 100.
        "rate inf, max_num_seqs 16, paged_jax_one_prefill: throughput 3.00x generate_batch "
        "(goal >= 5.0x: not met); throughput 0.75x generate (goal >= 2.0x: not met); TTFT "
        "p50 1000 ms vs transformers' best 400 ms (not met); ITL p99/p50 2.50 (goal <= 3.0: "
        "met)",
        "rate inf, max_num_seqs 16, paged_jax_all_rows: throughput 4.80x generate_batch "
        "(goal >= 5.0x: not met); throughput 1.20x generate (goal >= 2.0x: not met); TTFT "
        "p50 550 ms vs transformers' best 400 ms (not met); ITL p99/p50 2.50 (goal <= 3.0: "
        "met)",
        "rate inf, max_num_seqs 16, paged_jax_whole_budget: throughput 6.10x generate_batch "
        "(goal >= 5.0x: met); throughput 1.52x generate (goal >= 2.0x: not met); TTFT p50 450 "
        "ms vs transformers' best 400 ms (not met); ITL p99/p50 6.25 (goal <= 3.0: not met)"]
    # Without paged_jax, an ablation's line alone (a TTFT equal to the peer's is no worse).
    alone = [_result("paged_jax_one_dispatch", 16, 20.0, 480.0, itl=(50.0, 120.0)),
             _result("generate_batch", 16, 18.0, 480.0)]
    assert bench_serve.goals(alone) == [
        "rate inf, max_num_seqs 16, paged_jax_one_dispatch: throughput 1.11x generate_batch "
        "(goal >= 5.0x: not met); TTFT p50 480 ms vs transformers' best 480 ms (met); ITL "
        "p99/p50 2.40 (goal <= 3.0: met)"]


@pytest.mark.parametrize("policy", ["fcfs", "shortest_first"])
def test_scheduling_policy_reaches_paged_jax_and_its_ablations(monkeypatch, policy):
    """``--scheduling-policy`` is the admission order of paged_jax's engine and of each
    ablation's but ``paged_jax_shortest_first``'s, which admits shortest first either way;
    an ablation's own settings stay as they are beside it."""
    monkeypatch.setattr(bench_serve, "warm_up", lambda engine, progress: None)
    args = bench_serve.build_parser().parse_args(["--scheduling-policy", policy,
                                                  "--kv-cache-mib", "1"])
    model = init_model(TINY)
    paged = bench_serve.PagedServer(model, args, 64)
    assert paged.engine(4).scheduler.policy == policy
    for name, (overrides, _) in bench_serve.ABLATIONS.items():
        engine = bench_serve.PagedServer(model, args, 64, overrides(args), paged.steps).engine(4)
        want = "shortest_first" if name == "paged_jax_shortest_first" else policy
        assert engine.scheduler.policy == want, name
        if name == "paged_jax_one_dispatch":
            assert engine.decode_with_prefill and engine.scheduler.one_prefill_chunk


def test_bad_arguments():
    for argv, match in ((["--max-output-len", "1"], "max-output-len"),
                        (["--request-rate", "0"], "request-rate"),
                        (["--max-num-seqs", "0"], "max-num-seqs"),
                        (["--num-prompts", "0"], "num-prompts"),
                        (["--steps-while-prefilling", "0"], "steps-while-prefilling must be >= 1"),
                        (["--steps-per-dispatch", "4", "--steps-while-prefilling", "5"],
                         r"steps-while-prefilling must be at most --steps-per-dispatch \(4\), "
                         "got 5"),
                        (["--max-dispatch-ms", "-1"],
                         r"max-dispatch-ms must be >= 0 and finite \(0: off\), got -1.0"),
                        (["--max-dispatch-ms", "inf"], "max-dispatch-ms must be >= 0"),
                        (["--max-num-batched-tokens", "64", "--prefill-tokens-while-decoding",
                          "65"], r"--prefill-tokens-while-decoding must be in \[0, "
                         r"--max-num-batched-tokens=64\] \(0: the same\), got 65"),
                        (["--prefill-tokens-while-decoding", "-1"],
                         "prefill-tokens-while-decoding must be in")):
        with pytest.raises(ValueError, match=match):
            bench_serve.check_args(bench_serve.build_parser().parse_args(argv))
    assert math.isinf(bench_serve.build_parser().parse_args([]).request_rate[0])


def test_matmul_flops_against_the_models_own_matrices():
    from flax import nnx

    from paged_jax.engine.serve_metrics import matmul_flops
    from paged_jax.model.config import ModelConfig
    from paged_jax.model.llama import Llama

    cfg = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=40, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    # Every projection weight of every layer, counted from the built model's own arrays.
    paths = nnx.to_flat_state(nnx.state(model))
    per_token = sum(v.get_value().size for path, v in paths
                    if "layers" in map(str, path) and path[-1] in ("weight", "kernel"))
    assert per_token > 0
    reqs = [Request((1, 2, 3), 2), Request((4, 5, 6, 7, 8), 4)]
    # 8 prompt tokens and 6 generated, of which each request's last (2) is never fed back.
    expected = 2 * (12 * per_token + 6 * cfg.vocab_size * cfg.hidden_size)
    assert matmul_flops(cfg, reqs) == expected


def test_throughput_bound_by_hand():
    from paged_jax.engine.serve_metrics import throughput_bound

    reqs = [Request((1,), 10, 0.0), Request((2,), 30, 0.5)]
    # Compute-bound: 8e9 FLOP at 4e9/s take 2 s, longer than the 0.5 s arrival span.
    assert throughput_bound(reqs, 8e9, 4e9) == pytest.approx(40 / 2.0)
    # Arrival-bound: 1e9 FLOP take 0.25 s; the last request arrives at 0.5 s.
    assert throughput_bound(reqs, 1e9, 4e9) == pytest.approx(40 / 0.5)
    with pytest.raises(ValueError, match="flops_per_s must be > 0, got 0"):
        throughput_bound(reqs, 1e9, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_rate_names_what_reached_it(dtype):
    rate, where = bench_serve.matmul_rate([(64, 32, 16), (8, 8, 8)], repeats=1, dtype=dtype)
    assert rate > 0
    assert re.fullmatch(r"(jax|torch) \[(64x32\] @ \[32x16|8x8\] @ \[8x8)\]", where), where


def test_goals_say_how_far_the_machine_allows():
    results = [_result("paged_jax", 16, 60.0, 500.0), _result("generate_batch", 16, 10.0, 400.0),
               _result("generate", 16, 40.0, 900.0)]
    # At most 120 tok/s on this machine: 12x generate_batch's 10, 3x generate's 40.
    line = bench_serve.goals(results, {math.inf: 120.0})[0]
    assert line.startswith(
        "rate inf, max_num_seqs 16: throughput 6.00x generate_batch (goal >= 5.0x: met; at most "
        "12.00x on this machine); throughput 1.50x generate (goal >= 2.0x: not met; at most "
        "3.00x on this machine); ")
    # A rate without a bound says nothing of one.
    assert "at most" not in bench_serve.goals(results, {4.0: 120.0})[0]


def test_each_batch_limit_runs_whole_then_is_released(tiny_hf_dir):
    args = bench_serve.build_parser().parse_args(
        ["--max-num-seqs", "1", "4", "--request-rate", "inf", "2", "--repeats", "2"])
    runs = bench_serve.run_order(args, ["a", "b"])
    # Every run of a batch limit before the next; each rate's repeats with the systems in turn.
    assert runs == [(r, m, k, s) for m in (1, 4) for r in (math.inf, 2.0) for k in (0, 1)
                    for s in ("a", "b")]
    from paged_jax.model.checkpoint import load_checkpoint

    args = bench_serve.build_parser().parse_args(
        ["--max-num-batched-tokens", "32", "--steps-per-dispatch", "2"])
    server = bench_serve.PagedServer(load_checkpoint(tiny_hf_dir), args, 64)
    first = server.engine(2)
    assert server.engine(2) is first  # built and warmed once per batch limit
    server.warm_once([Request((1, 2), 1)], 2, lambda: None)
    server.release(2)
    assert server.engines == {} and server.warmed == set()
    assert server.engine(2) is not first  # a new engine after release


def test_run_time_splits_compiling_from_the_untimed_passes(tiny_hf_dir, monkeypatch):
    """On a clock the test advances: warm_up's seconds count as compiling, also when an
    untimed pass builds the engine (as the HTTP server's does), and only the rest of that
    pass counts as untimed; ``run_seconds`` sums every paged_jax server, the HTTP one's
    through its ``paged``, and leaves the transformers peers out."""
    from types import SimpleNamespace

    from paged_jax.model.checkpoint import load_checkpoint

    clock = [0.0]
    monkeypatch.setattr(bench_serve, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def warm_up(engine, progress):  # 7 s of compiling
        clock[0] += 7.0

    monkeypatch.setattr(bench_serve, "warm_up", warm_up)
    args = bench_serve.build_parser().parse_args(["--max-num-batched-tokens", "32"])
    server = bench_serve.PagedServer(load_checkpoint(tiny_hf_dir), args, 64)

    def untimed_pass():  # builds the engine (7 s of warm_up), then serves for 2 s
        server.engine(2)
        clock[0] += 2.0

    requests = [Request((1, 2), 1)]
    server.warm_once(requests, 2, untimed_pass)
    server.warm_once(requests, 2, untimed_pass)  # met already: runs nothing
    assert server.spent == {"warm_up": 7.0, "untimed": 2.0}
    server.engine(4)  # another limit's engine, outside any pass
    assert server.spent == {"warm_up": 14.0, "untimed": 2.0}
    http = SimpleNamespace(paged=SimpleNamespace(spent={"warm_up": 1.5, "untimed": 0.5}))
    peer = SimpleNamespace()
    assert bench_serve.run_seconds({"paged_jax": server, "paged_jax_http": http,
                                    "generate": peer}, 30.0) == {
        "total": 30.0, "warm_up": 15.5, "untimed": 2.5}
