"""Speculation by batch size: the tuner's cost model measured again at larger batches, and
the policy table it implies (config.SpecPolicy).

A step of B sequences costs more than a step of one, but not B times more (the weights are
read once per step), and a speculative step's verify carries B trees: where speculation
pays depends on B. The acceptance model does not (each sequence drafts and verifies its own
tree), so at each batch size only the costs are measured again: plain decoding and the
calibration configurations, each run as B concurrent requests, their steps at that batch
size (the profiler's by-batch split) fitted to a cost model of ms per step. The prediction
for configuration c at batch B is B * tau(c) / step_ms_B(c) tokens per second, against
B / plain_step_ms_B for plain decoding; the bucket's entry is the best prediction, or off
when it does not beat plain decoding by the tie margin. Each bucket's pick is then run once
at its batch size, and a pick measured below plain decoding is turned off (the guardrail's
rule, per bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specscope.config import SamplingParams, SpecConfig, SpecPolicy
from specscope.profiler.profiler import batch_bucket
from specscope.tune.calibration import calibration_shapes, kernel_classes
from specscope.tune.cost import (
    CostModel,
    calibration_from_summary,
    fit_cost_model,
    plain_ms_from_summary,
)

Config = tuple[int, int, int]


@dataclass
class BucketRow:
    """One batch size's outcome: its fitted costs, the pick, predicted and measured."""

    batch: int
    cost: CostModel
    plain_tok_per_s: float  # measured (the calibration's plain run)
    pick: Config | None
    predicted_tok_per_s: float | None
    measured_tok_per_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "pick": list(self.pick) if self.pick else "off",
                "plain_tok_per_s": round(self.plain_tok_per_s, 2),
                "predicted_tok_per_s": (round(self.predicted_tok_per_s, 2)
                                        if self.predicted_tok_per_s else None),
                "measured_tok_per_s": (round(self.measured_tok_per_s, 2)
                                       if self.measured_tok_per_s else None),
                "cost_model": self.cost.as_dict()}


def batched_run(llm: Any, spec: SpecConfig | None, prompts: list[Any], batch: int,
                params: SamplingParams, warmup_tokens: int) -> tuple[dict, float]:
    """`batch` concurrent requests (the prompts cycled), profiled: the summary of the steps
    at that batch size (its by-batch bucket, as a summary of its own) and the run's output
    tok/s over those steps."""
    llm.set_spec(spec)
    prof = llm.enable_profiling(True, interval=None)
    reqs = [prompts[i % len(prompts)] for i in range(batch)]
    llm.generate(reqs, SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))
    prof.reset()
    llm.generate(reqs, params)
    s = prof.summary(prof.config)
    llm.enable_profiling(False)
    b = s["by_batch"].get(batch_bucket(batch))
    if b is None:
        raise RuntimeError(f"no step ran at batch {batch}: raise max_tokens or --max-num-seqs")
    return {"phases": b["phases"], "modes": {}, "experts": b.get("experts", {})}, \
        b["tok_per_s"]


def fit_batch(llm: Any, draft: str, prompts: list[Any], batch: int, params: SamplingParams,
              calibration: list[Config], spec_for: Any, base: SpecConfig | None,
              warmup_tokens: int, configs: list[Config] | None = None
              ) -> tuple[CostModel, float]:
    """The cost model of a step of `batch` sequences, and plain decoding's tok/s there.
    `configs`: the configurations it will predict, whose verify kernel classes at this batch
    size the calibration must reach (tune/calibration.py)."""
    plain, plain_tps = batched_run(llm, None, prompts, batch, params, warmup_tokens)
    kc = kernel_classes(llm, batch)
    moe = moe_shape(llm)
    cals = []
    for cfg in calibration_shapes(kc, configs or [], calibration, moe is not None):
        s, _ = batched_run(llm, spec_for(cfg, draft, base), prompts, batch, params,
                           warmup_tokens)
        cals.append(calibration_from_summary(s, *cfg))
    return fit_cost_model(cals, plain_ms_from_summary(plain), moe, batch,
                          kernel_class=kc), plain_tps


def moe_shape(llm: Any) -> tuple[int, int] | None:
    """(num_experts, top_k) of a MoE target, for the cost model's expert term; None when
    dense."""
    moe = getattr(getattr(getattr(llm, "model", None), "config", None), "moe", None)
    return None if moe is None else (moe.num_experts, moe.top_k)


def best_at(cost: CostModel, batch: int, taus: dict[Config, float], margin: float
            ) -> tuple[Config | None, float | None]:
    """The configuration predicted fastest at this batch size, or None when none beats
    plain decoding by `margin`."""
    plain = batch * cost.plain_tok_per_s
    scored = {c: batch * cost.tok_per_s(t, *c) for c, t in taus.items()}
    best = max(scored, key=scored.get, default=None)
    if best is None or scored[best] <= plain * (1 + margin):
        return None, scored.get(best)
    return best, scored[best]


def fit_policy(llm: Any, draft: str, prompts: list[Any], batch_sizes: list[int],
               taus: dict[Config, float], batch1: Config | None, params: SamplingParams,
               calibration: list[Config], spec_for: Any, base: SpecConfig | None,
               warmup_tokens: int, margin: float, log: Any = print
               ) -> tuple[SpecPolicy | None, list[BucketRow]]:
    """The policy over `batch_sizes` (1 takes the batch-1 tuning's pick, `batch1`), each
    larger bucket's pick confirmed by one run at its batch size. None when no bucket
    speculates."""
    rows: list[BucketRow] = []
    entries: list[tuple[int, SpecConfig | None]] = []
    for b in sorted(set(batch_sizes)):
        if b == 1:
            entries.append((1, spec_for(batch1, draft, base)))
            continue
        cost, plain_tps = fit_batch(llm, draft, prompts, b, params, calibration, spec_for,
                                    base, warmup_tokens, list(taus))
        pick, pred = best_at(cost, b, taus, margin)
        row = BucketRow(b, cost, plain_tps, pick, pred)
        if pick is not None:
            _, row.measured_tok_per_s = batched_run(llm, spec_for(pick, draft, base), prompts,
                                                    b, params, warmup_tokens)
            if row.measured_tok_per_s <= plain_tps:
                row.pick = None  # measured slower than plain decoding here: off
        log(f"[tune] batch {b}: plain {plain_tps:.1f} tok/s, pick {row.pick or 'off'}"
            + (f" (predicted {pred:.1f}, measured {row.measured_tok_per_s:.1f})"
               if row.measured_tok_per_s else ""))
        rows.append(row)
        entries.append((b, spec_for(row.pick, draft, base)))
    if all(c is None for _, c in entries):
        return None, rows
    return SpecPolicy(tuple(entries)), rows
