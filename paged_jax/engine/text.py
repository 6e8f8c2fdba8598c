"""Text in, text out for one prompt: chat template, paged prefill, K-step decode to EOS.

``answer(model, tokenizer, question)`` renders the chat template, prefills the prompt into a
one-sequence pool, and decodes ``steps_per_dispatch`` tokens per dispatch, handing each
dispatch's new text to ``on_text`` as it comes (streaming), until the model emits its EOS
token or ``max_new_tokens`` are out. ``paged-jax generate "..."`` runs it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine.sampling import check_sampling, sample
from paged_jax.engine.steps import decode_steps, pad_prompts, prefill
from paged_jax.kvcache import init_cache
from paged_jax.model.llama import Llama
from paged_jax.model.tokenizer import Tokenizer

PROMPT_BUCKET = 64  # tokens: prefill compiles once per multiple of this
BLOCKS_BUCKET = 16  # blocks: the pool (and so the decode step) compiles once per multiple


@dataclasses.dataclass(frozen=True)
class Answer:
    """What ``answer`` produced: the prompt's and the answer's token ids, the answer's text
    (EOS excluded), whether it stopped at EOS, the seconds to the first token and in all
    (compilation included), and ``steady``: ``(tokens, seconds)`` of the dispatches after the
    first decode dispatch (which compiles), for a tokens/s that is the decoder's own."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stopped_at_eos: bool
    first_token_s: float
    total_s: float
    steady: tuple[int, float]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first decode dispatch; None if there was none."""
        tokens, seconds = self.steady
        return tokens / seconds if tokens and seconds > 0 else None


def answer(
    model: Llama,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    raw: bool = False,
    max_new_tokens: int = 128,
    steps_per_dispatch: int = 8,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    block_size: int = 16,
    on_text: Callable[[str], None] | None = None,
) -> Answer:
    """Answer ``prompt`` (a user message, put through the chat template unless ``raw``).

    Greedy at ``temperature == 0``, else sampled with ``seed`` at ``temperature``, ``top_k``
    (0 = off) and ``top_p`` (1 = off), the first token as every later one
    (``sampling.sample``). Raises ``ValueError`` for an empty prompt, a non-positive
    ``max_new_tokens`` / ``steps_per_dispatch`` or a sampling parameter out of range
    (``check_sampling``).
    """
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string. Got {prompt!r}.")
    for name, value in (("max_new_tokens", max_new_tokens),
                        ("steps_per_dispatch", steps_per_dispatch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int. Got {value!r}.")
    check_sampling(temperature, top_k, top_p)
    text = prompt if raw else tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(text, add_special_tokens=raw)
    cfg = model.config
    dispatches = math.ceil(max(max_new_tokens - 1, 0) / steps_per_dispatch)
    # The prompt's width and the pool's size are rounded up to buckets, so that questions of
    # other lengths reuse the compiled steps.
    width = -(-len(ids) // PROMPT_BUCKET) * PROMPT_BUCKET
    need = math.ceil((len(ids) + 1 + dispatches * steps_per_dispatch) / block_size)
    max_blocks = -(-need // BLOCKS_BUCKET) * BLOCKS_BUCKET
    cache = CacheConfig(num_blocks=max_blocks, block_size=block_size, max_seqs=1,
                        max_blocks_per_seq=max_blocks)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)  # cheaper for jit to flatten on every dispatch
    kv, state = init_cache(cfg, cache), init_state(cache)
    key = jax.random.key(seed)

    start = time.perf_counter()
    logits, kv, state, status = prefill(graphdef, params, kv, state, pad_prompts([ids], width),
                                        jnp.array([0]), jnp.array([len(ids)]))
    status.raise_if_failed()
    key, sub = jax.random.split(key)
    nxt = sample(logits, sub, temperature, top_k, top_p)
    out = [int(nxt[0])]
    first = time.perf_counter() - start
    shown = ""

    def stream():
        nonlocal shown
        body = out[:-1] if out[-1] == tokenizer.eos_token_id else out
        now = tokenizer.decode(body)
        # A partial UTF-8 sequence decodes to U+FFFD until its last byte arrives: hold it.
        stable = now.rstrip("\ufffd")
        if on_text is not None and stable.startswith(shown) and len(stable) > len(shown):
            on_text(stable[len(shown):])
            shown = stable

    stream()
    steady_start = steady_from = None  # time and token count after the first dispatch
    while out[-1] != tokenizer.eos_token_id and len(out) < max_new_tokens:
        if steady_start is None and len(out) > 1:
            steady_start, steady_from = time.perf_counter(), len(out)
        key, sub = jax.random.split(key)
        toks, _, kv, state, status = decode_steps(graphdef, params, kv, state, nxt, sub,
                                                  temperature, top_k=top_k, top_p=top_p,
                                                  num_steps=steps_per_dispatch)
        toks = np.asarray(jax.device_get(toks))[:, 0]  # one host round trip per dispatch
        if toks.min() < 0:
            status.raise_if_failed()
        for t in toks.tolist():
            out.append(int(t))
            if t == tokenizer.eos_token_id or len(out) == max_new_tokens:
                break
        stream()
        nxt = jnp.asarray(toks[-1:], jnp.int32)
    end = time.perf_counter()
    total = end - start
    steady = (0, 0.0) if steady_start is None else (len(out) - steady_from, end - steady_start)
    eos = out[-1] == tokenizer.eos_token_id
    body = out[:-1] if eos else out
    return Answer(prompt_ids=list(ids), token_ids=out, text=tokenizer.decode(body),
                  stopped_at_eos=eos, first_token_s=first, total_s=total, steady=steady)
