"""The cost model of a speculative cycle, fitted from profiler summaries of a calibration run.

A cycle of configuration (num_steps s, topk k, num_draft_tokens n) costs, with tree = 1 when
k > 1 (an EAGLE-2 tree) and 0 for a chain:

    draft  = a_draft + b_step * (s - 1)                   the extend and s - 1 chain steps
             + tree * (c_tree + e_tree * (s - 1))         a tree step's own work, per depth
             + b_row * (s - 1) * (k - 1)                  the k - 1 extra rows of each step
    verify = a_verify + b_verify * n                      one target forward over n tokens
             + tree * (c_tree_verify + d_tree_verify * s) tree mask, tree accept, KV commit
    other  = other + tree * tree_other                    host work between the segments

and a plain decoding step costs `plain`. On a MoE target the verify line has one more term,

             + b_expert * X(B * n)                        the distinct experts it activates

where X(t) is the expected number of distinct experts per MoE layer that t tokens activate
(B sequences' trees of n tokens each, one forward), under the routing measured in the
calibration (`ExpertModel`): a verify at batch 1 on a GPU streams each activated expert's
weights once per layer, so more draft tokens cost what their new experts cost, which grows
more slowly than n as tokens share experts. Why the tree terms: at batch 1 on a GPU a 135M
target's verify is launch-bound, flat in n (2.47 ms + 0.010 ms per token on the H200), and a
tree adds work a chain never does, whatever its width: the ancestor mask (one pass per
depth), the general accept walk, the move of the accepted path's KV in every layer, and, in
drafting, a mask, two top-k and gathers per step. Fitting those as per-token or per-row
costs priced a (5, 3, 21) tree 14 % too cheap; with them the fit is within 3.1 % of every
steady cycle of 25 chains and trees measured there (benchmarks/cycle_costs.py).

On CUDA a kernel's cost changes in steps with the rows it serves, not per token: the
paged attention's query tile (tokens x query heads per KV head, rounded up to 16, 32, 64 or
128 rows) and the few-row linear (at most 16 rows, GEMMs beyond). The verify line then has one
more term per kernel class the calibration reaches beyond the first (engine/machine.py
verify_kernel_class):

             + class_ms[class(n)]                         that class's step, either sign

On the H200 the default model's verify took 1.37 ms at 2-5 tokens, 1.69 ms at 6-9 (16- then
32-row tiles), and a 16-token tree's less than an 8-token tree's (64-row tiles run another
kernel configuration than 32-row ones). Fitted to those calibration runs and scored
against a grid of 35 speculative configurations measured on the same GPU
(benchmarks/cost_replay.py), the model linear in n was off by 7.6 % on average (worst
17.7 %), the one with classes by 5.1 % (worst 14.0 %, short chains whose host time moved
between the runs). The calibration adds shapes until every class of the configurations
the tuner predicts is measured (tune/calibration.py).

Each line is fitted by non-negative least squares on the mean per-cycle phase times that
`Profiler.summary` reports (of its graph replays when it has them), so the same code fits
eager phases (draft_extend + draft_step + tree_build) and graph-replayed segments (draft,
verify_commit). CALIBRATION in tuner.py is chosen so that every term is identified; the fit
checks the rank of each design matrix and refuses a calibration that cannot identify a term.
Predicted speculative tok/s = tau(s, k, n) / cycle(s, k, n); plain tok/s = 1 / plain.

Under tensor parallelism the profile splits each phase into collectives and compute
(profiler/collectives.py), and so does the draft line: its terms above are fitted on the
draft's compute, and its collectives on a line of their own (a_draft_comm for the extend,
b_step_comm per draft step). Every calibration's collectives also fit a per-collective cost
(comm_alpha_ms each, comm_beta_ms_per_mb per MB), so tune/placement.py can price the other draft
placement (replicated or sharded) without having run it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

DRAFT_PHASES = ("draft", "draft_extend", "draft_step", "tree_build")
VERIFY_PHASES = ("verify_commit", "verify", "accept", "kv_commit")


@dataclass(frozen=True)
class Calibration:
    """One measured configuration: mean ms per cycle of each cost term; on a MoE target the
    mean distinct experts per MoE layer its verify cycles activated."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    draft_ms: float
    verify_ms: float
    other_ms: float
    experts: float | None = None
    # Tensor parallelism: of draft_ms and verify_ms, the collectives; every collective of
    # the cycle, counted and in bytes (0 without tensor parallelism).
    draft_comm_ms: float = 0.0
    verify_comm_ms: float = 0.0
    comm_count: float = 0.0
    comm_bytes: float = 0.0
    comm_ms: float = 0.0


@dataclass(frozen=True)
class ExpertModel:
    """Expected distinct experts per MoE layer that t routed tokens activate.

    A token picks top_k of E experts; were picks uniform and independent, an expert would
    be missed by one token with probability 1 - k/E and X(t) = E (1 - (1 - k/E)^t). Real
    routing is skewed (and consecutive tokens of one text pick alike), so fewer experts
    are reached: the same curve with E replaced by an effective count E_eff fitted to the
    measured (t, X) points, then capped at E and at k t.
    """

    num_experts: int
    top_k: int
    effective: float  # E_eff

    def distinct(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        if tokens <= 1:  # the curve meets k t at t = 1 (and lies above it before): exact
            return min(float(self.num_experts), float(self.top_k) * tokens)
        e, k = self.effective, self.top_k
        x = e * (1.0 - (1.0 - k / e) ** tokens)
        return min(float(self.num_experts), x, float(k) * tokens)


def fit_expert_model(points: list[tuple[float, float]], num_experts: int, top_k: int
                     ) -> ExpertModel:
    """E_eff minimising the squared relative error of X over the measured (tokens,
    distinct experts) points, searched over [k, 16 E] on a log grid (one parameter: a grid
    of 2000 is exact enough and cannot fail to converge). No points: uniform routing."""
    pts = [(t, x) for t, x in points if t > 0 and x > 0]
    if not pts:
        return ExpertModel(num_experts, top_k, float(num_experts))
    lo, hi = float(top_k), 16.0 * num_experts
    best, best_err = float(num_experts), float("inf")
    for j in range(2001):
        e = lo * (hi / lo) ** (j / 2000)
        m = ExpertModel(num_experts, top_k, e)
        err = sum((m.distinct(t) / x - 1.0) ** 2 for t, x in pts)
        if err < best_err:
            best, best_err = e, err
    return ExpertModel(num_experts, top_k, best)


DRAFT_TERMS = ("a_draft", "b_step", "c_tree", "e_tree", "b_row")
VERIFY_TERMS = ("a_verify", "b_verify", "c_tree_verify", "d_tree_verify")


def draft_columns(s: int, k: int, n: int) -> list[float]:
    tree = 1.0 if k > 1 else 0.0
    return [1.0, s - 1.0, tree, tree * (s - 1), (s - 1.0) * (k - 1)]


def verify_columns(s: int, k: int, n: int) -> list[float]:
    tree = 1.0 if k > 1 else 0.0
    return [1.0, float(n), tree, tree * s]


OTHER_TERMS = ("other", "tree_other")


def other_columns(s: int, k: int, n: int) -> list[float]:
    return [1.0, 1.0 if k > 1 else 0.0]


@dataclass(frozen=True)
class CostModel:
    a_draft: float
    b_step: float
    c_tree: float
    e_tree: float
    b_row: float
    a_verify: float
    b_verify: float
    c_tree_verify: float
    d_tree_verify: float
    other: float  # the host's time between a cycle's phases (a chain's)
    plain: float  # ms per plain decoding step
    # Tensor parallelism (tune/placement.py): the draft's collectives per cycle (the extend,
    # each draft step), the cost of one collective, and the placement measured.
    a_draft_comm: float = 0.0
    b_step_comm: float = 0.0
    comm_alpha_ms: float = 0.0
    comm_beta_ms_per_mb: float = 0.0
    tp: int = 1
    draft_tp: int = 1
    # Calibration point -> (measured, fitted) ms of each term: how well the lines fit.
    residuals: dict[str, list[dict[str, Any]]] = field(default_factory=dict, compare=False)
    # MoE targets: ms per distinct expert per layer a verify activates, the routing's
    # expert model, and the sequences per step the costs were measured at (a verify of n
    # tokens each routes batch * n tokens).
    b_expert: float = 0.0
    experts: ExpertModel | None = None
    batch: int = 1
    # CUDA: the verify's kernel class of n tokens (None: one class) and each class's step
    # over the first class's, as fitted.
    kernel_class: Any = field(default=None, compare=False, repr=False)
    verify_class_ms: dict[str, float] = field(default_factory=dict)
    # A tree's extra host time between phases (its verdicts and path walk on the host).
    tree_other: float = 0.0

    def draft_ms(self, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        """The draft's compute, then its collectives (none when it is replicated)."""
        x = draft_columns(num_steps, topk, num_draft_tokens)
        compute = sum(c * getattr(self, t) for c, t in zip(x, DRAFT_TERMS, strict=True))
        return compute + self.a_draft_comm + self.b_step_comm * (num_steps - 1)

    def experts_for(self, num_draft_tokens: int) -> float | None:
        """Expected distinct experts per MoE layer of one verify (None: a dense target)."""
        if self.experts is None:
            return None
        return self.experts.distinct(self.batch * num_draft_tokens)

    def verify_ms(self, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        x = verify_columns(num_steps, topk, num_draft_tokens)
        ms = sum(c * getattr(self, t) for c, t in zip(x, VERIFY_TERMS, strict=True))
        experts = self.experts_for(num_draft_tokens)
        return (ms if experts is None else ms + self.b_expert * experts) + \
            self.class_ms(num_draft_tokens)

    def class_ms(self, num_draft_tokens: int) -> float:
        """The step of a verify of this many tokens' kernel class (0 without classes)."""
        if self.kernel_class is None:
            return 0.0
        k = self.kernel_class(num_draft_tokens)
        if k not in self.verify_class_ms:
            raise ValueError(f"cost model: no calibration measured the kernel class {k!r} "
                             f"of a {num_draft_tokens}-token verify (tune/calibration.py "
                             f"calibration_shapes covers every class the tuner predicts)")
        return self.verify_class_ms[k]

    def other_ms(self, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        return self.other + (self.tree_other if topk > 1 else 0.0)

    def cycle_ms(self, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        cfg = (num_steps, topk, num_draft_tokens)
        return self.draft_ms(*cfg) + self.verify_ms(*cfg) + self.other_ms(*cfg)

    def tok_per_s(self, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
        return 1e3 * tau / self.cycle_ms(num_steps, topk, num_draft_tokens)

    @property
    def plain_tok_per_s(self) -> float:
        return 1e3 / self.plain

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: round(v, 5) for k, v in asdict(self).items()
                               if isinstance(v, float)}
        if self.experts is not None:
            out["effective_experts"] = round(self.experts.effective, 2)
            out["batch"] = self.batch
        if self.verify_class_ms:
            out["verify_class_ms"] = {k: round(v, 5) for k, v in self.verify_class_ms.items()}
        return out

    def worst_residual(self) -> float:
        """The largest |measured / fitted - 1| over the calibration points of the draft and
        verify lines (the host's tenth of a millisecond, the other line, is kept in
        `residuals` but would swamp a relative measure)."""
        return max((abs(r["measured_ms"] / r["fitted_ms"] - 1) for line in ("draft", "verify")
                    for r in self.residuals.get(line, []) if r["fitted_ms"]), default=0.0)


def calibration_from_summary(summary: dict[str, Any], num_steps: int, topk: int,
                             num_draft_tokens: int) -> Calibration:
    """Mean ms per cycle of the draft, verify and other terms from a profiler summary: of
    its graph replays when it has them (the capture cycles are not the steady state the model
    predicts), else of all its cycles."""
    phases = steady_phases(summary)  # name -> {"mean_ms": per cycle, ...}

    def base(name: str) -> str:  # "draft_step[3]" -> "draft_step"
        return name.split("[", 1)[0]

    def total(names: tuple[str, ...]) -> float:
        return sum(p["mean_ms"] for name, p in phases.items() if base(name) in names)

    def comm(names: tuple[str, ...], key: str = "comm_ms") -> float:
        return sum(p.get(key, 0.0) for name, p in phases.items() if base(name) in names)

    draft, verify = total(DRAFT_PHASES), total(VERIFY_PHASES)
    other = sum(p["mean_ms"] for name, p in phases.items()
                if base(name) not in DRAFT_PHASES + VERIFY_PHASES + ("prefill",))
    experts = steady_experts(summary).get("verify")
    every = tuple({base(n) for n in phases})
    return Calibration(num_steps, topk, num_draft_tokens, draft, verify, other, experts,
                       draft_comm_ms=comm(DRAFT_PHASES), verify_comm_ms=comm(VERIFY_PHASES),
                       comm_count=comm(every, "comm_count"),
                       comm_bytes=comm(every, "comm_bytes"), comm_ms=comm(every))


def steady_phases(summary: dict[str, Any]) -> dict[str, Any]:
    seg = summary.get("modes", {}).get("segments")
    return seg["phases"] if seg else summary["phases"]


def steady_experts(summary: dict[str, Any]) -> dict[str, float]:
    """MoE: mean distinct experts per layer ("verify", "decode") of the same cycles as
    steady_phases ({} for a dense target)."""
    seg = summary.get("modes", {}).get("segments")
    return (seg.get("experts") if seg else summary.get("experts")) or {}


def plain_ms_from_summary(summary: dict[str, Any]) -> float:
    """Mean ms per plain decoding cycle (decode step plus per-token host work)."""
    return sum(p["mean_ms"] for name, p in summary["phases"].items() if name != "prefill")


def _lstsq(rows: list[list[float]], y: list[float], free: int = 0) -> list[float]:
    """Least squares with every cost >= 0, exactly: the best unconstrained fit on each
    subset of the terms (the rest held at 0) whose coefficients are all >= 0. A line has at
    most six such terms, so there are at most 64 subsets. A negative cost is noise fitted
    (the 2-core CPU's calibration once gave the per-depth tree verify term -2.4 ms, and the
    model then priced deep trees below shallow ones). The last `free` columns (kernel class
    steps, which may be negative) are in every subset and unconstrained."""
    A = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)[:, None]
    m = A.shape[1]
    c = m - free
    best, best_err = [0.0] * m, float((b ** 2).sum())
    for mask in range(1 if not free else 0, 1 << c):
        cols = [j for j in range(c) if mask >> j & 1] + list(range(c, m))
        sol = torch.linalg.lstsq(A[:, cols], b, driver="gelsd").solution[:, 0]
        if (sol[:len(cols) - free] < 0).any():
            continue
        err = float(((A[:, cols] @ sol[:, None] - b) ** 2).sum())
        if err < best_err - 1e-12:
            best, best_err = [0.0] * m, err
            for j, x in zip(cols, sol.tolist(), strict=True):
                best[j] = x
    return best


def _check_identified(name: str, terms: tuple[str, ...], rows: list[list[float]],
                      cals: list[Calibration]) -> None:
    """Every term of a line must be identified by the calibration: its design matrix must
    have full column rank (else least squares would share one effect between two terms)."""
    rank = _rank(rows)
    if rank < len(terms):
        shapes = sorted({(c.num_steps, c.topk, c.num_draft_tokens) for c in cals})
        raise ValueError(f"cost model: the calibration configurations {shapes} cannot "
                         f"identify the {name} terms {list(terms)} (rank {rank} of "
                         f"{len(terms)}): it needs chains of two lengths and trees of "
                         f"several depths, widths and sizes (tuner.CALIBRATION)")


def _fit_line(name: str, terms: tuple[str, ...], columns, cals: list[Calibration],
              attr: str, free: int = 0) -> tuple[list[float], list[dict[str, Any]]]:
    """One line's non-negative fit; columns(s, k, n) -> its design row (its last `free`
    terms unconstrained)."""
    rows = [columns(c.num_steps, c.topk, c.num_draft_tokens) for c in cals]
    _check_identified(name, terms, rows, cals)
    y = [getattr(c, attr) for c in cals]
    coef = _lstsq(rows, y, free)
    resid = [{"config": [c.num_steps, c.topk, c.num_draft_tokens], "measured_ms": round(m, 4),
              "fitted_ms": round(sum(a * b for a, b in zip(r, coef, strict=True)), 4)}
             for c, r, m in zip(cals, rows, y, strict=True)]
    return coef, resid


def fit_cost_model(cals: list[Calibration], plain_ms: float,
                   moe: tuple[int, int] | None = None, batch: int = 1, tp: int = 1,
                   draft_tp: int = 1, kernel_class: Any = None) -> CostModel:
    """Non-negative least-squares fit of the cycle terms (module docstring), with each
    calibration point's residual kept. Raises, naming what is missing, when the calibration
    cannot identify every term (e.g. no tree, or trees of one depth only).

    moe: (num_experts, top_k) of a MoE target whose calibrations measured their experts:
    the expert model is fitted to them (each verify routed batch * n tokens) and the verify
    line gets its b_expert term. tp, draft_tp: the tensor-parallel placement the calibration
    ran under (the draft's collectives are fitted apart from its compute). kernel_class:
    n -> the verify's kernel class at this batch (engine/machine.py verify_kernel_class;
    None: one class), each class the calibration reached beyond its smallest verify's
    getting a step of its own."""
    compute = [dataclasses.replace(c, draft_ms=c.draft_ms - c.draft_comm_ms) for c in cals]
    d, d_res = _fit_line("draft", DRAFT_TERMS, draft_columns, compute, "draft_ms")
    experts = None
    v_terms, base_columns = VERIFY_TERMS, verify_columns
    steps = _class_steps(cals, kernel_class)
    if moe is not None and cals and all(c.experts is not None for c in cals):
        experts = fit_expert_model([(batch * c.num_draft_tokens, c.experts) for c in cals],
                                   *moe)

        def with_experts(s: int, k: int, n: int) -> list[float]:
            return verify_columns(s, k, n) + [experts.distinct(batch * n)]
        if _expert_term_identified(cals, with_experts, steps, kernel_class):
            v_terms, base_columns = VERIFY_TERMS + ("b_expert",), with_experts

    v_columns = _with_class_steps(base_columns, kernel_class, steps)
    v, v_res = _fit_line("verify", v_terms + tuple(f"class {c}" for c in steps), v_columns,
                         cals, "verify_ms", free=len(steps))
    classes = {kernel_class(min(c.num_draft_tokens for c in cals)): 0.0} if steps else {}
    classes.update(zip(steps, v[len(v_terms):], strict=True))
    # The host's time between segments: a constant, and a tree's more (on the H200 the
    # default model's confirmed trees spent 0.25-0.32 ms a cycle there, its chains
    # 0.14-0.18: one mean priced a tree's cycle 5-6 % short).
    o, o_res = _fit_line("other", OTHER_TERMS, other_columns, cals, "other_ms")
    terms = dict(zip(DRAFT_TERMS + v_terms + OTHER_TERMS,
                     d + v[:len(v_terms)] + o, strict=True))
    return CostModel(**terms, plain=plain_ms,
                     **_comm_terms(cals), tp=tp, draft_tp=draft_tp,
                     residuals={"draft": d_res, "verify": v_res, "other": o_res},
                     experts=experts,
                     batch=batch, kernel_class=kernel_class if steps else None,
                     verify_class_ms=classes)


def _expert_term_identified(cals: list[Calibration], with_experts: Any, steps: list[str],
                            kernel_class: Any) -> bool:
    """Whether the calibration identifies the expert term beside the others. At a large
    batch every calibration's verify activates every expert a random or trained router
    reaches (on the H200, Qwen3-30B-A3B's shape at batch 64: 128 routed tokens and more a
    layer), so X(B n) is one constant and its cost is part of a_verify: the term is then
    left out (b_expert 0), as it changes no prediction at that batch, where raising would
    stop a tuner that has nothing left to learn from it. Otherwise the verify line's own
    check (_check_identified) names what is missing."""
    def rank(columns: Any) -> tuple[int, int]:  # (rank, columns) of the verify line
        rows = [_with_class_steps(columns, kernel_class, steps)(
            c.num_steps, c.topk, c.num_draft_tokens) for c in cals]
        return _rank(rows), len(rows[0])
    (full, width), (without, _) = rank(with_experts), rank(verify_columns)
    return full == width or full > without


def _with_class_steps(columns: Any, kernel_class: Any, steps: list[str]) -> Any:
    """columns(s, k, n) with an indicator per kernel class step appended (the verify line's
    design row)."""
    def row(s: int, k: int, n: int) -> list[float]:
        own = kernel_class(n) if steps else None
        return columns(s, k, n) + [float(own == c) for c in steps]
    return row


def _rank(rows: list[list[float]]) -> int:
    return int(torch.linalg.matrix_rank(torch.tensor(rows, dtype=torch.float64)))


def _class_steps(cals: list[Calibration], kernel_class: Any) -> list[str]:
    """The kernel classes the calibration reached beyond its smallest verify's ([] without
    classes, or when every verify ran one class)."""
    if kernel_class is None or not cals:
        return []
    base = kernel_class(min(c.num_draft_tokens for c in cals))
    seen = {kernel_class(c.num_draft_tokens) for c in cals}
    return sorted(k for k in seen if k != base and k is not None)


def _comm_terms(cals: list[Calibration]) -> dict[str, float]:
    """Tensor parallelism: the draft's collectives per cycle (the extend, each draft step)
    and one collective's cost (per call, per MB), fitted to what the calibrations measured;
    {} when they ran none."""
    if not any(c.comm_count for c in cals):
        return {}
    dc = _lstsq([[1.0, c.num_steps - 1.0] for c in cals], [c.draft_comm_ms for c in cals])
    ab = _lstsq([[c.comm_count, c.comm_bytes / 1e6] for c in cals], [c.comm_ms for c in cals])
    return dict(a_draft_comm=dc[0], b_step_comm=dc[1], comm_alpha_ms=ab[0],
                comm_beta_ms_per_mb=ab[1])
