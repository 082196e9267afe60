"""The OpenAI-compatible FastAPI app: middleware, error bodies and the routes.

One worker thread owns the engine (worker.py): handlers queue jobs, the worker adds them to
the engine's scheduler between steps and steps every running request at once, handing each
StreamDelta back to its handler's event loop. A handler whose client went away sets its
job's cancel flag; the worker aborts the request after the step, freeing its KV blocks. At
most `max_num_seqs` requests run and `max_queue` more wait; more get 503 with Retry-After.

Before a route sees a request, the RequestGuard (guard.py) has checked its Host, API key and
content type and read its whole body within the size and time limits. The completion routes
(completion.py) then parse, validate, render and tokenize on a worker thread, so no
request's size can stall the event loop that every stream and /health share.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specscope.config import ServerConfig, SpecConfig
from specscope.engine.llm import LLM
from specscope.server.admin import add_admin_routes
from specscope.server.completion import CompletionRunner, add_completion_routes
from specscope.server.guard import RequestGuard
from specscope.server.guardrail import Guardrail
from specscope.server.limits import PromptLimits
from specscope.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specscope.server.metrics import CountRequests, Metrics
from specscope.server.profile_routes import add_profile_routes
from specscope.server.schemas import (
    APIError,
    validation_error,
)
from specscope.server.stats_log import StatsLog
from specscope.server.tokenizer_routes import add_tokenizer_routes
from specscope.server.worker import EngineWorker

log = logging.getLogger("specscope.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


# -- helpers ------------------------------------------------------------------------------


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _get_and_head(app: FastAPI, path: str) -> Callable:
    """Register a GET route that also answers HEAD (probes and load balancers send it)."""
    def register(fn: Callable) -> Callable:
        app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
        return app.get(path)(fn)
    return register


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error body."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(list(e.errors())))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, e: json.JSONDecodeError) -> JSONResponse:
        return _error_response(APIError(400, f"the body is not valid JSON: {e}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=e)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}",
                                        type="server_error"))


# -- the app ------------------------------------------------------------------------------


def create_app(llm: LLM, config: ServerConfig | None = None, *,
               guardrail: Guardrail | None = None,
               draft_spec: SpecConfig | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `llm` (see the module docstring for concurrency).

    config: access rules and request limits (config.ServerConfig; its defaults are the
    CLI's). guardrail: compares speculative goodput with plain decoding after each request
    (server/guardrail.py). draft_spec: what POST /admin/spec {"enabled": true} switches to
    when `llm` starts with speculation off (e.g. --auto-tune chose plain decoding).
    """
    cfg = config or ServerConfig()
    names = cfg.model_names(llm.model_name)
    served = names[0]
    created = int(time.time())  # /v1/models' `created`: when this server started
    metrics = Metrics(served)
    metrics.engine_state = lambda: llm.engine.state()
    metrics.guardrail_state = guardrail.state if guardrail is not None else None
    stats = (StatsLog(lambda: llm.engine.state(), cfg.log_stats_interval)
             if cfg.log_stats_interval > 0 else None)
    worker = EngineWorker(llm, cfg.max_queue, metrics, guardrail, stats)
    limits = PromptLimits(llm, cfg)
    runner = CompletionRunner(llm, worker, metrics, limits, cfg.tool_call_parser
                              if cfg.enable_auto_tool_choice else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.stop()

    docs = {} if cfg.enable_docs else {"docs_url": None, "redoc_url": None,
                                       "openapi_url": None}
    app = FastAPI(title="specscope", lifespan=lifespan, **docs)
    app.state.llm, app.state.worker, app.state.metrics = llm, worker, metrics
    app.state.guardrail, app.state.config = guardrail, cfg

    # The guard runs inside the counter, so the requests it refuses are counted too.
    app.add_middleware(RequestGuard, config=cfg)
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS)

    _add_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (*names, llm.model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{' or '.join(map(repr, names))}", type="invalid_request_error",
                           param="model", code="model_not_found")

    add_completion_routes(app, runner, check_model, served)

    @_get_and_head(app, "/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": n, "object": "model", "created": created, "owned_by": "specscope",
            "root": llm.model_name, "max_model_len": llm.max_model_len} for n in names]}

    @_get_and_head(app, "/health")
    async def health():
        # 503 while draining after SIGTERM, so a load balancer stops sending requests here.
        state = "shutting_down" if worker.shutting_down else "ok"
        return JSONResponse({"status": state, "model": served,
                             "queue_depth": worker.inflight},
                            status_code=503 if worker.shutting_down else 200)

    @_get_and_head(app, "/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    add_tokenizer_routes(app, llm, check_model, limits.check_chars)
    add_admin_routes(app, llm, worker, guardrail, draft_spec, enabled=cfg.enable_admin)
    add_profile_routes(app, llm, worker, served)

    return app
