"""The engine worker: one thread owns the engine and feeds its scheduler.

Handlers put tasks on a queue; between engine steps the worker runs every task queued (a
new request joins the engine's waiting queue; an admin call runs), then steps the engine,
which batches every running request, and hands each request's StreamDelta back to its
handler's event loop through its job (see `_Job`). Streams interleave step by step. A
job's cancel flag (set when its client went away) is checked after every step: the request
is aborted and its KV blocks are free for the next step.

Shutdown (`begin_shutdown(grace)`): new requests get 503; running and queued ones go on
for `grace` seconds; then each is stopped at the next step (it gets a
`server_shutting_down` error after what it already streamed).

After each step, still on the engine thread, the guardrail (guardrail.py) gets its timings
and may switch speculation off for that step's batch-size bucket.
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
from specscope.server.guardrail import Guardrail
from specscope.server.metrics import Metrics
from specscope.server.schemas import APIError
from specscope.server.stats_log import StatsLog

log = logging.getLogger("specscope.server")

_END = object()  # pushed after a job's last item
_NOTHING = object()  # the task queue is empty


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
                 guardrail: Guardrail | None = None, stats_log: StatsLog | None = None
                 ) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        self.guardrail = guardrail
        self.stats_log = stats_log
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0  # generation jobs queued or running
        self._running: dict[str, _Job] = {}  # request id -> its job (engine thread only)
        self._last_out: dict[str, float] = {}  # request id -> when it last produced tokens
        self.peak_running = 0  # the most requests in the engine at once
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
            # Block for work only while the engine is idle; otherwise take what is queued
            # and step.
            busy = bool(self._running)
            try:
                task = self._jobs.get(block=not busy)
            except queue.Empty:
                task = _NOTHING
            while task is not _NOTHING:
                if task is None:
                    return
                task()
                try:
                    task = self._jobs.get_nowait()
                except queue.Empty:
                    task = _NOTHING
            if self._running:
                self._step()

    def submit_generation(self, prompt_ids: list[int], params: SamplingParams,
                          grammar: Any = None) -> _Job:
        """Queue a generation; raises 503 when `max_queue` requests already wait. grammar:
        its structured-output state, compiled off the engine thread (engine/grammar.py)."""
        job = _Job(asyncio.get_running_loop())
        with self._lock:
            if self._deadline is not None:
                raise shutting_down("no new requests are taken")
            # max_num_seqs run in the engine's batch, max_queue more may wait
            room = self.max_queue + self.llm.engine_config.max_num_seqs
            if self._inflight >= room:
                raise APIError(503, f"the server is busy ({self._inflight} requests running "
                               f"or waiting); retry later", type="server_overloaded",
                               code="queue_full", headers={"Retry-After": "1"})
            self._inflight += 1
            self.metrics.set_queue_depth(self._inflight)

        def start() -> None:
            if self._expired():
                self._close(job, shutting_down("the request was not started"))
            elif job.cancel.is_set():
                self._close(job)
            else:
                try:
                    rid = self.llm.add_request(prompt_ids, params, grammar=grammar)
                except Exception as e:  # handed to the handler, which maps it to a response
                    self._close(job, e)
                    return
                self._running[rid] = job
                self.peak_running = max(self.peak_running, len(self._running))

        self._jobs.put(start)
        return job

    def _close(self, job: _Job, last: Any = None) -> None:
        if last is not None:
            job.push(last)
        job.push(_END)
        with self._lock:
            self._inflight -= 1
            self.metrics.set_queue_depth(self._inflight)

    def _step(self) -> None:
        """One engine step for every running request; deltas to their jobs; finished,
        cancelled and (past the shutdown grace) stopped requests closed."""
        try:
            deltas = self.llm.step()
        except Exception as e:  # the step failed for the whole batch: end every request
            log.exception("engine step failed")
            for rid, job in list(self._running.items()):
                self.llm.abort_request(rid)
                del self._running[rid]
                self._last_out.pop(rid, None)
                self._close(job, e)
            return
        self._after_step()
        now = time.perf_counter()
        for d in deltas:
            job = self._running.get(d.request_id)
            if job is None:
                continue
            if d.token_ids:  # inter-token latency: the gap since this request's last output
                last = self._last_out.get(d.request_id)
                if last is not None:
                    self.metrics.inter_token(now - last)
                self._last_out[d.request_id] = now
            if not d.finished:
                job.push(d)
                continue
            del self._running[d.request_id]
            self._last_out.pop(d.request_id, None)
            self._close(job, d)
        expired = self._expired()
        for rid, job in list(self._running.items()):
            if job.cancel.is_set() or expired:
                self.llm.abort_request(rid)  # its blocks are free for the next step
                del self._running[rid]
                self._last_out.pop(rid, None)
                self._close(job, shutting_down("the request was stopped before it "
                                               "finished") if expired else None)

    def _after_step(self) -> None:
        step = self.llm.last_step
        if step is None:
            return
        self.metrics.step(step)
        if self.stats_log is not None:
            self.stats_log.record(step)
        if self.guardrail is None:
            return
        try:
            self.guardrail.after_step(self.llm, step)
        except Exception:  # the guardrail must never stop the engine thread
            log.exception("guardrail failed")

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
