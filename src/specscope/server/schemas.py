"""OpenAI request bodies (the fields specscope honours) and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do; wrong types and out-of-range
values fail validation and become 400 invalid_request_error responses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator


class APIError(Exception):
    """An error to return as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_NO_DATA = object()


def param_path(loc: tuple, data: Any = _NO_DATA) -> str | None:
    """'messages[0].role' from a pydantic error location. With the request data, the path
    stops where the data does (dropping union-member tags such as 'str' or 'list[str]')."""
    s = ""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    for p in parts:
        if data is not _NO_DATA:
            in_dict = isinstance(data, dict) and isinstance(p, str) and p in data
            in_list = isinstance(data, list) and isinstance(p, int) and 0 <= p < len(data)
            if in_dict or in_list:
                data = data[p]
            elif s and isinstance(data, dict) and isinstance(p, str) and p.isidentifier():
                s += "." + p  # a missing field of a present object
                break
            elif not s and isinstance(p, str):
                s = p  # a missing top-level field
                break
            else:
                break
        s += f"[{p}]" if isinstance(p, int) else ("." if s else "") + str(p)
    return s or None


def validation_error(errors: list[dict], data: Any = _NO_DATA) -> APIError:
    first = errors[0]
    param = param_path(tuple(first.get("loc", ())), data)
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, or a list of text parts (joined); images and other parts are not supported.
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # extension (vLLM, SGLang)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens tokens

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n > 1:
            raise ValueError("n > 1 is not supported")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(_Sampling):
    # A string, a one-element list of strings, or a list of token ids.
    prompt: str | list[str] | list[StrictInt]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, p: str | list) -> str | list:
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], str) and len(p) > 1:
                raise ValueError("a batch of prompts is not supported; send one per request")
        return p

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
