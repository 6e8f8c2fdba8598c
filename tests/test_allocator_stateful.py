"""Random programs of allocator ops, checked step by step against the pure-Python model.

Hypothesis drives admit, append, release, fork, share_prefix, copy_on_write, move_slots and the
loose-block ops with valid and invalid arguments alike, at a fixed batch width (padded with -1)
so that each jitted op compiles once. After every step: the invariants hold, and tables,
lengths, ref counts, held counts and the free-list order equal the model's; a failed op
changed nothing.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import paged_jax as pj
from tests.allocator_helpers import assert_invariants_hold, assert_matches_model
from tests.reference_allocator import ModelAllocator

N, BS, SEQS, M, WIDTH = 24, 4, 8, 6, 4
MOSTLY = st.sampled_from([True] * 9 + [False])  # 9 in 10 batches are valid
CFG = pj.CacheConfig(num_blocks=N, block_size=BS, max_seqs=SEQS, max_blocks_per_seq=M)

admit = jax.jit(pj.admit)
append = jax.jit(pj.append)
append_one = jax.jit(lambda s, ids: pj.append(s, ids, 1))
release = jax.jit(pj.release)
reserve_steps = jax.jit(pj.reserve_steps, static_argnums=2)
fork = jax.jit(pj.fork)
share_prefix = jax.jit(pj.share_prefix)
copy_on_write = jax.jit(pj.copy_on_write)
move_slots = jax.jit(pj.move_slots)
allocate = jax.jit(pj.allocate_blocks, static_argnums=1)
share_blocks = jax.jit(pj.share_blocks)
free_blocks = jax.jit(pj.free_blocks)
slot_mapping = jax.jit(pj.slot_mapping)


def pad(xs, fill=-1):
    return jnp.asarray(list(xs) + [fill] * (WIDTH - len(xs)), jnp.int32)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = pj.init_state(CFG)
        self.model = ModelAllocator(N, BS, SEQS, M)

    # Mostly valid ids (unique active or free slots); one batch in ten is arbitrary.
    def seq_ids(self, data, active: bool | None, k_max=WIDTH):
        live = sorted(self.model.tables)
        pool = live if active else sorted(set(range(SEQS)) - set(live))
        if pool and data.draw(MOSTLY):
            size = min(k_max, len(pool))
            ids = st.lists(st.sampled_from(pool), min_size=1, max_size=size, unique=True)
            return data.draw(ids)
        return data.draw(st.lists(st.integers(-2, SEQS), min_size=1, max_size=k_max))

    def codes(self, status, n):
        return np.asarray(status.code).tolist()[:n]

    @precondition(lambda self: len(self.model.tables) < SEQS)
    @rule(data=st.data())
    def do_admit(self, data):
        ids = self.seq_ids(data, active=False)
        ns = data.draw(st.lists(st.integers(-1, M * BS + 1), min_size=len(ids), max_size=len(ids)))
        self.state, status = admit(self.state, pad(ids), pad(ns, 0))
        assert self.codes(status, len(ids)) == self.model.admit(ids, ns)

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_append(self, data):
        ids = self.seq_ids(data, active=True)
        if data.draw(st.booleans()):
            self.state, status = append_one(self.state, pad(ids))
            ns = [1] * len(ids)
        else:
            ns = data.draw(st.lists(st.integers(-1, 9), min_size=len(ids), max_size=len(ids)))
            self.state, status = append(self.state, pad(ids), pad(ns, 0))
        assert self.codes(status, len(ids)) == self.model.append(ids, ns)

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data(), steps=st.integers(0, 9))
    def do_reserve_steps(self, data, steps):
        ids = self.seq_ids(data, active=True)
        self.state, status = reserve_steps(self.state, pad(ids), steps)
        before = (list(self.model.free), list(self.model.refs), dict(self.model.lens),
                  {k: list(v) for k, v in self.model.tables.items()})
        # Zero steps still check the ids, as append(ids, 0) does: a bad id fails the op.
        applied = steps > 0 or all(c == 0 for c in self.model.append(ids, [0] * len(ids)))
        for _ in range(steps):
            if any(c != 0 for c in self.model.append(ids, [1] * len(ids))):
                applied = False
                break
        if not applied:  # all-or-nothing over every step: roll the model back
            self.model.free = collections.deque(before[0])
            self.model.refs, self.model.lens, self.model.tables = before[1], before[2], before[3]
        assert bool(status.applied) == applied

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_release_again(self, data):
        self.do_release(data)

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_release(self, data):
        ids = self.seq_ids(data, active=True)
        self.state, status = release(self.state, pad(ids))
        assert self.codes(status, len(ids)) == self.model.release(ids)

    @precondition(lambda self: len(self.model.tables) < SEQS)
    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_fork(self, data):
        parents = self.seq_ids(data, active=True)
        children = self.seq_ids(data, active=False)[: len(parents)]
        parents = parents[: len(children)]
        self.state, status = fork(self.state, pad(parents), pad(children))
        assert self.codes(status, len(parents)) == self.model.share(parents, children)

    @precondition(lambda self: len(self.model.tables) < SEQS)
    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_share_prefix(self, data):
        srcs = self.seq_ids(data, active=True, k_max=2)
        dsts = self.seq_ids(data, active=False)[: len(srcs)]
        srcs = srcs[: len(dsts)]
        ks = data.draw(st.lists(st.integers(-1, 4), min_size=len(srcs), max_size=len(srcs)))
        self.state, status = share_prefix(self.state, pad(srcs), pad(dsts), pad(ks, 0))
        assert self.codes(status, len(srcs)) == self.model.share(srcs, dsts, ks)

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_move_slots(self, data):
        # Sources among the active slots; destinations drawn from every slot, so that free
        # ones, other sources (swaps, cycles) and refused active ones all come up.
        srcs = self.seq_ids(data, active=True)
        if data.draw(MOSTLY):
            dsts = data.draw(st.lists(st.integers(0, SEQS - 1), min_size=len(srcs),
                                      max_size=len(srcs), unique=True))
        else:
            dsts = data.draw(st.lists(st.integers(-2, SEQS), min_size=len(srcs),
                                      max_size=len(srcs)))
        self.state, status = move_slots(self.state, pad(srcs), pad(dsts))
        assert self.codes(status, len(srcs)) == self.model.move(srcs, dsts)

    @precondition(lambda self: self.model.tables)
    @rule(data=st.data())
    def do_copy_on_write(self, data):
        ids = self.seq_ids(data, active=True)
        pos = [
            data.draw(st.integers(-1, max(self.model.lens.get(s, 0), 1) + 1)) for s in ids
        ]
        self.state, (src, dst), status = copy_on_write(self.state, pad(ids), pad(pos, 0))
        codes, msrc, mdst = self.model.copy_on_write(ids, pos)
        assert self.codes(status, len(ids)) == codes
        assert np.asarray(src).tolist()[: len(ids)] == msrc
        assert np.asarray(dst).tolist()[: len(ids)] == mdst

    @precondition(lambda self: sum(self.model.held) < 4)  # loose blocks must not hog the pool
    @rule(count=st.integers(1, 2))
    def do_allocate(self, count):
        self.state, blocks, status = allocate(self.state, count)
        codes, mblocks = self.model.allocate(count)
        assert np.asarray(status.code).tolist() == codes
        assert np.asarray(blocks).tolist() == mblocks

    @rule(data=st.data(), free=st.booleans())
    def do_loose(self, data, free):
        held = [b for b in range(N) if self.model.held[b] > 0] or [0]
        if data.draw(MOSTLY):
            blocks = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=2))
        else:
            blocks = data.draw(st.lists(st.integers(-1, N), min_size=1, max_size=WIDTH))
        op, mop = (free_blocks, self.model.free_blocks) if free else (
            share_blocks, self.model.share_blocks)
        self.state, status = op(self.state, jnp.asarray(blocks, jnp.int32))
        assert np.asarray(status.code).tolist() == mop(blocks)

    @rule(data=st.data())
    def do_slot_mapping(self, data):
        ids = self.seq_ids(data, active=True)
        pos = data.draw(st.lists(st.integers(-1, M * BS), min_size=len(ids), max_size=len(ids)))
        slots = slot_mapping(self.state, pad(ids), pad(pos, 0))
        assert np.asarray(slots).tolist()[: len(ids)] == [
            self.model.slot(s, p) for s, p in zip(ids, pos, strict=True)
        ]

    @invariant()
    def matches_model(self):
        assert_matches_model(self.state, self.model)
        assert_invariants_hold(self.state)


AllocatorMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorAgainstModel = AllocatorMachine.TestCase
