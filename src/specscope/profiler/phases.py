"""The phases of a cycle, named once, and a timer that records them without host syncs.

On CUDA a mark is an event recorded on the stream (no synchronisation); events are
resolved to milliseconds lazily, when a summary is asked for. On the CPU a mark is
perf_counter_ns. Inside a CUDA graph individual kernels cannot be timed, so graph-replayed
segments are timed as a whole: a segment's phase name says what it contains.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict

import torch


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_STEP = "draft_step"
    TREE_BUILD = "tree_build"
    VERIFY = "verify"
    ACCEPT = "accept"
    KV_COMMIT = "kv_commit"
    DECODE = "decode"  # one plain decoding step (the no-draft cycle)
    DRAFT = "draft"  # a graph-replayed segment: draft extend + draft steps + tree build
    VERIFY_COMMIT = "verify_commit"  # a graph-replayed segment: verify + accept + kv commit
    DETOKENIZE = "detokenize"
    OTHER = "other"


class PhaseTimer:
    """Records (phase, start, end) marks per cycle. `mark(phase)` closes the previous phase.

    Disabled timers are not created at all (callers hold None), so off costs nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._pending: list[tuple[str, object, object]] = []
        self._open: tuple[str, object] | None = None
        self.totals_ms: dict[str, list[float]] = defaultdict(list)

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter_ns()

    def mark(self, phase: Phase | str) -> None:
        """Close the open phase (if any) and open `phase` now."""
        now = self._now()
        if self._open is not None:
            self._pending.append((self._open[0], self._open[1], now))
        self._open = (Phase(phase).value, now)

    def stop(self) -> None:
        """Close the open phase."""
        if self._open is not None:
            now = self._now()
            self._pending.append((self._open[0], self._open[1], now))
            self._open = None

    def resolve(self) -> dict[str, list[float]]:
        """Turn recorded marks into milliseconds (synchronises CUDA once, here only)."""
        if self.cuda and self._pending:
            torch.cuda.synchronize(self.device)
        for name, a, b in self._pending:
            ms = a.elapsed_time(b) if self.cuda else (b - a) / 1e6
            self.totals_ms[name].append(ms)
        self._pending.clear()
        return self.totals_ms

    def reset(self) -> None:
        self._pending.clear()
        self._open = None
        self.totals_ms = defaultdict(list)
