"""One completion request end to end, for both OpenAI routes: its sampling parameters from
the request (checked against the prompt limits), the job on the engine worker, a watcher for
a client that leaves while it waits, and the answer: one JSON body, or an SSE stream.

The per-token path is kept short because on a small CPU it shares the GIL (and cores) with
the engine: a stream sends everything produced since its last send as one write (one SSE
event per step while it keeps up, several steps' text in one event when it fell behind),
and text events are formatted from a JSON template made once per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specscope.config import SamplingParams, StructuredOutputs
from specscope.engine.grammar import Grammar
from specscope.engine.llm import LLM, StreamDelta
from specscope.engine.request import RequestOutput
from specscope.server.limits import PromptLimits
from specscope.server.metrics import Metrics
from specscope.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_json,
)
from specscope.server.tools import ToolCalls, tool_constraint
from specscope.server.worker import _END, EngineWorker, _Job

log = logging.getLogger("specscope.server")

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def _engine_error(e: BaseException, param: str | None = None) -> APIError:
    if isinstance(e, APIError):  # the worker's own (shutting down)
        return e
    if isinstance(e, (ValueError, TypeError)):
        msg = str(e)
        field = msg.split(" ", 1)[0]
        return APIError(400, msg, param=field if field in SAMPLING_FIELDS else param)
    log.exception("engine error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


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


class CompletionRunner:
    """Runs completion requests on `worker`'s engine, counted in `metrics`."""

    def __init__(self, llm: LLM, worker: EngineWorker, metrics: Metrics,
                 limits: PromptLimits, tool_parser: str | None = None) -> None:
        self.llm, self.worker, self.metrics, self.limits = llm, worker, metrics, limits
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused

    def encode_chat(self, raw: bytes, check_model: Callable[[str | None], None]
                    ) -> tuple[ChatCompletionRequest, list[int]]:
        """Parse, check and tokenize a chat request (on a worker thread)."""
        req: ChatCompletionRequest = parse_json(raw, ChatCompletionRequest)
        check_model(req.model)
        self.tool_calls(req)  # tool_choice "auto" without a parser fails before any work
        messages = [m.for_template() for m in req.messages]
        self.limits.check_chars(sum(len(m["content"]) for m in messages), "messages",
                                len(messages))
        try:
            ids = self.llm.encode_prompt(messages, chat=True, tools=req.template_tools())
        except (ValueError, TypeError) as e:
            raise _engine_error(e, "messages") from None
        return req, ids

    def tool_calls(self, req: ChatCompletionRequest) -> ToolCalls | None:
        """How this request's answer becomes tool calls (None: plain content)."""
        choice = req.effective_tool_choice
        if choice == "none":  # tools are offered to the template, calls never parsed
            return None
        if choice == "auto" and self.tool_parser is None:
            raise APIError(400, 'tools with tool_choice "auto" (the default when tools are '
                           'given) need the server started with --enable-auto-tool-choice '
                           'and --tool-call-parser; or send tool_choice "none", "required" '
                           'or a named function', param="tool_choice")
        return ToolCalls(choice, self.tool_parser, req.parallel_tool_calls is not False)

    @staticmethod
    def constraint(req: ChatCompletionRequest | CompletionRequest
                   ) -> tuple[str, StructuredOutputs] | None:
        """The output's grammar and the field asking for it: response_format, vLLM's
        structured_outputs / guided_*, or a forced tool call."""
        found = req.constraint()
        if isinstance(req, ChatCompletionRequest) and req.tools:
            forced = tool_constraint(req.template_tools(), req.effective_tool_choice,
                                     req.parallel_tool_calls is not False)
            if forced is not None and found is not None:
                raise APIError(400, f"tool_choice {req.effective_tool_choice!r} constrains "
                               f"the output, and so does {found[0]}; send one",
                               param=found[0])
            if forced is not None:
                found = ("tool_choice", forced)
        return found

    def grammar(self, req: ChatCompletionRequest | CompletionRequest) -> Grammar | None:
        """The request's grammar state (None: unconstrained), or a 400 naming the field
        whose schema or grammar cannot be enforced (or the extra to install). Compiling a
        large schema can take a while: it runs on a thread, not the event loop or the
        engine's."""
        found = self.constraint(req)
        if found is None:
            return None
        try:
            return self.llm.grammars.compile(found[1])
        except ValueError as e:
            field = "tools" if found[0] == "tool_choice" else found[0]
            raise APIError(400, f"{field}: {e}", param=field) from None

    def encode_completion(self, raw: bytes, check_model: Callable[[str | None], None]
                          ) -> tuple[CompletionRequest, list[int]]:
        """Parse, check and tokenize a completion request (on a worker thread)."""
        req: CompletionRequest = parse_json(raw, CompletionRequest)
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            V = self.llm.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < V]
            if bad:
                raise APIError(400, f"prompt holds token ids outside [0, {V}): {bad[:8]}",
                               param="prompt")
            return req, list(prompt)
        text = prompt[0] if isinstance(prompt, list) else prompt
        self.limits.check_chars(len(text), "prompt")
        try:
            ids = self.llm.encode_prompt(text)
        except (ValueError, TypeError) as e:
            raise _engine_error(e, "prompt") from None
        return req, ids

    def sampling(self, req: ChatCompletionRequest | CompletionRequest, n_prompt: int,
                 prompt_field: str) -> SamplingParams:
        """The request's SamplingParams, its prompt and limits checked."""
        limits, llm = self.limits, self.llm
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
        found = self.constraint(req)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=req.top_k or 0, seed=req.seed, stop=req.stop or (),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                structured_outputs=found[1] if found else None)
        except (ValueError, TypeError) as e:
            raise _engine_error(e) from None

    @staticmethod
    async def _first_items(job: _Job) -> list:
        """Wait for the first delta, so engine errors still become error responses."""
        try:
            items = await job.take()
        except BaseException:
            job.cancel.set()
            raise
        if isinstance(items[0], BaseException):
            raise _engine_error(items[0])
        if items[0] is _END:
            raise CompletionRunner._closed(job)
        return items

    @staticmethod
    def _closed(job: _Job) -> APIError:
        if job.cancel.is_set():  # the watcher saw the client leave; nobody reads this
            return APIError(499, "client closed the request", code="client_closed")
        return APIError(500, "generation ended without output", type="server_error")

    async def _watch(self, request: Request, job: _Job) -> None:
        """Until cancelled: poll for the client leaving while its request waits or runs."""
        while not job.cancel.is_set():
            if await request.is_disconnected():
                job.cancel.set()
                self.metrics.cancel()
                return
            await asyncio.sleep(0.1)

    @staticmethod
    async def _collect(job: _Job, items: list) -> RequestOutput:
        try:
            while True:
                for item in items:
                    if isinstance(item, BaseException):
                        raise _engine_error(item)
                    if item is _END:
                        raise CompletionRunner._closed(job)
                    if item.finished:
                        return item.output
                items = await job.take()
        finally:
            job.cancel.set()  # a no-op when finished; frees the engine if we were cancelled

    def _record(self, out: RequestOutput, t0: float) -> None:
        m = out.metrics
        self.metrics.generation_done(m.prompt_tokens, m.completion_tokens, out.finish_reason,
                                m.ttft_s, m.decode_s, time.perf_counter() - t0)

    async def generate(self, request: Request, ids: list[int],
                       req: ChatCompletionRequest | CompletionRequest, prompt_field: str,
                       chunk: Callable[..., dict], full: Callable[[RequestOutput], dict],
                       tools: ToolCalls | None = None) -> Response:
        """Run one request: a JSON response, or an SSE stream of `chunk` events (`full`
        builds the non-streaming body; a stream's tool calls go through `tools`)."""
        t0 = time.perf_counter()
        params = self.sampling(req, len(ids), prompt_field)
        grammar = await asyncio.to_thread(self.grammar, req) \
            if params.structured_outputs is not None else None
        job = self.worker.submit_generation(ids, params, grammar)
        # Streams notice a departed client when a chunk fails to send; until the first
        # chunk (queued, prefill) and for whole non-streaming requests, a watcher polls.
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            first = await self._first_items(job)
            if not req.stream:
                out = await self._collect(job, first)
                self._record(out, t0)
                return JSONResponse(full(out))
        finally:
            watcher.cancel()
        return self._stream(job, first, req, chunk, t0, tools)

    def _stream(self, job: _Job, first: list,
                req: ChatCompletionRequest | CompletionRequest,
                chunk: Callable[..., dict], t0: float, tools: ToolCalls | None = None
                ) -> StreamingResponse:
        """The SSE stream of one request: everything produced since the last send goes out
        as one write; text events are formatted from a template made once. With `tools`,
        text that may be a tool call is held, and the calls go out whole at the end."""
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
                    text = "".join(texts)
                    if tools is not None:
                        text = tools.feed(text)
                    send = [text_event(text)] if text else []
                    if end is None:
                        if send:
                            yield send[0]
                        items = await job.take()
                        continue
                    if isinstance(end, StreamDelta):
                        out = end.output
                        assert out is not None
                        finished = True
                        self._record(out, t0)
                        finish = out.finish_reason
                        if tools is not None:
                            rest, calls = tools.finish()
                            if rest:
                                send.append(text_event(rest))
                            if calls:
                                send.append(_sse(chunk(None, None, calls)))
                                finish = "tool_calls" if finish == "stop" else finish
                        send.append(_sse(chunk(None, finish)))
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
                    self.metrics.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def add_completion_routes(app: FastAPI, runner: CompletionRunner,
                          check_model: Callable[[str | None], None], served: str) -> None:
    """POST /v1/chat/completions and /v1/completions on `app`. Parsing, validation,
    chat-template rendering and tokenization run on a thread, never on the event loop: a
    large prompt must not stall other streams or /health."""

    async def prepare(request: Request, encode: Callable[[bytes], Any]) -> Any:
        """JSON parsing, validation, chat-template rendering and tokenization run on a
        thread, never on the event loop: a large prompt must not stall other streams or
        /health while it is read."""
        raw = await request.body()  # already read (and bounded) by the RequestGuard
        return await asyncio.to_thread(encode, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, ids = await prepare(request, lambda raw: runner.encode_chat(raw, check_model))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tools = runner.tool_calls(req)
        sent_role = False

        def chunk(text: str | None, finish: str | None, calls: list | None = None) -> dict:
            nonlocal sent_role
            delta: dict[str, Any] = {}
            if not sent_role:
                delta["role"], sent_role = "assistant", True
            if text is not None:
                delta["content"] = text
            if calls:  # each call whole, in one chunk
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": served, "choices": [{"index": 0, "delta": delta,
                                                  "logprobs": None, "finish_reason": finish}]}

        def full(out: RequestOutput) -> dict:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish = out.finish_reason
            if tools is not None:
                message["content"], calls = tools.parse(out.text)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": served,
                    "choices": [{"index": 0, "logprobs": None, "message": message,
                                 "finish_reason": finish}],
                    "usage": _usage(out)}

        return await runner.generate(request, ids, req, "messages", chunk, full, tools)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, ids = await prepare(request,
                                 lambda raw: runner.encode_completion(raw, check_model))
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

        return await runner.generate(request, ids, req, "prompt", chunk, full)
