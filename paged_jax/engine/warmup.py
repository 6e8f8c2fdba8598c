"""``warm_up(engine)``: compile, before serving, every prefill shape an engine can dispatch and
its greedy decode, so that no request waits for a compilation.

The engine compiles a step the first time it meets its shape. Which prefill shapes a run
meets depends on which chunks land in one iteration, and so on the order requests arrive in:
a server fed by many clients meets shapes that a warm-up pass of the same workload did not,
and a request then waits for a compilation (seconds for a real model on a CPU) in the middle
of serving. ``warm_up`` runs each shape once on padding rows, which change neither the cache
nor the allocator's state.

The shapes are ``buckets.prefill_shapes``'s; where the engine packs the chunks that start a
prompt (``pack_prefill``), ``buckets.packed_widths``'s; and where it runs a one-row chunk
and a decode step in one dispatch (``decode_with_prefill``), each one-row width the chunk
budget of an iteration that decodes allows, at every decode row count, greedy. Decode is
warmed for greedy requests with one stop id (EOS), at both of the engine's dispatch lengths
(``steps_per_dispatch`` and ``steps_while_prefilling``) and every row count
(``LLMEngine.decode_rows_for``); sampled requests and longer stop lists compile on first use.
The allocator ops applied between dispatches are compiled too (``LLMEngine.compile_pool_ops``).

XLA:CPU maps memory for every compiled kernel (about 1,200 mappings per SmolLM2 executable),
and Linux stops a process at ``vm.max_map_count`` mappings (65,530 by default), where the
next compilation fails with LLVM's "Cannot allocate memory". On the CPU backend ``warm_up``
counts the mappings its first compilation added and warns, before compiling the rest, when
all of them would pass the limit (``MappingWatch``).
"""

from __future__ import annotations

import pathlib
import warnings

import jax
import numpy as np

from paged_jax.engine.buckets import (
    MIN_PREFILL_WIDTH,
    packed_widths,
    pow2_at_least,
    prefill_shapes,
)
from paged_jax.engine.llm_engine import LLMEngine

__all__ = ["MappingWatch", "mappings", "packed_widths", "prefill_shapes", "warm_up"]


def mappings() -> tuple[int, int] | None:
    """``(memory mappings this process holds, the kernel's limit on them)`` from ``/proc``,
    or None where it does not say (not Linux)."""
    try:
        limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps), limit
    except (OSError, ValueError):
        return None


class MappingWatch:
    """Wrap each of ``total`` compilations in ``with watch:``. The first one's added
    mappings, times the compilations left, plus those held after it, is what all of them
    would hold; where that passes the limit, a ``RuntimeWarning`` says so (once) with the
    fix, before the rest compile. ``enabled=False`` (other backends) watches nothing."""

    def __init__(self, total: int, enabled: bool = True, read=None):
        self.total, self.enabled, self.read = total, enabled, read or mappings
        self.done, self.before = 0, None

    def __enter__(self):
        if self.enabled and self.done == 0:
            self.before = self.read()
        return self

    def __exit__(self, *exc):
        self.done += 1
        if self.done == 1 and self.before is not None and exc[0] is None:
            after = self.read()
            if after is not None:
                self.check(after[0] - self.before[0], after[0], after[1])
        return False

    def projected(self, per: int, held: int) -> int:
        """Mappings held once every compilation has run, at ``per`` each."""
        return held + max(per, 0) * (self.total - self.done)

    def check(self, per: int, held: int, limit: int) -> None:
        need = self.projected(per, held)
        if need > limit:
            warnings.warn(
                f"warm_up compiles {self.total} executables; the first added {per} memory "
                f"mappings, so all of them would hold about {need} against this kernel's "
                f"vm.max_map_count of {limit}, and a compilation past it fails with \"Cannot "
                f"allocate memory\". Raise the limit (sysctl -w vm.max_map_count=262144) or "
                f"compile fewer shapes (a smaller max_num_seqs or max_num_batched_tokens).",
                RuntimeWarning, stacklevel=4)


def warm_up(engine: LLMEngine, progress: bool = True) -> int:
    """Compile ``engine``'s prefill shapes and its greedy decode dispatches; returns how many
    prefill shapes (packed ones and those beside a decode step included) were run. Call it
    before the first request (it runs on padding rows and leaves the engine as it was)."""
    from tqdm import tqdm

    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs before serving: the engine has unfinished requests.")
    shapes = prefill_shapes(engine.cache_config.max_seqs, engine.max_num_batched_tokens,
                            engine.prefill_by_width)
    s = engine.cache_config.max_seqs
    widths = packed_widths(engine.max_num_batched_tokens) if engine.pack_prefill else []
    # A one-row prefill chunk beside a decode of one step runs as one prefill_decode dispatch
    # (decode_with_prefill), of a width the chunk budget of an iteration that decodes allows.
    widest = pow2_at_least(engine.scheduler.prefill_tokens_while_decoding, MIN_PREFILL_WIDTH,
                           engine.max_num_batched_tokens)
    row_counts = sorted({engine.decode_rows_for(slot) for slot in range(s)})
    beside = ([(width, rows) for n, width in shapes if n == 1 and width <= widest
               for rows in row_counts]
              if engine.merges_prefill_decode else [])
    decodes = [(k, rows) for k in sorted({engine.steps_while_prefilling,
                                          engine.steps_per_dispatch})
               for rows in row_counts]
    watch = MappingWatch(len(shapes) + len(widths) + len(beside) + len(decodes),
                         enabled=jax.default_backend() == "cpu")
    for rows, width in tqdm(shapes, desc="compiling prefill shapes", disable=not progress):
        # Padding rows (slot -1) are skipped: nothing is admitted, written or allocated.
        with watch:
            _, engine.kv, engine.state, status = engine.steps.prefill(
                engine.params, engine.kv, engine.state, np.zeros((rows, width), np.int32),
                np.full(rows, -1, np.int32), np.zeros(rows, np.int32), np.zeros(rows, bool))
        status.raise_if_failed()
    for width in tqdm(widths, desc="compiling packed prefill widths", disable=not progress):
        with watch:
            _, engine.kv, engine.state, status = engine.steps.prefill_packed(
                engine.params, engine.kv, engine.state, np.zeros(width, np.int32),
                np.full(s, -1, np.int32), np.zeros(s, np.int32))
        status.raise_if_failed()
    for width, rows in tqdm(beside, desc="compiling prefill + decode shapes",
                            disable=not progress):
        with watch:
            _, _, engine.kv, engine.state, status = engine.steps.prefill_decode(
                engine.params, engine.kv, engine.state, np.zeros((1, width), np.int32),
                np.full(1, -1, np.int32), np.zeros(1, np.int32), np.zeros(1, bool),
                np.zeros(s, np.int32), impl=engine.impl, budgets=np.zeros(s, np.int32),
                rows=rows)
        status.raise_if_failed()
    for k, rows in tqdm(decodes, desc="compiling decode dispatches", disable=not progress):
        with watch:
            _, _, engine.kv, engine.state, status = engine.steps.decode_steps(
                engine.params, engine.kv, engine.state, np.zeros(s, np.int32), None, 0.0,
                top_k=0, top_p=1.0, num_steps=k, impl=engine.impl,
                budgets=np.zeros(s, np.int32), stop_ids=np.full((s, 1), -1, np.int32),
                seeds=None, rows=rows)
        status.raise_if_failed()
    engine.compile_pool_ops()
    return len(shapes) + len(widths) + len(beside)
