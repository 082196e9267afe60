"""The goodput guardrail: is speculative decoding on this server actually faster than plain
decoding would be, at each batch size it runs at?

A step's speed depends on its batch, so each batch-size bucket (1, 2, 4, 8, ...; the
profiler's and the speculation policy's) is judged on its own. Every engine step in which
all sequences speculated and none prefilled gives its bucket one sample: the tokens it
emitted and its wall time. A bucket's window holds its latest samples covering at least
`window_tokens` tokens and `min_samples` steps; its rate is tokens / seconds summed over
them. With P the bucket's predicted plain-decoding tok/s (all of its sequences together) and
m the margin:

    slower  when the window is full, its rate is below (1 - m) * P, and so is the rate of
            the steps that emitted at least half of its tokens (a shortfall sustained across
            the window, not one slow step dragging the sum down)
    ok      when the window is full otherwise
    warming_up  until the window is full

P comes from the `--auto-tune` fit (each batch size's measured plain decoding; batch 1 from
its cost model) or from a short plain calibration at start-up (`calibrate_plain`, batch 1).
A bucket without a prediction is not judged. In `warn` mode a `slower` verdict logs a
warning; in `off-when-slower` mode it also switches speculation off for that bucket only
(the policy's entry there becomes `off`; other buckets keep speculating), on the engine
thread between steps. A new configuration for a bucket (POST /admin/spec) starts its window
again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Hashable
from typing import Any

from specscope.config import SamplingParams, SpecConfig, SpecPolicy
from specscope.engine.cuda_graph import bucket_for
from specscope.engine.llm import LLM, Prompt, StepRecord
from specscope.profiler.profiler import BATCH_BUCKETS

log = logging.getLogger("specscope.server.guardrail")

MODES = ("warn", "off-when-slower", "off")
WARMING_UP, OK, SLOWER = "warming_up", "ok", "slower"


class GoodputWindow:
    """Rolling window of (decode tokens, decode seconds) samples and its verdict (module
    docstring). Pure: no clock, no I/O; the caller feeds samples."""

    def __init__(self, plain_tok_per_s: float, *, window_tokens: int = 512,
                 min_samples: int = 3, margin: float = 0.05) -> None:
        if not plain_tok_per_s > 0:
            raise ValueError(f"the plain-decoding prediction must be > 0 tok/s, got "
                             f"{plain_tok_per_s}")
        if window_tokens < 1 or min_samples < 1:
            raise ValueError(f"the guardrail window needs >= 1 token and >= 1 sample, got "
                             f"{window_tokens} and {min_samples}")
        if not 0 <= margin < 1:
            raise ValueError(f"the guardrail margin must be in [0, 1), got {margin}")
        self.plain_tok_per_s = plain_tok_per_s
        self.window_tokens = window_tokens
        self.min_samples = min_samples
        self.margin = margin
        self.config: Hashable = None  # the configuration the samples were measured under
        self._samples: collections.deque[tuple[int, float]] = collections.deque()

    def reset(self, config: Hashable = None) -> None:
        self._samples.clear()
        self.config = config

    def observe(self, tokens: int, seconds: float, config: Hashable = None) -> str:
        """Add one sample (measured under `config`: another one restarts the window) and
        return the verdict."""
        if config != self.config:
            self.reset(config)
        if tokens <= 0 or seconds <= 0:  # nothing measured
            return self.verdict
        self._samples.append((tokens, seconds))
        # Drop the oldest samples the window can do without: it keeps covering
        # window_tokens tokens and min_samples samples.
        while (len(self._samples) > self.min_samples
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
    def samples(self) -> int:
        return len(self._samples)

    @property
    def tok_per_s(self) -> float:
        s = self.seconds
        return self.tokens / s if s > 0 else 0.0

    @property
    def slow_share(self) -> float:
        """Fraction of the window's tokens emitted by samples slower than the threshold."""
        n = self.tokens
        slow = sum(t for t, s in self._samples if t / s < self.threshold)
        return slow / n if n else 0.0

    @property
    def threshold(self) -> float:
        return self.plain_tok_per_s * (1.0 - self.margin)

    @property
    def full(self) -> bool:
        return self.tokens >= self.window_tokens and self.samples >= self.min_samples

    @property
    def verdict(self) -> str:
        if not self.full:
            return WARMING_UP
        return SLOWER if self.tok_per_s < self.threshold and self.slow_share >= 0.5 else OK


class Guardrail:
    """The server's guardrail: a GoodputWindow per batch-size bucket, fed by pure
    speculative steps, and what to do on its verdict (`mode`). `after_step` runs on the
    engine thread; `state` may be read from any thread.

    plain_tok_per_s: the predicted plain-decoding tok/s by bucket (all sequences of a
    step together), or one number for batch 1."""

    def __init__(self, plain_tok_per_s: float | dict[int, float], source: str, *,
                 mode: str = "warn", window_tokens: int = 512, min_samples: int = 3,
                 margin: float = 0.05) -> None:
        if mode not in MODES:
            raise ValueError(f"guardrail mode must be one of {MODES}, got {mode!r}")
        plain = plain_tok_per_s if isinstance(plain_tok_per_s, dict) else {1: plain_tok_per_s}
        bad = [b for b in plain if bucket_for(b) != b]
        if bad:
            raise ValueError(f"guardrail predictions must be for batch-size buckets "
                             f"{BATCH_BUCKETS}, got {bad}")
        self.mode = mode
        self.source = source  # where the predictions came from, said in every report
        self.windows = {b: GoodputWindow(p, window_tokens=window_tokens,
                                         min_samples=min_samples, margin=margin)
                        for b, p in sorted(plain.items())}
        self.switched_off: set[int] = set()  # buckets this guardrail switched off
        self.switch_offs = 0
        self.last_trigger: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def after_step(self, llm: LLM, step: StepRecord) -> None:
        """Feed one engine step (engine thread); warn and, in off-when-slower mode, switch
        speculation off for the bucket on a `slower` verdict."""
        if (self.mode == "off" or step.prefill_tokens or step.batch == 0
                or step.speculating < step.batch):
            return  # plain or mixed steps: nothing to compare
        b = bucket_for(step.batch)
        w = self.windows.get(b)
        spec = llm.engine.spec if llm.engine is not None else None
        if w is None or spec is None:
            return  # no prediction for this bucket: not judged
        with self._lock:
            self.switched_off.discard(b)  # speculating here again: someone switched it on
            before = w.verdict if w.config == spec else WARMING_UP
            verdict = w.observe(step.tokens, step.seconds, spec)
            if verdict == before:
                return
            numbers = (f"at batch <= {b}, speculative decoding ran at {w.tok_per_s:.1f} tok/s "
                       f"over the last {w.tokens} tokens ({w.samples} steps) against "
                       f"{w.plain_tok_per_s:.1f} tok/s predicted for plain decoding "
                       f"({self.source}; margin {w.margin:.0%})")
            if verdict == OK and before == SLOWER:
                log.info("guardrail: recovered: %s", numbers)
            if verdict != SLOWER:
                return
            self.last_trigger = {"time": time.time(), "bucket": b, "spec": _spec_label(spec),
                                 "window_tok_per_s": round(w.tok_per_s, 3),
                                 "window_tokens": w.tokens, "window_steps": w.samples,
                                 "plain_tok_per_s": round(w.plain_tok_per_s, 3)}
            if self.mode == "warn":
                log.warning("guardrail: %s; speculation stays on (--guardrail warn)", numbers)
                return
            log.warning("guardrail: %s; switching speculation off at batch <= %d "
                        "(--guardrail off-when-slower; POST /admin/spec switches it back "
                        "on)", numbers, b)
            self.switched_off.add(b)
            self.switch_offs += 1
            w.reset()  # a later configuration is judged on its own samples
        llm.set_spec(llm.spec, policy_without(llm.spec, llm.spec_policy, b))

    @property
    def verdict(self) -> str:
        """slower if any bucket is, ok if any is judged, else warming_up."""
        verdicts = {w.verdict for w in self.windows.values()}
        return SLOWER if SLOWER in verdicts else OK if OK in verdicts else WARMING_UP

    def state(self) -> dict[str, Any]:
        with self._lock:
            buckets = [{"bucket": b, "verdict": w.verdict,
                        "window_tok_per_s": round(w.tok_per_s, 3), "window_tokens": w.tokens,
                        "window_seconds": round(w.seconds, 4), "window_steps": w.samples,
                        "slow_share": round(w.slow_share, 3),
                        "plain_tok_per_s": round(w.plain_tok_per_s, 3),
                        "threshold_tok_per_s": round(w.threshold, 3),
                        "switched_off": b in self.switched_off}
                       for b, w in self.windows.items()]
            first = next(iter(self.windows.values()))
            return {"object": "guardrail", "mode": self.mode, "verdict": self.verdict,
                    "buckets": buckets, "plain_source": self.source, "margin": first.margin,
                    "min_window_tokens": first.window_tokens,
                    "min_window_steps": first.min_samples,
                    "switched_off": sorted(self.switched_off),
                    "switch_offs": self.switch_offs, "last_trigger": self.last_trigger}


def policy_without(spec: SpecConfig | None, policy: SpecPolicy | None,
                   bucket: int) -> SpecPolicy | None:
    """The policy in force (a policy, or one configuration for every batch) with plain
    decoding for the batches of `bucket` (those above the bucket below it)."""
    if spec is None:
        return policy
    lower = max([b for b in BATCH_BUCKETS if b < bucket] or [0])
    points = sorted(set(BATCH_BUCKETS) | ({b for b, _ in policy.entries} if policy else set()))
    entries: list[tuple[int, SpecConfig | None]] = []
    for b in points:  # b: the largest batch of the interval since the previous point
        c = None if lower < b <= bucket else policy.for_batch(b) if policy else spec
        if entries and entries[-1][1] == c:
            entries[-1] = (b, c)  # the same configuration: one wider bucket
        else:
            entries.append((b, c))
    return SpecPolicy(tuple(entries))


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
