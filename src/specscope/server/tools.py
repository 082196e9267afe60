"""Tool calls: the grammar that forces one (tool_choice "required" or a named function), and
the parsing of calls out of an answer, whole or streamed.

Modes, as vLLM serves them:

- "auto" (with --enable-auto-tool-choice): the model answers freely; calls are parsed out
  of the text in the --tool-call-parser format:
  - hermes (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call; text before the first block is the message's content;
  - llama3_json (Llama 3.1): the whole answer is `{"name": ..., "parameters": {...}}`,
    optionally after `<|python_tag|>`, several calls separated by `;`.
  An answer that does not parse as calls is plain content.
- "required": the output is constrained to a JSON array of calls `[{"name": ...,
  "parameters": {...}}]`, each name one of the tools' and its parameters valid against
  that tool's schema (one item at most without parallel_tool_calls);
- a named function: the output is constrained to that function's parameters: the text is
  the call's arguments.

Streaming: content streams until the text may be a call; from there the text is held, and
the calls go out at the end as one `delta.tool_calls` chunk holding each whole call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from specscope.config import StructuredOutputs

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_RE = re.compile(re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|$)",
                        re.DOTALL)
# A function with no parameters takes none (OpenAI: "omitting parameters defines a function
# with an empty parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_PARAMETERS


def tool_constraint(tools: list[dict], choice: Any, parallel: bool) -> StructuredOutputs | None:
    """The grammar a tool_choice imposes: None for "none" and "auto"; for "required" an
    array of calls of the tools; for a named function its parameters."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "parameters": parameters_schema(t)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema)
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return StructuredOutputs(json=parameters_schema(tool))


def make_call(name: str, arguments: Any) -> dict:
    """One OpenAI tool call: arguments as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            return make_call(obj["name"], obj[key])
    return make_call(obj["name"], {})


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a Hermes / Qwen answer; no valid block: the text is content."""
    if HERMES_START not in text:
        return text, []
    calls = []
    for m in _HERMES_RE.finditer(text):
        try:
            call = _call_from(json.loads(m.group(1).strip()), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(HERMES_START)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a Llama 3.1 JSON answer: `{"name", "parameters"}` objects
    separated by ';', optionally after <|python_tag|>; anything else is content."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


def parse_forced(text: str, choice: Any) -> list[dict]:
    """The calls of a constrained answer (tool_choice "required" or named); [] when it was
    cut short (max_tokens) and does not parse."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if choice == "required":
        if not isinstance(value, list):
            return []
        return [c for obj in value if (c := _call_from(obj, ("parameters",))) is not None]
    return [make_call(choice["function"]["name"], value)]


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


class ToolCalls:
    """One request's tool-call handling: the whole answer (`parse`), or a stream (`feed`
    each text delta, the content that may go out now; `finish`, the held rest)."""

    def __init__(self, choice: Any, parser: str | None, parallel: bool) -> None:
        self.choice, self.parser, self.parallel = choice, parser, parallel
        self.forced = choice != "auto"
        self._text = ""
        self._sent = 0  # characters streamed as content

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole answer."""
        if self.forced:
            calls = parse_forced(text, self.choice)
            content, calls = (None, calls) if calls else (text, [])
        else:
            content, calls = PARSERS[self.parser](text)
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls

    def feed(self, delta: str) -> str:
        """Content that may stream now; text that is or may become a call is held."""
        self._text += delta
        if self.forced:
            return ""
        if self.parser == "hermes":
            at = self._text.find(HERMES_START, self._sent)
            if at >= 0:
                hold = at
            else:  # a tail that could still grow into the start tag
                hold = next((len(self._text) - k for k in range(len(HERMES_START) - 1, 0, -1)
                             if self._text.endswith(HERMES_START[:k])), len(self._text))
        else:
            head = self._text.lstrip()
            may_call = head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
            hold = 0 if may_call else len(self._text)
        start, self._sent = self._sent, max(hold, self._sent)  # text once sent stays sent
        return self._text[start:self._sent]

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of a stream: the held text (content when it held no call) and the
        calls."""
        content, calls = self.parse(self._text)
        if calls:
            return "", calls
        return self._text[self._sent:], []
