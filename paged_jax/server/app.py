"""The OpenAI-compatible HTTP API over one ``LLMEngine`` (FastAPI; streams through
sse-starlette).

==========================  ==========================================================
``POST /v1/completions``    text or token-id prompts; ``stream`` true or false
``POST /v1/chat/completions``  messages through the model's chat template
``GET /v1/models``          the one model served
``GET /health``             200 while the engine loop runs (needs no API key)
``GET /metrics``            Prometheus text format (``server.metrics``)
``GET /blocks``             the live block-layout page (``server.blocks``)
==========================  ==========================================================

Every request joins the one running batch (``AsyncEngine``). A streamed response sends a
chunk per engine step that gave its request new tokens (a dispatch's K tokens in one chunk),
then ``data: [DONE]``. Text is held back while it may still change: a trailing incomplete
UTF-8 character, and the last ``len(longest stop string) - 1`` characters, which a stop string
completed later would remove. The streamed pieces therefore join to exactly the non-streamed
text. A client that disconnects aborts its requests at the next step boundary, streamed or
not, and their blocks go back to the pool (or stay in the prefix cache).

Errors answer in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad field (named, with its value), an unknown model, an empty prompt or one that can never
fit; 401 without the API key (when one is set); 413 for a body over ``max_request_bytes``;
500 if the engine failed on the request. None of them touches other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import RequestOutput
from paged_jax.server.async_engine import AsyncEngine
from paged_jax.server.blocks import LiveBlocks
from paged_jax.server.metrics import ServerMetrics
from paged_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_error,
)

__all__ = ["ServerConfig", "build_app"]

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is there


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Args:
      model_name: the id ``/v1/models`` lists and requests must name (or leave out).
      api_key: when set, every endpoint but ``/health`` wants ``Authorization: Bearer KEY``.
      max_request_bytes: the largest request body accepted (413 above it).
      blocks_history: steps the ``/blocks`` page keeps (0: no page, nothing recorded).
      blocks_refresh_s: how often the page reloads itself while it shows the newest step.
    """

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    blocks_history: int = 256
    blocks_refresh_s: float = 2.0

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string.")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None or a non-empty string.")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive int. Got "
                             f"{self.max_request_bytes!r}.")
        if not isinstance(self.blocks_history, int) or self.blocks_history < 0:
            raise ValueError(f"blocks_history must be an int >= 0. Got "
                             f"{self.blocks_history!r}.")


def _error(status: int, message: str, param: str | None = None, type_: str | None = None,
           code: str | int | None = None) -> JSONResponse:
    type_ = type_ or ("invalid_request_error" if status < 500 else "internal_error")
    return JSONResponse(error_body(message, type_, param, code if code is not None else status),
                        status_code=status)


class _Guard:
    """ASGI middleware: the API key (constant-time compare) and the body size limit, checked
    before a route runs. A body without a Content-Length (chunked) is read here, up to the
    limit, before the route sees it."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        key = self.config.api_key
        if key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return await _error(401, "Incorrect or missing API key: send "
                                    "'Authorization: Bearer <key>'.",
                                    code="invalid_api_key")(scope, receive, send)
        limit = self.config.max_request_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._too_large(int(length), scope, receive, send)
        if length is not None:
            return await self.app(scope, receive, send)
        # A chunked body: read it here, up to the limit, and hand it on whole.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await self._too_large(len(body), scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope, receive, send):
        await _error(413, f"The request body ({size} bytes or more) exceeds the limit of "
                     f"{self.config.max_request_bytes} bytes.",
                     code="request_too_large")(scope, receive, send)


@dataclasses.dataclass
class _Choice:
    """What one completion has sent so far."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None


def _held_back(text: str, finished: bool, hold: int) -> str:
    """The part of ``text`` that is final: all of it once finished, otherwise without a
    trailing incomplete character and the last ``hold`` characters."""
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[: max(len(text) - hold, 0)]


class _Server:
    """The routes' shared state: the engine loop, the metrics, the page."""

    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics()
        self.blocks = (LiveBlocks(engine, config.blocks_history, config.blocks_refresh_s)
                       if config.blocks_history else None)
        self.aengine = AsyncEngine(engine, after_step=self.metrics.observe,
                                   after_change=self.blocks.flush if self.blocks else None)
        self.created = int(time.time())

    # -- requests -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> JSONResponse | None:
        if model is not None and model != self.config.model_name:
            return _error(400, f"The model {model!r} is not served here; this server serves "
                          f"{self.config.model_name!r}.", param="model", code="model_not_found")
        return None

    async def submit(self, prompts, params, queue) -> list[str] | JSONResponse:
        """Add every prompt as a request feeding ``queue``; on a refusal, abort the ones
        added and answer 400."""
        base = uuid.uuid4().hex
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{base}-{i}"
                await self.aengine.add(rid, prompt, params, queue)
                ids.append(rid)
        except (ValueError, TypeError) as e:
            for rid in ids:
                self.aengine.abort(rid)
            return _error(400, str(e), param="prompt")
        return ids

    async def collect(self, request: Request, ids: list[str], queue) -> dict[str, RequestOutput]:
        """Wait for every request's final output; abort them all if the client leaves."""
        final: dict[str, RequestOutput] = {}
        checked = time.monotonic()
        try:
            while len(final) < len(ids):
                try:
                    out = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    out = None
                # Checked on a clock, not only when no output comes: a fast engine may
                # deliver more often than the poll period for the request's whole life.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                if out is None:
                    continue
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    final[out.request_id] = out
        finally:
            for rid in ids:
                if rid not in final:
                    self.aengine.abort(rid)
        return final

    async def stream(self, ids: list[str], queue, n: int, hold: int, make_chunk, usage_chunk):
        """SSE events: a chunk per output that moved a choice forward, then usage (when
        asked), then ``[DONE]``. Aborts what is unfinished if the stream is cancelled."""
        index = {rid: i for i, rid in enumerate(ids)}
        choices = {(i, j): _Choice() for i in range(len(ids)) for j in range(n)}
        finished: dict[str, RequestOutput] = {}
        try:
            for choice in make_chunk.first(len(ids) * n):
                yield {"data": json.dumps(choice)}
            while len(finished) < len(ids):
                out = await queue.get()
                if isinstance(out, BaseException):
                    yield {"data": json.dumps(error_body(f"The engine failed: {out}",
                                                         "internal_error", None, 500))}
                    return
                i = index[out.request_id]
                for c in out.outputs:
                    sent = choices[i, c.index]
                    done = c.finish_reason is not None
                    text = _held_back(c.text, done, hold)
                    delta, new = text[len(sent.text):], c.token_ids[sent.tokens:]
                    if not (delta or new or done) or sent.finish_reason is not None:
                        continue
                    sent.text, sent.tokens = text, len(c.token_ids)
                    sent.finish_reason = c.finish_reason
                    yield {"data": json.dumps(make_chunk(i * n + c.index, delta, new,
                                                         c.finish_reason))}
                if out.finished:
                    finished[out.request_id] = out
            if usage_chunk is not None:
                yield {"data": json.dumps(usage_chunk(_usage(finished.values())))}
            yield {"data": "[DONE]"}
        finally:
            for rid in ids:
                if rid not in finished:
                    self.aengine.abort(rid)


def _usage(outputs) -> dict:
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Chunks:
    """Makes one endpoint's stream chunks (``self(...)``) and its opening chunks."""

    def __init__(self, kind: str, rid: str, model: str, token_ids: bool):
        self.kind, self.rid, self.model, self.token_ids = kind, rid, model, token_ids
        self.created = int(time.time())

    def _wrap(self, choices: list[dict], **extra) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def first(self, count: int) -> list[dict]:
        """Chat streams open each choice with its role, as OpenAI's do."""
        if self.kind == "completion":
            return []
        return [self._wrap([{"index": k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]) for k in range(count)]

    def __call__(self, k: int, delta: str, new: list[int], finish: str | None) -> dict:
        if self.kind == "completion":
            choice = {"index": k, "text": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": k, "delta": {"content": delta} if delta else {},
                      "logprobs": None, "finish_reason": finish}
        if self.token_ids:
            choice["token_ids"] = list(new)
        return self._wrap([choice])

    def usage(self, usage: dict) -> dict:
        return self._wrap([], usage=usage)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app serving ``engine``. Its lifespan starts and stops the engine loop; the app's
    ``state.server.aengine`` is the loop (``call`` runs code on the engine between steps)."""
    server = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.aengine.start()
        try:
            yield
        finally:
            await server.aengine.stop()

    app = FastAPI(title="paged_jax", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Guard, config=config)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        return JSONResponse(validation_error(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if not server.aengine.running:
            return _error(503, f"The engine loop is not running: {server.aengine.error!r}")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": server.created,
            "owned_by": "paged_jax", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        stats = await server.aengine.call(lambda e: e.stats())
        return Response(server.metrics.exposition(stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/blocks")
    async def blocks():
        if server.blocks is None:
            return _error(404, "The block page is off (the server runs with "
                          "--blocks-history 0).")
        log = await server.aengine.call(lambda e: server.blocks.window())
        return HTMLResponse(await asyncio.to_thread(server.blocks.render, log))

    async def respond(request: Request, body, kind: str, prompts, max_tokens: int):
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as e:
            return _error(400, str(e))
        queue: asyncio.Queue = asyncio.Queue()
        ids = await server.submit(prompts, params, queue)
        if isinstance(ids, JSONResponse):
            return ids
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{ids[0].split('-')[0]}"
        hold = max((len(s) for s in params.stop), default=1) - 1
        if body.stream:
            chunks = _Chunks(kind, rid, config.model_name, body.return_token_ids)
            return EventSourceResponse(server.stream(
                ids, queue, params.n, hold, chunks,
                chunks.usage if body.include_usage else None), ping=15)
        try:
            final = await server.collect(request, ids, queue)
        except asyncio.CancelledError:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as e:
            return _error(500, f"The engine failed on this request: {e}")
        choices = []
        for i, req_id in enumerate(ids):
            for c in final[req_id].outputs:
                if kind == "completion":
                    choice = {"index": i * params.n + c.index, "text": c.text,
                              "logprobs": None, "finish_reason": c.finish_reason}
                else:
                    choice = {"index": i * params.n + c.index, "logprobs": None,
                              "message": {"role": "assistant", "content": c.text},
                              "finish_reason": c.finish_reason}
                if body.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        return {"id": rid, "object": "text_completion" if kind == "completion"
                else "chat.completion", "created": int(time.time()),
                "model": config.model_name, "choices": choices,
                "usage": _usage(final[r] for r in ids)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        bad = server.check_model(body.model)
        if bad is not None:
            return bad
        return await respond(request, body, "completion", body.prompts(), body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        bad = server.check_model(body.model)
        if bad is not None:
            return bad
        tok = engine.tokenizer
        if tok is None or tok.chat_template is None:
            return _error(400, "This model has no chat template; use /v1/completions.",
                          param="messages")
        try:
            text = tok.apply_chat_template([m.as_dict() for m in body.messages])
        except Exception as e:  # the template's own raise_exception, or a bad role
            return _error(400, f"The chat template refused the messages: {e}",
                          param="messages")
        ids = tok.encode(text, add_special_tokens=False)
        room = min(engine.cache_config.max_tokens_per_seq, engine.max_model_len) - len(ids)
        limit = body.token_limit if body.token_limit is not None else max(room, 1)
        return await respond(request, body, "chat", [ids], limit)

    return app
