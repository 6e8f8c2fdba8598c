"""The engine's scheduler: plain Python, no JAX, testable without a model.

Every ``LLMEngine.step`` asks ``Scheduler.schedule`` for one iteration's plan:

1. **Decode.** Every running sequence whose prompt is in the cache decodes
   ``min(K, tokens it may still produce)`` tokens in one K-step dispatch (K as the engine
   asks: fewer where K steps take too long, see ``LLMEngine``'s ``max_dispatch_ms``).
   While prompts are being prefilled (a started prompt has chunks left, or a queued one
   has a free slot), K is ``steps_while_prefilling`` instead (1 by default): every decode
   step computes every slot's row, so eight steps beside each prefill chunk would hold each
   new prompt's first token behind them and run steps for rows that have nothing to decode
   yet. When such an
   iteration plans no prefill after all (the pool is short), it is planned again with K.
2. **Preemption by recompute.** If the pool cannot hold that dispatch's blocks, the newest
   sequence (latest arrival, then highest completion index) is preempted: its slot and blocks
   are freed and it goes back to the front of the queue, to resume later from its prompt plus
   what it generated (the prefix cache keeps most of that cheap). Repeated until the
   dispatch fits. The oldest sequence always makes progress, so nothing deadlocks; nothing
   is dropped.
3. **Chunked prefill.** Then prompts are prefilled, at most ``max_num_batched_tokens`` tokens
   in all per iteration (at most ``prefill_tokens_while_decoding`` in an iteration with
   decode rows: a decoding row's next token waits for the iteration's prefill, so this
   bounds that wait, the inter-token latency's tail, at the cost of more iterations for a
   long prompt): first the chunks of prompts already started, then new admissions,
   first come first served (preempted sequences first; with ``policy="shortest_first"``, the
   requests queued since the previous plan are taken shortest prompt first among
   themselves). A waiting sequence is admitted only
   when a slot is free (``n`` slots for a request with ``n`` completions, which fork after
   the prefill) and the pool holds its whole prompt plus one copy-on-write block per extra
   completion beside the decode dispatch; so a long prompt stalls running requests for at
   most one chunk per iteration, and a prompt is never started that cannot finish.

4. **First tokens first** (``first_tokens_first``). An iteration whose prefill finishes a
   prompt and leaves nothing to prefill (no prompt with chunks left, none queued) plans no
   decode dispatch, unless the iteration before it planned none either: the new prompt's
   first token is returned after its prefill alone, not after a decode step of every other
   row as well. The other rows decode in the next iteration, their token coming after the
   same work as before (the prefill, then a decode step), and the new sequence decodes
   with them. Where more prefill is pending, deferring would hold the rows behind the next
   chunk too, so they decode as usual.

5. **New rows join the decode** (``join_decode``). A prompt whose prefill finishes in an
   iteration with a decode dispatch decodes in that dispatch too, beside the rows planned
   for it, where the free blocks hold its steps (``joiners``, ``join``; the engine leaves
   out the completions of a request with ``n > 1``, which fork there). Otherwise its second
   token would wait for the rest of the iteration and all of the next one.

6. **One prefill chunk** (``one_prefill_chunk``). Each iteration with decode rows prefills
   one prompt's chunk at most, and leaves the rest of its budget unused where that chunk
   finishes its prompt. With the engine's ``decode_with_prefill``, every iteration whose
   rows decode is then one dispatch: a decoding row's next token waits for one chunk of at
   most ``prefill_tokens_while_decoding`` tokens, never for two chunks' dispatches. An
   iteration without decode rows takes several chunks only where each starts its prompt
   (nothing cached before it), up to its whole budget: prompts that arrive together at an
   idle engine are prefilled together, in one dispatch (the engine packs them, with
   ``pack_prefill``). Otherwise it takes one chunk too. So every iteration is one prefill
   dispatch: a prompt whose first token comes from it never waits for another prompt's
   chunk before its second. The cost: while rows decode, prompts are prefilled one after
   another, so where many arrive together the later ones' first tokens come later.

The plan is separate prefill-chunk and decode dispatches in one iteration (not one ragged
step that mixes them): the decode dispatch is the K-step scan, whose point is K tokens per
host round trip, and a mixed step would be one token per trip.

Blocks are counted through a ``BlockCounter`` the engine provides (the device state's free
count, the prefix cache's hits and evictable blocks); the scheduler only adds them up.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable
from typing import Protocol

__all__ = ["DEFAULT_MAX_DISPATCH_MS", "POLICIES", "BlockCounter", "Plan", "Scheduler",
           "Sequence", "max_dispatch_ms_flag", "prefill_budget_flag"]

POLICIES = ("fcfs", "shortest_first")
# The longest a decode dispatch of K steps may take before the engine dispatches fewer
# (``LLMEngine``'s ``max_dispatch_ms``): what a request arriving meanwhile waits, at most.
DEFAULT_MAX_DISPATCH_MS = 100.0


def max_dispatch_ms_flag(value: float) -> float | None:
    """A command line's ``--max-dispatch-ms`` as ``LLMEngine``'s ``max_dispatch_ms``: 0 is
    None (K steps whenever nothing is prefilled). Raises ``ValueError`` naming a negative or
    infinite value."""
    if not 0 <= value < math.inf:
        raise ValueError(f"--max-dispatch-ms must be >= 0 and finite (0: off), got {value}")
    return value or None


def prefill_budget_flag(value: int, max_num_batched_tokens: int) -> int | None:
    """A command line's ``--prefill-tokens-while-decoding`` as ``LLMEngine``'s
    ``prefill_tokens_while_decoding``: 0 is None (the whole budget). Raises ``ValueError``
    naming a value outside ``[0, max_num_batched_tokens]``."""
    if not 0 <= value <= max_num_batched_tokens:
        raise ValueError(f"--prefill-tokens-while-decoding must be in [0, "
                         f"--max-num-batched-tokens={max_num_batched_tokens}] (0: the same), "
                         f"got {value}")
    return value or None


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion of a request, the unit that holds a slot.

    ``target`` is what must be in the cache before it decodes: the prompt, plus its own
    generated tokens after a preemption. ``cached`` counts its tokens in the KV cache.
    ``fork`` is the number of completions it splits into after its prefill (``n`` for a new
    request's first sequence, 1 otherwise); ``reserved`` holds the slots kept for them from
    its admission on. ``decoding`` turns on with its first token after a prefill: from then
    on its cache holds every token but the newest, which the next decode step feeds.
    """

    request_id: str
    index: int
    arrival: int  # the request's arrival order: older first
    prompt_ids: list[int]
    max_tokens: int
    fork: int = 1
    output_ids: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    cached: int = 0
    finish_reason: str | None = None
    preemptions: int = 0
    decoding: bool = False
    reserved: list[int] = dataclasses.field(default_factory=list)
    seed: int = 0  # this completion's sampling seed
    request_seed: int = 0  # its request's, from which the siblings' seeds derive

    @property
    def target(self) -> list[int]:
        return self.prompt_ids + self.output_ids


    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)

    @property
    def age(self) -> tuple[int, int]:
        return (self.arrival, self.index)


class BlockCounter(Protocol):
    """Block arithmetic for the scheduler.

    * ``free()``: blocks the next dispatches may take (free ones plus evictable cached ones);
    * ``decode_need(seq, steps)``: new blocks for ``steps`` decode steps (copies included);
    * ``lookup(seq)``: tokens of a queued sequence's target already cached (a prefix hit,
      whole blocks, always short of the whole target);
    * ``prefill_need(seq, upto)``: blocks to take ``seq`` from ``seq.cached`` to ``upto``
      cached tokens (for a new admission, counting the hit's blocks that would otherwise be
      evictable);
    * ``held_alone(seq)``: blocks that releasing ``seq`` makes available again.
    """

    def free(self) -> int: ...

    def decode_need(self, seq: Sequence, steps: int) -> int: ...

    def lookup(self, seq: Sequence) -> int: ...

    def prefill_need(self, seq: Sequence, upto: int) -> int: ...

    def held_alone(self, seq: Sequence) -> int: ...


@dataclasses.dataclass
class Plan:
    """One iteration: slots to free first (``(seq, slot)`` of preempted sequences), prefill
    chunks ``(seq, start, length)`` (the sequences in ``admitted`` start this iteration, on
    ``start`` tokens of prefix-cache hit), then decode rows ``(seq, steps)``."""

    preempt: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)
    decode: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    decode_steps: int = 1  # the decode dispatch's number of steps (no row decodes more)
    deferred: bool = False  # the decode rows wait for the next iteration (first tokens first)

    @property
    def empty(self) -> bool:
        return not (self.preempt or self.prefill or self.decode)


class Scheduler:
    """Queues and slots. ``add`` queues a sequence, ``schedule`` plans an iteration and moves
    sequences between the queue and the slots; the engine reports back with ``finish``."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, steps_per_dispatch: int,
                 block_size: int, steps_while_prefilling: int | None = None,
                 policy: str = "fcfs", first_tokens_first: bool = False,
                 prefill_tokens_while_decoding: int | None = None, join_decode: bool = False,
                 one_prefill_chunk: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}. Got {policy!r}.")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.steps_per_dispatch = steps_per_dispatch
        # None: K throughout (no separate setting while prefilling).
        self.steps_while_prefilling = min(steps_while_prefilling or steps_per_dispatch,
                                          steps_per_dispatch)
        self.block_size = block_size
        self.first_tokens_first = first_tokens_first
        # None: max_num_batched_tokens whether or not rows decode.
        self.prefill_tokens_while_decoding = min(
            prefill_tokens_while_decoding or max_num_batched_tokens, max_num_batched_tokens)
        self.join_decode = join_decode
        self.one_prefill_chunk = one_prefill_chunk
        self._deferred = False  # whether the previous plan deferred its decode rows
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # holding a slot, in admission order
        self.free_slots = list(range(max_num_seqs))
        self.num_preemptions = 0
        self._fresh: list[Sequence] = []  # queued since the previous plan, in arrival order

    # -- queue -------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._fresh.append(seq)

    def _order_fresh(self) -> None:
        """Under ``shortest_first``, put the sequences queued since the previous plan in order
        of prompt length (arrival order among equals), behind everything queued before them.

        They arrived between two plans, so no one of them has waited for a plan longer than
        another; taking the short ones first gives more of them their first token sooner
        (the longest finishes no later than it would have last). Sequences queued earlier
        keep their places, so none waits behind later arrivals."""
        fresh, self._fresh = {id(s) for s in self._fresh}, []
        if self.policy == "fcfs" or len(fresh) < 2:
            return
        new = sorted((s for s in self.waiting if id(s) in fresh), key=lambda s: len(s.target))
        self.waiting = collections.deque(
            [s for s in self.waiting if id(s) not in fresh] + new)

    def remove(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """Take ``seqs`` out of the queue and the slots (abort, finish); returns those that held
        a slot (their blocks are for the caller to release)."""
        seqs = list(seqs)
        drop = set(map(id, seqs))
        self.waiting = collections.deque(s for s in self.waiting if id(s) not in drop)
        held = [s for s in self.running if id(s) in drop]
        self.running = [s for s in self.running if id(s) not in drop]
        for s in held:
            self.free_slots.append(s.slot)
            self.free_slots += s.reserved
            s.reserved = []
        self.free_slots.sort()
        return held

    def adopt(self, seq: Sequence) -> None:
        """A forked child: already in its slot, with its parent's cache."""
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ----------------------------------------------------------------------------

    def prefill_pending(self) -> bool:
        """Whether a prompt could be prefilled now: a started one has chunks left, or the
        first queued one has its slots free (the pool may still be short of blocks)."""
        return (any(not s.decoding for s in self.running)
                or bool(self.waiting and len(self.free_slots) >= self.waiting[0].fork))

    def schedule(self, blocks: BlockCounter, steps: int | None = None) -> Plan:
        """The next iteration's plan. Its decode dispatch has ``steps`` steps (K, by
        default) where nothing is prefilled, ``steps_while_prefilling`` where something is."""
        k = self.steps_per_dispatch if steps is None else steps
        self._order_fresh()
        plan = None
        if self.steps_while_prefilling < k and self.prefill_pending():
            plan = self._plan(blocks, self.steps_while_prefilling)
            # A plan without prefill or preemption changed nothing (no admission, no slot
            # moved): planning again with K is safe.
            if not (plan.prefill or plan.preempt):
                plan = None
        plan = self._plan(blocks, k) if plan is None else plan
        # First tokens first (module docstring, 4). Not where the plan preempted: the pool
        # is short, and the decode dispatch is what it made room for.
        if (self.first_tokens_first and plan.decode and not plan.preempt
                and not self._deferred and self._prefill_ends(plan)):
            plan.decode, plan.deferred = [], True
        self._deferred = plan.deferred
        return plan

    def _prefill_ends(self, plan: Plan) -> bool:
        """Whether ``plan``'s prefill finishes a prompt and leaves none to prefill: every
        started prompt finishes in it and none is queued. Deferring the decode rows then
        costs them nothing: the next iteration decodes without a prefill beside it (unless
        a request arrives in between)."""
        finishing = {id(seq) for seq, start, n in plan.prefill if start + n == len(seq.target)}
        return (bool(finishing) and not self.waiting
                and all(s.decoding or id(s) in finishing for s in self.running))

    def _plan(self, blocks: BlockCounter, k: int) -> Plan:
        """One iteration's plan with decode dispatches of ``k`` steps."""
        plan = Plan(decode_steps=k)
        decode = [(s, min(k, s.remaining)) for s in self.running if s.decoding]
        free = blocks.free()
        need = {id(s): blocks.decode_need(s, n) for s, n in decode}
        # Preempt the newest until the dispatch fits. Partly prefilled sequences count too:
        # they hold blocks, and they are newer than what already decodes.
        # Victims are chosen first and preempted only once the dispatch is known to fit, so a
        # refusal leaves the queues and slots as they were.
        victims: list[Sequence] = []
        while sum(need.values()) > free:
            left = [s for s in self.running if all(s is not v for v in victims)]
            victim = max(left, key=lambda s: s.age)
            if victim is min(left, key=lambda s: s.age):
                raise RuntimeError(  # admission rules make this impossible; never silent
                    f"The pool cannot hold one decode dispatch of its oldest sequence "
                    f"({victim.request_id}); free {free}, needed {sum(need.values())}.")
            free += blocks.held_alone(victim)
            need.pop(id(victim), None)
            victims.append(victim)
        for victim in victims:
            self._preempt(victim, plan)
        decode = [(s, n) for s, n in decode if all(s is not v for v in victims)]
        plan.decode = decode
        free -= sum(need.values())

        tokens = (self.prefill_tokens_while_decoding if decode
                  else self.max_num_batched_tokens)

        def room(start: int = 0) -> bool:
            """Whether the plan takes another chunk, one from ``start`` (module docstring,
            6: beside decode rows one chunk; without, chunks that start their prompts)."""
            if tokens <= 0:
                return False
            if not (self.one_prefill_chunk and plan.prefill):
                return True
            return not decode and start == 0 and all(st == 0 for _, st, _ in plan.prefill)

        for seq in self.running:  # prompts already started continue first
            if seq.decoding or not room(seq.cached):
                continue
            length = min(len(seq.target) - seq.cached, tokens)
            cost = blocks.prefill_need(seq, seq.cached + length)
            if cost > free:
                continue
            plan.prefill.append((seq, seq.cached, length))
            tokens -= length
            free -= cost
        # No admissions in an iteration that preempted: the pool is what is short.
        while self.waiting and room() and not plan.preempt:
            seq = self.waiting[0]
            if len(self.free_slots) < seq.fork:
                break
            seq.cached = blocks.lookup(seq)
            # The whole prompt, plus one copy per extra completion of its last block.
            whole = blocks.prefill_need(seq, len(seq.target)) + (seq.fork - 1)
            if whole > free or not room(seq.cached):
                seq.cached = 0
                break
            start = seq.cached  # a prefix-cache hit, set by the lookup
            length = min(len(seq.target) - start, tokens)
            # Counted before the slot is taken: an admission's count includes its hit's
            # evictable blocks, which stop being evictable once it holds them.
            cost = blocks.prefill_need(seq, start + length)
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.reserved, self.free_slots = (self.free_slots[:seq.fork - 1],
                                             self.free_slots[seq.fork - 1:])
            self.running.append(seq)
            plan.admitted.append(seq)
            plan.prefill.append((seq, start, length))
            tokens -= length
            free -= cost
        return plan

    def joiners(self, plan: Plan) -> list[Sequence]:
        """The running sequences that may join ``plan``'s decode dispatch (``join_decode``):
        those decoding that it did not plan, whose prompt finished in its prefill. Oldest
        first; none where the plan has no decode dispatch."""
        if not (self.join_decode and plan.decode):
            return []
        planned = {id(s) for s, _ in plan.decode}
        return [s for s in self.running
                if s.decoding and id(s) not in planned and s.remaining > 0]

    def join(self, plan: Plan, joiners: list[Sequence], blocks: BlockCounter,
             free: int) -> list[tuple[Sequence, int]]:
        """Add ``joiners`` to ``plan.decode``, oldest first, while ``free`` blocks (the pool's
        free count after the iteration's prefill) hold the planned rows' steps and theirs;
        returns the rows added, ``(seq, steps)``. ``blocks`` answers ``decode_need`` for the
        pool as it is now."""
        free -= sum(blocks.decode_need(s, n) for s, n in plan.decode)
        joined = []
        for seq in joiners:
            steps = min(plan.decode_steps, seq.remaining)
            need = blocks.decode_need(seq, steps)
            if need > free:
                break
            joined.append((seq, steps))
            free -= need
        plan.decode = plan.decode + joined
        return joined

    def condense(self, decoding: list[Sequence], rows: int) -> list[tuple[Sequence, int, int]]:
        """Move the ``decoding`` sequences (a decode dispatch's rows) into the slots below
        ``rows``, where some lie above: a dispatch computes every slot up to the highest one
        it decodes, so a row left alone in a high slot (the others below it finished) costs
        the dispatch every slot below it. Each one above goes to the lowest free slot below
        ``rows``, or else swaps with a sequence there whose prompt is being prefilled; the
        slots kept for a request's completions stay where they are, and so do decoding
        sequences outside the dispatch (completions that forked in this iteration).
        Returns the moves ``(seq, from, to)``, already made here (``seq.slot`` and the free
        slots), for the caller to make in the pool (``move_slots``); none where they cannot
        all be placed, since a dispatch over ``rows`` slots then would not cover them."""
        above = sorted((s for s in decoding if s.slot >= rows), key=lambda s: s.slot)
        if not above:
            return []
        free = [slot for slot in self.free_slots if slot < rows]
        idle = sorted((s for s in self.running if s.slot < rows and not s.decoding),
                      key=lambda s: s.slot)
        if len(free) + len(idle) < len(above):
            return []
        moves = []
        for seq in above:
            old = seq.slot
            if free:
                seq.slot = free.pop(0)
                self.free_slots.remove(seq.slot)
                self.free_slots.append(old)
            else:
                other = idle.pop(0)
                seq.slot, other.slot = other.slot, old
                moves.append((other, seq.slot, old))
            moves.append((seq, old, seq.slot))
        self.free_slots.sort()
        return moves

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        """Free ``seq``'s slot and queue it first (older victims end up ahead)."""
        self.running.remove(seq)
        self.free_slots += [seq.slot, *seq.reserved]
        self.free_slots.sort()
        plan.preempt.append((seq, seq.slot))
        seq.slot, seq.cached, seq.decoding, seq.reserved = None, 0, False, []
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
