"""Speculative decoding's per-request statistics and the draft it runs (the cycle itself is
the batched engine's, engine/engine.py; its pure pieces live in spec/)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specscope.config import SpecConfig
from specscope.draft.eagle3 import Eagle3Draft, random_draft, shard_draft
from specscope.draft.loader import load_draft
from specscope.models.registry import TargetModel

log = logging.getLogger("specscope.spec")

@dataclass
class SpecStats:
    """Per-request speculative statistics (definitions in DESIGN.md)."""

    num_steps: int
    simulated: bool
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle
    drafted: list[int] = field(default_factory=list)  # draft positions verified per cycle

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per cycle, bonus included (tau)."""
        return (sum(self.accepted) / len(self.accepted) + 1.0) if self.accepted else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Conditional acceptance at each draft position (accepted given all earlier were)."""
        return acceptance_by_position(self.accepted, self.num_steps, self.drafted)[0]

    def as_dict(self) -> dict:
        cond, per_draft = acceptance_by_position(self.accepted, self.num_steps, self.drafted)
        return {"cycles": self.cycles, "accept_length": round(self.accept_length, 4),
                "acceptance_by_position": [round(x, 4) for x in cond],
                "acceptance_per_draft_by_position": [round(x, 4) for x in per_draft],
                "accepted_per_cycle": list(self.accepted),
                "drafted_per_cycle": list(self.drafted), "simulated": self.simulated}


def acceptance_by_position(accepted: list[int], depth: int,
                           drafted: list[int] | None = None) -> tuple[list[float],
                                                                      list[float]]:
    """Both definitions of acceptance at draft positions 1..depth, for cycles that accepted
    accepted[c] draft tokens each of drafted[c] (default: depth each; fewer where the
    confidence stop ended a chain) (docs/speculative.md):
    conditional[i]: cycles accepting >= i + 1 over cycles accepting >= i that drafted
        position i + 1 (accepted given all earlier were and it was drafted; ours,
        `acceptance_by_position`);
    per_draft[i]: cycles accepting >= i + 1 over all cycles (vLLM's per-position
        acceptance rate, `acceptance_per_draft_by_position`).
    For [1, 0, 2, 3, 2]: conditional 0.80 0.75 0.33 0 0, per draft 0.80 0.60 0.20 0 0.
    Drafting [5, 5, 2, 5, 5] instead, the third cycle never offered position 3:
    conditional 0.80 0.75 0.50 0 0."""
    n = len(accepted)
    drafted = drafted if drafted else [depth] * n
    cond, per = [], []
    for i in range(depth):
        reached = sum(1 for a, d in zip(accepted, drafted, strict=True) if a >= i and d > i)
        took = sum(1 for a in accepted if a > i)
        cond.append(took / reached if reached else 0.0)
        per.append(took / n if n else 0.0)
    return cond, per


def load_spec_draft(spec: SpecConfig, target: TargetModel, dtype: torch.dtype,
                    device: torch.device) -> tuple[Eagle3Draft, str]:
    """The draft named by spec.draft: a checkpoint directory, or "random" (an EAGLE-3-shaped
    random-weight draft for the target, for benchmarking with simulated acceptance).

    Under tensor parallelism every rank loads the same draft; spec.draft_tensor_parallel_size
    1 keeps it whole on each (replicated), the target's size shards it like the target."""
    tp = getattr(target, "tp", None)
    size, want = (1 if tp is None else tp.size), spec.draft_tensor_parallel_size
    if want not in (1, size):
        raise ValueError(f"draft_tensor_parallel_size {want} must be 1 (the draft replicated "
                         f"on every rank) or the target's tensor-parallel size ({size})")
    if spec.draft is None:
        raise ValueError("speculative decoding needs a draft: pass --draft PATH (or 'random' "
                         "with --simulate-acceptance for benchmarking)")
    if spec.draft == "random":
        draft = random_draft(target.config, dtype, device, layer_ids=spec.draft_layer_ids)
        msg = (f"random EAGLE-3 draft (hidden {draft.config.hidden_size}, draft vocab "
               f"{draft.config.draft_vocab_size}, layer ids {list(draft.config.aux_layer_ids)})")
        if not spec.simulated:
            log.warning("a random draft accepts almost nothing; use --simulate-acceptance")
    else:
        # Sharded (want > 1): each rank reads only its slices, as the target does.
        loaded = load_draft(spec.draft, target.config, dtype=dtype, device=device,
                            layer_ids=list(spec.draft_layer_ids) if spec.draft_layer_ids
                            else None, tp=tp if want > 1 else None)
        draft, msg = loaded.model, loaded.message
    if want > 1:
        if spec.draft == "random":
            draft = shard_draft(draft, tp)
        msg += f", sharded over {want} ranks"
    elif size > 1:
        msg += f", replicated on each of {size} ranks"
    draft.attach_target(target)
    log.info("draft: %s", msg)
    return draft, msg
