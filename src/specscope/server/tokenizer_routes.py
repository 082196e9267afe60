"""vLLM's utility routes: POST /tokenize and /detokenize (the served model's tokenizer, the
chat template too), GET /version, and GET/POST /ping (a health probe, answered without an API
key like /health)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from specscope import __version__
from specscope.engine.llm import LLM
from specscope.server.schemas import APIError, ChatMessage, parse_json


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages (rendered with the chat template, as a chat request is)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = True  # vLLM's; only True is what the server runs


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]


def add_tokenizer_routes(app: FastAPI, llm: LLM, check_model: Callable[[str | None], None],
                         check_chars: Callable[..., None]) -> None:
    """The routes on `app`; check_model and check_chars: the app's model-name and prompt
    size checks (server/limits.py)."""

    def tokenize(raw: bytes) -> dict[str, Any]:
        req: TokenizeRequest = parse_json(raw, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send a prompt or messages (one of them)", param="prompt")
        if not req.add_generation_prompt:
            raise APIError(400, "add_generation_prompt false is not supported: the server "
                           "always opens the assistant's turn", param="add_generation_prompt")
        try:
            if req.messages is not None:
                messages = [m.for_template() for m in req.messages]
                check_chars(sum(len(m["content"]) for m in messages), "messages",
                            len(messages))
                ids = llm.encode_prompt(messages, chat=True)
            else:
                check_chars(len(req.prompt), "prompt")
                ids = llm.encode_prompt(req.prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    def detokenize(raw: bytes) -> dict[str, Any]:
        req: DetokenizeRequest = parse_json(raw, DetokenizeRequest)
        check_model(req.model)
        V = llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise APIError(400, f"tokens holds ids outside [0, {V}): {bad[:8]}", param="tokens")
        return {"prompt": llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await asyncio.to_thread(tokenize, await request.body())

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await asyncio.to_thread(detokenize, await request.body())

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/ping")
    async def ping():
        return {"status": "ok"}

    @app.post("/ping")
    async def ping_post():
        return {"status": "ok"}
