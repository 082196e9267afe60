"""Cycle records and their export as a Chrome-trace / Perfetto timeline.

A `CycleRecord` is what the engine hands the profiler for each decode cycle: plain Python,
already resolved to milliseconds on one clock (ms since the profiler's origin). The trace
shows one lane (thread) per configuration, a "cycle" slice per cycle and its phases nested
under it. Open the file in ui.perfetto.dev or chrome://tracing.

Chrome-trace times are in MICROseconds; records are in milliseconds (x 1000 here, once).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PID = 1  # one process: the engine
SEGMENT_PHASES = ("draft", "verify_commit")  # Phase.DRAFT and Phase.VERIFY_COMMIT
TIMING_MODES = ("segments", "phases")


@dataclass
class CycleRecord:
    index: int  # cycle number within its configuration, from 0
    config: str  # label of the engine configuration, e.g. "spec steps=5 topk=1 ndt=6"
    start_ms: float  # cycle start, ms since the profiler's origin (same clock for all records)
    wall_ms: float  # cycle wall time
    # (phase name, start_ms, dur_ms); names are Phase values, draft steps "draft_step[1]", ...
    phases: list[tuple[str, float, float]]
    tokens: int  # tokens emitted by the cycle
    accepted: int | None = None  # draft tokens accepted (None for plain decoding)
    # The engine step the cycle was: sequences in its batch, how many speculated, and the
    # target tokens it fed by kind; each speculating sequence's accepted draft tokens and
    # the draft positions it verified (fewer than num_steps where the confidence stop ended
    # its chain; empty where unknown).
    batch: int = 1
    speculating: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    verify_tokens: int = 0
    accepted_all: tuple[int, ...] = ()
    drafted_all: tuple[int, ...] = ()
    # MoE targets: distinct experts the step's target forward activated, mean over the MoE
    # layers (None: a dense target).
    experts_active: float | None = None
    # Tensor parallelism: each collective (phase it ran in, op, start_ms, dur_ms, bytes).
    collectives: list[tuple[str, str, float, float, int]] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """How the cycle was timed: "segments" when it replayed CUDA graphs (only the
        segments draft and verify_commit have times), else "phases" (eager, or the capture
        cycle of a KV window: every phase timed). The two never share a summary row."""
        return "segments" if any(n in SEGMENT_PHASES for n, _, _ in self.phases) else "phases"

    @property
    def other_ms(self) -> float:
        """Wall time in no named phase. >= 0 up to rounding; not clamped, so errors show."""
        return self.wall_ms - sum(dur for _, _, dur in self.phases)


def _last_per_config(
    records: list[CycleRecord], last: int | None
) -> dict[str, list[CycleRecord]]:
    """Records grouped by configuration (first-seen order), keeping the last `last` of each."""
    if last is not None and last < 0:
        raise ValueError(f"last must be >= 0 or None, got {last}")
    groups: dict[str, list[CycleRecord]] = {}
    for r in records:
        groups.setdefault(r.config, []).append(r)
    if last is None:
        return groups
    # `rs[-0:]` would keep everything, hence the explicit slice start.
    return {c: rs[max(len(rs) - last, 0) :] for c, rs in groups.items()}


def chrome_trace(records: list[CycleRecord], last: int | None = None) -> dict:
    """A Chrome-trace JSON object of the last `last` cycles of each configuration.

    Lane (tid) k+1 is the k-th configuration seen. Within a lane, events are sorted by start
    time, a cycle before the phases it contains (longer first at equal start), which is the
    order trace viewers need to nest complete ("X") events; under tensor parallelism each
    collective is a slice of its own (cat "collective") inside its phase.
    """
    groups = _last_per_config(records, last)
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "specscope"}}
    ]
    for tid, (config, recs) in enumerate(groups.items(), start=1):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": config}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
             "args": {"sort_index": tid}}
        )
        lane: list[dict] = []
        for r in recs:
            lane.append({
                "name": "cycle", "cat": "cycle", "ph": "X", "pid": PID, "tid": tid,
                "ts": r.start_ms * 1000.0, "dur": r.wall_ms * 1000.0,
                "args": {"config": config, "index": r.index, "tokens": r.tokens,
                         "accepted": r.accepted, "other_ms": r.other_ms, "batch": r.batch,
                         "speculating": r.speculating, "prefill_tokens": r.prefill_tokens,
                         "decode_tokens": r.decode_tokens,
                         "verify_tokens": r.verify_tokens,
                         "accepted_all": list(r.accepted_all),
                         "drafted_all": list(r.drafted_all),
                         "experts_active": r.experts_active},
            })
            for name, start_ms, dur_ms in r.phases:
                lane.append({
                    "name": name, "cat": "phase", "ph": "X", "pid": PID, "tid": tid,
                    "ts": start_ms * 1000.0, "dur": dur_ms * 1000.0,
                    "args": {"cycle": r.index, "ms": dur_ms},
                })
            for phase, op, start_ms, dur_ms, nbytes in r.collectives:  # nested in phase
                lane.append({
                    "name": op, "cat": "collective", "ph": "X", "pid": PID, "tid": tid,
                    "ts": start_ms * 1000.0, "dur": dur_ms * 1000.0,
                    "args": {"cycle": r.index, "phase": phase, "ms": dur_ms,
                             "bytes": nbytes},
                })
        lane.sort(key=lambda e: (e["ts"], -e["dur"], e["name"] != "cycle"))
        events.extend(lane)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` via a temp file in the same folder and os.replace.

    Readers see the old file or the new one, never half of one; on failure the temp file
    is removed and the old file is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp's file is private (0600); the result gets the mode of any file written
        # here (0666 less the umask), as the run's other outputs do.
        os.chmod(tmp, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_chrome_trace(
    records: list[CycleRecord], path: str | os.PathLike, last: int | None = None
) -> Path:
    """Write `chrome_trace(records, last)` to `path` atomically; returns the path."""
    return write_text_atomic(path, json.dumps(chrome_trace(records, last)))
