"""The serving steps' traced bodies: what ``steps.py`` and its ``Steps`` object jit.

Each takes the model's ``graphdef`` first (a static argument or closed over), then
``(params, kv, state, ...)``, and does the step's three parts: the allocator's bookkeeping
(``admit``/``append`` and copy-on-write for prefill, ``claim_feeding`` for decode), the
forward pass writing the new K/V in place, and for ``decode_steps_body`` the ``lax.scan``
over steps with in-dispatch stops and sampling. The inputs are checked before, on the host
(``step_inputs.py``); ``steps.py`` documents the behaviour.

With a ``mesh`` (``paged_jax.sharding``), the inputs come placed on it, XLA partitions the
model and the cache updates over ``"tp"``, the decode attention runs per shard, and the cache
and state leave on their input shardings (``sharding.constrain``), so donation aliases them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.allocator import (
    BlockState,
    Code,
    Status,
    admit,
    append,
    bad_tokens,
    claim_feeding,
    copy_on_write,
    slot_mapping,
)
from paged_jax.allocator.status import combine, concat, details
from paged_jax.engine import sampling
from paged_jax.kernels import strategies
from paged_jax.kernels.reference import gather_pages
from paged_jax.kvcache import KVCache, copy_blocks, write
from paged_jax.model.llama import masked_attention
from paged_jax.sharding import constrain

# The key under which ``steps.serving_params`` carries the embedding table's bits beside the
# model's parameters (``Llama.embedding_bits``), so that no step makes them per dispatch.
EMBED_BITS = "embed_bits"


def _merge(graphdef: nnx.GraphDef, params):
    """``(model, embed_bits)``: the model merged from ``params``, and the embedding bits they
    carry under ``EMBED_BITS`` (None if they carry none)."""
    if isinstance(params, dict) and EMBED_BITS in params:
        params = dict(params)
        bits = params.pop(EMBED_BITS)
    else:
        bits = None
    return nnx.merge(graphdef, params), bits


def _select(pred, on_true, on_false):
    """Pytree-wide ``where`` on a scalar predicate (all-or-nothing state updates)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _prefill_claim(model, state: BlockState, tokens, seq_ids, num_tokens, extend, op: str):
    """``prefill``'s bookkeeping on ``state``, not yet applied: ``(new state, (src, dst)
    block copies, status, cached [B] tokens each row held before)``. The caller keeps the new
    state, and makes the copies, only where the status (or one it is combined into) applied."""
    cfg = state.config
    batch, width = tokens.shape
    ids = seq_ids.astype(jnp.int32)
    n = num_tokens.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < cfg.max_seqs)
    safe = jnp.where(in_range, ids, 0)
    # An extending row continues its active slot (its first blocks shared or prefix-cached);
    # every other row is admitted fresh, so a row into an occupied slot is refused
    # (SEQ_ACTIVE) and an extending row into an empty one too (SEQ_INACTIVE).
    cached = jnp.where(extend & in_range, state.seq_lens[safe], 0)  # [B] tokens in the cache

    st, s_admit = admit(state, jnp.where(extend, -1, ids), jnp.where(extend, 0, n))
    st, s_append = append(st, jnp.where(extend, ids, -1), jnp.where(extend, n, 0))
    # Only the block holding the first new token can be shared and partly filled.
    cow_ids = jnp.where(extend & (cached % cfg.block_size != 0) & (n > 0), ids, -1)
    st, copies, s_cow = copy_on_write(st, cow_ids, cached)
    # A real row must bring 1..T new tokens: more than `tokens` holds would leave cache
    # slots that nothing writes.
    bad_len = (ids != -1) & ((n < 1) | (n > width))
    # Only a row's first n tokens are read: padding past them may hold anything.
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    new = (ids != -1)[:, None] & (col < n[:, None])  # [B, T]
    bad = bad_tokens(tokens, new, model.config.vocab_size)  # [B, T]
    first_bad = jnp.argmax(bad, axis=1)  # [B] column of the row's first bad id
    own = jnp.where(bad_len, jnp.int32(Code.BAD_NUM_TOKENS),
                    jnp.where(jnp.any(bad, axis=1), jnp.int32(Code.BAD_TOKEN), jnp.int32(Code.OK)))
    value, limit, at = details(own, {
        Code.BAD_NUM_TOKENS: (n, width, None),
        Code.BAD_TOKEN: (tokens[jnp.arange(batch), first_bad], model.config.vocab_size,
                         cached + first_bad),
    })
    own = Status(code=own, ids=ids, value=value, limit=limit, at=at, requested=0,
                 num_free=state.num_free, op=op)
    status = combine(ids, state.num_free, op, s_admit, s_append, s_cow, own=own)
    return st, copies, status, cached


def _prefill_reader(model, state: BlockState, seq_ids, num_tokens, cached, ok, width: int,
                    bucket_tokens: int):
    """For rows of up to ``width`` new tokens after ``cached`` [B] ones, their blocks claimed
    in ``state``: ``(positions [B, T], slots [B, T] (-1: nothing written), read)``, where
    ``read(layer, q [B, T, Hq, D], kv) -> [B, T, Hq, D]`` attends each new token to its row's
    tokens up to itself, once this layer's K/V are written. It reads the table's first
    ``strategies.context_widths(..., bucket_tokens)`` columns that cover the longest row."""
    cfg = state.config
    ids = seq_ids.astype(jnp.int32)
    n = num_tokens.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < cfg.max_seqs)
    safe = jnp.where(in_range, ids, 0)
    positions = cached[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, T]
    live = ok & (jnp.arange(width)[None, :] < n[:, None])  # [B, T]
    slots = jnp.where(live, slot_mapping(state, ids, positions), -1)  # [B, T]
    kv_lens = jnp.where(ok & in_range, state.seq_lens[safe], 0)  # [B]
    tables = jnp.where(in_range[:, None], state.block_tables[safe], -1)  # [B, M]
    key_pos = jnp.arange(tables.shape[1] * cfg.block_size)  # [S]
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
        key_pos[None, None, :] < kv_lens[:, None, None]
    )  # [B, T, S]
    widths = strategies.context_widths(tables.shape[1], cfg.block_size, bucket_tokens)

    def read(layer, q, kv):
        def at_width(w):  # the table's first w blocks: [B, T, Hq, D]
            part = tables[:, :w]
            keys = kv.values(gather_pages(kv.k[layer], part)).swapaxes(1, 2)  # [B, S, Hkv, D]
            values = kv.values(gather_pages(kv.v[layer], part)).swapaxes(1, 2)
            return masked_attention(q, keys, values, mask[:, :, : w * cfg.block_size],
                                    per_kv_head=model.kv_head_attention)

        return strategies.by_context_width(kv_lens, cfg.block_size, widths, at_width)

    return positions, slots, read


def prefill_body(graphdef: nnx.GraphDef, params, kv: KVCache, state: BlockState, tokens,
                 seq_ids, num_tokens, extend, *, all_logits: bool,
                 bucket_tokens: int = strategies.CONTEXT_BUCKET_TOKENS, mesh=None):
    """``prefill`` on checked inputs: tokens [B, T], seq_ids and num_tokens [B] int, extend
    [B] bool. The attention reads the table's first ``strategies.context_widths(...,
    bucket_tokens)`` columns that cover the longest row. Returns ``(logits, kv, state,
    status)``."""
    model, bits = _merge(graphdef, params)
    batch, width = tokens.shape
    st, (src, dst), status, cached = _prefill_claim(model, state, tokens, seq_ids, num_tokens,
                                                    extend, "prefill")
    ok = status.applied
    state = _select(ok, st, state)
    kv = copy_blocks(kv, jnp.where(ok, src, -1), dst)
    positions, slots, read = _prefill_reader(model, state, seq_ids, num_tokens, cached, ok,
                                             width, bucket_tokens)

    def attend(layer, q, k, v, kv):  # q [B, T, Hq, D]; k, v [B, T, Hkv, D]
        kv = write(kv, layer, slots, k, v)
        return read(layer, q, kv), kv

    h, kv = model.hidden(tokens.astype(jnp.int32), positions, kv, attend, bits)  # [B, T, E]
    if all_logits:
        logits = model.logits(h)  # [B, T, V]
    else:
        last = jnp.maximum(num_tokens.astype(jnp.int32) - 1, 0)
        logits = model.logits(h[jnp.arange(batch), last])  # [B, V]
    kv, state = constrain(kv, state, mesh)
    return logits, kv, state, status


def packed_prefill_body(graphdef: nnx.GraphDef, params, kv: KVCache, state: BlockState,
                        tokens, seq_ids, num_tokens, *, mesh=None):
    """``prefill_packed`` on checked inputs: tokens [T] int, the rows' chunks one after
    another (row ``r``'s ``num_tokens[r]`` tokens start where row ``r - 1``'s end; padding
    rows, id -1, bring none), seq_ids and num_tokens [R] int. Every real row extends an
    active, empty slot. The projections run on the T packed tokens; each token attends to the
    tokens of its own row up to itself (nothing is cached before them, so no table is
    read). Returns ``(logits [R, V], kv, state, status)``."""
    cfg = state.config
    model, bits = _merge(graphdef, params)
    (width,) = tokens.shape
    rows = seq_ids.shape[0]
    ids = seq_ids.astype(jnp.int32)
    real = ids != -1
    n = jnp.where(real, num_tokens.astype(jnp.int32), 0)  # [R]
    in_range = (ids >= 0) & (ids < cfg.max_seqs)
    held = jnp.where(in_range, state.seq_lens[jnp.where(in_range, ids, 0)], 0)  # [R]
    ends = jnp.cumsum(n)  # [R] where each row's tokens end in the packed row
    starts = ends - n

    st, s_append = append(state, ids, n)
    t = jnp.arange(width, dtype=jnp.int32)
    # The row each packed token belongs to, and its column (its position: rows start empty).
    seg = jnp.minimum(jnp.searchsorted(ends, t, side="right"), rows - 1).astype(jnp.int32)
    col = t - starts[seg]  # [T]
    used = t < ends[-1]  # [T] tokens some row brings
    bad = bad_tokens(tokens[None], used[None], model.config.vocab_size)[0]  # [T]
    row_bad = bad[None, :] & (seg[None, :] == jnp.arange(rows)[:, None])  # [R, T]
    first_bad = jnp.argmax(row_bad, axis=1)  # [R]
    bad_len = real & ((n < 1) | (ends > width))
    own = jnp.where(
        bad_len, jnp.int32(Code.BAD_NUM_TOKENS),
        jnp.where(real & in_range & (held != 0), jnp.int32(Code.SEQ_ACTIVE),
                  jnp.where(jnp.any(row_bad, axis=1), jnp.int32(Code.BAD_TOKEN),
                            jnp.int32(Code.OK))))
    value, limit, at = details(own, {
        Code.BAD_NUM_TOKENS: (n, jnp.maximum(width - starts, 0), None),
        Code.SEQ_ACTIVE: (held, None, None),
        Code.BAD_TOKEN: (tokens[first_bad], model.config.vocab_size, first_bad - starts),
    })
    own = Status(code=own, ids=ids, value=value, limit=limit, at=at, requested=0,
                 num_free=state.num_free, op="prefill_packed")
    status = combine(ids, state.num_free, "prefill_packed", s_append, own=own)
    ok = status.applied
    state = _select(ok, st, state)

    live = ok & used  # [T]
    slots = jnp.where(live, slot_mapping(state, ids[seg], col), -1)  # [T]
    # Block diagonal and causal: a token sees the earlier tokens of its own row.
    mask = ((seg[:, None] == seg[None, :]) & (col[None, :] <= col[:, None])
            & live[None, :])  # [T, T]

    def attend(layer, q, k, v, kv):  # q [1, T, Hq, D]; k, v [1, T, Hkv, D]
        kv = write(kv, layer, slots[None], k, v)
        # As the cache holds them, so that what this step attends to is what a later step
        # reads back from the blocks.
        keys, values = kv.values(kv.stored(k)), kv.values(kv.stored(v))
        return masked_attention(q, keys, values, mask[None],
                                per_kv_head=model.kv_head_attention), kv

    h, kv = model.hidden(tokens[None].astype(jnp.int32), col[None], kv, attend, bits)  # [1, T, E]
    logits = model.logits(h[0, jnp.maximum(ends - 1, 0)])  # [R, V]
    kv, state = constrain(kv, state, mesh)
    return logits, kv, state, status


def _claim(model, kv: KVCache, state: BlockState, tokens, mask, num_steps: int, op: str,
           budgets=None):
    """``claim_feeding``, with its block copies applied to ``kv``. Copy-on-write is rare (the
    first write after a fork into a shared, partly filled block): skipped when no row
    copies."""
    state, (src, dst), status = claim_feeding(state, tokens, mask, num_steps,
                                              model.config.vocab_size, budgets, op=op)
    kv = jax.lax.cond(jnp.any((src >= 0) & (dst >= 0)),
                      lambda kv: copy_blocks(kv, src, dst), lambda kv: kv, kv)
    return kv, state, status


def _forward(model, kv: KVCache, state: BlockState, tokens, positions, live, attention,
             extra=(), embed_bits=None):
    """One token per row at ``positions`` (rows not ``live`` write nothing): writes its K/V
    at the row's ``slot_mapping``, then ``attention(layer, q, k, v, kv, extra) -> (out,
    extra)`` (a ``kernels.strategies`` attention) attends. ``state`` has already claimed the
    blocks (its lengths may run ahead, as after ``reserve_steps``).

    Returns ``(logits [S, V], kv, extra)``."""
    ids = jnp.where(live, jnp.arange(tokens.shape[0], dtype=jnp.int32), -1)  # [S]
    slots = slot_mapping(state, ids, positions)  # [S], -1 for rows that write nothing

    def attend(layer, q, k, v, carry):  # q [S, 1, Hq, D]; k, v [S, 1, Hkv, D]
        kv, extra = carry
        kv = write(kv, layer, slots, k, v)
        out, extra = attention(layer, q[:, 0], k[:, 0], v[:, 0], kv, extra)
        return out[:, None], (kv, extra)

    logits, (kv, extra) = model(tokens[:, None], positions[:, None], (kv, extra), attend,
                                embed_bits)
    return logits[:, 0], kv, extra


def decode_step_body(graphdef: nnx.GraphDef, params, kv: KVCache, state: BlockState, tokens,
                     *, impl: str, interpret: bool,
                     bucket_tokens: int = strategies.CONTEXT_BUCKET_TOKENS, mesh=None):
    """``decode_step`` on checked inputs (tokens [max_seqs] int): one token for every active
    row. Returns ``(logits, kv, state, status)``."""
    model, bits = _merge(graphdef, params)
    tokens, mask = tokens.astype(jnp.int32), state.active
    positions = state.seq_lens
    kv, state, status = _claim(model, kv, state, tokens, mask, 1, "decode_step")
    live = mask & status.applied
    widths = strategies.xla_widths(kv, state.block_tables, impl, bucket_tokens)
    attention_at, extra = strategies.per_step(state.block_tables, positions, impl=impl,
                                              interpret=interpret, mesh=mesh, widths=widths)
    logits, kv, _ = _forward(model, kv, state, tokens, positions, live, attention_at(0, live),
                             extra, bits)
    kv, state = constrain(kv, state, mesh)
    return logits, kv, state, status


def _first_rows(x, rows: int):
    """``x[:rows]`` for a per-row array; a scalar or None as it is."""
    return x if x is None or jnp.ndim(x) == 0 else x[:rows]


def prefill_decode_body(graphdef: nnx.GraphDef, params, kv: KVCache, state: BlockState, tokens,
                        seq_ids, num_tokens, extend, decode_tokens, key, temperature,
                        top_k=None, top_p=None, budgets=None, seeds=None, *, impl: str,
                        interpret: bool, sample: bool, filtered: bool = False,
                        rows: int | None = None,
                        bucket_tokens: int = strategies.CONTEXT_BUCKET_TOKENS, mesh=None):
    """``prefill_decode`` on checked inputs: ``prefill``'s rows (tokens [B, T], seq_ids and
    num_tokens [B] int, extend [B] bool) and one ``decode_steps`` step (decode_tokens
    [max_seqs] int, sampling and ``budgets``/``seeds`` as there) in one forward pass, so the
    weights are read once for both. The B*T prefill positions and the R = ``rows`` decode
    rows (static; max_seqs without it) go through the projections as one row of tokens; each
    part attends as its own step does. The decoding rows are the active slots below R with a
    budget above 0 (every active one without ``budgets``), as ``decode_steps``' ``rows``. A
    slot in both parts is refused (``DUPLICATE_SEQ``). All or nothing: the status has the
    max_seqs decode entries, then the B prefill rows. Returns ``(emitted
    [max_seqs] (-1 where a row did not decode), logits [B, V] of each prefill row's last
    token, kv, state, status)``."""
    cfg = state.config
    model, bits = _merge(graphdef, params)
    batch, width = tokens.shape
    slots = cfg.max_seqs
    op = "prefill_decode"
    rows = slots if rows is None else rows
    decode_tokens = decode_tokens.astype(jnp.int32)
    mask = state.active & (jnp.arange(slots) < rows)
    start = state.seq_lens  # [S]
    st, (d_src, d_dst), s_decode = claim_feeding(state, decode_tokens, mask, 1,
                                                 model.config.vocab_size, budgets, op=op)
    decoding = mask if budgets is None else mask & (budgets > 0)  # [S]
    st, (p_src, p_dst), s_prefill, cached = _prefill_claim(model, st, tokens, seq_ids,
                                                           num_tokens, extend, op)
    ids = seq_ids.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < slots)
    both = in_range & decoding[jnp.where(in_range, ids, 0)]  # [B] rows in both parts
    own = Status(code=jnp.where(both, jnp.int32(Code.DUPLICATE_SEQ), jnp.int32(Code.OK)),
                 ids=ids, requested=0, num_free=state.num_free, op=op)
    s_prefill = combine(ids, state.num_free, op, s_prefill, own=own)
    status = concat(op, state.num_free, s_decode, s_prefill)
    ok = status.applied
    state = _select(ok, st, state)
    src = jnp.where(ok, jnp.concatenate([d_src, p_src]), -1)
    kv = copy_blocks(kv, src, jnp.concatenate([d_dst, p_dst]))

    live = decoding & ok  # [S]
    # From here on the decode part is over the first `rows` slots: the rows the model computes.
    d_slots = slot_mapping(state, jnp.where(live, jnp.arange(slots, dtype=jnp.int32), -1),
                           start)[:rows]  # [R]
    start, live, tables = start[:rows], live[:rows], state.block_tables[:rows]
    widths = strategies.xla_widths(kv, tables, impl, bucket_tokens)
    decode_attention, extra = strategies.per_step(tables, start, impl=impl, interpret=interpret,
                                                  mesh=mesh, widths=widths)
    decode_attention = decode_attention(0, live)
    positions, p_slots, read = _prefill_reader(model, state, seq_ids, num_tokens, cached, ok,
                                               width, bucket_tokens)
    all_slots = jnp.concatenate([d_slots, p_slots.reshape(-1)])  # [R + B*T]

    def attend(layer, q, k, v, carry):  # q [1, R + B*T, Hq, D]; k, v [1, R + B*T, Hkv, D]
        kv, extra = carry
        kv = write(kv, layer, all_slots[None], k, v)
        out, extra = decode_attention(layer, q[0, :rows], k[0, :rows], v[0, :rows], kv,
                                      extra)  # [R, Hq, D]
        chunk = read(layer, q[0, rows:].reshape(batch, width, *q.shape[2:]), kv)  # [B, T, ...]
        return jnp.concatenate([out, chunk.reshape(batch * width, *q.shape[2:])])[None], (
            kv, extra)

    row = jnp.concatenate([decode_tokens[:rows], tokens.astype(jnp.int32).reshape(-1)])[None]
    pos = jnp.concatenate([start, positions.reshape(-1)])[None]
    h, (kv, _) = model.hidden(row, pos, (kv, extra), attend, bits)  # [1, R + B*T, E]
    last = rows + jnp.arange(batch) * width + jnp.maximum(num_tokens.astype(jnp.int32) - 1, 0)
    logits = model.logits(h[0, jnp.concatenate([jnp.arange(rows), last])])  # [R + B, V]
    temperature, top_k, top_p, seeds = (
        _first_rows(x, rows) for x in (temperature, top_k, top_p, seeds))
    if sample:  # as decode_steps' one step draws
        keys = (sampling.row_keys(seeds, start + 1) if seeds is not None
                else jax.random.split(key, 1)[0])
        nxt = (sampling.sample(logits[:rows], keys, temperature, top_k, top_p) if filtered
               else sampling.sample(logits[:rows], keys, temperature))
    else:
        nxt = jnp.argmax(logits[:rows], axis=-1).astype(jnp.int32)
    # Back to one entry per slot: the slots past `rows` emit -1.
    emitted = jnp.pad(jnp.where(live, nxt, -1), (0, slots - rows), constant_values=-1)
    kv, state = constrain(kv, state, mesh)
    return emitted, logits[rows:], kv, state, status


def decode_steps_body(graphdef: nnx.GraphDef, params, kv: KVCache, state: BlockState, tokens,
                      key, temperature, top_k=None, top_p=None, budgets=None, stop_ids=None,
                      seeds=None, *, num_steps: int, impl: str, interpret: bool,
                      return_logits: bool, sample: bool, filtered: bool = False,
                      rows: int | None = None,
                      hoist_max_bytes: int = strategies.HOIST_MAX_BYTES,
                      bucket_tokens: int = strategies.CONTEXT_BUCKET_TOKENS, mesh=None):
    """``decode_steps`` on checked inputs (``step_inputs.decode_steps_inputs``). Returns
    ``(tokens, logits, kv, state, status)``."""
    model, bits = _merge(graphdef, params)
    slots = state.config.max_seqs
    rows = slots if rows is None else rows  # the model runs on slots 0..rows-1 only
    # All K steps' blocks are claimed once, up front: the scan body does no allocator work.
    mask = state.active & (jnp.arange(slots) < rows)
    start = state.seq_lens  # [S]
    tokens = tokens.astype(jnp.int32)
    if budgets is not None:
        budgets = budgets.astype(jnp.int32)
        mask = mask & (budgets > 0)
    kv, state, status = _claim(model, kv, state, tokens, mask, num_steps, "decode_steps",
                               budgets)
    live = mask & status.applied
    limit = jnp.full_like(start, num_steps) if budgets is None else budgets  # [S]
    # From here on everything is over the first `rows` slots: the rows the model computes.
    start, live, limit, tokens = (x[:rows] for x in (start, live, limit, tokens))
    temperature, top_k, top_p, stop_ids, seeds = (
        _first_rows(x, rows) for x in (temperature, top_k, top_p, stop_ids, seeds))
    attention_at, extra = strategies.decode_strategy(
        kv, state.block_tables[:rows], start, live, num_steps, impl=impl, interpret=interpret,
        hoist_max_bytes=hoist_max_bytes, bucket_tokens=bucket_tokens, mesh=mesh)

    def body(loop, xs):
        kv, extra, tokens, going = loop  # going: [S] rows that run step t
        t, step_key = xs
        logits, kv, extra = _forward(model, kv, state, tokens, start + t, going,
                                     attention_at(t, going), extra, bits)
        if seeds is not None and sample:  # one key per row: its seed, the new token's position
            step_key = sampling.row_keys(seeds, start + t + 1)
        if sample:  # static: a greedy run draws no random numbers
            # Static too: with the filters off, the scan has no full-vocabulary sort.
            nxt = (sampling.sample(logits, step_key, temperature, top_k, top_p) if filtered
                   else sampling.sample(logits, step_key, temperature))
        else:
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        emitted = jnp.where(going, nxt, -1)  # [S]
        tokens = jnp.where(going, nxt, tokens)
        stopped = jnp.zeros_like(going) if stop_ids is None else jnp.any(
            (nxt[:, None] == stop_ids) & (stop_ids >= 0), axis=1)
        going = going & ~stopped & (t + 1 < limit)
        out = (emitted, logits) if return_logits else (emitted,)
        return (kv, extra, tokens, going), out

    keys = jax.random.split(key, num_steps) if sample and seeds is None else None
    steps = (jnp.arange(num_steps, dtype=jnp.int32), keys)
    (kv, _, _, _), out = jax.lax.scan(body, (kv, extra, tokens, live), steps)
    # Back to one column per slot: the slots past `rows` emit -1 (and zero logits).
    pad = ((0, 0), (0, slots - rows))
    emitted = jnp.pad(out[0], pad, constant_values=-1)  # [K, S]
    logits = jnp.pad(out[1], (*pad, (0, 0))) if return_logits else None
    kv, state = constrain(kv, state, mesh)
    return emitted, logits, kv, state, status
