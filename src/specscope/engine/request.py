"""Request state: tokens emitted so far, stop conditions, text, log-probabilities, timings.

Output shapes are vLLM's: a `RequestOutput` per prompt with one `CompletionOutput` per
choice (n of them); a choice's `logprobs`, when asked for, is a list with one dict per
generated token, token id -> `Logprob` (the chosen token first, then the top ones by rank;
the chosen token appears once, so a dict holds k or k + 1 entries). Values are the target
model's raw log-probabilities (log_softmax of its logits before penalties, bias or
filters: vLLM's default `raw_logprobs`), the same with and without speculation.
"""

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
class Logprob:
    """A token's log-probability under the target's raw distribution, its rank there (1:
    the most likely; vLLM's: the tokens at least as likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per token: token id -> Logprob (vLLM's SampleLogprobs).
SampleLogprobs = list[dict[int, Logprob]]


def logprob_dict(token: int, entry: tuple, tokenizer: Tokenizer) -> dict[int, Logprob]:
    """vLLM's dict of a token from the engine's entry (its log-probability, its rank, the
    top (id, log-probability) pairs): the token first, then the top ones by rank."""
    lp, rank, top = entry

    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    out = {token: Logprob(lp, rank, text(token))}
    for r, (t, v) in enumerate(top, start=1):
        if t not in out:
            out[t] = Logprob(v, r, text(t))
    return out


def prompt_logprobs(prompt_ids: list[int], entries: list, tokenizer: Tokenizer
                    ) -> list[dict[int, Logprob] | None]:
    """RequestOutput.prompt_logprobs: None for the first token, then each prompt token's."""
    return [None] + [logprob_dict(t, e, tokenizer) for t, e in zip(prompt_ids[1:], entries,
                                                                 strict=True)]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, in vLLM's shape (RequestOutput.outputs[i]).
    finish_reason: "stop" (EOS, a stop id or string), "length" (max_tokens or the
    context), or "abort" (cancelled, or the server stopped it)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None


@dataclass
class RequestOutput:
    """A finished request. vLLM's shape (`outputs[i].text`, one per choice) and the
    shortcuts `text`, `token_ids` and `finish_reason` of its first completion.
    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token (None
    for the first, which has no prefix)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Speculative statistics (cycles, accept_length, acceptance_by_position, simulated);
    # None for plain decoding.
    spec: dict | None = None
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


class Request:
    """One generation (one choice of a request: `index`). `append` consumes emitted tokens
    (and their log-probabilities, when asked for) and returns the text to stream."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, index: int = 0) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.index = index
        self.tokenizer = tokenizer
        self.output_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self._pending_lp: list = []  # the engine's entries for the tokens being appended
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

    def append(self, tokens: list[int], logprobs: list | None = None) -> str:
        """Consume tokens emitted by one cycle; return the text that may now be streamed.
        logprobs: the engine's entry per token (engine.TokenLogprobs), kept for the tokens
        that are kept.

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
        if logprobs is not None and self.logprobs is not None:
            self._pending_lp = list(logprobs)
        if not self._max_stop or len(tokens) <= 1:
            return self._consume(tokens)
        pieces = []
        for t in tokens:
            if self.finished:
                break
            pieces.append(self._consume([t]))
        return "".join(pieces)

    def _keep_logprob(self, token: int) -> None:
        """The log-probabilities of a token just appended to output_ids, as vLLM's dict."""
        if self.logprobs is None or not self._pending_lp:
            return
        self.logprobs.append(logprob_dict(token, self._pending_lp.pop(0), self.tokenizer))

    def _consume(self, tokens: list[int]) -> str:
        """Stop ids and max_tokens per token, then decode what is left and apply stop strings."""
        new: list[int] = []
        for t in tokens:
            if self.finished:
                break  # tokens past a stop are discarded, never shown
            self.output_ids.append(t)
            self._keep_logprob(t)
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

    def completion(self) -> CompletionOutput:
        """This choice as vLLM's CompletionOutput."""
        lps = self.logprobs
        cum = None if lps is None else sum(e[t].logprob for e, t in zip(
            lps, self.output_ids, strict=False))
        return CompletionOutput(self.index, self._text, list(self.output_ids),
                                self.finish_reason or "length", cum,
                                None if lps is None else list(lps))

    def output(self) -> RequestOutput:
        """A request of this one choice."""
        return request_output(self.request_id, self.prompt_ids, [self])


def request_output(request_id: str, prompt_ids: list[int], choices: list[Request],
                   prompt_logprobs: list | None = None) -> RequestOutput:
    """The RequestOutput of a request's choices (in index order): its prompt counted once,
    the choices' tokens summed; first token and last token over all of them."""
    t0 = min(c.t_arrival for c in choices)
    firsts = [c.t_first for c in choices if c.t_first is not None]
    lasts = [c.t_last for c in choices if c.t_last is not None]
    first, last = (min(firsts) if firsts else None), (max(lasts) if lasts else None)
    m = RequestMetrics(
        prompt_tokens=len(prompt_ids),
        completion_tokens=sum(len(c.output_ids) for c in choices),
        ttft_s=(first - t0) if first else 0.0,
        decode_s=(last - first) if first and last else 0.0,
        total_s=((last or t0) - t0),
    )
    return RequestOutput(request_id, prompt_ids, [c.completion() for c in choices], m,
                         prompt_logprobs=prompt_logprobs)
