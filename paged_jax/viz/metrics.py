"""Per-step numbers behind the curves, the HTML page and the Perfetto counters."""

from __future__ import annotations

import numpy as np

from paged_jax.viz.layout import block_views
from paged_jax.viz.log import RunLog

CURVES = {
    "block_util": "blocks in use / pool",
    "token_util": "tokens stored / pool capacity",
    "saved_blocks": "blocks saved by sharing (logical - physical)",
    "free_blocks": "free blocks",
    "used_blocks": "blocks in use",
    "shared_blocks": "blocks with ref count > 1",
    "cow_copies": "copy-on-write copies (cumulative)",
    "preemptions": "preemptions (cumulative)",
    "prefix_hits": "prefix hits (cumulative)",
    "evictions": "evicted blocks (cumulative)",
}


def step_metrics(log: RunLog) -> dict[str, np.ndarray]:
    """Each ``CURVES`` key -> [num_steps] array.

    Utilization is over the whole pool: ``block_util - token_util`` is the internal
    fragmentation of partly filled blocks. ``saved_blocks`` counts table entries minus the
    distinct blocks they point at. Event counts are cumulative; preemptions and prefix hits
    count requests, copies and evictions count blocks.
    """
    cfg = log.config
    out = {k: np.zeros(log.num_steps) for k in CURVES}
    per_step = {k: np.zeros(log.num_steps) for k in ("cow_copies", "preemptions",
                                                      "prefix_hits", "evictions")}
    kinds = {"cow_copy": "cow_copies", "preempt": "preemptions", "prefix_hit": "prefix_hits",
             "evict": "evictions"}
    seen = set()
    for e in log.events:
        if e.kind not in kinds:
            continue
        if e.kind in ("preempt", "prefix_hit"):
            if (e.step, e.kind, e.request) in seen:
                continue
            seen.add((e.step, e.kind, e.request))
        per_step[kinds[e.kind]][e.step] += 1
    for t, snap in enumerate(log.snapshots):
        views = block_views(snap)
        used = [v for v in views if v.ref_count > 0]
        logical = sum(len(r.table) for r in snap.requests().values())
        physical = len({b for v in views for b in [v.block] if v.holders})
        out["used_blocks"][t] = len(used)
        out["free_blocks"][t] = cfg.num_blocks - len(used)
        out["shared_blocks"][t] = sum(v.ref_count > 1 for v in views)
        out["block_util"][t] = len(used) / cfg.num_blocks
        out["token_util"][t] = sum(v.tokens for v in used) / (cfg.num_blocks * cfg.block_size)
        out["saved_blocks"][t] = logical - physical
    for k, v in per_step.items():
        out[k] = np.cumsum(v)
    return out
