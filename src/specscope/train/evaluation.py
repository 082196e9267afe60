"""Held-out evaluation of a draft during training, with the engine's definitions:
acceptance by position (given all earlier accepted), the formula accept length, and the
engine-walk accept length (cycles start after each bonus token)."""

from __future__ import annotations

from typing import Any

import torch

from specscope.draft.eagle3 import Eagle3Draft
from specscope.models.registry import TargetModel
from specscope.train.config import TrainConfig
from specscope.train.data import Example, token_batches
from specscope.train.tap_cache import target_batch
from specscope.train.ttt import (
    acceptance,
    predicted_accept_length,
    ttt_loss,
    walk_accept_counts,
)


def evaluate(draft: Eagle3Draft, target: TargetModel, examples: list[Example],
             cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """Held-out loss, top-1 agreement and acceptance by position (engine definitions)."""
    if not examples:
        return {}
    was_training = draft.training
    draft.eval()
    draft_ids = draft.to_target(torch.arange(draft.config.draft_vocab_size, device=device))
    sums = None
    losses = torch.zeros(cfg.ttt_length)
    n_batches = 0
    walk_steps = sorted({k for k in (1, 3, 5, cfg.ttt_length) if k <= cfg.ttt_length})
    walk = {k: [0, 0] for k in walk_steps}  # num_steps -> [accepted tokens, cycles]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for idx in token_batches(examples, cfg.batch_tokens, cfg.seed, epoch=-1):
        batch = target_batch(target, [examples[i] for i in idx], draft_ids, device)
        with torch.no_grad(), autocast:
            _, step_losses, m = ttt_loss(draft, batch, cfg.ttt_length, cfg.loss_decay,
                                         cfg.ttt_attention)
        for k in walk_steps:
            tokens, cycles = walk_accept_counts(m, batch.label_mask, k)
            walk[k][0] += tokens
            walk[k][1] += cycles
        vals = torch.stack([m.count, m.correct, m.chain, m.reached]).cpu()
        sums = vals if sums is None else sums + vals
        losses += torch.stack(step_losses).float().cpu()
        n_batches += 1
    draft.train(was_training)
    count, correct, chain, reached = sums
    rates = acceptance(chain, reached)
    return {
        "loss_by_position": [round(x, 4) for x in (losses / n_batches).tolist()],
        "top1_by_position": [round(float(c / n), 4) if n else 0.0
                             for c, n in zip(correct, count, strict=True)],
        "acceptance_by_position": [round(a, 4) for a in rates],
        "predicted_accept_length": {k: round(predicted_accept_length(rates, k), 3)
                                    for k in sorted({1, 3, 5, cfg.ttt_length})
                                    if k <= cfg.ttt_length},
        # The engine's greedy chain replayed over the answers (cycles start after each
        # bonus token): what `specscope profile` measures. The formula above assumes a
        # cycle at every position and is optimistic when rejections cluster.
        "walk_accept_length": {k: round(1 + t / max(c, 1), 3) for k, (t, c) in walk.items()},
        "labels": int(count[0]),
    }
