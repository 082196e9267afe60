"""What the tuner hands back: each confirmed run (Measured), the whole result with its
predictions, cost and acceptance models (TuneResult: the table, the per-term errors, the
recommendation and tune.json), the serve flags of a configuration, and the SVG plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specscope.config import SpecPolicy
from specscope.tune.acceptance import AcceptanceModel
from specscope.tune.batch_policy import BucketRow
from specscope.tune.cost import CostModel, calibration_from_summary, steady_phases

Config = tuple[int, int, int]  # (num_steps, topk, num_draft_tokens)


def spec_flags(cfg: Config) -> str:
    s, k, n = cfg
    return (f"--speculative-num-steps {s} --speculative-eagle-topk {k} "
            f"--speculative-num-draft-tokens {n}")


@dataclass
class Measured:
    """One configuration's run. tok_per_s is the steady state, which a server sees and the
    tuner ranks by: on CUDA the graph-replay cycles only, leaving out the first cycle of each
    KV window (its graph capture, paid once per window in a server's life but several times
    in a short run); elsewhere every cycle. run_tok_per_s counts every cycle of the run."""

    config: Config | None  # None: plain decoding
    tok_per_s: float
    accept_length: float | None
    seconds: float
    run_tok_per_s: float | None = None
    summary: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, config: Config | None, summary: dict, seconds: float) -> Measured:
        """From a profiler summary of the configuration's runs (kept, for term_errors)."""
        return cls(config, summary["steady_tok_per_s"], summary["accept_length"], seconds,
                   summary["tok_per_s"], summary)


@dataclass
class TuneResult:
    cost: CostModel
    acceptance: AcceptanceModel
    predictions: dict[Config, tuple[float, float]]  # cfg -> (tau, tok/s)
    measured: list[Measured] = field(default_factory=list)
    recommended: Config | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Plain decoding as the cost model read it: the whole prompts (then also in `measured`)
    # or a calibration-length run.
    plain_run: Measured | None = None
    # Speculation by batch size (tune(batch_sizes=...)): the policy and each batch's row.
    policy: SpecPolicy | None = None
    batch_rows: list[BucketRow] = field(default_factory=list)

    def table(self) -> str:
        plain = next((m for m in self.measured if m.config is None), None)
        # error: predicted tok/s against measured; cycle error: the cost model's alone, its
        # cycle time against the measured one (measured tau / tok/s), the acceptance's draw
        # (simulated: the seed's luck) left out.
        lines = [f"{'configuration':<28} {'pred tau':>8} {'pred tok/s':>10} {'meas tau':>8} "
                 f"{'meas tok/s':>10} {'error':>7} {'cycle error':>11}"]
        if plain:
            err = self.cost.plain_tok_per_s / plain.tok_per_s - 1
            lines.append(f"{'plain':<28} {'1.00':>8} {self.cost.plain_tok_per_s:>10.1f} "
                         f"{'1.00':>8} {plain.tok_per_s:>10.1f} {err:>+7.1%} "
                         f"{-err / (1 + err):>+11.1%}")
        else:
            lines.append(f"{'plain (not confirmed)':<28} {'1.00':>8} "
                         f"{self.cost.plain_tok_per_s:>10.1f} {'-':>8} {'-':>10}")
        for m in self.measured:
            if m.config is None:
                continue
            tau, tps = self.predictions[m.config]
            meas_ms = 1e3 * (m.accept_length or 1) / m.tok_per_s
            lines.append(f"{str(m.config):<28} {tau:>8.2f} {tps:>10.1f} "
                         f"{m.accept_length or 1:>8.2f} {m.tok_per_s:>10.1f} "
                         f"{tps / m.tok_per_s - 1:>+7.1%} "
                         f"{self.cost.cycle_ms(*m.config) / meas_ms - 1:>+11.1%}")
        for r in self.batch_rows:
            meas = f"{r.measured_tok_per_s:.1f}" if r.measured_tok_per_s else "-"
            pred = f"{r.predicted_tok_per_s:.1f}" if r.predicted_tok_per_s else "-"
            lines.append(f"batch {r.batch:<4} plain {r.plain_tok_per_s:>9.1f} tok/s   pick "
                         f"{str(r.pick or 'off'):<14} predicted {pred:>9} measured {meas:>9}")
        return "\n".join(lines)

    def term_errors(self) -> list[dict[str, Any]]:
        """Where the cost model misses each confirmed cycle: the draft, verify and other
        terms (ms per cycle) as modelled and as the confirmation measured them, from the same
        steady cycles the calibration reads; and the measured host time's ("other" phase)
        median and 90th percentile cycle, which tell a steady cost from rare long cycles."""
        rows = []
        for m in self.measured:
            if m.config is None or m.summary is None:
                continue
            got = calibration_from_summary(m.summary, *m.config)
            host = steady_phases(m.summary).get("other", {})
            rows.append({"config": list(m.config),
                         "other_p50_ms": round(host.get("p50_ms", 0.0), 4),
                         "other_p90_ms": round(host.get("p90_ms", 0.0), 4), **{
                term: {"model_ms": round(model, 4), "measured_ms": round(meas, 4)}
                for term, model, meas in (
                    ("draft", self.cost.draft_ms(*m.config), got.draft_ms),
                    ("verify", self.cost.verify_ms(*m.config), got.verify_ms),
                    ("other", self.cost.other_ms(*m.config), got.other_ms))}})
        return rows

    def term_lines(self) -> list[str]:
        """term_errors as one line per confirmed configuration."""
        def cell(name: str, t: dict[str, float]) -> str:
            err = t["model_ms"] / t["measured_ms"] - 1 if t["measured_ms"] else 0.0
            return f"{name} {t['model_ms']:.3f}/{t['measured_ms']:.3f} ({err:+.1%})"
        return [f"[terms] {tuple(r['config'])} model/measured ms: " +
                ", ".join(cell(k, r[k]) for k in ("draft", "verify", "other")) +
                f"; host p50/p90 {r['other_p50_ms']:.3f}/{r['other_p90_ms']:.3f}"
                for r in self.term_errors()]

    def recommendation(self) -> str:
        if self.policy is not None:
            return (f"recommendation by batch size: {self.policy.describe()} -> specscope "
                    f"serve ... --draft DRAFT --spec-policy '{self.policy.flag()}'")
        if self.recommended is None:
            return ("recommendation: speculation OFF: no configuration beat plain decoding "
                    "(serve without --draft)")
        return f"recommendation: {self.recommended} -> specscope serve ... --draft DRAFT " \
               f"{spec_flags(self.recommended)}"

    def as_dict(self) -> dict[str, Any]:
        best = sorted(self.predictions.items(), key=lambda kv: -kv[1][1])[:20]
        return {"cost_model": self.cost.as_dict(), "cost_residuals": self.cost.residuals,
                "recommended": list(self.recommended) if self.recommended else None,
                "flags": spec_flags(self.recommended) if self.recommended else None,
                "measured": [{"config": list(m.config) if m.config else "plain",
                              "tok_per_s": round(m.tok_per_s, 2),
                              "run_tok_per_s": (round(m.run_tok_per_s, 2)
                                                if m.run_tok_per_s is not None else None),
                              "accept_length": m.accept_length, "seconds": round(m.seconds, 2),
                              "predicted": (round(self.predictions[m.config][1], 2)
                                            if m.config else round(self.cost.plain_tok_per_s, 2))}
                             for m in self.measured],
                "top_predictions": [{"config": list(c), "tau": round(t, 3),
                                     "tok_per_s": round(v, 2)} for c, (t, v) in best],
                "terms": self.term_errors(),
                "timings_s": {k: round(v, 2) for k, v in self.timings.items()},
                "policy": self.policy.flag() if self.policy else None,
                "by_batch": [r.as_dict() for r in self.batch_rows]}


def write_plot(result: TuneResult, path: Path) -> None:
    """SVG: predicted tok/s against num_steps, one line per topk (best num_draft_tokens),
    plain decoding dashed, confirmed measurements as dots."""
    best: dict[tuple[int, int], float] = {}
    for (s, k, _), (_, tps) in result.predictions.items():
        best[(s, k)] = max(best.get((s, k), 0.0), tps)
    steps = sorted({s for s, _ in best})
    ks = sorted({k for _, k in best})
    vals = list(best.values()) + [result.cost.plain_tok_per_s] + [
        m.tok_per_s for m in result.measured]
    top = max(vals) * 1.1
    W, H, P = 640, 400, 50

    def xy(s: float, v: float) -> tuple[float, float]:
        x = P + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (W - 2 * P)
        return x, H - P - v / top * (H - 2 * P)

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{P}" y="20">predicted tok/s vs num_steps (best num_draft_tokens per '
           f'topk); dots: measured</text>',
           f'<line x1="{P}" y1="{H - P}" x2="{W - P}" y2="{H - P}" stroke="black"/>',
           f'<line x1="{P}" y1="{P}" x2="{P}" y2="{H - P}" stroke="black"/>']
    for s in steps:
        x, _ = xy(s, 0)
        out.append(f'<text x="{x - 3:.0f}" y="{H - P + 15}">{s}</text>')
    for i in range(5):
        v = top * i / 4
        _, y = xy(steps[0], v)
        out.append(f'<text x="5" y="{y + 4:.0f}">{v:.0f}</text>')
    for i, k in enumerate(ks):
        pts = " ".join(f"{xy(s, best[(s, k)])[0]:.1f},{xy(s, best[(s, k)])[1]:.1f}"
                       for s in steps if (s, k) in best)
        c = colors[i % len(colors)]
        out.append(f'<polyline fill="none" stroke="{c}" points="{pts}"/>')
        lx, ly = W - P + 5, P + 14 * i
        out.append(f'<text x="{lx - 40}" y="{ly}" fill="{c}">topk {k}</text>')
    _, y = xy(steps[0], result.cost.plain_tok_per_s)
    out.append(f'<line x1="{P}" y1="{y:.1f}" x2="{W - P}" y2="{y:.1f}" stroke="gray" '
               f'stroke-dasharray="4"/><text x="{P + 5}" y="{y - 4:.1f}">plain</text>')
    for m in result.measured:
        if m.config is not None:
            x, y = xy(m.config[0], m.tok_per_s)
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="black"/>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
