"""The OpenAI-compatible FastAPI app.

The engine runs one request at a time, so one worker thread owns it: handlers put jobs on
a FIFO queue and the worker runs them in order, handing each StreamDelta back to the
handler's event loop (worker.py). Each request therefore gets exactly what the engine
produces for it alone. A handler whose client went away sets the job's cancel flag; the
worker checks it after every delta (one cycle) and closes the engine's generator, freeing
the engine for the next job. At most `max_queue` requests wait behind the running one;
more get 503 with Retry-After.

Before a route sees a request, the RequestGuard (guard.py) has checked its Host, API key and
content type and read its whole body within the size and time limits. The routes then parse,
validate, render and tokenize on a worker thread, so no request's size can stall the event
loop that every stream and /health share.

The per-token path is kept short because on a small CPU it shares the GIL (and cores)
with the engine: a stream sends everything produced since its last send as one write (one
SSE event per cycle while it keeps up, several cycles' text in one event when it fell
behind), and text events are formatted from a JSON template made once per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specscope.config import SamplingParams, ServerConfig, SpecConfig
from specscope.engine.llm import LLM, StreamDelta
from specscope.engine.request import RequestOutput
from specscope.server.admin import add_admin_routes
from specscope.server.guard import RequestGuard
from specscope.server.guardrail import Guardrail
from specscope.server.limits import PromptLimits
from specscope.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specscope.server.metrics import CountRequests, Metrics
from specscope.server.profile_routes import add_profile_routes
from specscope.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_json,
    validation_error,
)
from specscope.server.stats_log import StatsLog
from specscope.server.tokenizer_routes import add_tokenizer_routes
from specscope.server.worker import _END, EngineWorker, _Job

log = logging.getLogger("specscope.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


# -- helpers ------------------------------------------------------------------------------


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _engine_error(e: BaseException, param: str | None = None) -> APIError:
    if isinstance(e, APIError):  # the worker's own (shutting down)
        return e
    if isinstance(e, (ValueError, TypeError)):
        msg = str(e)
        field = msg.split(" ", 1)[0]
        return APIError(400, msg, param=field if field in SAMPLING_FIELDS else param)
    log.exception("engine error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def _get_and_head(app: FastAPI, path: str) -> Callable:
    """Register a GET route that also answers HEAD (probes and load balancers send it)."""
    def register(fn: Callable) -> Callable:
        app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
        return app.get(path)(fn)
    return register


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_MARK = "\x00text\x00"  # JSON-encodes to "\u0000text\u0000", which no other field holds


def _sse_template(obj: dict) -> tuple[str, str]:
    """(prefix, suffix) of `_sse(obj)` around the JSON string of its one field holding
    _MARK (the text): an event is then prefix + json.dumps(text) + suffix."""
    prefix, suffix = _sse(obj).split(json.dumps(_MARK), 1)
    return prefix, suffix


def _usage(out: RequestOutput) -> dict:
    p, c = out.metrics.prompt_tokens, out.metrics.completion_tokens
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if out.spec is not None:
        usage["spec"] = out.spec
    return usage


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

    def check_model(name: str | None) -> None:
        if name is not None and name not in (*names, llm.model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{' or '.join(map(repr, names))}", type="invalid_request_error",
                           param="model", code="model_not_found")

    def sampling(req: ChatCompletionRequest | CompletionRequest, n_prompt: int,
                 prompt_field: str) -> SamplingParams:
        limits.check_tokens(n_prompt, prompt_field)
        limits.check_request(req)
        room = llm.max_model_len - n_prompt
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                           f"{n_prompt + max_tokens} exceeds the model's context length "
                           f"({llm.max_model_len})", param="max_tokens",
                           code="context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=req.top_k or 0, seed=req.seed, stop=req.stop or (),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)
        except (ValueError, TypeError) as e:
            raise _engine_error(e) from None

    async def first_items(job: _Job) -> list:
        """Wait for the first delta, so engine errors still become error responses."""
        try:
            items = await job.take()
        except BaseException:
            job.cancel.set()
            raise
        if isinstance(items[0], BaseException):
            raise _engine_error(items[0])
        if items[0] is _END:
            raise closed(job)
        return items

    def closed(job: _Job) -> APIError:
        if job.cancel.is_set():  # the watcher saw the client leave; nobody reads this
            return APIError(499, "client closed the request", code="client_closed")
        return APIError(500, "generation ended without output", type="server_error")

    async def watch(request: Request, job: _Job) -> None:
        """Until cancelled: poll for the client leaving while its request waits or runs."""
        while not job.cancel.is_set():
            if await request.is_disconnected():
                job.cancel.set()
                metrics.cancel()
                return
            await asyncio.sleep(0.1)

    async def collect(job: _Job, items: list) -> RequestOutput:
        try:
            while True:
                for item in items:
                    if isinstance(item, BaseException):
                        raise _engine_error(item)
                    if item is _END:
                        raise closed(job)
                    if item.finished:
                        return item.output
                items = await job.take()
        finally:
            job.cancel.set()  # a no-op when finished; frees the engine if we were cancelled

    def record(out: RequestOutput, t0: float) -> None:
        m = out.metrics
        metrics.generation_done(m.prompt_tokens, m.completion_tokens, out.finish_reason,
                                m.ttft_s, m.decode_s, time.perf_counter() - t0)

    async def generate(request: Request, ids: list[int],
                       req: ChatCompletionRequest | CompletionRequest, prompt_field: str,
                       chunk: Callable[[str | None, str | None], dict],
                       full: Callable[[RequestOutput], dict]):
        t0 = time.perf_counter()
        params = sampling(req, len(ids), prompt_field)
        job = worker.submit_generation(ids, params)
        # Streams notice a departed client when a chunk fails to send; until the first
        # chunk (queued, prefill) and for whole non-streaming requests, a watcher polls.
        watcher = asyncio.create_task(watch(request, job))
        try:
            first = await first_items(job)
            if not req.stream:
                out = await collect(job, first)
                record(out, t0)
                return JSONResponse(full(out))
        finally:
            watcher.cancel()

        template: tuple[str, str] | None = None

        def text_event(text: str) -> str:
            nonlocal template
            if template is None:  # the first chunk (a chat stream's carries the role)
                event = _sse(chunk(text, None))
                template = _sse_template(chunk(_MARK, None))
                return event
            return f"{template[0]}{json.dumps(text, ensure_ascii=False)}{template[1]}"

        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                items = first
                while True:
                    # All the items that arrived since the last send go out in one write.
                    texts: list[str] = []
                    end: Any = None  # the item that ends the stream, if it is here
                    for item in items:
                        if not isinstance(item, StreamDelta):
                            end = item  # _END, or an error
                            break
                        if item.text:
                            texts.append(item.text)
                        if item.finished:
                            end = item
                            break
                    send = [text_event("".join(texts))] if texts else []
                    if end is None:
                        if send:
                            yield send[0]
                        items = await job.take()
                        continue
                    if isinstance(end, StreamDelta):
                        out = end.output
                        assert out is not None
                        finished = True
                        record(out, t0)
                        send.append(_sse(chunk(None, out.finish_reason)))
                        if req.include_usage:
                            final = chunk(None, None)
                            final["choices"], final["usage"] = [], _usage(out)
                            send.append(_sse(final))
                    elif isinstance(end, BaseException):
                        send.append(_sse(_engine_error(end).body()))
                    send.append("data: [DONE]\n\n")
                    yield "".join(send)
                    return
            finally:
                job.cancel.set()
                if not finished:
                    metrics.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def encode_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """Parse and tokenize a chat request (on a worker thread: see prepare)."""
        req: ChatCompletionRequest = parse_json(raw, ChatCompletionRequest)
        check_model(req.model)
        messages = [m.for_template() for m in req.messages]
        limits.check_chars(sum(len(m["content"]) for m in messages), "messages",
                           len(messages))
        try:
            return req, llm.encode_prompt(messages, chat=True)
        except (ValueError, TypeError) as e:
            raise _engine_error(e, "messages") from None

    def encode_completion(raw: bytes) -> tuple[CompletionRequest, list[int]]:
        req: CompletionRequest = parse_json(raw, CompletionRequest)
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            V = llm.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < V]
            if bad:
                raise APIError(400, f"prompt holds token ids outside [0, {V}): {bad[:8]}",
                               param="prompt")
            return req, list(prompt)
        text = prompt[0] if isinstance(prompt, list) else prompt
        limits.check_chars(len(text), "prompt")
        try:
            return req, llm.encode_prompt(text)
        except (ValueError, TypeError) as e:
            raise _engine_error(e, "prompt") from None

    async def prepare(request: Request, encode: Callable[[bytes], Any]) -> Any:
        """JSON parsing, validation, chat-template rendering and tokenization run on a
        thread, never on the event loop: a large prompt must not stall other streams or
        /health while it is read."""
        raw = await request.body()  # already read (and bounded) by the RequestGuard
        return await asyncio.to_thread(encode, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, ids = await prepare(request, encode_chat)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sent_role = False

        def chunk(text: str | None, finish: str | None) -> dict:
            nonlocal sent_role
            delta: dict[str, Any] = {}
            if not sent_role:
                delta["role"], sent_role = "assistant", True
            if text is not None:
                delta["content"] = text
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": served, "choices": [{"index": 0, "delta": delta,
                                                  "logprobs": None, "finish_reason": finish}]}

        def full(out: RequestOutput) -> dict:
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": served,
                    "choices": [{"index": 0, "logprobs": None,
                                 "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason}],
                    "usage": _usage(out)}

        return await generate(request, ids, req, "messages", chunk, full)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, ids = await prepare(request, encode_completion)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": served, "choices": [{"index": 0, "text": text or "",
                                                  "logprobs": None, "finish_reason": finish}]}

        def full(out: RequestOutput) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": served,
                    "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                 "finish_reason": out.finish_reason}],
                    "usage": _usage(out)}

        return await generate(request, ids, req, "prompt", chunk, full)

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
