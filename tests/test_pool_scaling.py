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

from paged_jax.allocator import (
    CacheConfig,
    admit,
    append,
    copy_on_write,
    init_state,
    release,
    reserve_steps,
)
from tests.allocator_helpers import assert_matches_model
from tests.reference_allocator import ModelAllocator

PLUMBING = {"parameter", "get-tuple-element", "tuple", "while", "conditional", "bitcast"}
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


# tests/conftest.py turns XLA:CPU's MLIR fusion emitters off to compile the suite sooner; without
# them XLA expands every scatter into a loop that updates the whole buffer. The compiled programs
# inspected here are the ones users run, so they are compiled with the emitters on.
USERS_COMPILER = {"xla_cpu_use_fusion_emitters": True}


def compiled_hlo(lowered) -> str:
    """The HLO text of ``lowered`` compiled as outside the suite (``USERS_COMPILER``)."""
    return lowered.compile(compiler_options=USERS_COMPILER).as_text()


def pool_sized_work(hlo: str, size: int) -> list[str]:
    """Instructions outside fusions (in the entry, loop bodies, conditional branches) that
    produce an ``s32[size]`` array and are neither plumbing nor a fusion whose root is a
    scatter."""
    comps = _computations(hlo)
    roots = {}
    for name, lines in comps.items():
        for line in lines:
            m = INSTRUCTION.match(line)
            if m and line.lstrip().startswith("ROOT"):
                roots[name] = m.group(3)
    fused = set(re.findall(r"calls=%([\w.-]+)", hlo))
    bad = []
    for name in comps.keys() - fused:  # the entry, loop bodies, cond branches, reducers
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
    hlo = compiled_hlo(jax.jit(FORMS[form], donate_argnums=0).lower(state))
    size = state.buffers[0].shape[0]
    assert size > CFG.num_blocks
    assert pool_sized_work(hlo, size) == []


def whole_field_reads(hlo: str, size: int) -> list[str]:
    """``slice`` instructions (anywhere, fusions included) that cut a field of at least
    ``size`` elements out of a buffer, as indexing a pool-sized field does. A fusion that
    gathers from such a slice counts, for XLA:CPU's cost model, as reading the whole field,
    and is split into parallel tasks: a thread hand-off on every step."""
    bad = []
    for lines in _computations(hlo).values():
        for line in lines:
            m = INSTRUCTION.match(line)
            shape = re.match(r"s32\[(\d+)\]", m.group(2)) if m else None
            if m and m.group(3) == "slice" and shape and int(shape.group(1)) >= size:
                bad.append(line.strip()[:160])
    return bad


@pytest.mark.parametrize("form", sorted(set(FORMS) - {"copy_on_write"}))
def test_growing_reads_windows_of_the_free_ring_not_the_ring(form):
    state = _running_state()
    hlo = compiled_hlo(jax.jit(FORMS[form], donate_argnums=0).lower(state))
    assert whole_field_reads(hlo, CFG.num_blocks) == []
    plain = jax.jit(lambda s: s.free_list[s.free_head + jnp.arange(4)]).lower(state)
    assert whole_field_reads(compiled_hlo(plain), CFG.num_blocks)  # the check can fail


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
        hlo = compiled_hlo(jax.jit(fn, donate_argnums=0).lower(state))
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


def test_ring_reads_that_wrap_around_the_pool_match_the_model():
    """The taken blocks are read as two windows of the free ring (from the head, and from
    the ring's start where the hand-out wraps past its end): admitting, growing and releasing
    in turn walks the head around a 13-block ring many times, from every offset."""
    cfg = CacheConfig(num_blocks=13, block_size=2, max_seqs=3, max_blocks_per_seq=4)
    model = ModelAllocator(13, 2, 3, 4)
    step = jax.jit(lambda s, ids: append(s, ids, 1))
    reserve = jax.jit(reserve_steps, static_argnums=2)
    state = init_state(cfg)
    ids = jnp.array([0, 1, 2], jnp.int32)
    for round_ in range(9):
        lens = [1 + round_ % 2, 2, round_ % 3]
        state, status = admit(state, ids, jnp.array(lens, jnp.int32))
        status.raise_if_failed()
        model.admit([0, 1, 2], lens)
        for _ in range(2):
            state, status = step(state, ids)
            status.raise_if_failed()
            model.append([0, 1, 2], [1, 1, 1])
            assert_matches_model(state, model)
        state, status = reserve(state, ids, 3)
        status.raise_if_failed()
        for _ in range(3):
            model.append([0, 1, 2], [1, 1, 1])
        assert_matches_model(state, model)
        order = [2, 0, 1] if round_ % 2 else [1, 2, 0]
        state, status = release(state, jnp.array(order, jnp.int32))
        status.raise_if_failed()
        model.release(order)
        assert_matches_model(state, model)
