"""Simulated acceptance: benchmark the real cycle's cost at a chosen acceptance profile.

The draft and the verify forward run for real; only the decision of how many draft tokens
to accept is drawn from given per-position rates: draft token i is accepted with
probability rates[i - 1] given all earlier ones were. The emitted tokens are still real
vocabulary ids — the accepted draft tokens (whose target K/V the verify forward wrote)
followed by the target's own next token — so the KV cache stays consistent and the text
decodes. Output produced this way is labelled simulated everywhere.
"""

from __future__ import annotations

import torch

from specscope.spec.tree import DraftTree
from specscope.spec.verify import Verdict, _at


def simulated_verdict(tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None,
                      rates: torch.Tensor, u: torch.Tensor, max_depth: int, topk: int,
                      gen: torch.Generator | None) -> Verdict:
    """logits [N, V]; probs [N, V] processed target probabilities (None: greedy bonus);
    rates, u [max_depth]: acceptance rates and uniforms (drawn by the caller, so the
    function stays replayable in a CUDA graph). Walks the first-child path of the tree."""
    dev = tree.tokens.device
    want = (u < rates).long().cumprod(0).sum()  # [] accepted count drawn from the profile
    children = tree.children_table(max(topk, 1))  # [N, topk]
    cur = torch.zeros((), dtype=torch.long, device=dev)
    path = [cur]  # built from device tensors only: no host->device copy (graph capture)
    n_acc = torch.zeros((), dtype=torch.long, device=dev)
    for i in range(1, max_depth + 1):
        child = _at(children[:, 0], cur)
        take = (child >= 0) & (i <= want)
        path.append(torch.where(take, child, -1))
        cur = torch.where(take, child, cur)
        n_acc = n_acc + take.long()
    if probs is None:
        bonus = _at(logits, cur).argmax(-1)
    else:
        p = _at(probs, cur)  # [V]
        race = torch.empty_like(p).exponential_(generator=gen)
        bonus = (p / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(-1)
    return Verdict(path=torch.stack(path), num_accepted=n_acc, bonus=bonus)
