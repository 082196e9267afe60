"""Profiling routes: GET /profile (every configuration's phase summary) and
GET /profile/trace?cycles=N (a Chrome trace of the latest cycles). They read the engine's
profiler on the engine thread; with profiling off they answer 404 with how to turn it on."""

from __future__ import annotations

from fastapi import FastAPI

from specscope.engine.llm import LLM
from specscope.profiler.trace import chrome_trace
from specscope.server.schemas import APIError
from specscope.server.worker import EngineWorker


def add_profile_routes(app: FastAPI, llm: LLM, worker: EngineWorker, served: str) -> None:
    def profiling_off() -> APIError:
        return APIError(404, "profiling is off: start the server with profiling on "
                        "(LLM(..., profile=True) or SPECSCOPE_PROFILE=1)",
                        type="not_found_error", code="profiling_off")

    @app.get("/profile")
    async def profile():
        if llm.timer is None:
            raise profiling_off()
        try:
            summaries = await worker.call(llm.profile_summary)
        except RuntimeError:
            raise profiling_off() from None
        return {"object": "profile", "model": served, "summaries": summaries}

    @app.get("/profile/trace")
    async def profile_trace(cycles: int | None = None):
        if cycles is not None and cycles < 1:
            raise APIError(400, "cycles must be a positive integer", param="cycles")

        def trace() -> dict:
            timer = llm.timer
            if timer is None:
                raise RuntimeError("profiling is off")
            return chrome_trace(timer.all_records(), cycles)

        try:
            return await worker.call(trace)
        except RuntimeError:
            raise profiling_off() from None
