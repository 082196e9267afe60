"""The OpenAI response bodies of both completion routes: stream chunks and whole bodies,
choices indexed across prompts x n, usage summed, log-probabilities in each route's shape.

Chat (`logprobs: true`, `top_logprobs: k`): choice.logprobs = {"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}.
Completions (`logprobs: k`): choice.logprobs = {"tokens", "token_logprobs",
"top_logprobs" (token -> logprob: the k top ones and the chosen one, as vLLM), "text_offset"
(each token's offset in the choice's text, the echoed prompt included)}.
Values are the target's raw log-probabilities (engine/request.py).
"""

from __future__ import annotations

from typing import Any

from specscope.engine.request import Logprob, RequestOutput, SampleLogprobs


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

    def __init__(self, rid: str, created: int, model: str, fingerprint: str,
                 k: int | None) -> None:
        self.rid, self.created, self.model, self.fingerprint = rid, created, model, fingerprint
        self.k = k  # top log-probabilities per token (None: no logprobs)

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chunk(self, choices: list[dict]) -> dict:
        return {**self._head(self.chunk_obj), "choices": choices}

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return {**self.chunk([]), "usage": usage(outs)}

    def body(self, outs: list[RequestOutput], prefixes: list[str] | None = None) -> dict:
        choices = []
        for p, out in enumerate(outs):
            for c in out.outputs:
                prefix = prefixes[p] if prefixes else ""
                choices.append(self.choice(len(choices), prefix, c.text, c.logprobs,
                                           c.finish_reason))
        return {**self._head(self.obj), "choices": choices, "usage": usage(outs)}


class ChatFormat(Format):
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._roled: set[int] = set()  # choices whose first chunk (with the role) went out

    def delta(self, index: int, text: str | None, lps: SampleLogprobs | None,
              finish: str | None) -> dict:
        d: dict[str, Any] = {}
        if index not in self._roled:
            d["role"] = "assistant"
            self._roled.add(index)
        if text is not None:
            d["content"] = text
        logprobs = chat_logprobs(lps, self.k) if lps and self.k is not None else None
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, index: int, prefix: str, text: str, lps: SampleLogprobs | None,
               finish: str) -> dict:
        logprobs = chat_logprobs(lps or [], self.k) if self.k is not None else None
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}


class CompletionFormat(Format):
    obj = chunk_obj = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._offset: dict[int, int] = {}  # per choice: the text streamed so far

    def _logprobs(self, index: int, lps: SampleLogprobs) -> dict:
        """The completions logprobs object of tokens' entries, offsets running on from
        what this choice already has."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        at = self._offset.get(index, 0)
        for entry in lps:
            chosen = next(iter(entry.values()))
            text = chosen.decoded_token or ""
            out["tokens"].append(text)
            out["token_logprobs"].append(chosen.logprob)
            top = {lp.decoded_token or "": lp.logprob for lp in _top(entry, self.k)}
            top.setdefault(text, chosen.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(at)
            at += len(text)
        return out

    def delta(self, index: int, text: str | None, lps: SampleLogprobs | None,
              finish: str | None) -> dict:
        logprobs = None
        if self.k is not None and lps:
            logprobs = self._logprobs(index, lps)
        self._offset[index] = self._offset.get(index, 0) + len(text or "")
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish}

    def choice(self, index: int, prefix: str, text: str, lps: SampleLogprobs | None,
               finish: str) -> dict:
        self._offset[index] = len(prefix)
        logprobs = self._logprobs(index, lps or []) if self.k is not None else None
        return {"index": index, "text": prefix + text, "logprobs": logprobs,
                "finish_reason": finish}
