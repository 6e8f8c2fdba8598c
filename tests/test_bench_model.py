"""``paged-jax bench decode --model smollm2``: the table it prints parses, and the greedy ids
it decodes on both sides equal transformers' own ``generate()`` (an independent reference for
both the paged_jax side and the benchmark's hand-written transformers loop)."""

from __future__ import annotations

import re

import pytest
import torch

from paged_jax.engine import bench, bench_model
from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

ROW = re.compile(r"^\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+)x\s+(met|not met) \| "
                 r"(\d+)/(\d+) of (\d+) tokens")


def test_bench_decode_smollm2_prints_a_table_and_generate_s_tokens(capsys):
    tokens = 8
    assert bench.main(["--model", "smollm2", "--batch", "1", "--tokens", str(tokens),
                       "--rounds", "1", "--show-tokens"]) == 0
    out = capsys.readouterr().out
    rows = [m for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) == 1, out
    batch, ours, theirs, ratio, verdict, agree, of, new = rows[0].groups()
    assert (int(batch), int(of), int(new)) == (1, 1, tokens + 1)
    ours, theirs, ratio = float(ours), float(theirs), float(ratio)
    assert ours > 0 and theirs > 0
    # The rates are printed to 0.05 and the ratio to 0.005: it lies within what they allow.
    assert (ours - 0.05) / (theirs + 0.05) - 0.005 <= ratio <= (
        (ours + 0.05) / max(theirs - 0.05, 1e-9) + 0.005)
    assert (verdict == "met") == (ratio >= bench_model.GOAL)
    ids = {name: list(map(int, line.split(":")[1].split()))
           for line in out.splitlines()
           for name in ("paged_jax", "transformers") if line.startswith(f"batch 1 row 0 {name}:")}

    path = default_gguf_path()
    prompt = bench_model.prompt_ids(Tokenizer.from_gguf(path), 1)[0]
    model = bench_model.load_transformers(path)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens + 1,
                             min_new_tokens=tokens + 1, pad_token_id=2)
    ref = ref[0, len(prompt):].tolist()
    assert ids["paged_jax"] == ref
    assert ids["transformers"] == ref
    assert int(agree) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--tokens", "12"], r"--tokens must be a positive multiple of --steps-per-dispatch \(8\)"
                         r"\. Got 12\."),
    (["--batch", "1", "9"], r"--batch sizes must be in 1\.\.8\. Got \[9\]\."),
    (["--checkpoint", "/nonexistent/model.gguf"], r"/nonexistent/model\.gguf does not exist"),
])
def test_bench_decode_hands_a_real_model_to_bench_model_which_checks_its_flags(args, message):
    # Refused before anything loads: the message comes from bench_model's checks.
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "smollm2", *args] if "--checkpoint" not in args else args)
