"""The cost model of a speculative cycle, fitted from profiler summaries of a calibration run.

A cycle of configuration (num_steps s, topk k, num_draft_tokens n) costs

    draft(s, k)  = a_draft + b_step * (s - 1) + b_row * (s - 1) * k
                   (s - 1 draft forwards of k rows each; the extend always feeds s + 1
                   pairs, a term linear in s that a_draft and b_step absorb)
    verify(n)    = a_verify + b_verify * n          (one target forward over n tokens)
    other        = a_other                          (accept bookkeeping, detokenise, host)

and a plain decoding step costs `plain`. Each line is fitted by least squares on the mean
per-cycle phase times that `Profiler.summary` reports, so the same code fits eager phases
(draft_extend + draft_step + tree_build) and graph-replayed segments (draft, verify_commit).
Predicted speculative tok/s = tau(s, k, n) / cycle(s, k, n); plain tok/s = 1 / plain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

DRAFT_PHASES = ("draft", "draft_extend", "draft_step", "tree_build")
VERIFY_PHASES = ("verify_commit", "verify", "accept", "kv_commit")


@dataclass(frozen=True)
class Calibration:
    """One measured configuration: mean ms per cycle of each cost term."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    draft_ms: float
    verify_ms: float
    other_ms: float


@dataclass(frozen=True)
class CostModel:
    a_draft: float
    b_step: float
    b_row: float
    a_verify: float
    b_verify: float
    other: float
    plain: float  # ms per plain decoding step

    def cycle_ms(self, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        s, k, n = num_steps, topk, num_draft_tokens
        return (self.a_draft + self.b_step * (s - 1) + self.b_row * (s - 1) * k
                + self.a_verify + self.b_verify * n + self.other)

    def tok_per_s(self, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        return 1e3 * tau / self.cycle_ms(num_steps, topk, num_draft_tokens)

    @property
    def plain_tok_per_s(self) -> float:
        return 1e3 / self.plain

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 5) for k, v in asdict(self).items()}


def calibration_from_summary(summary: dict[str, Any], num_steps: int, topk: int,
                             num_draft_tokens: int) -> Calibration:
    """Mean ms per cycle of the draft, verify and other terms from a profiler summary."""
    phases = summary["phases"]  # name -> {"mean_ms": per cycle, ...}

    def base(name: str) -> str:  # "draft_step[3]" -> "draft_step"
        return name.split("[", 1)[0]

    def total(names: tuple[str, ...]) -> float:
        return sum(p["mean_ms"] for name, p in phases.items() if base(name) in names)

    draft, verify = total(DRAFT_PHASES), total(VERIFY_PHASES)
    other = sum(p["mean_ms"] for name, p in phases.items()
                if base(name) not in DRAFT_PHASES + VERIFY_PHASES + ("prefill",))
    return Calibration(num_steps, topk, num_draft_tokens, draft, verify, other)


def plain_ms_from_summary(summary: dict[str, Any]) -> float:
    """Mean ms per plain decoding cycle (decode step plus per-token host work)."""
    return sum(p["mean_ms"] for name, p in summary["phases"].items() if name != "prefill")


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    A = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(A, b, driver="gelsd").solution[:, 0].tolist()


def fit_cost_model(cals: list[Calibration], plain_ms: float) -> CostModel:
    """Least-squares fit of the cycle terms. Needs calibrations that vary num_steps, topk
    and num_draft_tokens independently enough (at least 3 distinct (s, k) and 2 distinct n);
    otherwise raises naming what is missing."""
    sk = {(c.num_steps, c.topk) for c in cals}
    ns = {c.num_draft_tokens for c in cals}
    if len(sk) < 3 or len(ns) < 2:
        raise ValueError(f"cost model: need >= 3 distinct (num_steps, topk) and >= 2 distinct "
                         f"num_draft_tokens among the calibration runs, got {sorted(sk)} and "
                         f"{sorted(ns)}")
    a_d, b_s, b_r = _lstsq([[1.0, c.num_steps - 1, (c.num_steps - 1) * c.topk] for c in cals],
                           [c.draft_ms for c in cals])
    a_v, b_v = _lstsq([[1.0, c.num_draft_tokens] for c in cals], [c.verify_ms for c in cals])
    other = sum(c.other_ms for c in cals) / len(cals)
    return CostModel(a_draft=a_d, b_step=b_s, b_row=b_r, a_verify=a_v, b_verify=b_v,
                     other=other, plain=plain_ms)
