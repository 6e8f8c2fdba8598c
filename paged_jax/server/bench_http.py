"""``paged-jax bench serve --http``: the serving benchmark's workload through the HTTP server.

``HttpServer`` serves a list of ``Request``s the way ``PagedServer`` does, but through
``paged-jax serve``'s app (``build_app``: the ``AsyncEngine`` loop, the Prometheus metrics
and, by default, the ``/blocks`` recorder) run by uvicorn in a background thread on
127.0.0.1, and the client of ``bench_client``, which replays the arrivals from a process of
its own, as ``vllm bench serve`` does: streamed requests sent at their scheduled arrivals,
a token timed when its chunk reached the client, the arrival the scheduled one, as
``PagedServer`` counts it.

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

from paged_jax.engine.bench_serve import PagedServer
from paged_jax.engine.serve_metrics import Request, Timing
from paged_jax.server.bench_client import replay_in_subprocess
from paged_jax.server.thread import running

__all__ = ["HttpServer"]


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

    def release(self, max_num_seqs: int) -> None:
        """Drop the app and engine of this batch limit (``PagedServer.release``)."""
        self.apps.pop(max_num_seqs, None)
        self.paged.release(max_num_seqs)

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
            served = replay_in_subprocess(url, requests, self.model_name)
        # The server names a completion "cmpl-<base>" and its one engine request "<base>-0".
        records = dict(self.paged.engine(max_num_seqs).finished_metrics)
        self.engine_side = []
        for (t, cid), r in zip(served, requests, strict=True):
            m = records[cid.removeprefix("cmpl-") + "-0"]
            self.engine_side.append(Timing(m.arrival_time, list(m.token_times),
                                           m.finished_time, len(r.prompt), t.tokens))
        return [t for t, _ in served]
