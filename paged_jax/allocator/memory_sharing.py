"""Physical blocks with and without sharing, on the real allocator (the memory benchmark's
sharing mixes).

Both mixes run in a pool large enough that nothing waits: every request is admitted at step
0, appends one token per step and is released after its ``output_len`` tokens, so the
shared and the unshared run follow the identical schedule and differ only in the blocks they
hold. The measure is the physical blocks in use (``num_blocks - num_free``) after each step
``0 .. max(output_len) - 1``: its mean and its peak.

* ``system_prompt_blocks``: request ``i``'s prompt is system prompt ``i % num_system`` of
  ``system_len`` tokens, then its own prompt. Shared: each system prompt is admitted once
  and held for the whole run; a request starts on its whole blocks with ``share_prefix`` and
  appends the rest of its prompt privately. Unshared: each request admits its whole prompt.
* ``parallel_sampling_blocks``: each request samples ``n`` outputs of ``output_len`` tokens.
  Shared: its prompt is admitted once and ``fork``-ed into ``n`` sequences; before their
  first token, ``copy_on_write`` gives each writer its own copy of the partly filled last
  block (the last writer keeps the original). Unshared: ``n`` independent copies of the
  prompt.

``reduction_bound`` gives the most either mix can save on a stream: the same measure with
sharing at token granularity (a block of one token, so no block is partly filled and no
copy-on-write runs), in closed form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import ops
from paged_jax.allocator.memory import cdiv, check_positive, check_stream
from paged_jax.allocator.memory_blocks import pad_ids
from paged_jax.allocator.state import CacheConfig, init_state

# Jitted once per shape: eagerly, every primitive inside an op would compile on its own.
_admit = jax.jit(ops.admit)
_append = jax.jit(ops.append)
_share_prefix = jax.jit(ops.share_prefix)
_fork = jax.jit(ops.fork)
_copy_on_write = jax.jit(ops.copy_on_write)


def _checked(result):
    *out, status = result
    status.raise_if_failed()
    return out[0] if len(out) == 1 else out


def _step(state, mask, done):
    """One step: ``mask`` ([max_seqs] bool) rows append a token, then ``done`` ([max_seqs]
    int, -1-padded) rows are released. Returns ``(state, num_free, ok)``."""
    state, grown = ops.append(state, mask, 1)
    state, released = ops.release(state, done)
    return state, state.num_free, grown.applied & released.applied


_step_jit = jax.jit(_step, donate_argnums=0)


def _config(num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
    """A pool of at least these sizes, each rounded up to a power of two (and at least 256
    blocks, 64 rows of 16): nothing here waits for blocks, so the extra room changes no
    count, and runs of similar sizes share their compilations."""
    up = lambda v, least: max(least, 1 << max(int(v) - 1, 0).bit_length())
    return CacheConfig(num_blocks=up(num_blocks, 256), block_size=block_size,
                       max_seqs=up(max_seqs, 64), max_blocks_per_seq=up(max_blocks_per_seq, 16))


def _wide(cfg, ids, values=None):
    """``ids`` (-1-padded) and ``values`` (0-padded; a scalar is broadcast) as [max_seqs]
    int32 device arrays, so each op compiles once per pool shape."""
    ids = np.asarray(ids)
    out = [jnp.asarray(pad_ids(ids, -1, cfg.max_seqs))]
    if values is not None:
        out.append(jnp.asarray(pad_ids(np.broadcast_to(values, ids.shape), 0, cfg.max_seqs)))
    return out


def _run_steps(state, rows, outputs, progress, before_first=None):
    """Append one token to every row of ``rows`` per step; release a row after its
    ``outputs`` tokens. Returns [max(outputs)] blocks in use after each step, step 0 first
    (step 0 is the state as given). ``before_first(state) -> state`` runs before step 1's
    append."""
    cfg = state.config
    rows, outputs = np.asarray(rows), np.asarray(outputs)
    used = np.zeros(int(outputs.max()), np.int64)
    used[0] = cfg.num_blocks - int(state.num_free)
    if progress is not None:
        progress(1)
    for t in range(1, used.shape[0]):
        if t == 1 and before_first is not None:
            state = before_first(state)
        mask = np.zeros(cfg.max_seqs, bool)
        mask[rows[outputs >= t]] = True
        done = pad_ids(rows[outputs == t], width=cfg.max_seqs)
        state, free, ok = _step_jit(state, jnp.asarray(mask), jnp.asarray(done))
        if not bool(ok):
            raise RuntimeError(f"An append or release failed at step {t}; the pool holds "
                               f"{cfg.num_blocks} blocks.")
        used[t] = cfg.num_blocks - int(free)
        if progress is not None:
            progress(1)
    return used


def system_prompt_blocks(stream, *, share: bool, block_size: int = 16, system_len: int = 512,
                         num_system: int = 4, progress=None) -> np.ndarray:
    """[max output_len] physical blocks in use per step, for the system-prompt mix."""
    pairs = check_stream(stream)
    bs = check_positive("block_size", block_size)
    system_len = check_positive("system_len", system_len)
    num_system = check_positive("num_system", num_system)
    n = len(pairs)
    prompts = np.array([p for p, _ in pairs]) + system_len
    outputs = np.array([o for _, o in pairs])
    finals = prompts + outputs
    num_blocks = int(np.sum(-(-finals // bs))) + num_system * cdiv(system_len, bs)
    cfg = _config(num_blocks, bs, n + num_system, cdiv(int(finals.max()), bs))
    state = init_state(cfg)
    rows = np.arange(n, dtype=np.int32) + num_system
    if share:
        # The system prompts' whole blocks are shared; a partial last block is not (each
        # request would write into it), so its tokens join the request's own.
        whole = system_len // bs
        state = _checked(_admit(state, *_wide(cfg, np.arange(num_system), system_len)))
        src = _wide(cfg, np.arange(n) % num_system)[0]
        dst, rest = _wide(cfg, rows, prompts - whole * bs)
        state = _checked(_share_prefix(state, src, dst, whole))
        state = _checked(_append(state, dst, rest))
    else:
        state = _checked(_admit(state, *_wide(cfg, rows, prompts)))
    return _run_steps(state, rows, outputs, progress)


def parallel_sampling_blocks(stream, *, share: bool, block_size: int = 16, n: int = 4,
                             progress=None) -> np.ndarray:
    """[max output_len] physical blocks in use per step, for ``n`` samples per request."""
    pairs = check_stream(stream)
    bs = check_positive("block_size", block_size)
    n = check_positive("n", n)
    count = len(pairs)
    prompts = np.repeat([p for p, _ in pairs], n)  # [count * n], request-major
    outputs = np.repeat([o for _, o in pairs], n)
    finals = prompts + outputs
    cfg = _config(int(np.sum(-(-finals // bs))), bs, count * n, cdiv(int(finals.max()), bs))
    state = init_state(cfg)
    rows = np.arange(count * n, dtype=np.int32)
    if share:
        parents = rows[::n]
        state = _checked(_admit(state, *_wide(cfg, parents, prompts[::n])))
        children = rows.reshape(count, n)[:, 1:].reshape(-1)
        state = _checked(_fork(state, _wide(cfg, np.repeat(parents, n - 1))[0],
                               _wide(cfg, children)[0]))
        # Step 1 writes position prompt_len: inside the shared last block unless the prompt
        # ends on a block boundary, so those writers copy it first.
        partial = prompts % bs != 0

        def before_first(state):
            if not partial.any():
                return state
            state, _, status = _copy_on_write(state, *_wide(cfg, rows[partial],
                                                            prompts[partial]))
            status.raise_if_failed()
            return state
    else:
        state = _checked(_admit(state, *_wide(cfg, rows, prompts)))
        before_first = None
    return _run_steps(state, rows, outputs, progress, before_first)


def reduction(shared: np.ndarray, unshared: np.ndarray) -> dict[str, float]:
    """Mean and peak blocks of both runs and the % fewer blocks with sharing."""
    out = {"shared_mean": float(shared.mean()), "unshared_mean": float(unshared.mean()),
           "shared_peak": int(shared.max()), "unshared_peak": int(unshared.max())}
    out["mean_reduction_percent"] = 100.0 * (1 - out["shared_mean"] / out["unshared_mean"])
    out["peak_reduction_percent"] = 100.0 * (1 - out["shared_peak"] / out["unshared_peak"])
    return out


def reduction_bound(stream, mix: str, *, n: int = 4, system_len: int = 512,
                    num_system: int = 4) -> float:
    """The % fewer token slots (mean over the same steps as the mixes above) that sharing
    saves at token granularity: what ``mix`` (``"parallel"`` or ``"system"``) would save with
    blocks of one token, the most any block size can save, since a block shares only whole
    blocks and copies the one a writer shares. Request ``i`` holds ``prompt + t`` tokens after
    step ``t`` for ``t < output_len``; with ``n`` samples the unshared run holds ``n`` such
    copies and the shared one the prompt once and ``n`` tails of ``t``; with system prompts
    the shared run holds each system prompt once for all ``max(output_len)`` steps."""
    pairs = check_stream(stream)
    p = np.array([a for a, _ in pairs], np.float64)
    o = np.array([b for _, b in pairs], np.float64)
    tails = o * (o - 1) / 2  # sum over t < o of t
    if mix == "parallel":
        n = check_positive("n", n)
        private = float(np.sum(n * (p * o + tails)))
        shared = float(np.sum(p * o + n * tails))
    elif mix == "system":
        system_len = check_positive("system_len", system_len)
        num_system = check_positive("num_system", num_system)
        own = float(np.sum(p * o + tails))
        private = own + system_len * float(o.sum())
        shared = own + num_system * system_len * float(o.max())
    else:
        raise ValueError(f"mix must be 'parallel' or 'system'. Got {mix!r}.")
    return 100.0 * (1 - shared / private)
