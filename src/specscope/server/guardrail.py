"""The goodput guardrail: is speculative decoding on this server actually faster than plain
decoding would be?

Each finished speculative request gives one sample: its decode tokens (those after the
first) and its decode time (first token to last, so queueing and prefill are left out). The
window holds the latest samples covering at least `window_tokens` tokens and
`min_requests` requests; its rate is tokens / seconds summed over them, the goodput a
client saw. With P the predicted plain-decoding tok/s and m the margin:

    slower  when the window is full, its rate is below (1 - m) * P, and so is the rate of
            the requests that decoded at least half of its tokens (a shortfall sustained
            across the window, not one slow request dragging the sum down)
    ok      when the window is full otherwise
    warming_up  until the window is full

P comes from the `--auto-tune` cost model, or from a short plain calibration at start-up
(`calibrate_plain`). In `warn` mode a `slower` verdict logs a warning; in
`off-when-slower` mode it also switches speculation off, on the engine thread between
requests (as POST /admin/spec {"enabled": false} does). A new speculative configuration
(POST /admin/spec) starts a new window.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Hashable
from typing import Any

from specscope.config import SamplingParams
from specscope.engine.llm import LLM, Prompt
from specscope.engine.request import RequestOutput

log = logging.getLogger("specscope.server.guardrail")

MODES = ("warn", "off-when-slower", "off")
WARMING_UP, OK, SLOWER = "warming_up", "ok", "slower"


class GoodputWindow:
    """Rolling window of (decode tokens, decode seconds) samples and its verdict (module
    docstring). Pure: no clock, no I/O; the caller feeds samples."""

    def __init__(self, plain_tok_per_s: float, *, window_tokens: int = 512,
                 min_requests: int = 3, margin: float = 0.05) -> None:
        if not plain_tok_per_s > 0:
            raise ValueError(f"the plain-decoding prediction must be > 0 tok/s, got "
                             f"{plain_tok_per_s}")
        if window_tokens < 1 or min_requests < 1:
            raise ValueError(f"the guardrail window needs >= 1 token and >= 1 request, got "
                             f"{window_tokens} and {min_requests}")
        if not 0 <= margin < 1:
            raise ValueError(f"the guardrail margin must be in [0, 1), got {margin}")
        self.plain_tok_per_s = plain_tok_per_s
        self.window_tokens = window_tokens
        self.min_requests = min_requests
        self.margin = margin
        self.config: Hashable = None  # the configuration the samples were measured under
        self._samples: collections.deque[tuple[int, float]] = collections.deque()

    def reset(self, config: Hashable = None) -> None:
        self._samples.clear()
        self.config = config

    def observe(self, tokens: int, seconds: float, config: Hashable = None) -> str:
        """Add one request's sample (measured under `config`: another one restarts the
        window) and return the verdict."""
        if config != self.config:
            self.reset(config)
        if tokens <= 0 or seconds <= 0:  # a one-token request has no decode time
            return self.verdict
        self._samples.append((tokens, seconds))
        # Drop the oldest samples the window can do without: it keeps covering
        # window_tokens tokens and min_requests requests.
        while (len(self._samples) > self.min_requests
               and self.tokens - self._samples[0][0] >= self.window_tokens):
            self._samples.popleft()
        return self.verdict

    @property
    def tokens(self) -> int:
        return sum(t for t, _ in self._samples)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self._samples)

    @property
    def requests(self) -> int:
        return len(self._samples)

    @property
    def tok_per_s(self) -> float:
        s = self.seconds
        return self.tokens / s if s > 0 else 0.0

    @property
    def slow_share(self) -> float:
        """Fraction of the window's tokens decoded by requests slower than the threshold."""
        n = self.tokens
        slow = sum(t for t, s in self._samples if t / s < self.threshold)
        return slow / n if n else 0.0

    @property
    def threshold(self) -> float:
        return self.plain_tok_per_s * (1.0 - self.margin)

    @property
    def full(self) -> bool:
        return self.tokens >= self.window_tokens and self.requests >= self.min_requests

    @property
    def verdict(self) -> str:
        if not self.full:
            return WARMING_UP
        return SLOWER if self.tok_per_s < self.threshold and self.slow_share >= 0.5 else OK


class Guardrail:
    """The server's guardrail: a GoodputWindow fed by finished speculative requests, and
    what to do on its verdict (`mode`). `after_request` runs on the engine thread;
    `state` may be read from any thread."""

    def __init__(self, plain_tok_per_s: float, source: str, *, mode: str = "warn",
                 window_tokens: int = 512, min_requests: int = 3,
                 margin: float = 0.05) -> None:
        if mode not in MODES:
            raise ValueError(f"guardrail mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.source = source  # where plain_tok_per_s came from, said in every report
        self.window = GoodputWindow(plain_tok_per_s, window_tokens=window_tokens,
                                    min_requests=min_requests, margin=margin)
        self.switched_off = False  # speculation is off because of this guardrail
        self.switch_offs = 0
        self.last_trigger: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def after_request(self, llm: LLM, out: RequestOutput) -> None:
        """Feed one finished request (engine thread, between requests); warn and, in
        off-when-slower mode, switch speculation off on a `slower` verdict."""
        if self.mode == "off" or out.spec is None or llm.spec is None:
            return  # plain decoding: nothing to compare
        w = self.window
        with self._lock:
            self.switched_off = False  # speculating again: someone switched it back on
            before = w.verdict if w.config == llm.spec else WARMING_UP
            verdict = w.observe(out.metrics.completion_tokens - 1, out.metrics.decode_s,
                                llm.spec)
            if verdict == before:
                return
            numbers = (f"speculative decoding ran at {w.tok_per_s:.1f} tok/s over the last "
                       f"{w.tokens} decode tokens ({w.requests} requests) against "
                       f"{w.plain_tok_per_s:.1f} tok/s predicted for plain decoding "
                       f"({self.source}; margin {w.margin:.0%})")
            if verdict == OK and before == SLOWER:
                log.info("guardrail: recovered: %s", numbers)
            if verdict != SLOWER:
                return
            self.last_trigger = {"time": time.time(), "spec": _spec_label(llm.spec),
                                 "window_tok_per_s": round(w.tok_per_s, 3),
                                 "window_tokens": w.tokens, "window_requests": w.requests,
                                 "plain_tok_per_s": round(w.plain_tok_per_s, 3)}
            if self.mode == "warn":
                log.warning("guardrail: %s; speculation stays on (--guardrail warn)", numbers)
                return
            log.warning("guardrail: %s; switching speculation off (--guardrail "
                        "off-when-slower; POST /admin/spec {\"enabled\": true} switches it "
                        "back on)", numbers)
            self.switched_off = True
            self.switch_offs += 1
            w.reset()  # a later configuration is judged on its own samples
        llm.set_spec(None)

    def state(self) -> dict[str, Any]:
        w = self.window
        with self._lock:
            return {"object": "guardrail", "mode": self.mode, "verdict": w.verdict,
                    "window_tok_per_s": round(w.tok_per_s, 3), "window_tokens": w.tokens,
                    "window_seconds": round(w.seconds, 4), "window_requests": w.requests,
                    "slow_share": round(w.slow_share, 3),
                    "plain_tok_per_s": round(w.plain_tok_per_s, 3),
                    "threshold_tok_per_s": round(w.threshold, 3), "plain_source": self.source,
                    "margin": w.margin, "min_window_tokens": w.window_tokens,
                    "min_window_requests": w.min_requests,
                    "switched_off": self.switched_off, "switch_offs": self.switch_offs,
                    "last_trigger": self.last_trigger}


def _spec_label(spec: Any) -> str:
    return f"steps={spec.num_steps} topk={spec.topk} ndt={spec.num_draft_tokens}"


def calibrate_plain(llm: LLM, prompt: Prompt, max_tokens: int = 32, runs: int = 2) -> float:
    """Plain-decoding tok/s measured as the guardrail measures speculation (decode tokens
    over decode time): a warm-up, then `runs` generations of `max_tokens` tokens. The
    speculative configuration is switched off for it and restored after."""
    spec, policy = llm.spec, llm.spec_policy
    if spec is not None:
        llm.set_spec(None)
    try:
        llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # first-call costs
        outs = [llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
                for _ in range(runs)]
    finally:
        if spec is not None:
            llm.set_spec(spec, policy)
    tokens = sum(o.metrics.completion_tokens - 1 for o in outs)
    seconds = sum(o.metrics.decode_s for o in outs)
    if tokens <= 0 or seconds <= 0:
        raise RuntimeError("plain calibration measured no decode time; raise max_tokens")
    return tokens / seconds
