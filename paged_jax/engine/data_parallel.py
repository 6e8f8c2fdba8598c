"""``DataParallelEngine``: one ``LLMEngine`` per ``"dp"`` replica of a mesh, and a router.

Each replica owns its pool, its ``BlockState``, its scheduler and its prefix cache on the
sub-mesh of its row of devices (``sharding.replica_meshes``; tensor parallel over that row's
``"tp"`` devices). A new request goes to the replica with the fewest unfinished requests (the
lowest index on a tie) and stays there until it finishes or is aborted: its blocks never
move. ``step`` steps every replica with work, each in its own thread, so the replicas'
dispatches overlap (JAX releases the GIL while a computation runs).

The interface is ``LLMEngine``'s (``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``stats``), so ``LLM`` drives either. Request ids are unique
across the replicas: the router refuses an id that any replica holds.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from paged_jax.engine.llm_engine import EngineStats, LLMEngine
from paged_jax.engine.params import RequestOutput
from paged_jax.sharding import check_model, replica_meshes

__all__ = ["DataParallelEngine"]


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


class DataParallelEngine:
    """``LLMEngine``s over the ``"dp"`` rows of ``mesh``, behind ``LLMEngine``'s interface.

    Args:
      model, tokenizer: as for ``LLMEngine``.
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` axis and optionally a ``"dp"`` axis.
      **engine_kwargs: ``LLMEngine``'s other options, for every replica (each gets the
        whole pool: ``num_blocks`` or ``kv_cache_bytes`` is per replica). ``steps`` cannot be
        given: each replica compiles for its own devices.
    """

    def __init__(self, model, tokenizer=None, *, mesh, **engine_kwargs):
        check_model(model.config, mesh, allow_dp=True)
        if "steps" in engine_kwargs:
            raise ValueError("DataParallelEngine builds one Steps per replica (each on its "
                             "own devices); do not pass steps=.")
        self.replicas = [LLMEngine(model, tokenizer, mesh=m, **engine_kwargs)
                         for m in replica_meshes(mesh)]
        self.tokenizer = tokenizer
        self._owner: dict[str, LLMEngine] = {}
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="dp-replica")

    def __len__(self) -> int:
        return len(self.replicas)

    def _forget_finished(self) -> None:
        self._owner = {rid: e for rid, e in self._owner.items() if rid in e.requests}

    def add_request(self, request_id: str, prompt, params=None,
                    arrival_time: float | None = None) -> None:
        """``LLMEngine.add_request`` on the replica with the fewest unfinished requests. An id
        any replica holds is refused (``ValueError``), nothing changed."""
        self._forget_finished()
        if request_id in self._owner:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        target = min(self.replicas, key=lambda e: len(e.requests))
        target.add_request(request_id, prompt, params, arrival_time)
        self._owner[request_id] = target

    def abort_request(self, request_id: str) -> None:
        """``LLMEngine.abort_request`` on the request's replica (``KeyError`` if none holds
        it)."""
        self._forget_finished()
        owner = self._owner.pop(request_id, None)
        if owner is None:
            raise KeyError(f"No unfinished request {request_id!r} to abort.")
        owner.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One ``LLMEngine.step`` of every replica with work, concurrently; their outputs in
        replica order."""
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        outputs = [out for outs in self._pool.map(lambda e: e.step(), busy) for out in outs]
        self._forget_finished()
        return outputs

    def stats(self) -> EngineStats:
        """The replicas' ``EngineStats`` summed; occupancies and the hit rate over the pools
        together, the medians over every replica's finished requests."""
        each = [e.stats() for e in self.replicas]
        total = {f.name: sum(getattr(s, f.name) for s in each)
                 for f in dataclasses.fields(EngineStats)
                 if isinstance(getattr(each[0], f.name), int)}
        blocks = total["blocks_total"]
        tokens = sum(s.token_occupancy * s.blocks_total * e.cache_config.block_size
                     for s, e in zip(each, self.replicas, strict=True))
        capacity = sum(s.blocks_total * e.cache_config.block_size
                       for s, e in zip(each, self.replicas, strict=True))
        metrics = [m for e in self.replicas for _, m in e.finished_metrics]
        return EngineStats(
            **total,
            block_occupancy=total["blocks_used"] / blocks,
            token_occupancy=tokens / capacity,
            prefix_cache_hit_rate=(total["prefix_cache_hits"] / total["prefix_cache_queries"]
                                   if total["prefix_cache_queries"] else 0.0),
            median_ttft=_median([m.ttft for m in metrics if m.ttft is not None]),
            median_tpot=_median([m.tpot for m in metrics if m.tpot is not None]),
            median_itl=_median([gap for m in metrics for gap in m.itl]),
            median_e2e=_median([m.e2e for m in metrics if m.e2e is not None]),
        )
