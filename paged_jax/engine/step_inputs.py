"""The serving steps' input checks, run on the host before every dispatch.

Each raises ``ValueError`` (or ``TypeError``) naming the offending value and what was expected,
before tracing, and turns the step's arguments into what its jitted body takes. ``steps.py``
and its ``Steps`` object share them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import BlockState
from paged_jax.engine import sampling
from paged_jax.kernels.pallas_decode import resolve_impl
from paged_jax.kvcache import KVCache


def check_cache(kv: KVCache, state: BlockState) -> None:
    """Raise before tracing unless ``kv`` and ``state`` describe the same pool."""
    cfg = state.config
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv must be a KVCache (init_cache). Got {type(kv).__name__}.")
    if kv.k.shape[2:4] != (cfg.num_blocks, cfg.block_size) or kv.v.shape != kv.k.shape:
        raise ValueError(
            f"The KV cache (k {kv.k.shape}, v {kv.v.shape}) must hold the BlockState's "
            f"{cfg.num_blocks} blocks of {cfg.block_size} tokens in its axes 2 and 3, and k and "
            "v must match. Build both from one CacheConfig (init_cache, init_state)."
        )


def step_impl(impl: str, kv: KVCache, state: BlockState) -> str:
    """The attention ``impl`` a decode step over ``kv`` runs (``resolve_impl`` at its shapes:
    one row per sequence slot). ``"pallas"`` on shapes the kernel cannot take raises here,
    before tracing."""
    return resolve_impl(impl, batch=state.config.max_seqs, head_dim=kv.k.shape[-1],
                        block_size=state.config.block_size)


def prefill_inputs(kv: KVCache, state: BlockState, tokens, seq_ids, num_tokens, extend):
    """``prefill``'s arrays, checked: ``(tokens [B, T], seq_ids [B], num_tokens [B], extend
    [B] bool)`` (``extend`` None becomes all False)."""
    tokens, seq_ids = jnp.asarray(tokens), jnp.asarray(seq_ids)
    num_tokens = jnp.asarray(num_tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be a [batch, T] int array. Got {tokens.dtype}{tokens.shape}."
        )
    for name, x in (("seq_ids", seq_ids), ("num_tokens", num_tokens)):
        if x.shape != tokens.shape[:1] or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be a [batch] int array with batch = {tokens.shape[0]}. "
                f"Got {x.dtype}{x.shape}."
            )
    extend = jnp.zeros(tokens.shape[:1], bool) if extend is None else jnp.asarray(extend)
    if extend.shape != tokens.shape[:1] or extend.dtype != jnp.bool_:
        raise ValueError(
            f"extend must be a [batch] bool array with batch = {tokens.shape[0]}, or None. "
            f"Got {extend.dtype}{extend.shape}."
        )
    check_cache(kv, state)
    return tokens, seq_ids, num_tokens, extend


def packed_prefill_inputs(kv: KVCache, state: BlockState, tokens, seq_ids, num_tokens):
    """``prefill_packed``'s arrays, checked: ``(tokens [T], seq_ids [R], num_tokens [R])``."""
    tokens, seq_ids = jnp.asarray(tokens), jnp.asarray(seq_ids)
    num_tokens = jnp.asarray(num_tokens)
    if tokens.ndim != 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be a [T] int array, the rows' tokens one after another. Got "
            f"{tokens.dtype}{tokens.shape}."
        )
    if seq_ids.ndim != 1 or not jnp.issubdtype(seq_ids.dtype, jnp.integer):
        raise ValueError(f"seq_ids must be a [rows] int array. Got {seq_ids.dtype}"
                         f"{seq_ids.shape}.")
    if num_tokens.shape != seq_ids.shape or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(
            f"num_tokens must be a [rows] int array with rows = {seq_ids.shape[0]} (one per "
            f"seq_ids entry). Got {num_tokens.dtype}{num_tokens.shape}."
        )
    check_cache(kv, state)
    return tokens, seq_ids, num_tokens


def check_decode_tokens(tokens, state: BlockState) -> None:
    """Raise unless ``tokens`` is a [max_seqs] int array, one per sequence slot."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is None:
        tokens = np.asarray(tokens)
        dtype = tokens.dtype
    if tokens.shape != (state.config.max_seqs,) or not np.issubdtype(dtype, np.integer):
        raise ValueError(
            f"tokens must be a [max_seqs] = [{state.config.max_seqs}] int array, one per "
            f"sequence slot. Got {dtype}{tokens.shape}."
        )


def check_row_controls(state: BlockState, num_steps: int, budgets, stop_ids, seeds):
    """``decode_steps``' per-row controls as int32 arrays (None stays None), or a
    ``ValueError`` naming the bad one (shape, dtype, or a budget outside ``0..num_steps``).
    ``budgets`` and ``seeds`` are [max_seqs], ``stop_ids`` [max_seqs, M]."""
    rows = state.config.max_seqs
    out = []
    for name, x, ndim in (("budgets", budgets, 1), ("stop_ids", stop_ids, 2), ("seeds", seeds, 1)):
        if x is None:
            out.append(None)
            continue
        dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
        shape = np.shape(x)
        if len(shape) != ndim or shape[0] != rows or not np.issubdtype(dtype, np.integer):
            want = f"[{rows}]" if ndim == 1 else f"[{rows}, M]"
            raise ValueError(f"{name} must be a {want} int array (one row per sequence slot). "
                             f"Got {dtype}{shape}.")
        out.append(jnp.asarray(x, jnp.int32))
    if budgets is not None and not isinstance(budgets, jax.core.Tracer):
        host = np.asarray(budgets)
        bad = (host < 0) | (host > num_steps)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"budgets must be in 0..num_steps ({num_steps}). Got {host[row]} "
                             f"at row {row}.")
    return tuple(out)


def decode_steps_inputs(kv: KVCache, state: BlockState, tokens, key, temperature, top_k, top_p,
                        *, num_steps, impl, budgets, stop_ids, seeds, rows=None,
                        default_key=None):
    """``decode_steps``' arguments, checked, as ``(args, static)``: the jitted body's
    positional arrays after the state (``tokens, key, temperature, top_k, top_p, budgets,
    stop_ids, seeds``, None where unused) and its static ``sample``, ``filtered`` and
    ``rows``.

    A Python temperature of 0 compiles a greedy-only scan (no key, no temperature); Python
    ``top_k=0`` and ``top_p=1.0`` one without the filters. A sampled call with neither
    ``key`` nor ``seeds`` draws with ``default_key``, or ``jax.random.key(0)`` when that is
    None."""
    check_decode_tokens(tokens, state)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int. Got {num_steps!r}.")
    slots = state.config.max_seqs
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool)
                             or not 1 <= rows <= slots):
        raise ValueError(f"rows must be None or an int in 1..max_seqs ({slots}). "
                         f"Got {rows!r}.")
    check_cache(kv, state)
    step_impl(impl, kv, state)
    sampling.check_sampling(temperature, top_k, top_p, rows=state.config.max_seqs)
    budgets, stop_ids, seeds = check_row_controls(state, num_steps, budgets, stop_ids, seeds)
    sample = not (isinstance(temperature, (int, float)) and temperature == 0)
    filtered = sample and not sampling.filters_off(top_k, top_p)
    if not sample:
        key = temperature = None  # nothing to pass: the greedy scan takes neither
    elif key is None and seeds is None:
        key = jax.random.key(0) if default_key is None else default_key
    if not filtered:
        top_k = top_p = None  # nor does a scan without the filters
    args = (tokens, key, temperature, top_k, top_p, budgets, stop_ids, seeds)
    return args, {"sample": sample, "filtered": filtered,
                  "rows": None if rows == slots else rows}


def prefill_decode_inputs(kv: KVCache, state: BlockState, tokens, seq_ids, num_tokens, extend,
                          decode_tokens, key, temperature, top_k, top_p, *, impl, budgets,
                          seeds, rows=None, default_key=None):
    """``prefill_decode``'s arguments, checked, as ``(args, static)``: the jitted body's
    positional arrays after the state (``prefill_inputs``' four, then ``decode_tokens, key,
    temperature, top_k, top_p, budgets, seeds`` as ``decode_steps_inputs`` makes them for one
    step) and its static ``sample``, ``filtered`` and ``rows``."""
    prefill_args = prefill_inputs(kv, state, tokens, seq_ids, num_tokens, extend)
    args, static = decode_steps_inputs(kv, state, decode_tokens, key, temperature, top_k, top_p,
                                       num_steps=1, impl=impl, budgets=budgets, stop_ids=None,
                                       seeds=seeds, rows=rows, default_key=default_key)
    decode_tokens, key, temperature, top_k, top_p, budgets, _, seeds = args
    return (*prefill_args, decode_tokens, key, temperature, top_k, top_p, budgets, seeds), {
        name: static[name] for name in ("sample", "filtered", "rows")}
