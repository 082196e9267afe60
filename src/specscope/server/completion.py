"""One completion request end to end, for both OpenAI routes: its sampling parameters from
the request (checked against the prompt limits), the job on the engine worker (one or more
prompts, n choices each), a watcher for a client that leaves while it waits, and the
answer: one JSON body, or an SSE stream (responses.py builds both).

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
from specscope.server.responses import ChatFormat, CompletionFormat, Format
from specscope.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_json,
)
from specscope.server.tools import ToolCalls, tool_constraint
from specscope.server.worker import _END, EngineWorker, _Job

log = logging.getLogger("specscope.server")

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logit_bias",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "min_tokens")


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


class CompletionRunner:
    """Runs completion requests on `worker`'s engine, counted in `metrics`."""

    def __init__(self, llm: LLM, worker: EngineWorker, metrics: Metrics,
                 limits: PromptLimits, tool_parser: str | None = None) -> None:
        self.llm, self.worker, self.metrics, self.limits = llm, worker, metrics, limits
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused

    def encode_chat(self, raw: bytes, check_model: Callable[[str | None], None]
                    ) -> tuple[ChatCompletionRequest, list[list[int]], None]:
        """Parse, check and tokenize a chat request (on a worker thread)."""
        req: ChatCompletionRequest = parse_json(raw, ChatCompletionRequest)
        check_model(req.model)
        messages = [m.for_template() for m in req.messages]
        self.limits.check_chars(sum(len(m["content"]) for m in messages), "messages",
                                len(messages))
        try:
            return req, [self.llm.encode_prompt(messages, chat=True,
                                                 tools=req.template_tools())], None
        except (ValueError, TypeError) as e:
            raise _engine_error(e, "messages") from None

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
                          ) -> tuple[CompletionRequest, list[list[int]], list[str] | None]:
        """Parse, check and tokenize a completion request's prompts (on a worker thread);
        with echo, also each prompt's text."""
        req: CompletionRequest = parse_json(raw, CompletionRequest)
        check_model(req.model)
        prompts = req.prompts
        room = self.llm.engine_config.max_num_seqs + self.worker.max_queue
        if len(prompts) * req.n > room:
            raise APIError(400, f"{len(prompts)} prompts x n={req.n} choices is more than this "
                           f"server holds at once ({room}); send fewer", param="prompt")
        ids, texts = [], []
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            tokens = isinstance(p, list)  # ids are checked as LLM.generate checks a TokensPrompt's
            if not tokens:
                self.limits.check_chars(len(p), field)
            try:
                ids.append(self.llm.encode_prompt({"prompt_token_ids": p} if tokens else p))
            except (ValueError, TypeError) as e:
                raise _engine_error(e, field) from None
            texts.append(self.llm.tokenizer.decode(ids[-1]) if tokens and req.echo else
                         "" if tokens else p)
        return req, ids, texts if req.echo else None

    def sampling(self, req: ChatCompletionRequest | CompletionRequest,
                 prompts: list[list[int]], prompt_field: str) -> SamplingParams:
        """The request's SamplingParams, its prompts and limits checked."""
        limits, llm = self.limits, self.llm
        for i, ids in enumerate(prompts):
            limits.check_tokens(len(ids), prompt_field if len(prompts) == 1
                                else f"{prompt_field}[{i}]")
        limits.check_request(req)
        n_prompt = max(len(ids) for ids in prompts)
        room = llm.max_model_len - n_prompt
        max_tokens = req.requested_max_tokens
        if max_tokens is None:  # chat: the rest of the context; completions: 16, as OpenAI's
            max_tokens = min(room, req.default_max_tokens or room)
        elif max_tokens > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                           f"{n_prompt + max_tokens} exceeds the model's context length "
                           f"({llm.max_model_len})", param="max_tokens",
                           code="context_length_exceeded")
        found = self.constraint(req)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=req.top_k or 0, seed=req.seed, stop=req.stop or (),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                presence_penalty=float(req.presence_penalty or 0),
                frequency_penalty=float(req.frequency_penalty or 0),
                repetition_penalty=float(1 if req.repetition_penalty is None
                                         else req.repetition_penalty),
                logit_bias=req.logit_bias or {}, min_p=float(req.min_p or 0),
                min_tokens=req.min_tokens or 0, logprobs=req.num_logprobs, n=req.n,
                # echo with logprobs: the prompt's too (computed at prefill)
                prompt_logprobs=req.logprobs if getattr(req, "echo", False) else None,
                structured_outputs=found[1] if found else None)
            llm.check_params(params)
            return params
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
    async def _collect(job: _Job, items: list) -> list[RequestOutput]:
        """Every prompt's RequestOutput, in prompt order."""
        outs: dict[str, RequestOutput] = {}
        try:
            while True:
                for item in items:
                    if isinstance(item, BaseException):
                        raise _engine_error(item)
                    if item is _END:
                        raise CompletionRunner._closed(job)
                    if item.finished:
                        outs[item.request_id] = item.output
                        if len(outs) == len(job.rids):
                            return [outs[r] for r in job.rids]
                items = await job.take()
        finally:
            job.cancel.set()  # a no-op when finished; frees the engine if we were cancelled

    def _record(self, outs: list[RequestOutput], t0: float) -> None:
        for out in outs:  # one generation per prompt: its n choices' tokens summed
            m = out.metrics
            self.metrics.generation_done(m.prompt_tokens, m.completion_tokens,
                                         out.finish_reason, m.ttft_s, m.decode_s,
                                         time.perf_counter() - t0)

    async def generate(self, request: Request, prompts: list[list[int]],
                       req: ChatCompletionRequest | CompletionRequest, prompt_field: str,
                       fmt: Format, prefixes: list[str] | None) -> Response:
        """Run one request of one or more prompts: a JSON response, or an SSE stream.
        prefixes: per prompt, the text each of its choices starts with (echo)."""
        t0 = time.perf_counter()
        params = self.sampling(req, prompts, prompt_field)
        grammar = await asyncio.to_thread(self.grammar, req) \
            if params.structured_outputs is not None else None
        job = self.worker.submit_generation(prompts, params, grammar)
        # Streams notice a departed client when a chunk fails to send; until the first
        # chunk (queued, prefill) and for whole non-streaming requests, a watcher polls.
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            first = await self._first_items(job)
            if not req.stream:
                outs = await self._collect(job, first)
                self._record(outs, t0)
                return JSONResponse(fmt.body(outs, prefixes))
        finally:
            watcher.cancel()
        return StreamingResponse(self._events(job, first, req, fmt, prompts, prefixes, t0),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _text_events(fmt: Format, fast: bool) -> Callable[[int, str, list | None], str]:
        """The text event of a choice. fast (one choice, no logprobs): events after the
        first are formatted from a template made once."""
        template: tuple[str, str] | None = None

        def event(index: int, text: str, lps: list | None) -> str:
            nonlocal template
            if not fast:
                return _sse(fmt.chunk([fmt.delta(index, text, lps, None)]))
            if template is None:  # the first chunk (a chat stream's carries the role)
                first = _sse(fmt.chunk([fmt.delta(0, text, None, None)]))
                template = _sse_template(fmt.chunk([fmt.delta(0, _MARK, None, None)]))
                return first
            return f"{template[0]}{json.dumps(text, ensure_ascii=False)}{template[1]}"
        return event

    async def _events(self, job: _Job, first: list,
                      req: ChatCompletionRequest | CompletionRequest, fmt: Format,
                      prompts: list[list[int]], prefixes: list[str] | None, t0: float
                      ) -> AsyncIterator[str]:
        """The SSE stream of one request: everything produced since the last send goes out
        as one write (per choice a text event, then its finish event when it ended). With
        echo, a prompt's choices first get its text (and logprobs, which its first delta
        brings) as their first chunk."""
        text_event = self._text_events(fmt, job.n == 1 and len(job.rids) == 1
                                       and fmt.k is None and not prefixes
                                       and fmt.tools is None)
        echoed: set[int] = set()

        def echo(item: StreamDelta) -> list[str]:
            p = item.index // job.n
            if prefixes is None or p in echoed:
                return []
            echoed.add(p)
            return [_sse(fmt.chunk([fmt.echo(p * job.n + i, prefixes[p], prompts[p],
                                             item.prompt_logprobs)])) for i in range(job.n)]

        outs: dict[str, RequestOutput] = {}
        finished = False
        try:
            items = first
            while True:
                send, end = self._batch(items, fmt, text_event, outs, echo)
                if len(outs) == len(job.rids):
                    finished = True
                    ordered = [outs[r] for r in job.rids]
                    self._record(ordered, t0)
                    if req.include_usage:
                        send.append(_sse(fmt.usage_chunk(ordered)))
                elif end is None:
                    if send:
                        yield "".join(send)
                    items = await job.take()
                    continue
                elif isinstance(end, BaseException):
                    send.append(_sse(_engine_error(end).body()))
                send.append("data: [DONE]\n\n")
                yield "".join(send)
                return
        finally:
            job.cancel.set()
            if not finished:
                self.metrics.cancel()

    @staticmethod
    def _batch(items: list, fmt: Format, text_event: Callable,
               outs: dict[str, RequestOutput], echo: Callable[[StreamDelta], list[str]]
               ) -> tuple[list[str], Any]:
        """The events of the items taken at once: echoes, then each choice's text (and
        logprobs) joined into one event, then the finish events; finished requests'
        outputs go to outs. Returns (events, the item that ends the stream early: _END or
        an error, else None)."""
        order: dict[int, tuple[list[str], list]] = {}
        pre, finishes, end = [], [], None
        for item in items:
            if not isinstance(item, StreamDelta):
                end = item  # _END, or an error
                break
            pre += echo(item)
            if item.text or item.logprobs:
                texts, lps = order.setdefault(item.index, ([], []))
                texts.append(item.text)
                lps += item.logprobs or []
            if item.finish_reason is not None:
                finishes.append((item.index, item.finish_reason))
            if item.finished:
                outs[item.request_id] = item.output
        send = pre
        for i, (t, lps) in order.items():
            text = fmt.feed(i, "".join(t))  # text that may be a tool call is held back
            if text or lps:
                send.append(text_event(i, text, lps or None))
        send += [_sse(fmt.chunk([d])) for i, r in finishes for d in fmt.ending(i, r)]
        return send, end


def add_completion_routes(app: FastAPI, runner: CompletionRunner,
                          check_model: Callable[[str | None], None], served: str,
                          fingerprint: str) -> None:
    """POST /v1/chat/completions and /v1/completions on `app`. Parsing, validation,
    chat-template rendering and tokenization run on a thread, never on the event loop: a
    large prompt must not stall other streams or /health. fingerprint: every response's
    system_fingerprint."""

    async def prepare(request: Request, encode: Callable[[bytes], Any]) -> Any:
        raw = await request.body()  # already read (and bounded) by the RequestGuard
        return await asyncio.to_thread(encode, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, prompts, _ = await prepare(request,
                                        lambda raw: runner.encode_chat(raw, check_model))
        tools = None
        if runner.tool_calls(req) is not None:  # checked once; each choice parses its own
            tools = lambda: runner.tool_calls(req)  # noqa: E731
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served,
                         fingerprint, req.num_logprobs, tools=tools)
        return await runner.generate(request, prompts, req, "messages", fmt, None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompts, prefixes = await prepare(
            request, lambda raw: runner.encode_completion(raw, check_model))
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()), served,
                               fingerprint, req.num_logprobs, runner.llm.tokenizer)
        return await runner.generate(request, prompts, req, "prompt", fmt, prefixes)
