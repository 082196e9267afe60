"""OpenAI request bodies (the fields specscope honours) and the error body.

Every field a request sends is honoured or refused, never ignored: a field this server does
not know is a 400 naming it, and an OpenAI field whose behaviour is not implemented (yet)
is accepted only at its no-op value (no tools, `response_format` text, `best_of` 1, ...)
and refused, by name, otherwise. Wrong types and out-of-range values fail validation the same
way: 400 invalid_request_error.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specscope.config import (
    MAX_LOGPROBS,
    MAX_NUM_DRAFT_TOKENS,
    MAX_NUM_STEPS,
    MAX_TOPK,
    StructuredOutputs,
)


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
# Tags pydantic puts in an error's location for the member of a union that failed.
_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "list", "dict", "tuple", "set"}


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "literal"))


def param_path(loc: tuple, data: Any = _NO_DATA) -> str | None:
    """'messages[0].role' from a pydantic error location. With the request data, the path
    stops where the data does (dropping union-member tags such as 'str' or 'list[str]')."""
    s = ""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    for p in parts:
        if isinstance(p, str) and _is_type_tag(p):
            break  # a union member's tag ('str', 'list[str]'): the field itself is the param
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
    if first.get("type") == "extra_forbidden":
        msg = "this field is not supported by this server; remove it"
    if param is None:  # a check across fields names the one at fault first ("top_logprobs: ")
        head, sep, _ = msg.partition(": ")
        if sep and isinstance(data, dict) and head in data:
            return APIError(400, msg, param=head)
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# Content parts of other modalities: named so the error can say what is not supported.
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file",
               "video_url", "video")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


def _check_part(i: int, part: Any) -> TextPart:
    if not isinstance(part, dict):
        raise ValueError(f"content[{i}] must be an object with 'type' and 'text'")
    kind = part.get("type")
    if kind in MEDIA_PARTS:
        raise ValueError(f"content[{i}] is an {kind!r} part: this server's model reads text "
                         f"only, so images, audio and files are not supported; send text "
                         f"parts or a string")
    if kind != "text":
        raise ValueError(f"content[{i}] has type {kind!r}; the supported part type is 'text'")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"content[{i}].text must be a string")
    return TextPart(type="text", text=part["text"])


class ChatMessage(BaseModel):
    """An OpenAI chat message. Content is a string or a list of text parts (joined); an
    assistant message may carry tool_calls with null content; a tool message its
    tool_call_id. These extra keys are passed to the chat template, which may render them."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[Any] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _parts(cls, content: Any, info: ValidationInfo) -> Any:
        if isinstance(content, list):
            return [_check_part(i, p) for i, p in enumerate(content)]
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"a {role or 'non-assistant'} message needs content (only an "
                             f"assistant message may have null content, beside tool_calls)")
        return content

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # content was left out
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its JSON-string arguments as an object: the templates that render
    calls (Qwen's, Llama 3.1's) write `arguments | tojson`, which would quote a string
    (vLLM passes objects too)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema (OpenAI): the schema is enforced whether strict or not."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object "
                             "({'name': ..., 'schema': {...}})")
        return self

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return StructuredOutputs(json={} if schema is None else schema)
        return None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` extension: one of json, regex, choice, grammar,
    json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def constraint(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_, regex=self.regex, choice=self.choice,
                                 grammar=self.grammar, json_object=bool(self.json_object))


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(BaseModel):
    """A tool the model may call (OpenAI: function tools only)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


# OpenAI fields whose behaviour is not implemented yet: each is accepted at the value that
# asks for nothing (what a client sending defaults sends) and refused otherwise.
_NOT_YET = {
    "functions": (([], None), "the legacy functions field is not supported; send tools"),
    "function_call": ((None, "none"), "the legacy function_call field is not supported; "
                      "send tool_choice"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "best_of": ((None, 1), "best_of is not supported yet; send 1"),
    "store": ((None, False), "this server stores no completions; send false"),
    "modalities": ((None, ["text"]), "this server's model produces text only"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
    "prompt_cache_retention": ((None,), "the prefix cache keeps what memory allows; "
                               "retention cannot be set"),
    "prompt_cache_options": ((None,), "prefix-cache options cannot be set"),
    "moderation": ((None,), "moderation is not supported"),
}


def _no_op_only(name: str, value: Any) -> Any:
    """`value` when it is one of `name`'s no-op values (_NOT_YET), else the refusal."""
    allowed, why = _NOT_YET[name]
    if any(value is a or (value == a and type(value) is type(a)) for a in allowed):
        return value
    raise ValueError(f"{why} (got {value!r})")


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")
    # max_tokens when the request gives none (None: what the context leaves)
    default_max_tokens: ClassVar[int | None] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default (n, stream, echo, ...) means that
        default, as OpenAI's API types them ("integer or null") and clients send them."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].default is None}
        return data

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # extension (vLLM, SGLang)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extension (vLLM): generate exactly max_tokens tokens
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM, SGLang)
    # Request metadata with no effect on generation (end-user ids, a routing hint: the
    # prefix cache is automatic).
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    prompt_cache_key: StrictStr | None = None
    # Structured output (engine/grammar.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* spellings; at most one per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # Logits adjustments (SamplingParams): OpenAI's penalties and logit_bias (token id ->
    # bias); repetition_penalty, min_p and min_tokens are vLLM's extensions.
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | StrictInt | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, Any] | None = None
    min_p: StrictFloat | StrictInt | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    # Not implemented: refused unless at their no-op values (_NOT_YET).
    best_of: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None

    # Every _NOT_YET field, declared here or on the chat or completion request.
    @field_validator(*_NOT_YET, mode="before", check_fields=False)
    @classmethod
    def _not_yet(cls, v: Any, info: ValidationInfo) -> Any:
        return _no_op_only(info.field_name, v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids (non-negative integers), got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"biases are numbers, got {value!r} for token {key}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases are in [-100, 100], got {value!r} for token {key}")
            out[int(key)] = float(value)
        return out

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return ids

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stops):
            raise ValueError("an empty stop string would end every answer before it starts; "
                             "remove it")
        return stops

    def constraint(self) -> tuple[str, StructuredOutputs] | None:
        """The output constraint this request asks for and the field asking, or None."""
        found = []
        if self.response_format is not None and \
                (so := self.response_format.constraint()) is not None:
            found.append(("response_format", so))
        field = "structured_outputs"  # the field being read: the one an error names
        try:
            if self.structured_outputs is not None:
                found.append((field, self.structured_outputs.constraint()))
            for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                               ("guided_choice", "choice"), ("guided_grammar", "grammar")):
                if getattr(self, field) is not None:
                    found.append((field, StructuredOutputs(**{key: getattr(self, field)})))
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        if len(found) > 1:
            raise APIError(400, f"{found[0][0]} and {found[1][0]} both constrain the output; "
                           f"send one", param=found[1][0])
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = None
    # Default: "auto" with tools, "none" without (OpenAI's, vLLM's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true to ask for top_logprobs")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @model_validator(mode="after")
    def _tools_and_choice(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tools: two tools are named {dup!r}; names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, "
                             f"which is not one of the tools ({', '.join(names) or 'none'})")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools to choose from")
        return self

    @property
    def effective_tool_choice(self) -> Any:
        """The tool choice: "none", "auto", "required", or the named function as a dict."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's shape), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many top tokens each token brings."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids:
    # each prompt gets n choices, indexed prompt by prompt (choice i of prompt p: p * n + i).
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: Any = None
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's legacy completions and vLLM

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p: str | list) -> str | list:
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise ValueError("prompt must not be empty")
        return p

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class SpecUpdate(BaseModel):
    """POST /admin/spec: the same names, types and ranges as the CLI flags (config.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool | None = None
    num_steps: StrictInt | None = Field(default=None, ge=1, le=MAX_NUM_STEPS)
    topk: StrictInt | None = Field(default=None, ge=1, le=MAX_TOPK)
    num_draft_tokens: StrictInt | None = Field(default=None, ge=2, le=MAX_NUM_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _not_both(self) -> SpecUpdate:
        knobs = [k for k in ("num_steps", "topk", "num_draft_tokens")
                 if getattr(self, k) is not None]
        if self.enabled is False and knobs:
            raise ValueError(f"'enabled': false turns speculation off; it cannot be sent with "
                             f"{knobs}")
        return self


def _no_constant(name: str) -> Any:
    raise APIError(400, f"the body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes, model: type[BaseModel]) -> Any:
    """A request body as `model`, or the APIError naming what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(), data) from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
