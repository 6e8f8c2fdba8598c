"""A decode step's bookkeeping does O(batch) work, whatever the pool size.

Timings are the benchmark's job (``paged-jax bench allocator --num-blocks ...``); this test
checks the compiled program instead. With the state donated, as the engine donates it, every
instruction of the entry computation and of the K-step loop body that produces the pool-sized
buffer (``BlockState.buffers[0]``: ref counts, held counts, tables, free ring) must be an
in-place scatter or plumbing (parameter, tuple element, loop). A copy, a select or a
dynamic-update-slice of that buffer is work that grows with the pool: XLA emits one whenever
an op reads an old version of the buffer after writing it, or selects between two versions.
The steps are also checked against the model allocator at a large pool.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.allocator import CacheConfig, admit, append, copy_on_write, init_state
from paged_jax.allocator.ops import reserve_steps
from tests.allocator_helpers import assert_matches_model
from tests.reference_allocator import ModelAllocator

PLUMBING = {"parameter", "get-tuple-element", "tuple", "while", "bitcast"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) ([\w-]+)\((.*)$")


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO text split into ``{name: instruction lines}``; the entry is named ``ENTRY``."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def pool_sized_work(hlo: str, size: int) -> list[str]:
    """Instructions of the entry and of every loop body that produce an ``s32[size]`` array
    and are neither plumbing nor a fusion whose root is a scatter."""
    comps = _computations(hlo)
    roots = {}
    for name, lines in comps.items():
        for line in lines:
            m = INSTRUCTION.match(line)
            if m and line.lstrip().startswith("ROOT"):
                roots[name] = m.group(3)
    bodies = {"ENTRY"} | set(re.findall(r"body=%([\w.-]+)", hlo))
    bad = []
    for name in bodies:
        for line in comps[name]:
            m = INSTRUCTION.match(line)
            if not m or not m.group(2).startswith(f"s32[{size}]"):
                continue
            op = m.group(3)
            called = re.search(r"calls=%([\w.-]+)", line)
            scatter = op == "fusion" and called and roots[called.group(1)] == "scatter"
            if op in PLUMBING or scatter:
                continue
            bad.append(f"{name}: {line.strip()[:160]}")
    return bad


CFG = CacheConfig(num_blocks=20_000, block_size=4, max_seqs=8, max_blocks_per_seq=6)
K = 5


def _running_state():
    lens = jnp.array([1, 4, 5, 7, 0, 3, 2, 6], jnp.int32)
    state, status = admit(init_state(CFG), jnp.arange(8, dtype=jnp.int32), lens)
    status.raise_if_failed()
    return state


MASK = jnp.array([True, True, True, False, True, True, False, True])
IDS = jnp.array([5, 0, -1, 2, 7], jnp.int32)


def _scan(state):
    def body(s, _):
        s, status = append(s, MASK, 1)
        return s, status.applied
    return jax.lax.scan(body, state, None, length=K)


def _cow(state):
    return copy_on_write(state, IDS, jnp.array([1, 0, 0, 4, 3], jnp.int32))


FORMS = {
    "append in lax.scan (mask)": _scan,
    "reserve_steps (mask)": lambda s: reserve_steps(s, MASK, K),
    "reserve_steps (ids)": lambda s: reserve_steps(s, IDS, K),
    "append (mask)": lambda s: append(s, MASK, 1),
    "append (ids, per-entry tokens)": lambda s: append(s, IDS, jnp.array([1, 5, 0, 2, 3])),
    "copy_on_write": _cow,
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_no_pool_sized_work_but_in_place_scatters(form):
    state = _running_state()
    hlo = jax.jit(FORMS[form], donate_argnums=0).lower(state).compile().as_text()
    size = state.buffers[0].shape[0]
    assert size > CFG.num_blocks
    assert pool_sized_work(hlo, size) == []


def test_the_check_sees_a_whole_buffer_copy():
    """A late read of the old state (here: the old lengths after an append) makes XLA keep
    the old buffer alive, i.e. copy it; a select between two states is pool-sized too."""
    state = _running_state()
    size = state.buffers[0].shape[0]

    def late_read(s):
        new, _ = append(s, MASK, 1)
        return new.scatter("ref_counts", s.block_tables[:, 0], 0)

    def select(s):
        new, status = append(s, MASK, 1)
        return jax.tree.map(lambda a, b: jnp.where(status.applied, a, b), new, s)

    for fn in (late_read, select):
        hlo = jax.jit(fn, donate_argnums=0).lower(state).compile().as_text()
        assert pool_sized_work(hlo, size), fn.__name__


def test_steps_at_a_large_pool_match_the_model():
    """The scanned appends and ``reserve_steps`` at a 20,000-block pool: tables, counts and
    free-ring order as the model allocator's step-by-step appends leave them."""
    state = _running_state()
    model = ModelAllocator(CFG.num_blocks, CFG.block_size, CFG.max_seqs, CFG.max_blocks_per_seq)
    model.admit(list(range(8)), [1, 4, 5, 7, 0, 3, 2, 6])
    assert_matches_model(state, model)
    state, applied = jax.jit(_scan, donate_argnums=0)(state)
    assert np.asarray(applied).all()
    running = [int(i) for i in np.flatnonzero(np.asarray(MASK))]
    for _ in range(K):
        model.append(running, [1] * len(running))
    assert_matches_model(state, model)
    state, status = jax.jit(FORMS["reserve_steps (ids)"], donate_argnums=0)(state)
    status.raise_if_failed()
    for _ in range(K):
        model.append(IDS.tolist(), [1] * len(IDS))
    assert_matches_model(state, model)
