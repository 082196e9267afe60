"""The profiler: every cycle's phases, recorded without host syncs, summarised on demand.

The engine brackets each cycle with `begin_cycle` / `end_cycle` and the decoders call
`mark(phase)` at each phase boundary (`stop()` closes a phase without opening another).
Each mark is one timestamp: a CUDA event recorded on the stream (no synchronisation) or
perf_counter_ns on the CPU. Events are turned into milliseconds lazily, in `resolve`, which
synchronises once — at summary time, never per cycle. Marks outside a cycle (the prefill)
are kept per request. For every cycle, other = wall - sum(named phases): the time no phase
claims (host reads, Python between phases), so phases + other = wall by construction, and
`attributed` = named / wall says how much the named phases explain.

Summaries cover every cycle since the last reset: throughput, phase means and shares and
acceptance come from running totals. Cycles that replayed CUDA graphs are timed by segment and
cycles run eagerly (on the CPU, with graphs off, or the capture cycle of a KV window) by
phase; a summary's `modes` keeps the two apart, each with its own cycle count, so a phase row
never averages a few eager cycles over all of them. Only the last `keep` cycles of each
configuration are held as records, for percentiles and traces (bounded memory on a
long-running server).

Under tensor parallelism the group times each collective through `collective_start` /
`collective_end` (profiler/collectives.py): it is attributed to the phase open when it
began, so every phase row splits into collectives and compute.

Off means no Profiler object at all (callers hold None): zero added work.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from specscope.profiler.collectives import collectives_summary, comm_rows, format_lines
from specscope.profiler.phases import Phase
from specscope.profiler.trace import TIMING_MODES, CycleRecord

log = logging.getLogger("specscope.profile")


@dataclass
class _Pending:
    config: str
    index: int
    start: object
    end: object = None
    marks: list[tuple[str, object, object]] = field(default_factory=list)
    tokens: int = 0
    accepted: int | None = None
    step: dict = field(default_factory=dict)  # CycleRecord's batch fields
    comm: list[tuple[str, str, object, object, int]] = field(default_factory=list)


def _events(c: _Pending) -> list:
    """Every event (or host timestamp) a cycle holds: its bounds, phases and collectives."""
    return [c.start, c.end] + [e for _, a, b in c.marks for e in (a, b)] + \
        [e for _, _, a, b, _ in c.comm for e in (a, b)]


# The event pool's low-water mark: below it, finished cycles are resolved to refill it.
RECLAIM_BELOW = 64
# Finished cycles are resolved (CUDA elapsed-time queries, a record, the totals: tens of
# microseconds of host work each) by `idle`, which the engine calls as it is about to wait
# for the device at its step's read: the work fills time the host would spend waiting, and
# each cycle pays alike. Left to the pool's low-water mark it was one pause of ~50 ms every
# ~800 cycles on the H200, charged to whichever configuration's cycle met it (the tuner read
# a tree's host time 0.1-0.2 ms a cycle high from one such pause). Cycles left pending past
# this many (a loop that never calls idle) are resolved at a cycle's end.
RESOLVE_EVERY = 32

# Batch-size buckets a summary splits its cycles into (the engine's CUDA-graph buckets).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_bucket(n: int) -> int:
    return next((b for b in BATCH_BUCKETS if b >= n), BATCH_BUCKETS[-1])


@dataclass
class Totals:
    """Whole-run aggregates of one configuration's cycles (what a summary reports)."""

    cycles: int = 0
    tokens: int = 0
    wall_ms: float = 0.0
    phase_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    accepted: Counter = field(default_factory=Counter)  # accepted draft tokens -> cycles
    # drafted positions d -> cycles that accepted all d (a chain the confidence stop ended
    # there never offered position d + 1: not a rejection at it)
    ended: Counter = field(default_factory=Counter)
    drafted: int = 0  # draft positions verified, summed over the chains that report them
    drafts: int = 0  # those chains
    # MoE: "verify" (cycles that speculated) / "decode" -> [sum of experts_active, cycles]
    experts: dict[str, list[float]] = field(default_factory=dict)
    comm_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by phase
    comm_n: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by phase
    comm_b: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by phase
    comm_count: int = 0
    comm_bytes: int = 0

    def add(self, r: CycleRecord, other_ms: float | None = None) -> None:
        """Count one cycle (other_ms: r.other_ms, when the caller has it already)."""
        if r.experts_active is not None:
            acc = self.experts.setdefault("verify" if r.speculating else "decode", [0.0, 0])
            acc[0] += r.experts_active
            acc[1] += 1
        self.cycles += 1
        self.tokens += r.tokens
        self.wall_ms += r.wall_ms
        phase_ms = self.phase_ms
        for name, _, dur in r.phases:
            phase_ms[name] += dur
        phase_ms["other"] += r.other_ms if other_ms is None else other_ms
        for phase, _, _, dur, nbytes in r.collectives:
            self.comm_ms[phase] += dur
            self.comm_n[phase] += 1
            self.comm_b[phase] += nbytes
            self.comm_count += 1
            self.comm_bytes += nbytes
        accepted = self.accepted
        if r.accepted_all:
            for a in r.accepted_all:
                accepted[a] += 1
            if r.drafted_all:
                for a, d in zip(r.accepted_all, r.drafted_all, strict=True):
                    self.ended[d] += a == d
                self.drafted += sum(r.drafted_all)
                self.drafts += len(r.drafted_all)
        elif r.accepted is not None:
            accepted[r.accepted] += 1

    @classmethod
    def of(cls, recs: list[CycleRecord]) -> Totals:
        t = cls()
        for r in recs:
            t.add(r)
        return t


@dataclass
class ConfigTotals:
    """A configuration's totals: over all its cycles, per timing mode, and per batch-size
    bucket."""

    all: Totals = field(default_factory=Totals)
    modes: dict[str, Totals] = field(default_factory=lambda: defaultdict(Totals))
    buckets: dict[int, Totals] = field(default_factory=lambda: defaultdict(Totals))

    def add(self, r: CycleRecord) -> None:
        other = r.other_ms  # summed once for the three
        self.all.add(r, other)
        self.modes[r.mode].add(r, other)
        self.buckets[batch_bucket(r.batch)].add(r, other)

    @classmethod
    def of(cls, recs: list[CycleRecord]) -> ConfigTotals:
        t = cls()
        for r in recs:
            t.add(r)
        return t


class Profiler:
    """Phase timing for an engine. interval: log a summary every N cycles (None: never)."""

    def __init__(self, device: torch.device, interval: int | None = 100,
                 keep: int = 4096, prealloc: int = 4096) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        # CUDA events ready for use: created up front (cudaEventCreate costs several times a
        # record) and refilled by `resolve`.
        self._free: list = ([torch.cuda.Event(enable_timing=True) for _ in range(prealloc)]
                            if self.cuda else [])
        self._stream = torch.cuda.current_stream(device) if self.cuda else None
        self._last_end: object = None  # the previous cycle's end: the next one's start
        self.interval = interval
        self.keep = keep
        self._origin = self._now()
        self._origin_ns = time.perf_counter_ns()
        self.config = "plain"
        self.simulated: dict[str, bool] = {}
        self.positions: dict[str, int] = {}
        self._cycle: _Pending | None = None
        self._open: tuple[str, object] | None = None
        self._loose: list[tuple[str, str, object, object]] = []  # (config, phase, a, b)
        self._pending: list[_Pending] = []
        self.records: dict[str, deque[CycleRecord]] = defaultdict(lambda: deque(maxlen=keep))
        self.totals: dict[str, ConfigTotals] = defaultdict(ConfigTotals)
        self.loose_ms: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self._count: dict[str, int] = defaultdict(int)
        self._since_log = 0
        # Tensor parallelism (size, draft placement) for the summaries; None without it.
        self.parallel: dict | None = None

    # -- recording (hot path: no syncs) -----------------------------------------------------

    def _now(self) -> object:
        if self.cuda:
            # Reuse resolved events: creating one costs more than recording it. Host time
            # spent here between cycles leaves the GPU idle, so every microsecond counts.
            if len(self._free) < RECLAIM_BELOW:
                self._reclaim()
            ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            ev.record(self._stream)
            return ev
        return time.perf_counter_ns()

    def set_config(self, label: str, simulated: bool = False, positions: int = 0) -> None:
        """Label the cycles that follow (one label per engine configuration); positions =
        draft tokens per cycle (num_steps), for acceptance by position."""
        self.config = label
        self.simulated[label] = simulated
        self.positions[label] = positions

    def begin_cycle(self) -> None:
        """Open a cycle. Consecutive cycles share one timestamp (this cycle starts where the
        last one ended), so cycles tile the decode time and each boundary costs one mark;
        the first cycle after a prefill starts at its first phase mark."""
        self._cycle = _Pending(self.config, self._count[self.config], self._last_end)
        self._count[self.config] += 1

    def mark(self, phase: Phase | str, step: int | None = None) -> None:
        """Close the open phase and open `phase` (draft steps: `step` = 1, 2, ...)."""
        now = self._now()
        self._close(now)
        c = self._cycle
        if c is None:
            self._last_end = None  # a request-level phase (prefill) breaks the tiling
        elif c.start is None:
            c.start = now
        value = phase.value if isinstance(phase, Phase) else Phase(phase).value
        self._open = (value if step is None else f"{value}[{step}]", now)

    def collective_start(self) -> object:
        """A collective begins (parallel/group.py): one mark, like a phase boundary."""
        return self._now()

    def collective_end(self, start: object, op: str, nbytes: int) -> None:
        """The collective begun at `start` ended; it belongs to the phase open now (the one
        it started in: collectives never span a mark). Outside a cycle it is dropped with
        the request-level phase it ran in, like that phase's per-cycle detail."""
        end = self._now()
        if self._cycle is not None:
            phase = self._open[0] if self._open is not None else "other"
            self._cycle.comm.append((phase, op, start, end, nbytes))
        elif self.cuda:
            self._free.extend((start, end))  # never resolved: recycle now

    def stop(self) -> None:
        """Close the open phase without opening another."""
        if self._open is not None:
            self._close(self._now())

    def _close(self, now: object) -> None:
        if self._open is None:
            return
        name, start = self._open
        if self._cycle is not None:
            self._cycle.marks.append((name, start, now))
        else:
            self._loose.append((self.config, name, start, now))
        self._open = None

    def end_cycle(self, tokens: int, accepted: int | None = None, **step: Any) -> None:
        """Close the cycle: tokens emitted, accepted draft tokens (one sequence), and the
        step's batch fields (CycleRecord: batch, speculating, prefill_tokens,
        decode_tokens, verify_tokens, accepted_all, experts_active)."""
        c = self._cycle
        if c is None:
            return
        now = self._now()
        self._close(now)
        c.end = now
        if c.start is None:  # a cycle with no phase marks
            c.start = now
        self._last_end = now
        c.tokens, c.accepted, c.step = tokens, accepted, step
        self._pending.append(c)
        self._cycle = None
        if len(self._pending) > RESOLVE_EVERY:
            self._reclaim()
        self._since_log += 1
        if self.interval and self._since_log >= self.interval:
            self._since_log = 0
            log.info("%s", format_summary(self.summary(self.config)))

    def idle(self) -> None:
        """The host is about to wait for the device (the engine's step read): resolve the
        cycles it has finished meanwhile, off the cycles' critical path."""
        if self._pending:
            self._reclaim()

    def end_as_request_phase(self) -> None:
        """Close the open cycle as request-level time, not a cycle: a step that only
        prefilled (no sequence decoded) is kept per request, like a prefill outside a
        cycle, and breaks the tiling of the cycles around it."""
        c = self._cycle
        if c is None:
            return
        self._close(self._now())
        self._loose.extend((c.config, name, a, b) for name, a, b in c.marks)
        self._count[c.config] -= 1
        self._cycle = None
        self._last_end = None

    # -- resolution and summaries (syncs once) --------------------------------------------

    def _ms(self, a: object, b: object) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) / 1e6

    def _at(self, ev: object) -> float:
        return self._origin.elapsed_time(ev) if self.cuda else (ev - self._origin) / 1e6

    def resolve(self) -> None:
        """Turn recorded marks into CycleRecords (one device synchronisation, here only)."""
        if not self._pending and not self._loose:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._resolve(len(self._pending), len(self._loose))

    def _reclaim(self) -> None:
        """Resolve the cycles (and request-level phases) the device has finished, oldest
        first, without waiting for the rest: the event pool refills as a long run goes, and
        the hot path never creates events (a launch-bound model ran 13 % slower once the
        prealloc ran out)."""
        n = next((i for i, c in enumerate(self._pending) if not self._done(c.end)),
                 len(self._pending))
        m = next((i for i, x in enumerate(self._loose) if not self._done(x[3])),
                 len(self._loose))
        if n or m:
            self._resolve(n, m)

    def _done(self, ev: object) -> bool:
        return ev.query() if self.cuda else True  # a host timestamp is final when taken

    def _live(self, n: int, m: int) -> set[int]:
        """Ids of the events still referenced once the first n pending cycles and m loose
        phases are resolved: a phase's end is the next one's start, across cycles too."""
        evs: list = [self._last_end] + ([self._open[1]] if self._open else [])
        for c in self._pending[n:] + ([self._cycle] if self._cycle else []):
            evs += _events(c)
        evs += [e for _, _, a, b in self._loose[m:] for e in (a, b)]
        return {id(e) for e in evs if e is not None}

    def _resolve(self, n: int, m: int) -> None:
        """The first n pending cycles and m loose phases, all finished on the device, into
        records; their events back to the pool unless still referenced."""
        used = []
        # Each event's time since the origin, once: a phase that starts where the last one
        # ended (and a cycle where the last one did) reuses it, so a cycle costs a device
        # query per duration and per gap, not two per phase (none is recycled until the end).
        at: dict[int, float] = {}

        def at_of(ev: object) -> float:
            t = at.get(id(ev))
            if t is None:
                t = at[id(ev)] = self._at(ev)
            return t

        for c in self._pending[:n]:
            start, wall = at_of(c.start), self._ms(c.start, c.end)
            at.setdefault(id(c.end), start + wall)
            phases = []
            for name, a, b in c.marks:
                t, dur = at_of(a), self._ms(a, b)
                at.setdefault(id(b), t + dur)
                phases.append((name, t, dur))
            comm = [(ph, op, self._at(a), self._ms(a, b), nb) for ph, op, a, b, nb in c.comm]
            rec = CycleRecord(index=c.index, config=c.config, start_ms=start, wall_ms=wall,
                              phases=phases, tokens=c.tokens, accepted=c.accepted,
                              collectives=comm, **c.step)
            self.records[c.config].append(rec)
            self.totals[c.config].add(rec)
            used += _events(c)
        for config, name, a, b in self._loose[:m]:
            self.loose_ms[config][name].append(self._ms(a, b))
            used += [a, b]
        if self.cuda:  # a mark's event closes one phase and opens the next: dedupe
            live = self._live(n, m)
            self._free.extend(e for i, e in {id(e): e for e in used}.items() if i not in live)
        del self._pending[:n]
        del self._loose[:m]

    def all_records(self) -> list[CycleRecord]:
        self.resolve()
        return [r for q in self.records.values() for r in q]

    def reset(self) -> None:
        self.resolve()
        self._last_end = None
        self.records.clear()
        self.totals.clear()
        self.loose_ms.clear()
        self._count.clear()

    def summary(self, config: str | None = None) -> dict | list[dict]:
        """Summary of one configuration (or a list, one per configuration seen)."""
        self.resolve()
        if config is None:
            return [self.summary(c) for c in self.records]
        recs = list(self.records.get(config, ()))
        out = summarise(config, recs, self.loose_ms.get(config, {}),
                        self.simulated.get(config, False), self.positions.get(config, 0),
                        totals=self.totals.get(config))
        out["tensor_parallel"] = self.parallel
        return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else 0.0


def _phase_rows(recs: list[CycleRecord], t: Totals) -> dict[str, dict[str, float]]:
    """Per phase: mean ms per cycle of `t` (so means add up to the cycle), p50/p90 over the
    cycles of `recs` that ran the phase, and share of the wall time."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        seen: dict[str, float] = defaultdict(float)
        for name, _, dur in r.phases:
            seen[name] += dur
        for name, dur in seen.items():
            per[name].append(dur)
        per["other"].append(r.other_ms)
    n = max(t.cycles, 1)
    comm = comm_rows(t.phase_ms, t.comm_ms, t.cycles, t.comm_n, t.comm_b) if t.comm_count \
        else {}
    return {name: {"mean_ms": total / n, "p50_ms": _pct(per.get(name, []), 0.5),
                   "p90_ms": _pct(per.get(name, []), 0.9),
                   "share": (total / t.wall_ms) if t.wall_ms else 0.0, **comm.get(name, {})}
            for name, total in t.phase_ms.items()}


def _by_mode(recs: list[CycleRecord], totals: ConfigTotals) -> dict[str, dict]:
    out = {}
    for mode in TIMING_MODES:
        t = totals.modes.get(mode)
        if t is None or not t.cycles:
            continue
        mine = [r for r in recs if r.mode == mode]
        out[mode] = {"cycles": t.cycles, "tokens": t.tokens, "wall_ms": t.wall_ms,
                     "cycle_ms": t.wall_ms / t.cycles, "phases": _phase_rows(mine, t),
                     "percentile_cycles": len(mine), "experts": experts_of(t)}
    return out


def experts_of(t: Totals) -> dict[str, float]:
    """MoE: mean distinct experts per MoE layer of the verify cycles and of the plain
    decode cycles ({} for a dense target)."""
    return {kind: total / n for kind, (total, n) in t.experts.items() if n}


def summarise(config: str, recs: list[CycleRecord], loose: dict[str, list[float]],
              simulated: bool, positions: int = 0, totals: ConfigTotals | None = None) -> dict:
    """Throughput, acceptance, and phase rows per timing mode.

    totals: aggregates of every cycle, when `recs` holds only the last of them (Profiler
    keeps a bounded window); means, shares, throughput and acceptance come from it, the
    percentiles from `recs`. Without it, everything comes from `recs`.

    `modes` maps "segments" (graph replays: the draft and verify_commit segments) and
    "phases" (eager cycles: every phase) to their own cycle count, mean cycle time and phase
    rows. The top-level `phases` are per cycle over all cycles (their means add up to the
    mean cycle, whatever the mix); read a phase's own time in `modes`."""
    ct = totals if totals is not None else ConfigTotals.of(recs)
    t = ct.all
    wall = t.wall_ms
    phases = _phase_rows(recs, t)
    acc = t.accepted
    n_acc = sum(acc.values())
    by_pos = per_draft = None
    if n_acc:  # both definitions (engine/speculative.py acceptance_by_position)
        k = max(positions, max(acc), 1)
        by_pos, per_draft = [], []
        for i in range(1, k + 1):
            reached = sum(c for a, c in acc.items() if a >= i - 1) - t.ended[i - 1]
            took = sum(c for a, c in acc.items() if a >= i)
            by_pos.append(took / reached if reached else 0.0)
            per_draft.append(took / n_acc)
    modes = _by_mode(recs, ct)
    seg = modes.get("segments")
    by_batch = {}
    for b, bt in sorted(ct.buckets.items()):
        mine = [r for r in recs if batch_bucket(r.batch) == b]
        by_batch[b] = {"cycles": bt.cycles, "tokens": bt.tokens,
                       "cycle_ms": bt.wall_ms / bt.cycles if bt.cycles else 0.0,
                       "tok_per_s": bt.tokens / bt.wall_ms * 1e3 if bt.wall_ms else 0.0,
                       "phases": _phase_rows(mine, bt), "experts": experts_of(bt)}
    return {
        "config": config, "cycles": t.cycles, "tokens": t.tokens, "wall_ms": wall,
        "tok_per_s": t.tokens / wall * 1e3 if wall else 0.0,
        # Graph replays only: what a long-running server sees once every KV window it
        # reaches has its graphs (a short run also pays each new window's capture).
        "steady_tok_per_s": (seg["tokens"] / seg["wall_ms"] * 1e3 if seg and seg["wall_ms"]
                             else (t.tokens / wall * 1e3 if wall else 0.0)),
        "cycles_per_s": t.cycles / wall * 1e3 if wall else 0.0,
        "accept_length": (sum(a * c for a, c in acc.items()) / n_acc + 1.0) if n_acc else None,
        # mean draft positions a chain verified (num_steps, or fewer under the confidence stop)
        "drafted_per_cycle": t.drafted / t.drafts if t.drafts else None,
        "acceptance_by_position": by_pos, "acceptance_per_draft_by_position": per_draft,
        "simulated": simulated, "phases": phases,
        # MoE targets: mean distinct experts per MoE layer, verify and decode cycles apart.
        "experts": experts_of(t),
        "modes": modes, "by_batch": by_batch,
        "attributed": 1.0 - (phases.get("other", {}).get("share", 0.0) if wall else 0.0),
        "request_phases_ms": {name: sum(xs) / len(xs) for name, xs in loose.items() if xs},
        "percentile_cycles": len(recs),
        "collectives": collectives_summary(t.comm_ms, t.comm_count, t.comm_bytes, t.cycles,
                                           wall),
    }


MODE_TITLES = {"segments": "graph replays, timed by segment",
               "phases": "eager cycles (incl. each KV window's capture), timed by phase"}


def format_summary(s: dict) -> str:
    """A compact text table of one summary (what --profile-interval logs)."""
    steady = s.get("steady_tok_per_s", s["tok_per_s"])
    lines = [f"[profile] {s['config']}: {s['cycles']} cycles, {s['tok_per_s']:.1f} tok/s"
             + (f" ({steady:.1f} in graph replays)" if "segments" in s.get("modes", {})
                and len(s["modes"]) > 1 else "")
             + f", {s['cycles_per_s']:.1f} cycles/s"
             + (f", accept length {s['accept_length']:.2f}" if s["accept_length"] else "")
             + (f", {s['drafted_per_cycle']:.2f} drafted a cycle" if s.get("drafted_per_cycle")
                is not None else "")
             + (" (SIMULATED)" if s["simulated"] else "")
             + f", attributed {s['attributed']:.1%}"]
    if s["acceptance_by_position"]:
        lines.append("  acceptance by position (conditional): " + " ".join(
            f"{x:.2f}" for x in s["acceptance_by_position"]))
    if s.get("acceptance_per_draft_by_position"):
        lines.append("  acceptance by position (per draft): " + " ".join(
            f"{x:.2f}" for x in s["acceptance_per_draft_by_position"]))
    modes = s.get("modes") or {"phases": {"cycles": s["cycles"], "phases": s["phases"],
                                          "percentile_cycles": s.get("percentile_cycles",
                                                                     s["cycles"])}}
    for mode, m in modes.items():
        if len(modes) > 1 or mode == "segments":
            lines.append(f"  {MODE_TITLES[mode]}: {m['cycles']} cycles"
                         + (f", {m['cycle_ms']:.3f} ms each" if "cycle_ms" in m else ""))
        lines.extend(_phase_table(m, m.get("experts", s.get("experts")) or {}))
    lines.extend(format_lines(s))
    by_batch = s.get("by_batch") or {}
    if len(by_batch) > 1 or any(b > 1 for b in by_batch):
        lines.append(f"  {'batch <=':>9} {'cycles':>7} {'ms each':>9} {'tok/s':>9}   "
                     "largest phases")
        for b, m in by_batch.items():
            top = sorted(m["phases"].items(), key=lambda kv: -kv[1]["mean_ms"])[:3]
            lines.append(f"  {b:>9} {m['cycles']:>7} {m['cycle_ms']:>9.3f} "
                         f"{m['tok_per_s']:>9.1f}   " + ", ".join(
                             f"{name} {p['mean_ms']:.2f}" for name, p in top)
                         + "".join(f", {kind} experts/layer {x:.1f}"
                                   for kind, x in (m.get("experts") or {}).items()))
    return "\n".join(lines)


# The phase rows a MoE cycle's expert count belongs beside (the target forward's).
EXPERT_ROWS = {"verify": "verify", "verify_commit": "verify", "decode": "decode"}


def _phase_table(m: dict, experts: dict[str, float]) -> list[str]:
    """Phase rows; under tensor parallelism with each phase's collectives (ms, share); for a
    MoE target with the experts per MoE layer beside the target forward's rows."""
    window = m.get("percentile_cycles", m["cycles"])
    comm = any("comm_ms" in p for p in m["phases"].values())
    lines = [f"  {'phase':<16} {'mean ms':>9} {'p50':>8} {'p90':>8} {'share':>7}"
             + (f" {'coll ms':>9} {'coll %':>7}" if comm else "")
             + (f" {'experts/layer':>14}" if experts else "")
             + (f"   (p50/p90: the last {window} cycles)" if window < m["cycles"] else "")]
    for name, p in sorted(m["phases"].items(), key=_phase_order):
        x = experts.get(EXPERT_ROWS.get(name, ""))
        lines.append(f"  {name:<16} {p['mean_ms']:>9.3f} {p['p50_ms']:>8.3f} "
                     f"{p['p90_ms']:>8.3f} {p['share']:>6.1%}"
                     + (f" {p.get('comm_ms', 0.0):>9.3f} {p.get('comm_share', 0.0):>6.0%}"
                        if comm else "")
                     + (f" {x:>14.1f}" if x is not None else ""))
    return lines


_ORDER = [p.value for p in Phase]


def _phase_order(item: tuple[str, dict]) -> tuple[int, str]:
    base = item[0].split("[")[0]
    return (_ORDER.index(base) if base in _ORDER else len(_ORDER), item[0])
