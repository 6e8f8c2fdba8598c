"""``AsyncEngine``: one ``LLMEngine`` stepped by one background task, fed by many coroutines.

Every change to the engine happens in that task, between two steps: requests added and
aborted, and any ``call(fn)`` (statistics, the block page's snapshot). ``engine.step()`` itself
runs in a worker thread (``asyncio.to_thread``), so the event loop keeps serving HTTP while a
dispatch runs; the task waits for it before it touches the engine again. A request added
while a step runs joins the batch at the next one: continuous batching, whatever the number
of clients.

    aengine = AsyncEngine(LLM().engine)
    await aengine.start()
    outputs = asyncio.Queue()
    await aengine.add("req-1", "Hello", SamplingParams(max_tokens=8), outputs)
    while not (out := await outputs.get()).finished: ...
    await aengine.stop()

Each step's ``RequestOutput`` for a request goes to the queue given with it (several requests
may share one: an HTTP request with several prompts). A failed step puts the exception in
the queue of every request it held, aborts those requests, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.params import RequestOutput, SamplingParams

__all__ = ["AsyncEngine"]

log = logging.getLogger("paged_jax.server")


class AsyncEngine:
    """Owns ``engine`` from ``start`` to ``stop``; nothing else may touch it meanwhile.

    Args:
      engine: the ``LLMEngine`` to step.
      after_step: called with the step's outputs (in the loop, after each step); the server
        records its latency histograms there.
      after_change: called after commands changed the engine outside a step (aborts); the
        block page records them there.
    """

    def __init__(self, engine: LLMEngine, *,
                 after_step: Callable[[list[RequestOutput]], None] | None = None,
                 after_change: Callable[[], None] | None = None):
        self.engine = engine
        self._after_step = after_step
        self._after_change = after_change
        self._queues: dict[str, asyncio.Queue] = {}
        self._commands: list[tuple] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop ``start`` ran on
        self.error: BaseException | None = None  # what stopped the loop, if anything did

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.running:
            raise RuntimeError("AsyncEngine is already running.")
        self._wake = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop(), name="paged_jax engine loop")

    async def stop(self) -> None:
        """Abort what is left and end the loop."""
        if self._task is None:
            return
        self._commands.append(("stop",))
        self._wake.set()
        await self._task
        self._task = None

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  outputs: asyncio.Queue) -> None:
        """Queue a request; its outputs go to ``outputs``. Raises what
        ``LLMEngine.add_request`` raises (``ValueError`` naming the problem), with the engine
        unchanged."""
        done = asyncio.get_running_loop().create_future()
        # Its arrival is now, not when the loop gets to it: TTFT counts the wait for a step.
        self._send(("add", request_id, prompt, params, time.perf_counter(), outputs, done))
        await done

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary; its blocks go back to the pool (or stay
        in the prefix cache) then. Unknown or finished ids are ignored."""
        if request_id in self._queues:
            self._send(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)``, run between two steps; its result (or exception)."""
        done = asyncio.get_running_loop().create_future()
        self._send(("call", fn, done))
        return await done

    def call_from_thread(self, fn: Callable[[LLMEngine], Any], timeout: float = 60.0) -> Any:
        """``call(fn)`` from another thread (a test, a debugger) while the loop runs."""
        return asyncio.run_coroutine_threadsafe(self.call(fn), self.loop).result(timeout)

    def _send(self, command: tuple) -> None:
        if not self.running:
            raise RuntimeError("The engine loop is not running"
                               + (f": it stopped on {self.error!r}." if self.error else "."))
        self._commands.append(command)
        self._wake.set()

    # -- the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            await self._serve()
        except BaseException as e:  # the loop itself broke: every waiting request hears it
            self.error = e
            for queue in self._queues.values():
                queue.put_nowait(RuntimeError(f"The engine loop stopped: {e!r}"))
            self._queues.clear()
            for command in self._commands:
                done = command[-1]
                if isinstance(done, asyncio.Future) and not done.done():
                    done.set_exception(RuntimeError(f"The engine loop stopped: {e!r}"))
            self._commands.clear()
            raise

    async def _serve(self) -> None:
        engine = self.engine
        while True:
            if not self._apply():
                break
            if not engine.has_unfinished_requests():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            try:
                outputs = await asyncio.to_thread(engine.step)
            except Exception as e:  # a bug, or the device: fail what ran, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
            if self._after_step is not None:
                self._after_step(outputs)

    def _apply(self) -> bool:
        """Run the queued commands in order; False once told to stop."""
        commands, self._commands = self._commands, []
        changed = False
        for command in commands:
            kind = command[0]
            if kind == "add":
                _, rid, prompt, params, arrival, queue, done = command
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival)
                except Exception as e:
                    if not done.done():
                        done.set_exception(e)
                    continue
                self._queues[rid] = queue
                if not done.done():
                    done.set_result(None)
            elif kind == "abort":
                changed |= self._abort(command[1])
            elif kind == "call":
                _, fn, done = command
                try:
                    result = fn(self.engine)
                except Exception as e:
                    if not done.done():
                        done.set_exception(e)
                else:
                    if not done.done():
                        done.set_result(result)
            else:  # stop
                for rid in list(self._queues):
                    changed |= self._abort(rid)
                if changed and self._after_change is not None:
                    self._after_change()
                return False
        if changed and self._after_change is not None:
            self._after_change()
        return True

    def _abort(self, request_id: str) -> bool:
        self._queues.pop(request_id, None)
        if request_id not in self.engine.requests:
            return False
        self.engine.abort_request(request_id)
        return True

    def _fail_all(self, error: Exception) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(error)
            self._abort(rid)
        if self._after_change is not None:
            self._after_change()
