"""The scheduler driven without a model: a toy pool with exact block accounting plays the
engine, applying each plan the way ``LLMEngine.step`` does, and checks every iteration.

``ToyPool`` owns physical block ids with reference counts and one table per sequence; forked
completions share their parent's blocks and copy the shared last block on their first write.
It is both the scheduler's ``BlockCounter`` and the state the plan is applied to, so "a
dispatch never fails for lack of blocks" is checked where the blocks are taken.
"""

from __future__ import annotations

import math
import random

import pytest

from paged_jax.engine.scheduler import (
    Plan,
    Scheduler,
    Sequence,
    max_dispatch_ms_flag,
    prefill_budget_flag,
)


def token(request: int, index: int, position: int) -> int:
    """The token a completion emits at ``position`` of its output: reproducible, so a lost
    or repeated step shows in the output."""
    return request * 100_000 + index * 1_000 + position


class OutOfToyBlocks(AssertionError):
    pass


class ToyPool:
    """Exact accounting over ``num_blocks`` blocks, keyed by sequence identity.

    As a ``BlockCounter`` it answers for the state at the start of the iteration, less the
    releases the scheduler has already planned in it (each ``held_alone`` call is one: the
    scheduler asks exactly when it preempts), so later answers in the same plan see them."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.free_ids = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.pending: dict[int, int] = {}  # block -> references the plan drops

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.bs)

    # -- BlockCounter ----------------------------------------------------------------------

    def free(self) -> int:
        return len(self.free_ids)

    def _ref(self, block: int) -> int:
        return self.refs[block] - self.pending.get(block, 0)

    def decode_need(self, seq: Sequence, steps: int) -> int:
        table = self.tables[id(seq)]
        need = self.blocks_for(seq.cached + steps) - len(table)
        if seq.cached % self.bs and self._ref(table[seq.cached // self.bs]) > 1:
            need += 1  # its first write to a shared block copies it
        return need

    def lookup(self, seq: Sequence) -> int:
        return 0  # no prefix cache in this pool

    def prefill_need(self, seq: Sequence, upto: int) -> int:
        return self.blocks_for(upto) - self.blocks_for(seq.cached)

    def held_alone(self, seq: Sequence) -> int:
        table = self.tables.get(id(seq), [])
        freed = sum(self._ref(b) == 1 for b in table)
        for b in table:
            self.pending[b] = self.pending.get(b, 0) + 1
        return freed

    # -- applying a plan -------------------------------------------------------------------

    def take(self) -> int:
        if not self.free_ids:
            raise OutOfToyBlocks("the plan needed a block the pool did not have")
        b = self.free_ids.pop(0)
        self.refs[b] = 1
        return b

    def grow(self, seq: Sequence, tokens: int) -> None:
        table = self.tables.setdefault(id(seq), [])
        while len(table) < self.blocks_for(tokens):
            table.append(self.take())

    def copy_on_write(self, seq: Sequence) -> None:
        table = self.tables[id(seq)]
        col = seq.cached // self.bs
        if seq.cached % self.bs and self.refs[table[col]] > 1:
            self.refs[table[col]] -= 1
            table[col] = self.take()

    def share(self, parent: Sequence, child: Sequence) -> None:
        self.tables[id(child)] = list(self.tables[id(parent)])
        for b in self.tables[id(child)]:
            self.refs[b] += 1

    def release(self, seq: Sequence) -> None:
        for b in self.tables.pop(id(seq), []):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_ids.append(b)

    def used(self) -> int:
        return len(self.refs) - len(self.free_ids)


class Sim:
    """The engine loop without a model. ``step`` plans one iteration, checks the plan and
    applies it; ``log`` keeps what the checks below need."""

    def __init__(self, *, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                 steps_per_dispatch, steps_while_prefilling=None, policy="fcfs",
                 first_tokens_first=False, prefill_tokens_while_decoding=None,
                 join_decode=False, one_prefill_chunk=False, condense=False):
        self.condense = condense
        self.moves = 0
        self.sched = Scheduler(max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               steps_per_dispatch=steps_per_dispatch, block_size=block_size,
                               steps_while_prefilling=steps_while_prefilling, policy=policy,
                               first_tokens_first=first_tokens_first,
                               prefill_tokens_while_decoding=prefill_tokens_while_decoding,
                               join_decode=join_decode,
                               one_prefill_chunk=one_prefill_chunk)
        self.budget_while_decoding = min(prefill_tokens_while_decoding or max_num_batched_tokens,
                                         max_num_batched_tokens)
        self.joined = self.join_refusals = 0
        self.deferred = False  # the previous plan's
        self.deferrals = 0
        self.policy = policy
        self.fresh: list[Sequence] = []  # added since the last step, in arrival order
        self.while_prefilling = steps_while_prefilling or steps_per_dispatch
        self.pool = ToyPool(num_blocks, block_size)
        self.n: dict[str, int] = {}
        self.done: dict[str, list[Sequence]] = {}
        self.arrivals = 0
        self.iterations = 0
        self.preempted_total = 0

    def add(self, prompt_len: int, max_tokens: int, n: int = 1) -> str:
        rid = f"r{self.arrivals}"
        prompt = [(self.arrivals * 7 + i) % 50 for i in range(prompt_len)]
        seq = Sequence(request_id=rid, index=0, arrival=self.arrivals, prompt_ids=prompt,
                       max_tokens=max_tokens, fork=n)
        self.sched.add(seq)
        self.fresh.append(seq)
        self.n[rid] = n
        self.done[rid] = []
        self.arrivals += 1
        return rid

    def emit(self, seq: Sequence, count: int) -> None:
        rid = int(seq.request_id[1:])
        for _ in range(count):
            seq.output_ids.append(token(rid, seq.index, len(seq.output_ids)))

    def check_slots(self) -> None:
        s = self.sched
        taken = [q.slot for q in s.running] + [r for q in s.running for r in q.reserved]
        assert None not in taken
        assert len(taken) == len(set(taken)), f"a slot is used twice: {sorted(taken)}"
        assert len(taken) <= s.max_num_seqs
        assert sorted(taken + s.free_slots) == list(range(s.max_num_seqs))
        for q in s.waiting:
            assert q.slot is None and not q.reserved and q.cached == 0 and not q.decoding

    def queue_order(self) -> list[Sequence]:
        """The order the scheduler must take the queue in: arrival order, except that under
        shortest_first the sequences added since the last step go shortest prompt first
        (stable) behind the ones queued before them."""
        fresh, self.fresh = self.fresh, []
        older = [q for q in self.sched.waiting if all(q is not f for f in fresh)]
        fresh = [f for f in fresh if any(q is f for q in self.sched.waiting)]
        if self.policy == "shortest_first":
            fresh = sorted(fresh, key=lambda q: len(q.prompt_ids))
        return older + fresh

    def step(self, steps: int | None = None) -> Plan:
        """One iteration; ``steps``: the engine's dispatch length for it (K by default)."""
        s, pool = self.sched, self.pool
        k = s.steps_per_dispatch if steps is None else steps
        while_prefilling = min(self.while_prefilling, k)
        before_running = list(s.running)
        before_waiting = self.queue_order()
        oldest = min(before_running, key=lambda q: q.age) if before_running else None
        decoding_before = [q for q in before_running if q.decoding]
        pool.pending = {}
        plan = s.schedule(pool, steps)
        self.iterations += 1
        assert not plan.empty, "an iteration with work planned nothing: a deadlock"

        victims = [q for q, _ in plan.preempt]
        self.preempted_total += len(victims)
        # (a) the oldest always makes progress; the preempted go to the front of the queue,
        # oldest first; (e) an iteration that preempted admits nothing.
        assert all(v is not oldest for v in victims)
        assert all(any(v is q for q in before_running) for v in victims)
        if victims:
            assert not plan.admitted
            front = list(s.waiting)[: len(victims)]
            assert [id(q) for q in front] == [id(v) for v in reversed(victims)]
            assert front == sorted(front, key=lambda q: q.age)
            assert [id(q) for q in list(s.waiting)[len(victims):]] == list(map(id, before_waiting))
        # (b) the chunk budget (a smaller one where rows decode), and every running decoder
        # decodes (unless preempted).
        decoders = [q for q in decoding_before if all(q is not v for v in victims)]
        budget = self.budget_while_decoding if decoders else s.max_num_batched_tokens
        assert sum(length for _, _, length in plan.prefill) <= budget
        # (h) with one_prefill_chunk, one prompt's chunk at most where rows decode; where
        # none do, several only if each starts its prompt.
        if s.one_prefill_chunk and len(plan.prefill) > 1:
            assert not decoders and all(start == 0 for _, start, _ in plan.prefill), plan.prefill
        # An iteration that prefills decodes steps_while_prefilling steps; one that neither
        # prefills nor preempts, K.
        if plan.prefill:
            assert plan.decode_steps == while_prefilling
        elif not plan.preempt:
            assert plan.decode_steps == k
        assert plan.decode_steps in (while_prefilling, k)
        planned = {id(q): steps for q, steps in plan.decode}
        # (c) with first_tokens_first, an iteration whose prefill finishes a prompt and
        # leaves none to prefill defers the decode rows, never two in a row and never
        # beside a preemption.
        finishing = [q for q, st, n in plan.prefill if st + n == len(q.target)]
        ends = (bool(finishing) and not s.waiting
                and all(q.decoding or any(q is f for f in finishing) for q in s.running))
        should_defer = (s.first_tokens_first and ends and not plan.preempt
                        and not self.deferred and bool(decoding_before))
        assert plan.deferred == should_defer, (plan.deferred, should_defer)
        self.deferred = plan.deferred
        self.deferrals += plan.deferred
        for q in decoding_before:
            if not any(q is v for v in victims) and not plan.deferred:
                assert planned.get(id(q)) == min(plan.decode_steps, q.remaining)
        for q, steps in plan.decode:
            assert q.decoding and q.slot is not None and 1 <= steps <= q.remaining
        for q in plan.admitted:  # (d) n > 1 keeps its completions' slots from admission on
            assert len(q.reserved) == q.fork - 1
        # (f) admissions come off the front of the queue in its order, the rest stay in it.
        if not victims:
            taken = len(plan.admitted)
            assert list(map(id, plan.admitted)) == list(map(id, before_waiting[:taken]))
            assert list(map(id, s.waiting)) == list(map(id, before_waiting[taken:]))
        self.check_slots()

        # Apply it as the engine does: release, prefill (first token, fork), decode, finish.
        for q in victims:
            pool.release(q)
        finished = []
        for q, start, length in plan.prefill:
            assert start == q.cached and 1 <= length <= len(q.target) - start
            assert not q.decoding and any(q is r for r in s.running)
            pool.grow(q, start + length)
            q.cached = start + length
            if q.cached == len(q.target):
                q.decoding = True
                self.emit(q, 1)
                for index, slot in enumerate(q.reserved, start=1):
                    child = Sequence(request_id=q.request_id, index=index, arrival=q.arrival,
                                     prompt_ids=q.prompt_ids, max_tokens=q.max_tokens,
                                     slot=slot, cached=q.cached, decoding=True)
                    pool.share(q, child)
                    self.emit(child, 1)
                    s.adopt(child)
                    finished.append(child)
                q.reserved, q.fork = [], 1
                finished.append(q)
        # (g) with join_decode, the sequences whose prompt finished in this prefill (with
        # tokens left to make) join its decode dispatch, oldest first, as many as the pool
        # holds (the pool raises where a block it lacks is taken); none where the plan has
        # no decode.
        joiners = s.joiners(plan)
        started = [q for q in s.running if q.remaining and any(q is f for f in finished)]
        assert list(map(id, joiners)) == (list(map(id, started))
                                          if s.join_decode and plan.decode else [])
        if joiners:
            pool.pending = {}  # the victims' releases are applied now
            joined = s.join(plan, joiners, pool, pool.free())
            assert [(id(q), n) for q, n in joined] == [
                (id(q), min(plan.decode_steps, q.remaining)) for q in joiners[: len(joined)]]
            assert plan.decode[len(plan.decode) - len(joined):] == joined
            self.joined += len(joined)
            self.join_refusals += len(joiners) > len(joined)
        if self.condense and plan.decode:
            self.check_condense([q for q, _ in plan.decode])
        for q, steps in plan.decode:
            pool.copy_on_write(q)
            pool.grow(q, q.cached + steps)
            q.cached += steps
            self.emit(q, steps)
            finished.append(q)
        # A joiner is in ``finished`` twice: from its prefill and from its decode.
        ended = list({id(q): q for q in finished if q.remaining == 0}.values())
        held = s.remove(ended)
        assert {id(q) for q in held} == {id(q) for q in ended}
        for q in ended:
            pool.release(q)
            q.finish_reason = "length"
            self.done[q.request_id].append(q)
        self.check_slots()
        return plan

    def check_condense(self, decoding: list[Sequence]) -> None:
        """(i) Before a decode dispatch, ``condense`` puts its rows below the power of two
        covering their count: rows above it go to free slots there, or swap with sequences
        there being prefilled; reserved slots stay; nothing moves where every row lies below
        it already, or where they cannot all be placed."""
        s = self.sched
        rows = min(1 << (len(decoding) - 1).bit_length(), s.max_num_seqs)
        slots = {id(q): q.slot for q in s.running}
        reserved = {id(q): list(q.reserved) for q in s.running}
        free = list(s.free_slots)
        above = [q for q in decoding if q.slot >= rows]
        idle = [q for q in s.running if q.slot < rows and not q.decoding]
        room = len([f for f in free if f < rows]) + len(idle)
        moves = s.condense(decoding, rows)
        self.moves += len(moves)
        if not above or room < len(above):
            assert moves == []
        else:
            assert all(q.slot < rows for q in decoding)
        for q, old, new in moves:
            assert old == slots[id(q)] and new == q.slot
            if all(q is not d for d in decoding):  # swapped out of a decoding row's way
                assert any(q is i for i in idle) and new >= rows
        for q in s.running:
            if all(q is not m for m, _, _ in moves):
                assert q.slot == slots[id(q)]
            assert q.reserved == reserved[id(q)]
        self.check_slots()

    def run(self, arrivals: dict[int, list[tuple[int, int, int]]], limit: int) -> None:
        """``arrivals[i]``: requests ``(prompt_len, max_tokens, n)`` added before iteration
        ``i``. Runs until all are done, failing after ``limit`` iterations."""
        last = max(arrivals, default=0)
        i = 0
        while i <= last or self.sched.has_work:
            for req in arrivals.get(i, []):
                self.add(*req)
            if self.sched.has_work:
                self.step()
            i += 1
            assert i < limit, f"no end after {limit} iterations"


def assert_all_complete(sim: Sim, requests: dict[str, tuple[int, int, int]]) -> None:
    """Every completion of every request finished with exactly its tokens, in order."""
    for rid, (_, max_tokens, n) in requests.items():
        seqs = sorted(sim.done[rid], key=lambda q: q.index)
        assert [q.index for q in seqs] == list(range(n)), (rid, [q.index for q in seqs])
        for q in seqs:
            want = [token(int(rid[1:]), q.index, p) for p in range(max_tokens)]
            assert q.output_ids == want, (rid, q.index)
    assert not sim.sched.running and not sim.sched.waiting
    assert sim.pool.used() == 0, "blocks leaked"
    assert sorted(sim.sched.free_slots) == list(range(sim.sched.max_num_seqs))


def random_workload(rng: random.Random, block_size: int, num_blocks: int, max_seqs: int,
                    count: int):
    arrivals: dict[int, list[tuple[int, int, int]]] = {}
    for _ in range(count):
        while True:
            n = rng.choice([1, 1, 1, 2, 3])
            n = min(n, max_seqs)
            p, m = rng.randint(1, 40), rng.randint(1, 30)
            # What add_request admits: the whole request plus a copy per extra completion.
            if math.ceil((p + m) / block_size) + n - 1 <= num_blocks:
                break
        arrivals.setdefault(rng.choice([0, 0, rng.randint(0, 60)]), []).append((p, m, n))
    return arrivals


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_under_pressure_all_complete(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_seqs = rng.randint(1, 6)
    tokens = rng.choice([1, 3, 8, 16, 64])
    k = rng.choice([1, 2, 3, 8])
    while_prefilling = rng.choice([None, 1, k])
    policy = rng.choice(["fcfs", "shortest_first"])
    num_blocks = rng.randint(math.ceil(72 / block_size), math.ceil(72 / block_size) + 6)
    arrivals = random_workload(rng, block_size, num_blocks, max_seqs, rng.randint(5, 25))
    sim = Sim(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
              max_num_batched_tokens=tokens, steps_per_dispatch=k,
              steps_while_prefilling=while_prefilling, policy=policy,
              prefill_tokens_while_decoding=rng.choice([None, 1, max(1, tokens // 2)]),
              join_decode=seed % 2 == 0, one_prefill_chunk=seed % 4 < 2,
              condense=seed % 3 != 0)
    sim.run(arrivals, limit=20_000)
    requests = {f"r{i}": r for i, r in enumerate(r for i in sorted(arrivals)
                                                   for r in arrivals[i])}
    assert_all_complete(sim, requests)


def test_a_small_pool_preempts_many_times_and_still_completes_everything():
    rng = random.Random(1234)
    arrivals = {0: [(rng.randint(10, 30), rng.randint(20, 40), 1) for _ in range(12)]}
    sim = Sim(num_blocks=18, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
              steps_per_dispatch=8)
    sim.run(arrivals, limit=5_000)
    assert sim.preempted_total >= 10, sim.preempted_total
    assert sim.sched.num_preemptions == sim.preempted_total
    assert_all_complete(sim, {f"r{i}": r for i, r in enumerate(arrivals[0])})


def test_a_small_pool_with_condensed_slots_preempts_moves_and_completes_everything():
    rng = random.Random(1235)
    arrivals = {0: [(rng.randint(10, 30), rng.randint(1, 40), 1) for _ in range(12)]}
    sim = Sim(num_blocks=18, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
              steps_per_dispatch=8, condense=True)
    sim.run(arrivals, limit=5_000)
    assert sim.preempted_total >= 10 and sim.moves >= 4, (sim.preempted_total, sim.moves)
    assert_all_complete(sim, {f"r{i}": r for i, r in enumerate(arrivals[0])})


def slotted(sched: Scheduler, slots: dict[str, int], decoding: set[str],
            reserved: dict[str, list[int]] | None = None) -> dict[str, Sequence]:
    """Running sequences named by ``slots`` (name -> slot), the others free."""
    seqs = {}
    for i, (name, slot) in enumerate(slots.items()):
        seqs[name] = Sequence(request_id=name, index=0, arrival=i, prompt_ids=[1, 2],
                              max_tokens=4, slot=slot, decoding=name in decoding,
                              reserved=list((reserved or {}).get(name, [])))
    sched.running = list(seqs.values())
    taken = set(slots.values()) | {r for rs in (reserved or {}).values() for r in rs}
    sched.free_slots = [i for i in range(sched.max_num_seqs) if i not in taken]
    return seqs


def test_condense_moves_a_lone_decoding_row_into_the_lowest_free_slot():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=16, steps_per_dispatch=4,
                      block_size=4)
    q = slotted(sched, {"a": 6, "b": 3}, decoding={"a", "b"})
    moves = sched.condense([q["a"], q["b"]], 2)
    assert [(m.request_id, old, new) for m, old, new in moves] == [("b", 3, 0), ("a", 6, 1)]
    assert (q["a"].slot, q["b"].slot) == (1, 0)
    assert sched.free_slots == [2, 3, 4, 5, 6, 7]
    # Rows that lie below the bound already stay.
    assert sched.condense([q["a"], q["b"]], 2) == []


def test_condense_swaps_with_a_prefilling_sequence_and_keeps_reserved_slots():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=16, steps_per_dispatch=4,
                      block_size=4)
    # p is being prefilled in slot 0, with slot 1 kept for its second completion.
    q = slotted(sched, {"p": 0, "d": 5}, decoding={"d"}, reserved={"p": [1]})
    moves = sched.condense([q["d"]], 1)
    assert [(m.request_id, old, new) for m, old, new in moves] == [("p", 0, 5), ("d", 5, 0)]
    assert (q["p"].slot, q["d"].slot, q["p"].reserved) == (5, 0, [1])
    assert sched.free_slots == [2, 3, 4, 6, 7]
    # Slot 0 reserved, 1 decoding: a row in slot 4 has no place below 2.
    q = slotted(sched, {"p": 3, "e": 1, "d": 4}, decoding={"e", "d"}, reserved={"p": [0]})
    assert sched.condense([q["e"], q["d"]], 2) == []
    assert (q["p"].slot, q["e"].slot, q["d"].slot) == (3, 1, 4)


def test_a_long_prompt_is_chunked_while_the_running_requests_decode_every_iteration():
    sim = Sim(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              steps_per_dispatch=4)
    for _ in range(3):
        sim.add(5, 200)
    sim.step()  # the three short prompts are prefilled together
    assert all(q.decoding for q in sim.sched.running)
    long = sim.add(1000, 3)
    chunks = []
    while not any(q.request_id == long and q.decoding for q in sim.sched.running):
        plan = sim.step()
        assert len(plan.decode) == 3  # nobody stalls for more than this iteration's chunk
        chunks += [length for q, _, length in plan.prefill if q.request_id == long]
    assert chunks == [64] * 15 + [40]


def test_a_smaller_chunk_budget_while_rows_decode():
    # As above with 24 tokens a chunk while the three decode; the three short prompts, with
    # nothing decoding, still take the whole budget together.
    sim = Sim(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              steps_per_dispatch=4, prefill_tokens_while_decoding=24)
    for _ in range(3):
        sim.add(30, 200)
    plan = sim.step()
    assert [n for _, _, n in plan.prefill] == [30, 30, 4]
    plan = sim.step()
    assert [n for _, _, n in plan.prefill] == [24] and len(plan.decode) == 2
    plan = sim.step()
    assert [n for _, _, n in plan.prefill] == [2] and len(plan.decode) == 2
    long = sim.add(1000, 3)
    chunks = []
    while not any(q.request_id == long and q.decoding for q in sim.sched.running):
        plan = sim.step()
        assert len(plan.decode) == 3
        chunks += [length for q, _, length in plan.prefill if q.request_id == long]
    assert chunks == [24] * 41 + [16]


def test_one_prefill_chunk_an_iteration():
    # Prompts of 30, 30, 30 and 10 tokens, 64 tokens an iteration (24 while rows decode).
    # The first plan has no decode rows, so it fills its budget either way (30, 30, 4).
    # After it, with one prefill chunk, each plan beside decode rows holds one prompt's
    # chunk: r2's 24, then its last 2 (the rest of the budget unused), then r3's 10.
    # Without it, r2's last 2 and r3's 10 share a plan.
    chunks = {}
    for one in (True, False):
        sim = Sim(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                  steps_per_dispatch=4, prefill_tokens_while_decoding=24,
                  one_prefill_chunk=one)
        for n in (30, 30, 30, 10):
            sim.add(n, 20)
        plans = []
        while sim.sched.has_work:
            plans.append(sim.step())
        assert_all_complete(sim, {f"r{i}": (n, 20, 1) for i, n in enumerate((30, 30, 30, 10))})
        chunks[one] = [[(q.request_id, n) for q, _, n in p.prefill] for p in plans
                       if p.prefill]
    first = [("r0", 30), ("r1", 30), ("r2", 4)]
    assert chunks[True] == [first, [("r2", 24)], [("r2", 2)], [("r3", 10)]], chunks
    assert chunks[False] == [first, [("r2", 24)], [("r2", 2), ("r3", 10)]], chunks


def test_one_prefill_chunk_without_decode_rows_takes_first_chunks_only():
    # r0 (100 tokens) alone, 64 tokens an iteration; r1 (10) arrives after the first plan.
    # No row decodes in the second plan either. With one prefill chunk it holds r0's last
    # 36 tokens alone (a continuing chunk and a first chunk would be two dispatches); r1
    # follows. Without it, r1's 10 tokens share the plan.
    chunks = {}
    for one in (True, False):
        sim = Sim(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                  steps_per_dispatch=4, one_prefill_chunk=one)
        sim.add(100, 5)
        plans = [sim.step()]
        sim.add(10, 5)
        while sim.sched.has_work:
            plans.append(sim.step())
        assert_all_complete(sim, {"r0": (100, 5, 1), "r1": (10, 5, 1)})
        chunks[one] = [[(q.request_id, start, n) for q, start, n in p.prefill] for p in plans
                       if p.prefill]
    assert chunks[True] == [[("r0", 0, 64)], [("r0", 64, 36)], [("r1", 0, 10)]], chunks
    assert chunks[False] == [[("r0", 0, 64)], [("r0", 64, 36), ("r1", 0, 10)]], chunks


def two_beside_a_decoder(sim: Sim) -> list[Plan]:
    """r0 (5 tokens) prefilled alone, then r1 (6) and r2 (20) added together: the plans of
    the next three iterations."""
    sim.add(5, 30)
    sim.step()
    sim.add(6, 30)
    sim.add(20, 30)
    return [sim.step() for _ in range(3)]


def test_a_prompt_that_finishes_joins_its_iteration_s_decode():
    # r0 decodes; r1 (6 tokens) and r2 (20) arrive together, 16 tokens a chunk. r1 finishes
    # in the first iteration and decodes in its dispatch beside r0; without join_decode it
    # waits for the next iteration's.
    rows = {}
    for join in (True, False):
        sim = Sim(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                  steps_per_dispatch=4, steps_while_prefilling=1, join_decode=join)
        plans = two_beside_a_decoder(sim)
        rows[join] = [[q.request_id for q, _ in p.decode] for p in plans]
        while sim.sched.has_work:
            sim.step()
        assert_all_complete(sim, {"r0": (5, 30, 1), "r1": (6, 30, 1), "r2": (20, 30, 1)})
    # The third iteration has nothing to prefill: K steps for all three either way.
    assert rows[True] == [["r0", "r1"], ["r0", "r1", "r2"], ["r0", "r1", "r2"]], rows
    assert rows[False] == [["r0"], ["r0", "r1"], ["r0", "r1", "r2"]], rows


def test_a_joiner_the_pool_cannot_hold_waits_for_the_next_iteration():
    # A pool one block short: some finished prompts cannot join their iteration's decode,
    # and everything still completes (the toy pool raises on any block it does not have).
    refused = 0
    for seed in range(12):
        rng = random.Random(seed)
        sim = Sim(num_blocks=rng.randint(10, 16), block_size=2, max_num_seqs=4,
                  max_num_batched_tokens=rng.choice([4, 8]), steps_per_dispatch=2,
                  steps_while_prefilling=1, join_decode=True)
        requests = {}
        for _ in range(10):
            p, m = rng.randint(1, 9), rng.randint(2, 9)
            requests[sim.add(p, m)] = (p, m, 1)
            sim.step()
        sim.run({}, limit=2_000)
        assert_all_complete(sim, requests)
        refused += sim.join_refusals
    assert refused > 0


def test_n_completions_hold_their_slots_from_admission_and_fork_after_the_prefill():
    sim = Sim(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
              steps_per_dispatch=2)
    big = sim.add(20, 6, n=3)
    other = sim.add(3, 4, n=2)  # needs 2 slots: waits until the first request's finish
    plan = sim.step()
    (first,) = plan.admitted
    assert len(first.reserved) == 2 and len(sim.sched.free_slots) == 1
    while len(sim.done[big]) < 3:
        sim.step()
        if len(sim.done[big]) == 0:
            assert [q.request_id for q in sim.sched.waiting] == [other]
    sim.run({}, limit=100)
    assert_all_complete(sim, {big: (20, 6, 3), other: (3, 4, 2)})


def test_no_admission_in_an_iteration_that_preempts():
    # Two decoders fill the pool; a third request waits. The iteration that preempts the
    # newer decoder must not hand the freed blocks to the waiting request.
    sim = Sim(num_blocks=6, block_size=2, max_num_seqs=3, max_num_batched_tokens=16,
              steps_per_dispatch=2)
    sim.add(3, 8)
    sim.add(3, 8)
    sim.step()
    sim.add(1, 1)
    saw = False
    while sim.sched.has_work:
        plan = sim.step()
        saw |= bool(plan.preempt)
        assert sim.iterations < 200
    assert saw


class Starved:
    """A counter that never has a block: even the oldest sequence cannot decode."""

    def free(self):
        return 0

    def decode_need(self, seq, steps):
        return 1

    def lookup(self, seq):
        return 0

    def prefill_need(self, seq, upto):
        return 0

    def held_alone(self, seq):
        return 0


def starved_scheduler():
    sched = Scheduler(max_num_seqs=3, max_num_batched_tokens=8, steps_per_dispatch=4,
                      block_size=4)
    seqs = [Sequence(request_id=f"r{i}", index=0, arrival=i, prompt_ids=[1, 2], max_tokens=9)
            for i in range(3)]
    for slot, q in enumerate(seqs):
        q.slot, q.cached, q.decoding, q.output_ids = slot, 2, True, [5]
        sched.running.append(q)
    sched.free_slots = []
    return sched, seqs


def test_the_oldest_dispatch_not_fitting_raises_naming_the_sizes():
    sched, _ = starved_scheduler()
    with pytest.raises(RuntimeError, match=r"oldest sequence \(r0\); free 0, needed 1"):
        sched.schedule(Starved())


def test_a_refused_schedule_leaves_the_queues_and_slots_unchanged():
    # The engine gets no plan when schedule raises, so it releases nothing: the scheduler
    # must not have moved the newer sequences to the queue either.
    sched, seqs = starved_scheduler()
    with pytest.raises(RuntimeError):
        sched.schedule(Starved())
    assert sched.running == seqs and not sched.waiting and sched.free_slots == []
    assert [(q.slot, q.cached, q.decoding) for q in seqs] == [(i, 2, True) for i in range(3)]
    assert sched.num_preemptions == 0


def test_a_request_with_n_completions_waits_for_its_copy_on_write_blocks():
    # 7 blocks of 4: the first request takes 3; the second's prompt needs 4, and its second
    # completion one more for the copy of the shared last block, so it waits.
    sim = Sim(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
              steps_per_dispatch=2)
    first = sim.add(12, 2)
    second = sim.add(16, 1, n=2)
    plan = sim.step()
    assert [q.request_id for q in plan.admitted] == [first]
    sim.run({}, limit=100)
    assert_all_complete(sim, {first: (12, 2, 1), second: (16, 1, 2)})


def test_removing_a_sequence_before_its_fork_returns_the_slots_kept_for_its_completions():
    sim = Sim(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
              steps_per_dispatch=2)
    sim.add(30, 4, n=3)
    (seq,) = sim.step().admitted  # a chunk of its prompt: it has not forked yet
    assert len(seq.reserved) == 2 and len(sim.sched.free_slots) == 1
    assert sim.sched.remove([seq]) == [seq]  # an abort
    assert sim.sched.free_slots == [0, 1, 2, 3] and not sim.sched.has_work


def test_decode_runs_one_step_per_iteration_while_prompts_are_prefilled_then_k():
    # 6 prompts of 20 tokens, 16 tokens a chunk budget: the prompts take 8 iterations to
    # prefill, one chunk each, and the rows that already decode get one step in each.
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              steps_per_dispatch=8, steps_while_prefilling=1)
    for _ in range(6):
        sim.add(20, 40)
    plans = []
    while sim.sched.has_work:
        plans.append(sim.step())
    kinds = [(bool(p.prefill), p.decode_steps) for p in plans if p.decode]
    # Every iteration that prefilled and decoded ran 1 step, every other one 8.
    assert kinds and all(k == (1 if prefilled else 8) for prefilled, k in kinds), kinds
    assert (True, 1) in kinds and (False, 8) in kinds
    # Two requests wait for a slot; when the first four finish they are admitted, and the
    # decoders step once per iteration again until their prompts are in.
    firsts = [i for i, p in enumerate(plans) if p.admitted]
    assert len(firsts) >= 2
    assert_all_complete(sim, {f"r{i}": (20, 40, 1) for i in range(6)})


def test_the_engine_may_ask_for_fewer_steps_than_k_and_prefill_iterations_keep_theirs():
    # The engine asks for 1 step in some iterations (LLMEngine's max_dispatch_ms): those
    # plans decode 1 step a row; prefill iterations still decode steps_while_prefilling
    # (2), unless the engine asked for fewer.
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
              steps_per_dispatch=8, steps_while_prefilling=2)
    sim.add(6, 30)
    sim.add(20, 30)  # chunked over three iterations, beside r0's decode
    asked = [8, 1, 8, 1, 1, 8, 1, 8]
    plans = [sim.step(k) for k in asked]
    got = [(bool(p.prefill), p.decode_steps) for p in plans]
    # r1's chunks: 2 tokens beside r0's whole prompt, 8, 8, then its last 2.
    assert got == [(True, 2), (True, 1), (True, 2), (True, 1), (False, 1), (False, 8),
                   (False, 1), (False, 8)], got
    assert [n for _, n in plans[-1].decode] == [8, 8]
    while sim.sched.has_work:
        sim.step(1)
    assert_all_complete(sim, {"r0": (6, 30, 1), "r1": (20, 30, 1)})


def test_first_tokens_first_defers_the_decode_rows_one_iteration_at_a_time():
    # r0 decodes; r1..r3 arrive one an iteration, each prefilled whole in one iteration. Each
    # iteration that finishes a prompt defers the decoders, unless the one before did.
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              steps_per_dispatch=4, steps_while_prefilling=1, first_tokens_first=True)
    sim.add(5, 30)
    first = sim.step()
    assert first.prefill and not first.decode and not first.deferred  # nothing decodes yet
    kinds = []
    for _ in range(3):
        sim.add(6, 30)
        plan = sim.step()
        kinds.append((len(plan.prefill), [n for _, n in plan.decode], plan.deferred))
    # r1 finishes: r0 deferred. r2 finishes: r0 and r1 decode 1 step (no two in a row).
    # r3 finishes: deferred again.
    assert kinds == [(1, [], True), (1, [1, 1], False), (1, [], True)], kinds
    plan = sim.step()  # nothing to prefill: everyone decodes K
    assert [n for _, n in plan.decode] == [4, 4, 4, 4] and not plan.deferred
    while sim.sched.has_work:
        sim.step()
    assert_all_complete(sim, {f"r{i}": (6 if i else 5, 30, 1) for i in range(4)})


def test_first_tokens_first_does_not_defer_while_prefill_is_left():
    # r1 (6 tokens) and r2 (20) arrive together beside a decoding r0, 16 tokens a chunk:
    # the first iteration finishes r1 but leaves r2's chunks, so r0 decodes; the second
    # finishes r2 with nothing left, so the decoders wait one iteration.
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              steps_per_dispatch=4, steps_while_prefilling=1, first_tokens_first=True)
    plans = two_beside_a_decoder(sim)
    got = [([n for _, _, n in p.prefill], [n for _, n in p.decode], p.deferred) for p in plans]
    assert got == [([6, 10], [1], False), ([10], [], True), ([], [4, 4, 4], False)], got


@pytest.mark.parametrize("seed", range(4))
def test_first_tokens_first_on_random_workloads_completes_everything(seed):
    # Arrivals between iterations, a pool that preempts now and then: Sim's checks hold in
    # every iteration (deferral exactly where due), and everything completes.
    rng = random.Random(seed)
    sim = Sim(num_blocks=rng.randint(30, 80), block_size=4, max_num_seqs=4,
              max_num_batched_tokens=rng.choice([8, 16, 32]), steps_per_dispatch=4,
              steps_while_prefilling=rng.choice([1, 4]), first_tokens_first=True)
    requests = {}
    for _ in range(12):
        for _ in range(rng.randint(0, 2)):
            p, m = rng.randint(1, 29), rng.randint(1, 19)
            requests[sim.add(p, m)] = (p, m, 1)
        if sim.sched.has_work:
            sim.step()
    while sim.sched.has_work:
        sim.step()
    assert sim.deferrals > 0
    assert_all_complete(sim, requests)


def test_an_admission_s_evictable_hit_blocks_leave_the_free_count_for_the_next_one():
    # 2 free blocks and 3 evictable ones, which hold the first queued prompt's first 24
    # tokens. Admitting it takes 1 new block and makes the 3 unevictable: 1 block is left,
    # so the next prompt (2 blocks) waits.
    class HitPool:
        def free(self):
            return 5

        def decode_need(self, seq, steps):
            return 0

        def lookup(self, seq):
            return 24 if seq.request_id == "hit" else 0

        def prefill_need(self, seq, upto):
            need = -(-upto // 8) - -(-seq.cached // 8)
            return need + (3 if seq.slot is None and seq.request_id == "hit" else 0)

        def held_alone(self, seq):
            return 0

    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, steps_per_dispatch=1,
                      block_size=8)
    for i, (rid, n) in enumerate((("hit", 28), ("other", 10))):
        sched.add(Sequence(request_id=rid, index=0, arrival=i, prompt_ids=[1] * n,
                           max_tokens=4))
    plan = sched.schedule(HitPool())
    assert [s.request_id for s in plan.admitted] == ["hit"]
    assert [(start, n) for _, start, n in plan.prefill] == [(24, 4)]
    assert [s.request_id for s in sched.waiting] == ["other"]


def test_a_plan_that_cannot_prefill_decodes_k_steps():
    # Free slots but too few blocks for the queued prompt: no prefill can run, so the
    # running request decodes K steps rather than one step an iteration.
    sim = Sim(num_blocks=12, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
              steps_per_dispatch=4, steps_while_prefilling=1)
    sim.add(8, 16)
    sim.step()  # prefilled (3 blocks with the first decode's)
    sim.add(40, 4)  # needs 10 blocks of the 12, and 3 are held: waits
    plan = sim.step()
    assert not plan.prefill and sim.sched.prefill_pending()
    assert plan.decode_steps == 4 and [n for _, n in plan.decode] == [4]


def first_token_iterations(policy: str, prompt_lens: list[int], budget: int) -> list[int]:
    """The iteration (from 1) in which each request, all added together, got its first
    token."""
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=len(prompt_lens),
              max_num_batched_tokens=budget, steps_per_dispatch=2, policy=policy)
    rids = [sim.add(n, 4) for n in prompt_lens]
    first = {}
    while sim.sched.has_work:
        sim.step()
        started = [q for q in sim.sched.running if q.decoding]  # 4 tokens: none ends yet
        for q in started:
            first.setdefault(q.request_id, sim.iterations)
    return [first[r] for r in rids]


@pytest.mark.parametrize("policy, want", [
    # Budget 8. fcfs: r0's 8, then r0's last 4 + r1's 3 + 1 of r2, then r2's 4 + r3's 3.
    ("fcfs", [2, 2, 3, 3]),
    # shortest_first takes r1, r3, r2, r0: r1's 3 + r3's 3 + 2 of r2, then r2's 3 + 5 of
    # r0, then r0's last 7.
    ("shortest_first", [3, 1, 2, 1]),
])
def test_requests_added_together_are_prefilled_in_the_policy_order(policy, want):
    assert first_token_iterations(policy, [12, 3, 5, 3], budget=8) == want


def test_shortest_first_keeps_a_request_queued_earlier_ahead_of_a_shorter_later_one():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
              steps_per_dispatch=2, policy="shortest_first")
    sim.add(4, 6)
    sim.step()  # r0 holds the only slot
    waiting = sim.add(10, 2)
    sim.step()  # r1 queued: no slot
    later = sim.add(2, 2)  # shorter, but added after r1 waited a plan
    order = []
    while sim.sched.has_work:
        plan = sim.step()
        order += [q.request_id for q in plan.admitted]
    assert order == [waiting, later]


def test_an_unknown_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"policy must be one of \('fcfs', 'shortest_first'\)"
                                         r"\. Got 'sjf'"):
        Scheduler(max_num_seqs=1, max_num_batched_tokens=8, steps_per_dispatch=1,
                  block_size=4, policy="sjf")


def test_the_max_dispatch_ms_flag_maps_0_to_no_budget_and_refuses_what_is_not_a_duration():
    assert max_dispatch_ms_flag(0.0) is None
    assert max_dispatch_ms_flag(250.0) == 250.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"--max-dispatch-ms must be >= 0 and finite "
                                             rf"\(0: off\), got {bad}"):
            max_dispatch_ms_flag(bad)


def test_the_prefill_budget_flag_maps_0_to_the_whole_budget_and_refuses_what_exceeds_it():
    assert prefill_budget_flag(0, 256) is None
    assert prefill_budget_flag(128, 256) == 128
    assert prefill_budget_flag(256, 256) == 256
    for bad in (-1, 257):
        with pytest.raises(ValueError, match=rf"--prefill-tokens-while-decoding must be in "
                                             rf"\[0, --max-num-batched-tokens=256\] \(0: the "
                                             rf"same\), got {bad}"):
            prefill_budget_flag(bad, 256)
