"""Text in, text out for one prompt: chat template, then ``LLMEngine`` to EOS.

``answer(model, tokenizer, question)`` renders the chat template and serves the prompt
through a one-slot ``LLMEngine``: the prompt is prefilled, then ``steps_per_dispatch``
tokens are decoded per dispatch, and each dispatch's new text goes to ``on_text`` as it
comes (streaming), until the model emits its EOS token or ``max_new_tokens`` are out.
``paged-jax generate "..."`` runs it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.sampling import check_sampling
from paged_jax.engine.steps import Steps
from paged_jax.model.llama import Llama
from paged_jax.model.tokenizer import Tokenizer

PROMPT_BUCKET = 64  # tokens: prefill compiles once per power of two from this up
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
    steps: Steps | None = None,
) -> Answer:
    """Answer ``prompt`` (a user message, put through the chat template unless ``raw``).

    Greedy at ``temperature == 0``, else sampled with ``seed`` at ``temperature``, ``top_k``
    (0 = off) and ``top_p`` (1 = off): the token at position ``p`` is drawn with a key made
    from ``(seed, p)``, as the engine draws every token. ``steps``, the model's ``Steps``,
    lets several answers share their compiled work. Raises ``ValueError`` for an empty
    prompt, a non-positive ``max_new_tokens`` / ``steps_per_dispatch`` or a sampling
    parameter out of range (``check_sampling``).
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
    # The pool's size and the prefill's width are rounded up to buckets, so that questions of
    # other lengths reuse the compiled steps.
    need = math.ceil((len(ids) + max_new_tokens + steps_per_dispatch) / block_size)
    blocks = -(-need // BLOCKS_BUCKET) * BLOCKS_BUCKET
    width = max(PROMPT_BUCKET, 1 << (len(ids) - 1).bit_length())
    engine = LLMEngine(model, tokenizer, block_size=block_size, num_blocks=blocks,
                       max_num_seqs=1, max_model_len=blocks * block_size,
                       max_num_batched_tokens=width, steps_per_dispatch=steps_per_dispatch,
                       # One request: no arrival waits behind a dispatch, so K throughout.
                       max_dispatch_ms=None, enable_prefix_caching=False, seed=seed,
                       steps=steps)
    engine.add_request("answer", ids, SamplingParams(
        temperature=temperature, top_k=top_k or -1, top_p=top_p, max_tokens=max_new_tokens,
        seed=seed))

    start = time.perf_counter()
    first = None
    shown = ""
    steady_start = steady_from = None  # time and token count after the first dispatch
    out = None
    while engine.has_unfinished_requests():
        count = 0 if out is None else len(out.outputs[0].token_ids)
        if steady_start is None and count > 1:
            steady_start, steady_from = time.perf_counter(), count
        for out in engine.step():
            if first is None:
                first = time.perf_counter() - start
            # A partial UTF-8 sequence decodes to U+FFFD until its last byte arrives: hold it.
            stable = out.outputs[0].text.rstrip("\ufffd")
            if on_text is not None and stable.startswith(shown) and len(stable) > len(shown):
                on_text(stable[len(shown):])
                shown = stable
    end = time.perf_counter()
    c = out.outputs[0]
    steady = ((0, 0.0) if steady_start is None
              else (len(c.token_ids) - steady_from, end - steady_start))
    eos = c.finish_reason == "stop"
    return Answer(prompt_ids=list(ids), token_ids=list(c.token_ids), text=c.text,
                  stopped_at_eos=eos, first_token_s=first, total_s=end - start, steady=steady)
