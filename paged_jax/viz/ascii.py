"""The seed's text picture of physical memory: ``[A][A][A][B][B][ ]...`` over a ruler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from paged_jax.allocator.state import NULL_BLOCK, BlockState

FREE = " "
SHARED = "*"  # referenced by more than one labelled table
HELD = "#"  # in use, but by no table (a loose allocate()/share() reference)


def block_owners(state: BlockState) -> list[list[int]]:
    """For every physical block, the active sequence slots whose tables point at it."""
    tables = np.asarray(state.block_tables)
    active = np.asarray(state.active)
    owners: list[list[int]] = [[] for _ in range(state.config.num_blocks)]
    for seq in np.flatnonzero(active):
        for block in tables[seq]:
            if block != NULL_BLOCK and seq not in owners[block]:
                owners[block].append(int(seq))
    return owners


def _owner_marks(state, labels, tables) -> list[list[str]]:
    marks = [[labels.get(slot, "?") for slot in owners] for owners in block_owners(state)]
    for label, table in (tables or {}).items():
        for block in table:
            if label not in marks[block]:
                marks[block].append(label)
    return marks


def default_labels(state: BlockState) -> dict[int, str]:
    """Slot 0 is ``A``, slot 1 ``B``, ...; beyond ``Z`` lowercase, then digits."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return {i: alphabet[i % len(alphabet)] for i in range(state.config.max_seqs)}


def render_layout(
    state: BlockState,
    labels: Mapping[int, str] | None = None,
    *,
    tables: Mapping[str, Sequence[int]] | None = None,
    per_row: int | None = None,
) -> str:
    """The seed's picture: one ``[X]`` cell per physical block above a block-index ruler.

    Args:
      state: the pool to draw.
      labels: sequence slot -> label, as wide as a cell at most (one character below 100
        blocks, two below 1,000, ...). Defaults to ``A, B, C...`` by slot.
      tables: extra block tables kept outside the state, label -> block ids (the seed's
        ``req_d_table = sys_prompt_blocks + [allocator.allocate()]``).
      per_row: wrap after this many blocks (default: one row, as in the seed).

    A cell shows its owner's label, ``*`` if several tables share it, ``#`` if it is held
    outside any table, and a blank if it is free. Cells widen past 100 blocks so the ruler
    stays aligned.
    """
    labels = default_labels(state) if labels is None else dict(labels)
    n = state.config.num_blocks
    inner = max(1, len(str(n - 1)) - 1)  # "[X]" for < 100 blocks, "[XY]" for < 1000, ...
    for slot, label in [*labels.items(), *((t, t) for t in tables or {})]:
        if not isinstance(label, str) or not 0 < len(label) <= inner:
            raise ValueError(
                f"labels must map slots to 1..{inner} characters (the cell width of a "
                f"{n}-block pool). Got {slot!r}: {label!r}."
            )
    refs = np.asarray(state.ref_counts)
    cells = []
    for block, owners in enumerate(_owner_marks(state, labels, tables)):
        if len(owners) > 1:
            mark = SHARED
        elif owners:
            mark = owners[0]
        else:
            mark = HELD if refs[block] > 0 else FREE
        cells.append("[" + mark.ljust(inner) + "]")
    per_row = per_row or n
    lines = []
    for start in range(0, n, per_row):
        stop = min(start + per_row, n)
        lines.append("".join(cells[start:stop]))
        lines.append("".join(f"{b:>{inner + 1}} " for b in range(start, stop)).rstrip())
    return "\n".join(lines)
