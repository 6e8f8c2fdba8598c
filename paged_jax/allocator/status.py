"""How an allocator op reports failure: a per-entry status code, never a partial update.

Every op is all-or-nothing. If any entry of a batch fails, the returned state is the input
state, the failing entries carry their reason and every other entry carries ``NOT_APPLIED``.
So ``status.ok`` is either all true (the op happened) or all false (nothing happened).

Inside ``jax.jit`` the status is the report. Outside it, ``status.raise_if_failed()`` turns it
into an exception that names the offending entries, and ``status.check()`` does the same
through ``jax.experimental.checkify``.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from paged_jax.allocator.packed import Packed


class Code(enum.IntEnum):
    OK = 0
    BAD_SEQ_ID = 1
    DUPLICATE_SEQ = 2
    SEQ_ACTIVE = 3
    SEQ_INACTIVE = 4
    BAD_LENGTH = 5
    BAD_POSITION = 6
    OUT_OF_BLOCKS = 7
    NOT_APPLIED = 8
    BAD_BLOCK = 9
    BAD_TOKEN = 10
    BAD_NUM_TOKENS = 11
    BAD_NUM_BLOCKS = 12


# What each code says, with the entry's ``value``, ``limit`` and ``at`` filled in. The subject
# (``seq 3 (entry 0)``) is the id the entry blames, which ``ids`` holds.
_EXPLAIN = {
    Code.BAD_SEQ_ID: "is not a sequence slot; expected -1 (padding) or 0 <= id < {limit} "
                     "(max_seqs)",
    Code.DUPLICATE_SEQ: "appears more than once in the batch; expected unique ids",
    Code.SEQ_ACTIVE: "is already active; expected a free (inactive) slot",
    Code.SEQ_INACTIVE: "is not active; expected an admitted sequence",
    Code.BAD_LENGTH: "would hold {value} tokens; expected 0 to {limit}, what its table holds "
                     "(max_blocks_per_seq * block_size)",
    Code.BAD_POSITION: "names position {value}, outside its {limit} allocated token slots",
    Code.OUT_OF_BLOCKS: "could not be served: the pool ran out of free blocks",
    Code.NOT_APPLIED: "was valid but not applied because another entry failed",
    Code.BAD_BLOCK: "is not a block with an outstanding allocate()/share() reference",
    Code.BAD_TOKEN: "feeds token id {value} at position {at}; expected 0 <= token < {limit} "
                    "(vocab_size)",
    Code.BAD_NUM_TOKENS: "brings {value} new tokens; expected 1 to {limit}, the width of its "
                         "tokens row",
    Code.BAD_NUM_BLOCKS: "holds {limit} blocks, but {value} of them were asked for (by entry "
                         "{entry}'s destination seq {at})",
}


# One op's own explanation of a code, where the general one would mislead.
_OP_EXPLAIN = {
    ("admit_cached", Code.BAD_LENGTH): "would hold {value} tokens; expected {at} to {limit}, "
                                       "what its listed blocks hold",
    ("move_slots", Code.SEQ_ACTIVE): "is active and no entry moves it away; expected a free "
                                     "slot or another entry's source",
    ("prefill_packed", Code.SEQ_ACTIVE): "holds {value} tokens; expected an empty slot (a "
                                         "packed prefill starts every row at position 0)",
    ("prefill_packed", Code.BAD_NUM_TOKENS): "brings {value} new tokens; expected 1 to "
                                             "{limit}, what the packed tokens hold from the "
                                             "row's start",
}

# Said after the explanation for one op's code, where that op offers a way out.
_HINTS = {
    ("prefill", Code.SEQ_ACTIVE): " (mark the row in extend to continue its sequence)",
}


class OutOfBlocksError(RuntimeError):
    """The pool cannot satisfy a request. The state is left exactly as it was."""

    def __init__(self, requested: int, free: int, detail: str = ""):
        self.requested, self.free = int(requested), int(free)
        msg = f"Out of KV cache blocks: requested {self.requested}, free {self.free}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class Status(Packed):
    """Outcome of one batched op.

    Fields (packed into one int32 buffer, see ``packed.py``):

    * ``code``: [batch] int32 ``Code`` per entry;
    * ``ids``: [batch] int32, the sequence (or block) id each entry blames: the entry's own
      sequence, or its source where the source is at fault (a fork's inactive parent, a
      ``share_prefix`` source with too few blocks);
    * ``value``: [batch] int32, the offending number of a failed entry (a length, a position,
      a block count, a token id), 0 elsewhere;
    * ``limit``: [batch] int32, what ``value`` was checked against (the table's capacity in
      tokens, the source's blocks, the tokens row's width, ``vocab_size``, ``max_seqs``);
    * ``at``: [batch] int32, where: a token's position for ``BAD_TOKEN``, the destination
      seq for ``BAD_NUM_BLOCKS``;
    * ``requested``: [] int32, blocks the whole batch asked for;
    * ``num_free``: [] int32, free blocks before the op;

    and the static ``op``, the op's name. ``describe()`` turns each failed entry into a
    sentence with those numbers.
    """

    FIELDS = (("code", jnp.int32), ("ids", jnp.int32), ("value", jnp.int32),
              ("limit", jnp.int32), ("at", jnp.int32), ("requested", jnp.int32),
              ("num_free", jnp.int32))
    STATIC = ("op",)
    __slots__ = ()

    def __init__(self, *, code, ids, requested, num_free, op, value=None, limit=None, at=None):
        zeros = jnp.zeros(jnp.shape(code), jnp.int32)
        super().__init__(
            code=code, ids=ids, requested=requested, num_free=num_free, op=op,
            value=zeros if value is None else value, limit=zeros if limit is None else limit,
            at=zeros if at is None else at,
        )

    def _shapes(self):
        batch = (self.buffer.shape[0] - 2) // 5
        return (batch,), (batch,), (batch,), (batch,), (batch,), (), ()

    @property
    def ok(self) -> jax.Array:
        """[batch] bool: true where the entry was applied (all or none are)."""
        return self.code == Code.OK

    @property
    def applied(self) -> jax.Array:
        """[] bool: the op changed the state."""
        return jnp.all(self.ok)

    def describe(self) -> list[str]:
        """One line per failing entry (eager only)."""
        codes, ids = np.asarray(self.code), np.asarray(self.ids)
        value, limit, at = np.asarray(self.value), np.asarray(self.limit), np.asarray(self.at)
        what = "block" if self.op in ("free", "share") else "seq"
        lines = []
        for i, (c, sid) in enumerate(zip(codes, ids, strict=True)):
            if c not in (Code.OK, Code.NOT_APPLIED):
                text = _OP_EXPLAIN.get((self.op, Code(c)), _EXPLAIN[Code(c)]).format(
                    value=value[i], limit=limit[i], at=at[i], entry=i)
                text += _HINTS.get((self.op, Code(c)), "")
                lines.append(f"{what} {sid} (entry {i}) {text}")
        return lines

    def raise_if_failed(self) -> None:
        """Raise if the op was not applied: ``OutOfBlocksError`` when the pool alone was the
        problem, ``ValueError`` naming each bad entry otherwise. Eager only."""
        codes = np.asarray(self.code)
        if (codes == Code.OK).all():
            return
        bad = set(codes.tolist()) - {Code.OK, Code.NOT_APPLIED}
        if bad == {Code.OUT_OF_BLOCKS}:
            raise OutOfBlocksError(int(self.requested), int(self.num_free), self.op)
        raise ValueError(f"{self.op} failed, state unchanged: " + "; ".join(self.describe()))

    def check(self) -> None:
        """``checkify.check`` that the op was applied; under ``checkify.checkify`` the failure
        becomes an error value, eagerly it raises."""
        first = jnp.argmax(self.code != Code.OK)
        checkify.check(
            self.applied,
            self.op + " failed (state unchanged): entry {i} has status code {c}",
            i=first,
            c=self.code[first],
        )


def first_error(code: jax.Array, cond: jax.Array, new: Code) -> jax.Array:
    """Record ``new`` where ``cond`` holds and no earlier check already failed."""
    return jnp.where((code == Code.OK) & cond, jnp.int32(new), code)


def details(code: jax.Array, table: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(value, limit, at)`` per entry, from ``table``: ``{Code: (value, limit, at)}``, each a
    [batch] array, a scalar or None (0). Within one op a code has one meaning, so the details
    follow from the final code alone; entries whose code is not in ``table`` get zeros."""
    out = [jnp.zeros(jnp.shape(code), jnp.int32) for _ in range(3)]
    for c, triple in table.items():
        hit = code == c
        out = [o if v is None else jnp.where(hit, jnp.asarray(v, jnp.int32), o)
               for o, v in zip(out, triple, strict=True)]
    return tuple(out)


def combine(ids, num_free, op: str, *statuses: Status, own: Status | None = None) -> Status:
    """One status for several ops run as one, all-or-nothing: per entry, the first real error
    (``own``'s, then each of ``statuses`` in order) with its details; ``requested`` adds up.
    Every status must have the same batch as ``ids``."""
    parts = ((own,) if own is not None else ()) + statuses
    code = jnp.zeros(jnp.shape(ids), jnp.int32)
    value = limit = at = code
    for s in parts:
        fires = (code == Code.OK) & (s.code != Code.OK) & (s.code != Code.NOT_APPLIED)
        code = jnp.where(fires, s.code, code)
        value, limit, at = (jnp.where(fires, new, old) for new, old in
                            ((s.value, value), (s.limit, limit), (s.at, at)))
    code, _ = finalize(code)
    requested = sum(s.requested for s in statuses)
    return Status(code=code, ids=ids, value=value, limit=limit, at=at,
                  requested=jnp.asarray(requested, jnp.int32), num_free=num_free, op=op)


def concat(op: str, num_free, *statuses: Status) -> Status:
    """One status for ops over different entries run as one, all-or-nothing: their entries
    one after another (each keeps its code and details); ``requested`` adds up."""
    fields = {name: jnp.concatenate([getattr(s, name) for s in statuses])
              for name in ("code", "ids", "value", "limit", "at")}
    fields["code"], _ = finalize(fields["code"])
    requested = sum(s.requested for s in statuses)
    return Status(**fields, requested=jnp.asarray(requested, jnp.int32), num_free=num_free,
                  op=op)


def finalize(code: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All-or-nothing: returns ``(code, apply)``; on any failure every other entry becomes
    ``NOT_APPLIED`` and ``apply`` is false."""
    apply = jnp.all(code == Code.OK)
    return jnp.where(apply | (code != Code.OK), code, jnp.int32(Code.NOT_APPLIED)), apply
