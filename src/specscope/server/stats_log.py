"""The server's periodic throughput line (vLLM's "Avg prompt throughput ..." and
"SpecDecoding metrics" lines): every `interval` seconds with traffic, prompt and generation
tok/s, running and waiting requests, KV-cache use, prefix-cache hit rate, and for the
speculative steps the mean accept length, the drafted and accepted tokens and the
acceptance at each draft position in both definitions (docs/speculative.md): conditional
(accepted at i given all earlier were, ours) and per draft (accepted at i over all drafts,
vLLM's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specscope.engine.llm import StepRecord
from specscope.engine.speculative import acceptance_by_position

log = logging.getLogger("specscope.server.stats")


class StatsLog:
    """Accumulates steps (engine thread) and logs one line per `interval` seconds that saw
    any. state(): the engine's queues and KV counters (Engine.state)."""

    def __init__(self, state: Callable[[], dict], interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state, self.interval, self.clock = state, interval, clock
        self._start = clock()
        self._reset()
        self._prefix = (0, 0)  # prefix-cache (queries, hits) at the last line

    def _reset(self) -> None:
        self.prompt_tokens = self.tokens = self.drafted = self.depth = 0
        self.accepted: list[int] = []
        self.positions: list[int] = []

    def record(self, step: StepRecord) -> None:
        self.prompt_tokens += step.prefill_tokens
        self.tokens += step.tokens
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.positions += step.positions or [step.depth] * len(step.accepted)
        self.depth = max(self.depth, step.depth)
        now = self.clock()
        if now - self._start >= self.interval:
            if self.tokens or self.prompt_tokens:
                log.info("%s", self.line(now - self._start))
            self._start = now
            self._reset()

    def line(self, seconds: float) -> str:
        st = self.state()
        q, h = st["prefix_queries"] - self._prefix[0], st["prefix_hits"] - self._prefix[1]
        self._prefix = (st["prefix_queries"], st["prefix_hits"])
        text = (f"prompt {self.prompt_tokens / seconds:.1f} tok/s, generation "
                f"{self.tokens / seconds:.1f} tok/s, running {st['running']}, waiting "
                f"{st['waiting']}, KV cache {100 * st['kv_blocks_in_use'] / st['kv_blocks']:.1f} "
                f"% of {st['kv_blocks']} blocks, prefix-cache hit rate "
                f"{100 * h / q if q else 0.0:.1f} %")
        if self.accepted:
            n = len(self.accepted)
            acc = sum(self.accepted)
            cond, per = acceptance_by_position(self.accepted, max(self.depth, 1),
                                               self.positions)
            text += (f"; speculation: {n} drafts, mean accept length {1 + acc / n:.2f}, "
                     f"accepted {acc} of {self.drafted} draft tokens "
                     f"({100 * acc / max(self.drafted, 1):.1f} %), acceptance by position "
                     f"(conditional) {', '.join(f'{x:.2f}' for x in cond)}, (per draft) "
                     f"{', '.join(f'{x:.2f}' for x in per)}")
        return text
