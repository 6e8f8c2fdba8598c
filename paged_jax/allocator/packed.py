"""Named integer arrays that cross a jit boundary as a few buffers.

A jitted call pays for every array that goes in or comes out (argument parsing, buffer
bookkeeping, one Python object per output). The allocator's state is
eight arrays and an op's ``Status`` seven; packed, a decode step moves a handful of buffers
instead of 30 arrays for its bookkeeping.

A subclass lists its fields, stored back to back in one int32 buffer per *group*; each is still
read by name (``state.block_tables``), as a static slice of its buffer (a bitcast inside jit,
one small dispatch eagerly). ``replace`` writes fields back with ``dynamic_update_slice`` and
``scatter`` scatters into the buffer, both in place when the old buffer is dead (donated, or
not read again). Bool fields are stored as 0/1.

Why groups: XLA updates a buffer in place only if every read of its old version is ordered
before the write, and it fuses small reads (an old length, an old count) into whichever later
computation uses them; such a late read costs a copy of the whole buffer it lives in. A class
whose fields differ in size by orders of magnitude (per-block against per-sequence arrays)
keeps the large ones in a group of their own, written only by scatters whose operands were
read before, so that a late read copies O(batch) words, not the pool. For the same reason a
pool-sized field is read through ``window`` where the reads fall in a known range: indexing
the field makes XLA:CPU reckon the read at the whole field. ``tests/test_pool_scaling.py``
checks both in the compiled decode-step ops.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax


@functools.cache
def _layout(shapes: tuple[tuple[int, ...], ...], groups: tuple[int, ...]):
    """``(group, offset, size)`` of each field: back to back, in field order, in its group."""
    out, offsets = [], [0] * (max(groups, default=0) + 1)
    for shape, group in zip(shapes, groups, strict=True):
        size = math.prod(shape)
        out.append((group, offsets[group], size))
        offsets[group] += size
    return tuple(out)


class Packed:
    """Base class: fields stored back to back in int32 ``buffers`` (one per group); static
    metadata beside.

    A subclass sets ``FIELDS`` (``(name, dtype)`` pairs, int32 or bool), optionally
    ``GROUPS`` (a tuple of field-name tuples partitioning ``FIELDS``; by default one group),
    ``STATIC`` (names of hashable, never-traced attributes, part of the pytree structure) and
    ``_shapes()`` (the shape of each field, from the statics and the buffers' shapes). It is
    then a pytree with one leaf per group, built from keywords like a dataclass:
    ``Cls(field=..., static=...)``.
    """

    FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()
    GROUPS: ClassVar[tuple[tuple[str, ...], ...]] = ()
    STATIC: ClassVar[tuple[str, ...]] = ()
    _GROUP_OF: ClassVar[tuple[int, ...]] = ()
    # The statics live in one tuple, which is the pytree's aux data as it is: flattening and
    # unflattening (once per jitted call for each state in and out) then do no per-name work.
    __slots__ = ("buffers", "_static")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = [name for name, _ in cls.FIELDS]
        groups = cls.GROUPS or (tuple(names),)
        listed = [name for group in groups for name in group]
        if sorted(listed) != sorted(names):
            raise TypeError(f"{cls.__name__}.GROUPS must list each field once. Got {groups}.")
        cls._GROUP_OF = tuple(
            next(g for g, group in enumerate(groups) if name in group) for name in names
        )
        for index, (name, dtype) in enumerate(cls.FIELDS):
            setattr(cls, name, property(functools.partial(_read, index=index, dtype=dtype)))
        for index, name in enumerate(cls.STATIC):
            setattr(cls, name, property(functools.partial(_static, index=index)))
        jax.tree_util.register_pytree_node(cls, cls._flatten, cls._unflatten)

    def __init__(self, **kwargs):
        names = [name for name, _ in self.FIELDS]
        wrong = sorted(set(kwargs) ^ set(names + list(self.STATIC)))
        if wrong:
            raise TypeError(
                f"{type(self).__name__} takes exactly the keywords {names + list(self.STATIC)}. "
                f"Missing or unexpected: {wrong}."
            )
        _SET_STATIC(self, tuple(kwargs[name] for name in self.STATIC))
        values = [jnp.asarray(kwargs[name]) for name in names]
        flat = [v.astype(jnp.int32).reshape(-1) for v in values]
        _SET_BUFFERS(self, tuple(
            jnp.concatenate([f for f, g in zip(flat, self._GROUP_OF, strict=True) if g == group])
            for group in range(max(self._GROUP_OF) + 1)
        ))
        for name, value, shape in zip(names, values, self._shapes(), strict=True):
            self._check_shape(name, value, shape)

    @property
    def buffer(self) -> jax.Array:
        """The one buffer of a single-group class."""
        if len(self.buffers) != 1:
            raise AttributeError(f"{type(self).__name__} has {len(self.buffers)} buffers.")
        return self.buffers[0]

    def _shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def _field(self, name: str) -> tuple[int, int, tuple[int, ...]]:
        """``(group, offset, shape)`` of the field ``name``."""
        names = [field for field, _ in self.FIELDS]
        if name not in names:
            raise TypeError(f"{type(self).__name__} has no field {name!r}; fields: {names}.")
        index = names.index(name)
        shapes = self._shapes()
        group, offset, _ = _layout(shapes, self._GROUP_OF)[index]
        return group, offset, shapes[index]

    def _check_shape(self, name: str, value: jax.Array, shape: tuple[int, ...]) -> None:
        if value.shape != shape:
            raise ValueError(
                f"{type(self).__name__}.{name} must have shape {shape}. Got {value.shape}."
            )

    def replace(self, **changes) -> Packed:
        """A copy with the named fields replaced (each must keep its shape)."""
        buffers = list(self.buffers)
        for name, value in changes.items():
            group, offset, shape = self._field(name)
            value = jnp.asarray(value)
            self._check_shape(name, value, shape)
            flat = value.astype(jnp.int32).reshape(-1)
            buffers[group] = lax.dynamic_update_slice_in_dim(buffers[group], flat, offset, 0)
        return self._unflatten(self._static, buffers)

    def window(self, name: str, start, size: int) -> jax.Array:
        """``field[start : start + size]`` of a 1-D field, ``start`` (traced) clamped so that
        the window lies inside the field. One dynamic slice of the buffer, which XLA reckons a
        read of ``size`` elements; indexing the field itself reads (a slice of) all of it.
        """
        group, offset, shape = self._field(name)
        if len(shape) != 1 or not 0 < size <= shape[0]:
            raise ValueError(f"window needs a 1-D field and 0 < size <= {shape[0]} (the "
                             f"length of {name}). Got shape {shape}, size {size}.")
        start = jnp.clip(jnp.asarray(start, jnp.int32), 0, shape[0] - size)
        return lax.dynamic_slice_in_dim(self.buffers[group], offset + start, size)

    def scatter(self, name: str, index, values, op: str = "set") -> Packed:
        """``replace(name=field.at[index].<op>(values, mode="drop"))``, scattered straight into
        the buffer: no copy of the field out and back, and in place under XLA.

        ``index`` is an int array for a 1-D field, or a tuple of broadcastable int arrays, one
        per dimension. An entry with any coordinate out of range is dropped; negative ones too
        (callers send what they skip past the end, never to ``-1``). ``op``: "set" or "add".
        """
        group, offset, shape = self._field(name)
        if op not in ("set", "add"):
            raise ValueError(f"op must be 'set' or 'add'. Got {op!r}.")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(shape):
            raise ValueError(f"{name} has {len(shape)} dimensions; got {len(index)} index arrays.")
        index = jnp.broadcast_arrays(*(jnp.asarray(i, jnp.int32) for i in index))
        flat, inside = jnp.zeros_like(index[0]), jnp.ones(index[0].shape, bool)
        for i, dim in zip(index, shape, strict=True):
            flat, inside = flat * dim + i, inside & (i >= 0) & (i < dim)
        buffers = list(self.buffers)
        target = jnp.where(inside, offset + flat, buffers[group].shape[0])  # past the end: dropped
        values = jnp.asarray(values).astype(jnp.int32)
        buffers[group] = getattr(buffers[group].at[target], op)(values, mode="drop")
        return self._unflatten(self._static, buffers)

    def _flatten(self):
        return self.buffers, self._static

    @classmethod
    def _unflatten(cls, static, children):
        new = object.__new__(cls)
        _SET_BUFFERS(new, tuple(children))
        _SET_STATIC(new, static)
        return new

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace({name}=...).")

    def __repr__(self) -> str:
        static = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.STATIC)
        shapes = dict(zip([n for n, _ in self.FIELDS], self._shapes(), strict=True))
        return f"{type(self).__name__}({static}, fields={shapes})"


_SET_BUFFERS = Packed.buffers.__set__  # slot setters: __setattr__ is closed (immutable)
_SET_STATIC = Packed._static.__set__


def _static(self: Packed, *, index: int):
    return self._static[index]


def _read(self: Packed, *, index: int, dtype) -> jax.Array:
    shapes = self._shapes()
    group, offset, size = _layout(shapes, self._GROUP_OF)[index]
    field = lax.slice_in_dim(self.buffers[group], offset, offset + size).reshape(shapes[index])
    return field != 0 if dtype == jnp.bool_ else field
