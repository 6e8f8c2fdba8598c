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


_EXPLAIN = {
    Code.BAD_SEQ_ID: "is not a sequence slot; expected -1 (padding) or 0 <= id < max_seqs",
    Code.DUPLICATE_SEQ: "appears more than once in the batch; expected unique ids",
    Code.SEQ_ACTIVE: "is already active; expected a free (inactive) slot",
    Code.SEQ_INACTIVE: "is not active; expected an admitted sequence",
    Code.BAD_LENGTH: "asks for a negative length or more tokens than its table can hold",
    Code.BAD_POSITION: "names a position outside its allocated blocks",
    Code.OUT_OF_BLOCKS: "could not be served: the pool ran out of free blocks",
    Code.NOT_APPLIED: "was valid but not applied because another entry failed",
    Code.BAD_BLOCK: "is not a block with an outstanding allocate()/share() reference",
    Code.BAD_TOKEN: "feeds a token id outside the vocabulary; expected 0 <= token < vocab_size",
}


class OutOfBlocksError(RuntimeError):
    """The pool cannot satisfy a request. The state is left exactly as it was."""

    def __init__(self, requested: int, free: int, detail: str = ""):
        self.requested, self.free = int(requested), int(free)
        msg = f"Out of KV cache blocks: requested {self.requested}, free {self.free}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class Status(Packed):
    """Outcome of one batched op.

    Fields (packed into one int32 ``buffer`` like ``BlockState``):

    * ``code``: [batch] int32 ``Code`` per entry;
    * ``ids``: [batch] int32, the sequence (or block) id each entry referred to;
    * ``requested``: [] int32, blocks the whole batch asked for;
    * ``num_free``: [] int32, free blocks before the op;

    and the static ``op``, the op's name.
    """

    FIELDS = (("code", jnp.int32), ("ids", jnp.int32), ("requested", jnp.int32),
              ("num_free", jnp.int32))
    STATIC = ("op",)
    __slots__ = ()

    def _shapes(self):
        batch = (self.buffer.shape[0] - 2) // 2
        return (batch,), (batch,), (), ()

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
        what = "block" if self.op in ("free", "share") else "seq"
        lines = []
        for i, (c, sid) in enumerate(zip(codes, ids, strict=True)):
            if c not in (Code.OK, Code.NOT_APPLIED):
                lines.append(f"{what} {sid} (entry {i}) {_EXPLAIN[Code(c)]}")
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


def finalize(code: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All-or-nothing: returns ``(code, apply)``; on any failure every other entry becomes
    ``NOT_APPLIED`` and ``apply`` is false."""
    apply = jnp.all(code == Code.OK)
    return jnp.where(apply | (code != Code.OK), code, jnp.int32(Code.NOT_APPLIED)), apply
