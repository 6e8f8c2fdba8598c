"""``paged-jax generate`` (and examples/generate.py): its greedy tokens equal a dense,
no-cache greedy loop over the same model."""

import re

import numpy as np
import pytest
from flax import nnx

from paged_jax.cli import main
from paged_jax.model import DEFAULT_MODEL, init_model
from tests.model_helpers import dense_logits


@pytest.mark.parametrize(("steps_per_dispatch", "block_size"), [(4, 8), (1, 3)])
def test_generate_matches_dense_greedy(capsys, steps_per_dispatch, block_size):
    # Block size 3 is one the Pallas kernel cannot take; the steps run it on the xla path.
    prompts = [[5, 17, 300, 2, 9, 44, 1], [100, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
    args = ["generate", "--model", "tiny", "--max-new-tokens", "11", "--steps-per-dispatch",
            str(steps_per_dispatch), "--block-size", str(block_size)]
    for p in prompts:
        args += ["--prompt", " ".join(map(str, p))]
    assert main(args) == 0
    out = capsys.readouterr().out
    generated = [list(map(int, re.findall(r"\d+", line.split("->")[1])))
                 for line in out.splitlines() if "->" in line]
    assert len(generated) == len(prompts)

    graphdef, params = nnx.split(init_model(DEFAULT_MODEL, seed=0))
    for prompt, got in zip(prompts, generated, strict=True):
        seq = list(prompt)
        for _ in range(11):
            seq.append(int(np.argmax(dense_logits(graphdef, params, seq)[-1])))
        assert got == seq[len(prompt):], (prompt, got, seq[len(prompt):])


def test_question_to_the_tiny_model_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "What is the capital of France?", "--model", "tiny"])
    assert "--model tiny has random weights and no tokenizer" in capsys.readouterr().err
