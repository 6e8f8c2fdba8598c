"""A Chrome trace-event JSON of a run, for https://ui.perfetto.dev (or chrome://tracing).

One step is one millisecond. Process 1 has one thread (track) per physical block with a
complete slice (``ph: "X"``) per ownership interval: a maximal run of steps with the same
owners and ref count, so slices on a track never overlap. Process 2 has an async span
(``b``/``e``) per request lifetime, counters (``C``) of used, free and shared blocks, and
instants (``i``) for copy-on-write, preemption, prefix hits and evictions (on the block's
track when the event names a block).
"""

from __future__ import annotations

import json
import os

from paged_jax.viz.layout import block_views
from paged_jax.viz.log import RunLog
from paged_jax.viz.metrics import step_metrics

STEP_US = 1000  # trace time of one step, microseconds
BLOCKS_PID, RUN_PID = 1, 2
EVENTS_TID = 0  # process 2's thread for instants that name no block
INSTANT_KINDS = ("cow_copy", "preempt", "prefix_hit", "evict")


def _owner_key(v) -> tuple:
    return (v.owners, v.ref_count, v.held if not v.owners else 0)


def _slice_name(v) -> str:
    who = "+".join(v.owners) if v.owners else "held"
    return who + (f" (ref {v.ref_count})" if v.ref_count > 1 else "")


def build_trace(log: RunLog) -> dict:
    events: list[dict] = [
        {"ph": "M", "pid": BLOCKS_PID, "tid": 0, "name": "process_name",
         "args": {"name": f"physical blocks ({log.scenario or 'run'})"}},
        {"ph": "M", "pid": RUN_PID, "tid": 0, "name": "process_name",
         "args": {"name": "requests and counters"}},
        {"ph": "M", "pid": RUN_PID, "tid": EVENTS_TID, "name": "thread_name",
         "args": {"name": "events"}},
    ]
    n = log.config.num_blocks
    for b in range(n):
        tid = b + 1
        events.append({"ph": "M", "pid": BLOCKS_PID, "tid": tid, "name": "thread_name",
                       "args": {"name": f"block {b}"}})
        events.append({"ph": "M", "pid": BLOCKS_PID, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": b}})
    views = [block_views(s) for s in log.snapshots]
    for b in range(n):
        start = None
        for t in range(log.num_steps + 1):
            v = views[t][b] if t < log.num_steps else None
            prev = views[start][b] if start is not None else None
            if prev is not None and (v is None or _owner_key(v) != _owner_key(prev)):
                events.append({
                    "ph": "X", "pid": BLOCKS_PID, "tid": b + 1, "cat": "ownership",
                    "name": _slice_name(prev), "ts": start * STEP_US,
                    "dur": (t - start) * STEP_US,
                    "args": {"owners": list(prev.owners), "ref_count": prev.ref_count,
                             "held": prev.held, "first_step": start, "last_step": t - 1},
                })
                start = None
            if v is not None and v.ref_count > 0 and start is None:
                start = t
    events += _request_spans(log)
    metrics = step_metrics(log)
    for t in range(log.num_steps):
        for key, name in (("used_blocks", "used blocks"), ("free_blocks", "free blocks"),
                          ("shared_blocks", "shared blocks")):
            events.append({"ph": "C", "pid": RUN_PID, "tid": 0, "name": name,
                           "ts": t * STEP_US, "args": {"value": int(metrics[key][t])}})
    for e in log.events:
        if e.kind not in INSTANT_KINDS:
            continue
        on_block = e.block is not None
        events.append({
            "ph": "i", "s": "t", "name": f"{e.kind} {e.request or ''}".strip(),
            "cat": e.kind, "ts": e.step * STEP_US,
            "pid": BLOCKS_PID if on_block else RUN_PID,
            "tid": e.block + 1 if on_block else EVENTS_TID,
            "args": {k: getattr(e, k) for k in ("request", "logical", "block", "ref_count",
                                                 "tokens", "src_block", "detail")},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"scenario": log.scenario, "step_us": STEP_US}}


def _request_spans(log: RunLog) -> list[dict]:
    """One async span per request lifetime: from its first step to the step it is gone."""
    out = []
    open_spans: dict[str, int] = {}
    span_id = 0
    for t in range(log.num_steps + 1):
        live = set(log.snapshots[t].requests()) if t < log.num_steps else set()
        for name in sorted(set(open_spans) - live):
            ended = open_spans.pop(name)
            out.append({"ph": "e", "cat": "request", "name": name, "id": f"0x{ended:x}",
                        "pid": RUN_PID, "tid": 0, "ts": t * STEP_US})
        for name in sorted(live - set(open_spans)):
            span_id += 1
            open_spans[name] = span_id
            out.append({"ph": "b", "cat": "request", "name": name, "id": f"0x{span_id:x}",
                        "pid": RUN_PID, "tid": 0, "ts": t * STEP_US,
                        "args": {"first_step": t}})
    return out


def save_trace(log: RunLog, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(build_trace(log), f, separators=(",", ":"))
