"""The client of ``paged-jax bench serve --http``: it replays a workload against a running
server in a process of its own, as ``vllm bench serve`` runs apart from ``vllm serve``.

A client in the server's process would share the server's interpreter lock: every chunk it
parses would hold up the server's event loop and the engine's thread between two dispatches,
which a real client on another machine never does. ``replay`` (the asyncio client) runs
wherever it is called; ``replay_in_subprocess`` runs it in a child Python process and reads
the results back. Times are ``time.perf_counter()`` readings, which on Linux, macOS and
Windows come from one system-wide monotonic clock, so the client's times and the server
engine's compare directly.

Each request is a streamed ``POST /v1/completions`` with the prompt as token ids,
``temperature`` 0, ``max_tokens`` its output length, ``ignore_eos`` and ``return_token_ids``
(vLLM's extensions), sent at its scheduled arrival (httpx, its SSE parsed by httpx-sse). A
token's time is when the client parsed the chunk that carried it (a dispatch's K tokens come
in one chunk, one delivery); a request finishes when its ``[DONE]`` arrives; its arrival is
the scheduled one.

    python -m paged_jax.server.bench_client < job.json > results.json

reads ``{"base_url", "model", "requests": [[prompt ids, output_len, arrival s], ...]}`` and
writes one ``{"timing": {...}, "completion_id": ...}`` per request, in order; a failed
request exits 1 with its message as the last line of standard error.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict

from paged_jax.engine.serve_metrics import Request, Timing

__all__ = ["replay", "replay_in_subprocess"]

# Seconds a stream may wait for its next chunk: the untimed pass compiles the shapes it
# meets inside a step, which on a small CPU takes far longer than any step.
READ_TIMEOUT_S = 900.0


async def _stream_one(client, model: str, i: int, r: Request,
                      start: float) -> tuple[Timing, str]:
    from httpx_sse import aconnect_sse

    await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
    body = {"model": model, "prompt": list(r.prompt), "max_tokens": r.output_len,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True}
    times: list[float] = []
    tokens: list[int] = []
    finish_reason, completion_id = None, None
    async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
        if source.response.status_code != 200:
            text = (await source.response.aread()).decode(errors="replace")
            raise RuntimeError(f"request {i}: HTTP {source.response.status_code}: {text}")
        async for event in source.aiter_sse():
            now = time.perf_counter()
            if event.data == "[DONE]":
                break
            chunk = json.loads(event.data)
            if "error" in chunk:
                raise RuntimeError(f"request {i}: the server failed: {chunk['error']}")
            completion_id = chunk["id"]
            for choice in chunk["choices"]:
                new = choice["token_ids"]
                tokens.extend(new)
                times.extend([now] * len(new))
                finish_reason = choice["finish_reason"] or finish_reason
    finish = time.perf_counter()
    if len(tokens) != r.output_len or finish_reason != "length":
        raise RuntimeError(f"request {i}: expected {r.output_len} tokens ending in 'length', "
                           f"got {len(tokens)} ending in {finish_reason!r}.")
    return Timing(start + r.arrival, times, finish, len(r.prompt), tokens), completion_id


async def replay(base_url: str, requests: list[Request],
                 model: str) -> list[tuple[Timing, str]]:
    """Stream every request from ``base_url`` at its arrival offset (seconds after the
    replay starts), all in flight at once; per request, in the order of ``requests``, its
    ``Timing`` and the completion id the server gave it."""
    import httpx

    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits,
                                 trust_env=False) as client:  # loopback: no proxy
        # One untimed request first, as vLLM's benchmark sends a test prompt: the client's
        # and the server's first-request costs (lazy imports, the first connection) would
        # otherwise delay the first arrival, and shift every later step boundary against
        # the arrival schedule.
        (await client.get("/v1/models")).raise_for_status()
        start = time.perf_counter()
        return list(await asyncio.gather(*(_stream_one(client, model, i, r, start)
                                           for i, r in enumerate(requests))))


def replay_in_subprocess(base_url: str, requests: list[Request],
                         model: str) -> list[tuple[Timing, str]]:
    """``replay``, run in a child Python process (this module's ``__main__``); raises
    ``RuntimeError`` with the child's message if a request failed there."""
    job = json.dumps({"base_url": base_url, "model": model,
                      "requests": [[list(r.prompt), r.output_len, r.arrival] for r in requests]})
    proc = subprocess.run([sys.executable, "-m", __name__], input=job, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"the benchmark client failed: {lines[-1]}")
    return [(Timing(**x["timing"]), x["completion_id"]) for x in json.loads(proc.stdout)]


def main() -> int:
    job = json.load(sys.stdin)
    requests = [Request(tuple(p), n, t) for p, n, t in job["requests"]]
    try:
        served = asyncio.run(replay(job["base_url"], requests, job["model"]))
    except Exception as e:  # the parent raises it again, by its message
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    json.dump([{"timing": asdict(t), "completion_id": cid} for t, cid in served], sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
