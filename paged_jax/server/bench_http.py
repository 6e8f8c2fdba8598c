"""``paged-jax bench serve --http``: the serving benchmark's workload through the HTTP server.

``HttpServer`` serves a list of ``Request``s the way ``PagedServer`` does, but through
``paged-jax serve``'s app (``build_app``: the ``AsyncEngine`` loop, the Prometheus metrics
and, by default, the ``/blocks`` recorder) run by uvicorn in a background thread on
127.0.0.1, and an asyncio client that replays the arrivals, as ``vllm bench serve`` does:

* each request is a streamed ``POST /v1/completions`` with the prompt as token ids,
  ``temperature`` 0, ``max_tokens`` its output length, ``ignore_eos`` and
  ``return_token_ids`` (vLLM's extensions), sent at its scheduled arrival (httpx, its SSE
  parsed by httpx-sse);
* a token's time is when the client parsed the chunk that carried it (a dispatch's K tokens
  come in one chunk, one delivery); a request finishes when its ``[DONE]`` arrives; its
  arrival is the scheduled one, as ``PagedServer`` counts it.

After each pass ``engine_side`` holds the same requests as the server's engine timed them,
which is how the in-process benchmark times its own: the difference between the two is
what HTTP adds (the admission, the event loop, SSE, the client's parsing) within one run,
free of the run-to-run spread of the machine's speed.

The engines are built by a ``PagedServer`` of this server's own over the same compiled
``Steps``: an engine and its pool per batch limit, as the in-process benchmark's, but not the
same objects, because the app subscribes the ``/blocks`` recorder to its engine for good and
that would then weigh on the in-process runs too. The engines have no tokenizer, as the
in-process ones: the difference measured is the server's (its loop, SSE, the client), not
detokenization. Each configuration is served once untimed the first time (compiling what
it needs), then timed; uvicorn is started before each pass and shut down after it, and the
prefix cache is emptied in between, while nothing else holds the engine.
"""

from __future__ import annotations

import asyncio
import json
import time

from paged_jax.engine.bench_serve import PagedServer
from paged_jax.engine.serve_metrics import Request, Timing
from paged_jax.server.thread import running

__all__ = ["HttpServer", "replay"]

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
        start = time.perf_counter()
        return list(await asyncio.gather(*(_stream_one(client, model, i, r, start)
                                           for i, r in enumerate(requests))))


class HttpServer:
    """``paged-jax serve``'s app over paged_jax's engine, one engine and app per batch limit.

    Args:
      model, args, max_len, steps: as ``PagedServer``'s (``steps``: the compiled ``Steps``
        to share with the in-process benchmark).
      options: ``ServerConfig`` fields other than the model name (``blocks_history``); what
        is left out keeps the default ``paged-jax serve`` runs with.
      model_name: the model id the app serves and the client names.
    """

    def __init__(self, model, args, max_len: int, steps=None, options: dict | None = None,
                 model_name: str = "paged_jax"):
        from paged_jax.server.app import ServerConfig

        # Checked here, before anything compiles: ServerConfig names a bad field.
        self.config = ServerConfig(model_name=model_name, **(options or {}))
        self.paged = PagedServer(model, args, max_len, steps=steps)
        self.model_name = model_name
        self.apps = {}
        # The engine's own record of the last pass: its requests' Timings as the in-process
        # benchmark times them (arrival when the server handed the request to the engine
        # loop, a token when the step that made it returned), in the order of the requests.
        self.engine_side: list[Timing] = []

    def app(self, max_num_seqs: int):
        """The app over the engine of this batch limit (built once: its ``/blocks`` recorder
        stays subscribed to the engine)."""
        from paged_jax.server.app import build_app

        if max_num_seqs not in self.apps:
            self.apps[max_num_seqs] = build_app(self.paged.engine(max_num_seqs), self.config)
        return self.apps[max_num_seqs]

    def serve(self, requests: list[Request], max_num_seqs: int) -> list[Timing]:
        """Serve ``requests`` timed, after an untimed pass (compiling what they need) the
        first time they meet this batch limit."""
        self.paged.warm_once(requests, max_num_seqs, lambda: self._serve(requests, max_num_seqs))
        return self._serve(requests, max_num_seqs)

    def _serve(self, requests: list[Request], max_num_seqs: int) -> list[Timing]:
        app = self.app(max_num_seqs)
        # uvicorn is down: nothing else holds the engine. No pass starts on blocks an
        # earlier pass cached.
        self.paged.engine(max_num_seqs).reset_prefix_cache()
        with running(app) as url:
            served = asyncio.run(replay(url, requests, self.model_name))
        # The server names a completion "cmpl-<base>" and its one engine request "<base>-0".
        records = dict(self.paged.engine(max_num_seqs).finished_metrics)
        self.engine_side = []
        for (t, cid), r in zip(served, requests, strict=True):
            m = records[cid.removeprefix("cmpl-") + "-0"]
            self.engine_side.append(Timing(m.arrival_time, list(m.token_times),
                                           m.finished_time, len(r.prompt), t.tokens))
        return [t for t, _ in served]
