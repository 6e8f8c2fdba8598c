"""Named integer arrays that cross a jit boundary as one buffer.

A jitted call pays for every array that goes in or comes out: on XLA:CPU about 2.5 µs each
(argument parsing, buffer bookkeeping, one Python object per output). The allocator's state is
eight arrays and an op's ``Status`` four, so a decode step that took and returned both used to
move 20 arrays for its bookkeeping alone, against 2 for a contiguous cache's lengths (in and
out). Packed, they are 3.

A subclass lists its fields; each is still read by name (``state.block_tables``), as a static
slice of the int32 buffer (a bitcast inside jit, one small dispatch eagerly). ``replace``
writes fields back with ``dynamic_update_slice``, which XLA performs in place when the old
buffer is dead (donated, or not read again). Bool fields are stored as 0/1.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax


@functools.cache
def _layout(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` of each field, back to back in field order."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append((offset, size))
        offset += size
    return tuple(out)


class Packed:
    """Base class: fields stored back to back in one int32 ``buffer``; static metadata beside.

    A subclass sets ``FIELDS`` (``(name, dtype)`` pairs, int32 or bool), ``STATIC`` (names of
    hashable, never-traced attributes, part of the pytree structure) and ``_shapes()`` (the
    shape of each field, from the statics and ``buffer.shape``). It is then a pytree with the
    one leaf ``buffer``, built from keywords like a dataclass: ``Cls(field=..., static=...)``.
    """

    FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()
    STATIC: ClassVar[tuple[str, ...]] = ()
    # The statics live in one tuple, which is the pytree's aux data as it is: flattening and
    # unflattening (once per jitted call for each state in and out) then do no per-name work.
    __slots__ = ("buffer", "_static")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
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
        buffer = jnp.concatenate([v.astype(jnp.int32).reshape(-1) for v in values])
        _SET_BUFFER(self, buffer)
        for name, value, shape in zip(names, values, self._shapes(), strict=True):
            self._check_shape(name, value, shape)

    def _shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def _field(self, name: str) -> tuple[int, tuple[int, ...]]:
        """``(offset, shape)`` of the field ``name`` in the buffer."""
        names = [field for field, _ in self.FIELDS]
        if name not in names:
            raise TypeError(f"{type(self).__name__} has no field {name!r}; fields: {names}.")
        index = names.index(name)
        return _layout(self._shapes())[index][0], self._shapes()[index]

    def _check_shape(self, name: str, value: jax.Array, shape: tuple[int, ...]) -> None:
        if value.shape != shape:
            raise ValueError(
                f"{type(self).__name__}.{name} must have shape {shape}. Got {value.shape}."
            )

    def replace(self, **changes) -> Packed:
        """A copy with the named fields replaced (each must keep its shape)."""
        buffer = self.buffer
        for name, value in changes.items():
            offset, shape = self._field(name)
            value = jnp.asarray(value)
            self._check_shape(name, value, shape)
            flat = value.astype(jnp.int32).reshape(-1)
            buffer = lax.dynamic_update_slice_in_dim(buffer, flat, offset, axis=0)
        return self._with_buffer(buffer)

    def scatter(self, name: str, index, values, op: str = "set") -> Packed:
        """``replace(name=field.at[index].<op>(values, mode="drop"))``, scattered straight into
        the buffer: no copy of the field out and back, and in place under XLA.

        ``index`` is an int array for a 1-D field, or a tuple of broadcastable int arrays, one
        per dimension. An entry with any coordinate out of range is dropped; negative ones too
        (callers send what they skip past the end, never to ``-1``). ``op``: "set" or "add".
        """
        offset, shape = self._field(name)
        if op not in ("set", "add"):
            raise ValueError(f"op must be 'set' or 'add'. Got {op!r}.")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(shape):
            raise ValueError(f"{name} has {len(shape)} dimensions; got {len(index)} index arrays.")
        index = jnp.broadcast_arrays(*(jnp.asarray(i, jnp.int32) for i in index))
        flat, inside = jnp.zeros_like(index[0]), jnp.ones(index[0].shape, bool)
        for i, dim in zip(index, shape, strict=True):
            flat, inside = flat * dim + i, inside & (i >= 0) & (i < dim)
        target = jnp.where(inside, offset + flat, self.buffer.shape[0])  # past the end: dropped
        values = jnp.asarray(values).astype(jnp.int32)
        return self._with_buffer(getattr(self.buffer.at[target], op)(values, mode="drop"))

    def _with_buffer(self, buffer) -> Packed:
        return self._unflatten(self._static, (buffer,))

    def _flatten(self):
        return (self.buffer,), self._static

    @classmethod
    def _unflatten(cls, static, children):
        new = object.__new__(cls)
        _SET_BUFFER(new, children[0])
        _SET_STATIC(new, static)
        return new

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace({name}=...).")

    def __repr__(self) -> str:
        static = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.STATIC)
        shapes = dict(zip([n for n, _ in self.FIELDS], self._shapes(), strict=True))
        return f"{type(self).__name__}({static}, fields={shapes})"


_SET_BUFFER = Packed.buffer.__set__  # slot setters: __setattr__ is closed (immutable)
_SET_STATIC = Packed._static.__set__


def _static(self: Packed, *, index: int):
    return self._static[index]


def _read(self: Packed, *, index: int, dtype) -> jax.Array:
    offset, size = _layout(self._shapes())[index]
    field = lax.slice_in_dim(self.buffer, offset, offset + size).reshape(self._shapes()[index])
    return field != 0 if dtype == jnp.bool_ else field
