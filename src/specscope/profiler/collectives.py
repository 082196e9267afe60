"""Communication in the profile: collectives per phase, and the skew between ranks.

Under tensor parallelism every collective (parallel/group.py) is timed and attributed to
the phase open when it started, so a phase's time splits into its collectives and the rest
(compute, and host work): a phase row carries `comm_ms` and `compute_ms` (mean per cycle,
summing to `mean_ms`) and `comm_share`. Each rank profiles itself; rank 0 gathers every
rank's summaries and `with_rank_skew` adds, per configuration, each phase's mean on every
rank and the slowest rank's over the fastest's (detokenize, rank 0's alone, and other left
out of the ranking). A collective's time includes the wait for the slowest rank to reach
it, so skew shows up as collective time too.
"""

from __future__ import annotations

from typing import Any

# Phases only rank 0 runs (its detokenizer) or no rank claims: not comparable across ranks.
RANK0_ONLY = ("detokenize", "other")


def comm_rows(phase_ms: dict[str, float], comm_ms: dict[str, float], cycles: int,
              counts: dict[str, int], nbytes: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per phase: collectives' and everything else's mean ms per cycle, their share, and
    the collectives' count and bytes per cycle (what the tuner's cost model fits)."""
    n = max(cycles, 1)
    out = {}
    for name, total in phase_ms.items():
        comm = comm_ms.get(name, 0.0)
        out[name] = {"comm_ms": comm / n, "compute_ms": (total - comm) / n,
                     "comm_share": comm / total if total else 0.0,
                     "comm_count": counts.get(name, 0) / n,
                     "comm_bytes": nbytes.get(name, 0) / n}
    return out


def collectives_summary(comm_ms: dict[str, float], count: int, nbytes: int, cycles: int,
                        wall_ms: float) -> dict[str, Any] | None:
    """The run's collectives per cycle (None when there were none)."""
    if not count:
        return None
    n, total = max(cycles, 1), sum(comm_ms.values())
    return {"ms_per_cycle": total / n, "share": total / wall_ms if wall_ms else 0.0,
            "count_per_cycle": count / n, "bytes_per_cycle": nbytes / n,
            "by_phase_ms": {k: v / n for k, v in comm_ms.items()}}


def with_rank_skew(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's summaries, each with `ranks`: per phase the mean ms per cycle on every rank
    (in rank order) and skew = slowest / fastest. A configuration is matched by its label."""
    ours = per_rank[0]
    by_label = [{s["config"]: s for s in rank} for rank in per_rank]
    for s in ours:
        phases = {}
        for name in s["phases"]:
            ms = [r[s["config"]]["phases"].get(name, {}).get("mean_ms", 0.0)
                  if s["config"] in r else None for r in by_label]
            seen = [x for x in ms if x is not None and x > 0]
            phases[name] = {"ms": ms, "skew": max(seen) / min(seen) if seen else 1.0}
        worst = max((p["skew"] for n, p in phases.items() if n not in RANK0_ONLY),
                    default=1.0)
        s["ranks"] = {"size": len(per_rank), "phases": phases, "max_skew": worst}
    return ours


def format_lines(s: dict) -> list[str]:
    """The summary's collective and skew lines (none without tensor parallelism)."""
    lines = []
    tp = s.get("tensor_parallel")
    if tp:
        lines.append(f"  tensor parallel: {tp['size']} ranks ({tp['backend']})"
                     + (f", draft {tp['draft_placement']} (draft TP {tp['draft_size']})"
                        if tp.get("draft_size") else ""))
    coll = s.get("collectives")
    if coll:
        lines.append(f"  collectives: {coll['ms_per_cycle']:.3f} ms per cycle "
                     f"({coll['share']:.0%} of it), {coll['count_per_cycle']:.1f} per cycle, "
                     f"{coll['bytes_per_cycle'] / 1e3:.1f} kB")
        for name, p in sorted(s["phases"].items(), key=lambda kv: -kv[1]["mean_ms"]):
            if p.get("comm_ms"):
                lines.append(f"    {name} {p['mean_ms']:.3f} ms (collectives "
                             f"{p['comm_ms']:.3f} ms, {p['comm_share']:.0%})")
    ranks = s.get("ranks")
    if ranks:
        top = sorted(((n, p) for n, p in ranks["phases"].items() if n not in RANK0_ONLY),
                     key=lambda kv: -kv[1]["skew"])[:4]
        lines.append(f"  per-rank skew (slowest / fastest of {ranks['size']} ranks): "
                     + ", ".join(f"{n} {p['skew']:.2f}" for n, p in top))
    return lines
