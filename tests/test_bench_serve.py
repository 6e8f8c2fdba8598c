"""``paged-jax bench serve`` end to end on a tiny random Llama saved by transformers: every
server completes every request with exactly its output length, greedy tokens agree across the
three servers, the figures are consistent with the workload, and the files are written."""

import json
import math

import pytest
import torch

from paged_jax.engine import bench_serve
from paged_jax.engine.serve_metrics import Request


def test_sweep_on_a_tiny_model(tiny_hf_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf_dir), "--dataset", "random", "--num-prompts", "6",
            "--random-input-len", "24", "--max-output-len", "5", "--max-num-seqs", "4",
            "--request-rate", "inf", "50", "--max-num-batched-tokens", "32",
            "--steps-per-dispatch", "2", "--out", str(out),
            "--systems", *bench_serve.SYSTEMS, *bench_serve.ABLATIONS]
    assert bench_serve.main(argv) == 0
    report = json.loads((out / "serve.json").read_text())
    assert (out / "serve.png").stat().st_size > 10_000
    results = report["results"]
    runs = {(r["rate"], r["max_num_seqs"], r["system"]) for r in results}
    assert runs == {(rate, 4, s) for rate in ("inf", 50.0)
                    for s in (*bench_serve.SYSTEMS, *bench_serve.ABLATIONS)}
    for r in results:
        assert r["completed"] == 6
        assert r["output_tokens"] == 6 * 5  # EOS ignored: exactly max-output-len each
        assert 6 * 12 <= r["prompt_tokens"] <= 6 * 24
        # Greedy decoding does not depend on the batch: every server makes the same tokens.
        assert r["greedy_agree_with_paged_jax"] == 6, r
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["output_throughput"] == pytest.approx(30 / r["duration_s"])
        assert 1 <= r["peak_concurrency"] <= 6
        if r["rate"] == "inf":  # all six are in flight from the start
            assert r["peak_concurrency"] == 6


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
        "TPOT p50 1.00x lower; decode rows bucketed vs every slot: output throughput 1.25x, "
        "TTFT p50 1.10x lower, TPOT p50 1.50x lower"]


def test_bad_arguments():
    for argv, match in ((["--max-output-len", "1"], "max-output-len"),
                        (["--request-rate", "0"], "request-rate"),
                        (["--max-num-seqs", "0"], "max-num-seqs"),
                        (["--num-prompts", "0"], "num-prompts"),
                        (["--steps-while-prefilling", "0"], "steps-while-prefilling must be >= 1"),
                        (["--steps-per-dispatch", "4", "--steps-while-prefilling", "5"],
                         r"steps-while-prefilling must be at most --steps-per-dispatch \(4\), "
                         "got 5")):
        with pytest.raises(ValueError, match=match):
            bench_serve.check_args(bench_serve.build_parser().parse_args(argv))
    assert math.isinf(bench_serve.build_parser().parse_args([]).request_rate[0])
