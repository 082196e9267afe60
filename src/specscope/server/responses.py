"""The OpenAI response bodies of both completion routes: stream chunks and whole bodies,
choices indexed across prompts x n, usage summed, log-probabilities in each route's shape.

Chat (`logprobs: true`, `top_logprobs: k`): choice.logprobs = {"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}.
Completions (`logprobs: k`): choice.logprobs = {"tokens", "token_logprobs",
"top_logprobs" (token -> logprob: the k top ones and the chosen one, as vLLM), "text_offset"
(each token's offset in the choice's text, the echoed prompt included)}. With echo the
prompt's tokens come first, the first with null log-probabilities (it has no prefix).
Values are the target's raw log-probabilities (engine/request.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specscope.engine.request import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from specscope.engine.tokenizer import Tokenizer
from specscope.server.tools import ToolCalls


def usage(outs: list[RequestOutput]) -> dict:
    """Prompt tokens (each prompt once) and completion tokens (every choice), summed over
    the requests; `spec`, a request's speculative statistics, when there is one request."""
    p = sum(o.metrics.prompt_tokens for o in outs)
    c = sum(o.metrics.completion_tokens for o in outs)
    body: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if len(outs) == 1 and outs[0].spec is not None:
        body["spec"] = outs[0].spec
    return body


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens of a token's entry, by rank."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                  key=lambda lp: lp.rank)[:k]


def _chat_token(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: SampleLogprobs, k: int) -> dict:
    """A chat choice's (or chunk's) logprobs object for tokens' entries."""
    content = []
    for entry in entries:
        chosen = next(iter(entry.values()))  # the chosen token comes first
        item = _chat_token(chosen)
        item["top_logprobs"] = [_chat_token(lp) for lp in _top(entry, k)]
        content.append(item)
    return {"content": content}


class Format:
    """What both routes' bodies share: id, created, model, system_fingerprint."""

    obj = chunk_obj = ""
    tools: Callable[[], ToolCalls] | None = None  # chat with tool-call parsing only

    def __init__(self, rid: str, created: int, model: str, fingerprint: str,
                 k: int | None, tokenizer: Tokenizer | None = None) -> None:
        self.rid, self.created, self.model, self.fingerprint = rid, created, model, fingerprint
        self.k = k  # top log-probabilities per token (None: no logprobs)
        self.tokenizer = tokenizer  # for the echoed prompt's first token's text

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chunk(self, choices: list[dict]) -> dict:
        return {**self._head(self.chunk_obj), "choices": choices}

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return {**self.chunk([]), "usage": usage(outs)}

    def feed(self, index: int, text: str) -> str:
        """Of a stream's new text for choice `index`, what may go out now."""
        return text

    def ending(self, index: int, finish: str) -> list[dict]:
        """The deltas that end choice `index` of a stream."""
        return [self.delta(index, None, None, finish)]

    def body(self, outs: list[RequestOutput], prefixes: list[str] | None = None) -> dict:
        choices = []
        for p, out in enumerate(outs):
            for c in out.outputs:
                prefix = prefixes[p] if prefixes else None
                choices.append(self.choice(len(choices), out, c, prefix))
        return {**self._head(self.obj), "choices": choices, "usage": usage(outs)}


class ChatFormat(Format):
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, tools: Callable[[], ToolCalls] | None = None) -> None:
        super().__init__(*args)
        self._roled: set[int] = set()  # choices whose first chunk (with the role) went out
        self.tools = tools  # a new ToolCalls per choice (each parses its own answer)
        self._calls: dict[int, ToolCalls] = {}

    def _parser(self, index: int) -> ToolCalls:
        if index not in self._calls:
            self._calls[index] = self.tools()
        return self._calls[index]

    def delta(self, index: int, text: str | None, lps: SampleLogprobs | None,
              finish: str | None, calls: list[dict] | None = None) -> dict:
        d: dict[str, Any] = {}
        if index not in self._roled:
            d["role"] = "assistant"
            self._roled.add(index)
        if text is not None:
            d["content"] = text
        if calls:  # each call whole, in one chunk
            d["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        logprobs = chat_logprobs(lps, self.k) if lps and self.k is not None else None
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    def feed(self, index: int, text: str) -> str:
        return text if self.tools is None else self._parser(index).feed(text)

    def ending(self, index: int, finish: str) -> list[dict]:
        """With tools: the held text that was no call, the calls, then the finish
        ("tool_calls" when the answer stopped on its own with calls)."""
        if self.tools is None:
            return super().ending(index, finish)
        rest, calls = self._parser(index).finish()
        out = [self.delta(index, rest, None, None)] if rest else []
        if calls:
            out.append(self.delta(index, None, None, None, calls))
            finish = "tool_calls" if finish == "stop" else finish
        return out + [self.delta(index, None, None, finish)]

    def choice(self, index: int, out: RequestOutput, c: CompletionOutput,
               prefix: str | None) -> dict:
        logprobs = chat_logprobs(c.logprobs or [], self.k) if self.k is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if self.tools is not None:
            message["content"], calls = self.tools().parse(c.text)
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish}


class CompletionFormat(Format):
    obj = chunk_obj = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._offset: dict[int, int] = {}  # per choice: the text streamed so far

    def _logprobs(self, index: int, lps: list[dict[int, Logprob] | None],
                  first_text: str = "") -> dict:
        """The completions logprobs object of tokens' entries, offsets running on from
        what this choice already has. A None entry (an echoed prompt's first token, of
        text first_text) has null log-probabilities."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        at = self._offset.get(index, 0)
        for entry in lps:
            if entry is None:
                text, value, top = first_text, None, None
            else:
                chosen = next(iter(entry.values()))
                text, value = chosen.decoded_token or "", chosen.logprob
                top = {lp.decoded_token or "": lp.logprob for lp in _top(entry, self.k)}
                top.setdefault(text, chosen.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append(top)
            out["text_offset"].append(at)
            at += len(text)
        return out

    def _prompt_part(self, index: int, prefix: str, prompt_ids: list[int],
                     plp: list | None) -> dict | None:
        """An echoed prompt's logprobs (None without logprobs); the choice's offsets then
        run on after the prompt's text."""
        self._offset[index] = 0
        part = None
        if self.k is not None and plp is not None:
            first = self.tokenizer.decode(prompt_ids[:1]) if self.tokenizer else ""
            part = self._logprobs(index, plp, first)
        self._offset[index] = len(prefix)
        return part

    def echo(self, index: int, prefix: str, prompt_ids: list[int], plp: list | None) -> dict:
        """A stream's first chunk of a choice with echo: the prompt (and its logprobs)."""
        part = self._prompt_part(index, prefix, prompt_ids, plp)
        return {"index": index, "text": prefix, "logprobs": part, "finish_reason": None}

    def delta(self, index: int, text: str | None, lps: SampleLogprobs | None,
              finish: str | None) -> dict:
        logprobs = None
        if self.k is not None and lps:
            logprobs = self._logprobs(index, lps)
        self._offset[index] = self._offset.get(index, 0) + len(text or "")
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish}

    def choice(self, index: int, out: RequestOutput, c: CompletionOutput,
               prefix: str | None) -> dict:
        part = None
        self._offset[index] = 0
        if prefix is not None:
            part = self._prompt_part(index, prefix, out.prompt_token_ids, out.prompt_logprobs)
        logprobs = None
        if self.k is not None:
            logprobs = self._logprobs(index, c.logprobs or [])
            if part is not None:
                logprobs = {key: part[key] + logprobs[key] for key in logprobs}
        return {"index": index, "text": (prefix or "") + c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}
