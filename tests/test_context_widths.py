"""The table widths the xla path attends over (``kernels.strategies.context_widths``) and the
switch that picks one per step (``by_context_width``), against hand-computed widths and a
plain-Python choice. The engine's outputs with narrow widths are checked against the dense
reference in ``tests/test_engine.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.kernels.strategies import by_context_width, context_widths


@pytest.mark.parametrize("max_blocks,block_size,bucket,want", [
    (128, 16, 256, (16, 32, 64, 128)),   # a 2,048-token table
    (26, 16, 256, (16, 26)),             # the last width is the whole table
    (65, 16, 256, (16, 32, 65)),         # not 64: under two thirds of the table only
    (25, 16, 256, (16, 25)),             # 16 is under two thirds of 25 ...
    (24, 16, 256, (24,)),                # ... and not of 24
    (16, 16, 256, (16,)),                # a table no wider than the bucket: one width
    (8, 16, 256, (8,)),
    (10, 4, 10, (3, 6, 10)),             # ceil(10 / 4) = 3 blocks, doubled
    (8, 8, 8, (1, 2, 4, 8)),
    (64, 16, 0, (64,)),                  # 0: the whole table, always
])
def test_widths_double_from_the_bucket_up_to_the_table(max_blocks, block_size, bucket, want):
    assert context_widths(max_blocks, block_size, bucket) == want


def test_a_negative_bucket_is_refused():
    with pytest.raises(ValueError, match="bucket_tokens must be >= 0. Got -1"):
        context_widths(8, 16, -1)


def test_the_switch_picks_the_narrowest_width_that_covers_the_longest_row():
    widths, block_size = (3, 6, 12, 20), 4

    @jax.jit
    def picked(lens):  # each branch reports its width
        return by_context_width(lens, block_size, widths, lambda w: jnp.int32(w))

    def want(lens):  # plain Python: the first width whose tokens hold the longest row
        longest = max(lens)
        return next((w for w in widths if w * block_size >= longest), widths[-1])

    rng = np.random.default_rng(0)
    cases = [[0, 0, 0], [1, 0, 0], [12, 0, 3], [13, 2, 0], [24, 24, 24], [25, 1, 1],
             [48, 0, 0], [49, 0, 0], [80, 80, 0]]
    cases += rng.integers(0, 81, (40, 3)).tolist()
    for lens in cases:
        assert int(picked(jnp.asarray(lens, jnp.int32))) == want(lens), lens


def test_one_width_needs_no_switch():
    calls = []
    out = by_context_width(jnp.array([5, 7]), 4, (2,), lambda w: calls.append(w) or w)
    assert out == 2 and calls == [2]
