"""The engine worker: one thread owns the engine and runs requests in FIFO order.

Handlers put jobs on a queue; the worker runs them one at a time, pushing each StreamDelta
back to the handler's asyncio.Queue with `loop.call_soon_threadsafe`, so each request gets
exactly what the engine produced for it alone. A job's cancel flag (set when its client
went away) is checked after every delta — one cycle — and the engine's generator closed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from specscope.config import SamplingParams
from specscope.engine.llm import LLM
from specscope.server.metrics import Metrics
from specscope.server.schemas import APIError

log = logging.getLogger("specscope.server")

_END = object()  # pushed after a job's last item


class _Job:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    def push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()


class EngineWorker:
    """One thread that runs every engine call, in arrival order."""

    def __init__(self, llm: LLM, max_queue: int, metrics: Metrics) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0  # generation jobs queued or running
        self._thread = threading.Thread(target=self._loop, name="specscope-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def inflight(self) -> int:
        return self._inflight

    def stop(self) -> None:
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
            if self._inflight > self.max_queue:  # one running + max_queue waiting
                raise APIError(503, f"the server is busy ({self._inflight - 1} requests "
                               f"waiting); retry later", type="server_overloaded",
                               code="queue_full", headers={"Retry-After": "1"})
            self._inflight += 1
            self.metrics.queue_depth = self._inflight

        def run() -> None:
            try:
                if not job.cancel.is_set():
                    self._generate(job, prompt_ids, params)
            finally:
                with self._lock:
                    self._inflight -= 1
                    self.metrics.queue_depth = self._inflight
                job.push(_END)

        self._jobs.put(run)
        return job

    def _generate(self, job: _Job, prompt_ids: list[int], params: SamplingParams) -> None:
        gen = self.llm.stream(None, params, prompt_ids=prompt_ids)
        try:
            for delta in gen:
                job.push(delta)
                if job.cancel.is_set():
                    break  # the client is gone: free the engine at this cycle boundary
        except Exception as e:  # handed to the handler, which maps it to a response
            job.push(e)
        finally:
            gen.close()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread (between requests) and return its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def run() -> None:
            try:
                loop.call_soon_threadsafe(settle, True, fn())
            except Exception as e:
                loop.call_soon_threadsafe(settle, False, e)

        self._jobs.put(run)
        return await fut
