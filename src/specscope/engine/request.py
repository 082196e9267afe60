"""Request state: tokens emitted so far, stop conditions, text, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specscope.config import SamplingParams
from specscope.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0  # arrival -> first token on the host
    decode_s: float = 0.0  # first token -> last token
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first (the steady decode rate)."""
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, in vLLM's shape (RequestOutput.outputs[i])."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    """A finished request. vLLM's shape (`outputs[0].text`) and the shortcuts `text`,
    `token_ids` and `finish_reason` of its one completion."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop id or stop string) or "length" (max_tokens)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Speculative statistics (cycles, accept_length, acceptance_by_position, simulated);
    # None for plain decoding.
    spec: dict | None = None
    finished: bool = True

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]


class Request:
    """One generation. `append` consumes emitted tokens and returns the text to stream."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tokenizer.eos_token_ids
        self._text = ""  # all decoded text (before stop-string truncation)
        self._emitted = 0  # chars of _text already streamed
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> str:
        """Consume tokens emitted by one cycle; return the text that may now be streamed.

        A speculative cycle emits several tokens at once. With stop strings they are taken
        one at a time, checking for a stop after each, so that output_ids, text and
        finish_reason are exactly those of plain decoding (one token per call): the output
        ends at the token whose text completes the stop string, and the cycle's later tokens
        are dropped (they must not count as completion tokens). Without stop strings the
        whole cycle is decoded at once: that is the hot path, and its result is the same.
        """
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if not self._max_stop or len(tokens) <= 1:
            return self._consume(tokens)
        pieces = []
        for t in tokens:
            if self.finished:
                break
            pieces.append(self._consume([t]))
        return "".join(pieces)

    def _consume(self, tokens: list[int]) -> str:
        """Stop ids and max_tokens per token, then decode what is left and apply stop strings."""
        new: list[int] = []
        for t in tokens:
            if self.finished:
                break  # tokens past a stop are discarded, never shown
            self.output_ids.append(t)
            if t in self._stop_ids:
                self.finish_reason = "stop"
            else:
                new.append(t)
                if len(self.output_ids) >= self.params.max_tokens:
                    self.finish_reason = "length"
        if new:
            self._text += self._detok.add(new)
        if self.finished:
            self._text += self._detok.flush()
        return self._release()

    def _release(self) -> str:
        """Apply stop strings; hold back a tail that could still grow into one."""
        if self._max_stop:
            start = max(0, self._emitted - self._max_stop + 1)
            hits = [(i, s) for s in self.params.stop
                    if (i := self._text.find(s, start)) != -1]
            if hits:
                i, s = min(hits)
                end = i + len(s) if self.params.include_stop_str_in_output else i
                self._text = self._text[:end]
                self.finish_reason = "stop"
        limit = len(self._text)
        if not self.finished and self._max_stop:
            for k in range(min(self._max_stop - 1, len(self._text)), 0, -1):
                tail = self._text[-k:]
                if any(s.startswith(tail) for s in self.params.stop):
                    limit = len(self._text) - k
                    break
        delta = self._text[self._emitted:limit]
        self._emitted = max(self._emitted, limit)
        return delta

    def end(self, reason: str) -> str:
        """The engine ended the sequence for a reason the request does not check itself
        (the context is full, the server cancelled it): flush the text, set the reason."""
        if self.finished:
            return ""
        self.finish_reason = reason
        self._text += self._detok.flush()
        return self._release()

    @property
    def text(self) -> str:
        return self._text

    def output(self) -> RequestOutput:
        m = RequestMetrics(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            ttft_s=(self.t_first - self.t_arrival) if self.t_first else 0.0,
            decode_s=(self.t_last - self.t_first) if self.t_first and self.t_last else 0.0,
            total_s=((self.t_last or self.t_arrival) - self.t_arrival),
        )
        return RequestOutput(self.request_id, self.prompt_ids, self._text, list(self.output_ids),
                             self.finish_reason or "length", m)
