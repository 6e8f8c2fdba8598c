"""Next-token sampling: temperature, top-k and top-p (nucleus), per row of a batch.

The filters apply in the order Hugging Face transformers applies its logits warpers:

1. **temperature**: the logits are divided by it; 0 makes the row greedy (its argmax, no
   random draw).
2. **top-k**: keep the logits ``>=`` the row's k-th largest (so tokens tied with it are kept
   too); 0 is off, as is any k at or above the vocabulary size.
3. **top-p**: on the distribution that top-k left (renormalised), keep the smallest run of
   highest-probability tokens whose cumulative probability reaches ``top_p``, plus every token
   tied with the last one kept (so the kept set never depends on how a sort orders ties);
   the top token is always kept. 1 is off.

Every parameter is a scalar or one value per row (``[S]``), so one compiled step serves a batch
of requests with different settings. ``sample`` and ``filtered_logits`` are pure and jittable;
``check_sampling`` validates the parameters on the host, before tracing.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_sampling", "filtered_logits", "filters_off", "row_keys", "sample"]

# Temperatures are floored here before dividing: a row's temperature is only used when it is
# > 0 (greedy rows take the argmax), and the floor keeps the division finite for those rows.
_MIN_TEMPERATURE = 1e-6


def filters_off(top_k, top_p) -> bool:
    """Whether ``top_k`` and ``top_p`` are the Python numbers that switch both filters off
    (0 and 1.0). Then ``sample`` skips the full-vocabulary sort at trace time; an array is
    never known to be off, so it always compiles the filtering path."""
    return (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k == 0
            and isinstance(top_p, numbers.Real) and top_p == 1)


def _per_row(x, rows: int, dtype) -> jax.Array:
    """A scalar or [rows] parameter as a [rows] array of ``dtype``."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), (rows,))


def filtered_logits(
    logits: jax.Array,  # [S, V] float
    temperature,  # scalar or [S] float >= 0; 0 = greedy row
    top_k=0,  # scalar or [S] int >= 0; 0 = off
    top_p=1.0,  # scalar or [S] float in (0, 1]; 1 = off
) -> jax.Array:
    """The logits ``sample`` draws from: ``[S, V]`` float32, the temperature-scaled logits on
    each row's kept set and ``-inf`` outside it. ``softmax`` of a row is its sampling
    distribution. A greedy row (temperature 0) keeps only its argmax (the first, on ties),
    at logit 0."""
    return _filtered(logits, temperature, top_k, top_p, filters=not filters_off(top_k, top_p))


# Jitted so that a host caller (the first token after prefill) runs one compiled program, not
# a dozen eager ops each compiled on first use; under an outer jit they are inlined.
@functools.partial(jax.jit, static_argnames="filters")
def _filtered(logits, temperature, top_k, top_p, *, filters: bool):
    logits = jnp.asarray(logits, jnp.float32)
    rows, vocab = logits.shape
    temp = _per_row(temperature, rows, jnp.float32)
    scaled = logits / jnp.maximum(temp, _MIN_TEMPERATURE)[:, None]  # [S, V]
    if filters:
        scaled = jnp.where(scaled >= _threshold(scaled, top_k, top_p)[:, None], scaled, -jnp.inf)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.bool_)  # [S, V]
    greedy_logits = jnp.where(greedy, 0.0, -jnp.inf)
    return jnp.where((temp > 0)[:, None], scaled, greedy_logits)


def _threshold(scaled, top_k, top_p) -> jax.Array:
    """Per row, the smallest scaled logit that top-k then top-p keep: [S] float32.

    One descending sort serves both filters. Top-k's cut is the k-th largest logit. Top-p
    works on the sorted logits that top-k kept: a position is kept while the probability mass
    strictly before it is below ``top_p`` (the token that crosses ``top_p`` is in, the top one
    always is); the cut is the logit at the last kept position, so ties with it stay in.
    """
    rows, vocab = scaled.shape
    k = _per_row(top_k, rows, jnp.int32)
    p = _per_row(top_p, rows, jnp.float32)
    desc = -jnp.sort(-scaled, axis=-1)  # [S, V] largest first
    kth = jnp.take_along_axis(desc, (jnp.clip(k, 1, vocab) - 1)[:, None], axis=-1)[:, 0]
    k_cut = jnp.where(k > 0, kth, -jnp.inf)  # [S]
    kept_k = desc >= k_cut[:, None]  # [S, V] a prefix of the sorted row
    probs = jax.nn.softmax(jnp.where(kept_k, desc, -jnp.inf), axis=-1)  # [S, V]
    before = jnp.cumsum(probs, axis=-1) - probs  # [S, V] mass of the higher-ranked tokens
    count = jnp.sum(kept_k & (before < p[:, None]), axis=-1)  # [S] >= 1: position 0 has 0
    p_cut = jnp.take_along_axis(desc, jnp.maximum(count - 1, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(p < 1, p_cut, k_cut)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One random key per row, ``[S]``: ``fold_in(key(seeds[r]), positions[r])``. A token
    drawn with it depends only on its request's seed and its position in the sequence, never
    on the row it runs in or on what else is batched."""
    seeds = jnp.asarray(seeds, jnp.uint32)
    positions = jnp.asarray(positions, jnp.uint32)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def _categorical(key, logits):
    """``jax.random.categorical`` with one key for the batch, or one key per row ([S])."""
    if jnp.ndim(key) == 1:
        return jax.vmap(jax.random.categorical)(key, logits)
    return jax.random.categorical(key, logits)


def sample(
    logits: jax.Array,  # [S, V] float
    key: jax.Array | None,  # a jax.random key, or [S] keys (one per row, see ``row_keys``);
    # unused (may be None) when temperature is 0
    temperature=0.0,  # scalar or [S] float >= 0; 0 = greedy row
    top_k=0,  # scalar or [S] int >= 0; 0 = off
    top_p=1.0,  # scalar or [S] float in (0, 1]; 1 = off
) -> jax.Array:
    """One token per row: ``[S]`` int32, drawn from ``softmax(filtered_logits(...))`` with
    ``key``, or the row's argmax where its temperature is 0.

    Decided at trace time from Python numbers: a temperature of 0 returns the argmax and
    draws nothing; ``top_k == 0`` with ``top_p == 1`` (``filters_off``) skips the sort, so
    plain temperature sampling costs one categorical draw. Arrays always take the general
    path, which handles every mix of greedy, filtered and unfiltered rows.
    """
    if isinstance(temperature, numbers.Real) and temperature == 0:
        return _argmax(logits)
    return _draw(logits, key, temperature, top_k, top_p, filters=not filters_off(top_k, top_p))


@jax.jit
def _argmax(logits):  # [S, V] -> [S] int32
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="filters")
def _draw(logits, key, temperature, top_k, top_p, *, filters: bool):
    logits = jnp.asarray(logits)
    temp = _per_row(temperature, logits.shape[0], jnp.float32)
    if filters:
        drawn = _categorical(key, _filtered(logits, temp, top_k, top_p, filters=True))
    else:  # the plain temperature draw, with no sort
        drawn = _categorical(key, logits / jnp.maximum(temp, _MIN_TEMPERATURE)[:, None])
    return jnp.where(temp > 0, drawn, _argmax(logits)).astype(jnp.int32)


def _host_values(name: str, x) -> np.ndarray | None:
    """``x`` as a host array for checking, or None while it is traced (checked by the caller
    that made it concrete)."""
    if isinstance(x, jax.core.Tracer):
        return None
    arr = np.asarray(x)
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or one value per row ([S]). Got shape "
                         f"{arr.shape}.")
    return arr


def _bad(name: str, arr: np.ndarray, bad: np.ndarray, expected: str) -> None:
    if bad.any():
        row = int(np.flatnonzero(bad)[0]) if arr.ndim else None
        value = arr[row] if arr.ndim else arr[()]
        where = f" at row {row}" if row is not None else ""
        raise ValueError(f"{name} must be {expected}. Got {value.item()!r}{where}.")


def check_sampling(temperature, top_k=0, top_p=1.0, rows: int | None = None) -> None:
    """Raise ``ValueError`` naming the first bad sampling parameter and its expected range:
    ``temperature >= 0``, ``top_k`` an int ``>= 0``, ``0 < top_p <= 1``. Each is a scalar or,
    with ``rows`` given, may be a ``[rows]`` array. Concrete arrays are read back to the host
    to check their values; traced ones are checked for shape and dtype only."""
    # Python numbers, as a decode loop passes every dispatch, are checked without numpy.
    if (type(temperature) in (int, float) and temperature >= 0 and type(top_k) is int
            and top_k >= 0 and type(top_p) in (int, float) and 0 < top_p <= 1):
        return
    for name, x in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        arr = _host_values(name, x)
        shape = np.shape(x)
        if shape not in ((), (rows,)):
            want = "a scalar" if rows is None else f"a scalar or a [{rows}] array (one per row)"
            raise ValueError(f"{name} must be {want}. Got shape {shape}.")
        dtype = x.dtype if arr is None else arr.dtype
        if name == "top_k":
            if not np.issubdtype(dtype, np.integer):  # a bool is refused too
                raise ValueError(f"top_k must be an int >= 0 (0 = off). Got {x!r} ({dtype}).")
        elif not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
            raise ValueError(f"{name} must be a real number. Got {x!r} ({dtype}).")
        if arr is None:
            continue
        if name == "temperature":
            _bad(name, arr, ~(arr >= 0), ">= 0 (0 = greedy)")
        elif name == "top_k":
            _bad(name, arr, arr < 0, "an int >= 0 (0 = off)")
        else:
            _bad(name, arr, ~((arr > 0) & (arr <= 1)), "in (0, 1] (1 = off)")
