"""The engine worker: one thread owns the engine and runs requests in FIFO order.

Handlers put jobs on a queue; the worker runs them one at a time and hands each
StreamDelta back to the handler's event loop through the job (see `_Job`), so each request
gets exactly what the engine produced for it alone. A job's cancel flag (set when its
client went away) is checked after every delta — one cycle — and the engine's generator
closed.

Shutdown (`begin_shutdown(grace)`): new requests get 503; running and queued ones go on
for `grace` seconds; then the running one is stopped at its next cycle (it gets a
`server_shutting_down` error after what it already streamed) and queued ones get 503.

After each finished request, still on the engine thread and before the next one starts, the
guardrail (guardrail.py) gets its timings and may switch speculation off.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from specscope.config import SamplingParams
from specscope.engine.llm import LLM
from specscope.engine.request import RequestOutput
from specscope.server.guardrail import Guardrail
from specscope.server.metrics import Metrics
from specscope.server.schemas import APIError

log = logging.getLogger("specscope.server")

_END = object()  # pushed after a job's last item


def shutting_down(detail: str) -> APIError:
    return APIError(503, f"the server is shutting down; {detail}", type="server_error",
                    code="server_shutting_down", headers={"Retry-After": "1"})


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():  # a handler cancelled while waiting leaves a cancelled future
        fut.set_result(None)


class _Job:
    """A generation's items, handed from the engine thread to the handler's event loop.

    The engine thread appends to a deque and wakes the loop only when the handler waits:
    one `call_soon_threadsafe` (a self-pipe write and a loop iteration, both under the
    GIL the engine needs) per batch instead of per token. A handler that fell behind
    takes everything produced meanwhile with one `take()`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.cancel = threading.Event()
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None  # set while the handler waits
        self._lock = threading.Lock()

    def push(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                self.cancel.set()

    async def take(self) -> list:
        """Every item pushed since the last take, in order (waits for at least one)."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                waiter = self._waiter = self.loop.create_future()
            await waiter


class EngineWorker:
    """One thread that runs every engine call, in arrival order."""

    def __init__(self, llm: LLM, max_queue: int, metrics: Metrics,
                 guardrail: Guardrail | None = None) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        self.guardrail = guardrail
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0  # generation jobs queued or running
        self._deadline: float | None = None  # monotonic; set by begin_shutdown
        self._thread = threading.Thread(target=self._loop, name="specscope-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def shutting_down(self) -> bool:
        return self._deadline is not None

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new requests; let running and queued ones run for `grace` s more."""
        deadline = time.monotonic() + max(grace, 0.0)
        with self._lock:
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
        if self._inflight:
            log.warning("shutting down: %d request(s) in flight get %.1f s to finish",
                        self._inflight, grace)

    def _expired(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def stop(self) -> None:
        self.begin_shutdown(0.0)
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            task = self._jobs.get()
            if task is None:
                return
            task()

    def submit_generation(self, prompt_ids: list[int], params: SamplingParams) -> _Job:
        """Queue a generation; raises 503 when `max_queue` requests already wait."""
        job = _Job(asyncio.get_running_loop())
        with self._lock:
            if self._deadline is not None:
                raise shutting_down("no new requests are taken")
            if self._inflight > self.max_queue:  # one running + max_queue waiting
                raise APIError(503, f"the server is busy ({self._inflight - 1} requests "
                               f"waiting); retry later", type="server_overloaded",
                               code="queue_full", headers={"Retry-After": "1"})
            self._inflight += 1
            self.metrics.queue_depth = self._inflight

        def run() -> None:
            out = None
            try:
                if self._expired():
                    job.push(shutting_down("the request was not started"))
                elif not job.cancel.is_set():
                    out = self._generate(job, prompt_ids, params)
            finally:
                with self._lock:
                    self._inflight -= 1
                    self.metrics.queue_depth = self._inflight
                job.push(_END)
            if out is not None and self.guardrail is not None:
                try:
                    self.guardrail.after_request(self.llm, out)
                except Exception:  # the guardrail must never stop the engine thread
                    log.exception("guardrail failed")

        self._jobs.put(run)
        return job

    def _generate(self, job: _Job, prompt_ids: list[int],
                  params: SamplingParams) -> RequestOutput | None:
        """Run one generation into `job`; its output when it finished, else None."""
        gen = self.llm.stream(None, params, prompt_ids=prompt_ids)
        try:
            for delta in gen:
                job.push(delta)
                if delta.finished:
                    return delta.output
                if job.cancel.is_set():
                    break  # the client is gone: free the engine at this cycle boundary
                if self._expired():
                    job.push(shutting_down("the request was stopped before it finished"))
                    break
        except Exception as e:  # handed to the handler, which maps it to a response
            job.push(e)
        finally:
            gen.close()
        return None

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread (between requests) and return its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def run() -> None:
            try:
                ok, value = True, fn()
            except Exception as e:
                ok, value = False, e
            # (RuntimeError: the event loop is closed, nobody is waiting any more)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, ok, value)

        self._jobs.put(run)
        return await fut
