"""Simulated acceptance: benchmark the real cycle's cost at a chosen acceptance profile.

The draft and the verify forward run for real; only the decision of how many draft tokens
to accept is drawn from given per-position rates: the top-ranked child at depth i is accepted
with probability rates[i - 1] given the path so far was. In a tree (topk > 1) with a sibling
rate s > 0, a rejected top child passes the turn to the next-ranked kept sibling, accepted
with probability s, and so on: rank r is accepted with probability (1 - a)(1 - s)^(r-2) s.
A drawn rank that the tree did not keep ends the cycle, as a real rejection would. The
emitted tokens are still real vocabulary ids (the accepted draft tokens, whose target K/V
the verify forward wrote, followed by the target's own next token), so the KV cache stays
consistent and the text decodes. Output produced this way is labelled simulated everywhere.
"""

from __future__ import annotations

import torch

from specscope.spec.tree import DraftTree
from specscope.spec.verify import Verdict, _at


def simulated_verdict(tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None,
                      rates: torch.Tensor, u: torch.Tensor, max_depth: int, topk: int,
                      gen: torch.Generator | None, sibling: float = 0.0) -> Verdict:
    """logits [N, V]; probs [N, V] processed target probabilities (None: greedy bonus);
    rates [max_depth]: acceptance rates of the top-ranked child; u [max_depth] or
    [max_depth, C] uniforms (drawn by the caller, so the function stays replayable in a CUDA
    graph): column 0 decides the top child, columns 1.. the siblings (rate `sibling`).
    Children are kept in rank order (drafter.py creates a beam's children best first)."""
    dev = tree.tokens.device
    u = u[:, None] if u.dim() == 1 else u  # [max_depth, C]
    C = min(u.shape[1], max(topk, 1))
    children = tree.children_table(max(topk, 1))  # [N, topk]
    cur = torch.zeros((), dtype=torch.long, device=dev)
    path = [cur]  # built from device tensors only: no host->device copy (graph capture)
    n_acc = torch.zeros((), dtype=torch.long, device=dev)
    alive = torch.ones((), dtype=torch.bool, device=dev)
    # One draw per (depth, rank) for the whole walk: rates for the top child, then siblings.
    thresholds = torch.cat([rates[:max_depth, None],
                            rates.new_full((max_depth, C - 1), sibling)], 1)  # [depth, C]
    drawn = u[:max_depth, :C] < thresholds  # [max_depth, C]
    for i in range(1, max_depth + 1):
        hits = drawn[i - 1]
        rank = hits.long().argmax()  # the first rank drawn as accepted (0 when none is)
        child = _at(_at(children, cur), rank)
        take = alive & hits.any() & (child >= 0)
        path.append(torch.where(take, child, -1))
        cur = torch.where(take, child, cur)
        n_acc = n_acc + take.long()
        alive = take
    if probs is None:
        bonus = _at(logits, cur).argmax(-1)
    else:
        p = _at(probs, cur)  # [V]
        race = torch.empty_like(p).exponential_(generator=gen)
        bonus = (p / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(-1)
    return Verdict(path=torch.stack(path), num_accepted=n_acc, bonus=bonus)
