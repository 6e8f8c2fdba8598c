"""``--scenario engine``: a short run of the real serving steps, recorded block by block.

``DEFAULT_MODEL`` (a tiny random Llama; weights cannot be downloaded here) serves requests
through the jitted ``prefill`` and ``decode_step``, which drive the allocator inside jit:

* A (13 tokens) and B (9) are prefilled together, then decode;
* A is forked into A2 (parallel sampling): the next decode step writes both into their shared,
  partly filled last block, so ``decode_step`` copies it (copy-on-write);
* B finishes; C arrives with A's first block as a cached prefix and prefills only its own
  5 new tokens (a prefix hit), then everybody decodes.

Every step is a ``Recorder.capture`` of the ``BlockState`` the step returned, so the pictures
show exactly what the engine did to each block. The run reports what it did itself: the fork's
shared blocks, B's freed blocks, C's prefix hit, and each copy ``decode_step`` made (the
entry it wrote into now names a fresh block). The recorder diffs only what the jitted steps
did without telling: the blocks they allocated and the tokens they appended.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from paged_jax.allocator import CacheConfig, fork, init_state, release, share_prefix
from paged_jax.viz.log import RunLog
from paged_jax.viz.recorder import Recorder

POOL = CacheConfig(num_blocks=16, block_size=8, max_seqs=4, max_blocks_per_seq=8)


def engine_run(seed: int = 0, decode_steps: int = 2) -> RunLog:
    """Record the run described in the module docstring; ``decode_steps`` per phase."""
    from flax import nnx

    from paged_jax.engine import decode_step, pad_prompts, prefill
    from paged_jax.kvcache import init_cache
    from paged_jax.model import DEFAULT_MODEL, init_model

    model = init_model(DEFAULT_MODEL, seed=seed)
    graphdef, params = nnx.split(model)
    kv, state = init_cache(model.config, POOL), init_state(POOL)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    bs = POOL.block_size
    names: dict[int, str] = {}
    rec = Recorder("engine")
    rec.capture(state, names, title="empty pool")
    last = jnp.zeros((POOL.max_seqs,), jnp.int32)  # each slot's newest token

    def run_prefill(slots, prompts, title, extend=None):
        nonlocal kv, state, last
        more = {} if extend is None else {"extend": jnp.asarray(extend)}
        logits, kv, state, status = prefill(
            graphdef, params, kv, state, jnp.asarray(pad_prompts(prompts)),
            jnp.asarray(slots, jnp.int32),
            jnp.asarray([len(p) for p in prompts], jnp.int32), **more,
        )
        status.raise_if_failed()
        last = last.at[jnp.asarray(slots)].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        rec.capture(state, names, title=title)

    def entries(st, slot):
        table = [int(b) for b in np.asarray(st.block_tables[slot]) if b >= 0]
        n = int(st.seq_lens[slot])
        return [(b, min(bs, max(0, n - i * bs))) for i, b in enumerate(table)]

    def run_decode(count, title):
        nonlocal kv, state, last
        for _ in range(count):
            before = {s: (entries(state, s), int(state.seq_lens[s])) for s in names}
            logits, kv, state, status = decode_step(graphdef, params, kv, state, last)
            status.raise_if_failed()
            for s, (old, length) in before.items():
                i = length // bs  # the entry this step's token went into
                new = entries(state, s)
                if i < len(old) and new[i][0] != old[i][0]:
                    rec.report("cow_copy", names[s], i, new[i][0], old[i][1],
                               src_block=old[i][0])
            last = jnp.where(state.active, jnp.argmax(logits, axis=-1).astype(jnp.int32), last)
            lens = ", ".join(f"{names[s]} {int(state.seq_lens[s])}" for s in sorted(names))
            rec.capture(state, names, title=f"{title}: decode_step ({lens} tokens)")

    names.update({0: "A", 1: "B"})
    run_prefill([0, 1], [rng.integers(0, vocab, 13), rng.integers(0, vocab, 9)],
                "prefill A (13 tokens) and B (9 tokens)")
    run_decode(decode_steps, "A and B decode")

    state, status = fork(state, jnp.array([0]), jnp.array([2]))
    status.raise_if_failed()
    names[2] = "A2"
    last = last.at[2].set(last[0])
    for i, (b, tokens) in enumerate(entries(state, 2)):
        rec.report("fork", "A2", i, b, tokens)
    rec.capture(state, names, title="fork A -> A2: A2 shares all of A's blocks")
    run_decode(1, "A and A2 write into their shared last block: copy-on-write")

    gone = entries(state, 1)
    state, status = release(state, jnp.array([1]))
    status.raise_if_failed()
    for i, (b, tokens) in enumerate(gone):
        rec.report("free", "B", i, b, tokens)
    del names[1]
    rec.capture(state, names, title="B finishes: its blocks return to the free list")

    state, status = share_prefix(state, jnp.array([0]), jnp.array([1]), jnp.array([1]))
    status.raise_if_failed()
    names[1] = "C"
    for i, (b, tokens) in enumerate(entries(state, 1)):
        rec.report("prefix_hit", "C", i, b, tokens)
    run_prefill([1], [rng.integers(0, vocab, 5)],
                "C reuses A's first block (prefix hit) and prefills only its 5 new tokens",
                extend=[True])
    run_decode(decode_steps, "everybody decodes")
    return rec.log
