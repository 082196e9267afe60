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
from specscope.spec.verify import Verdict, _at, children_table


def simulated_paths(parents: torch.Tensor, rates: torch.Tensor, u: torch.Tensor,
                    max_depth: int, topk: int, sibling: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The simulated walk of S trees at once: path [S, max_depth + 1] (-1 padded) and
    num_accepted [S]. parents [S, N]; rates [max_depth]: acceptance rates of the
    top-ranked child; u [S, max_depth, C] uniforms (drawn by the caller, so the walk stays
    replayable in a CUDA graph): column 0 decides the top child, columns 1.. the siblings
    (rate `sibling`). Children are kept in rank order (drafter.py creates a beam's
    children best first). Device ops only, the same few per depth for any S."""
    S = parents.shape[0]
    dev = parents.device
    M = max(topk, 1)
    C = min(u.shape[-1], M)
    children = children_table(parents, M)  # [S, N, M]
    # One draw per (depth, rank) for the whole walk: rates for the top child, then siblings.
    thresholds = torch.cat([rates[:max_depth, None],
                            rates.new_full((max_depth, C - 1), sibling)], 1)  # [depth, C]
    drawn = u[:, :max_depth, :C] < thresholds  # [S, max_depth, C]
    cur = torch.zeros(S, dtype=torch.long, device=dev)
    path = [cur]
    n_acc = torch.zeros(S, dtype=torch.long, device=dev)
    alive = torch.ones(S, dtype=torch.bool, device=dev)
    for i in range(1, max_depth + 1):
        hits = drawn[:, i - 1]  # [S, C]
        rank = hits.long().argmax(-1)  # the first rank drawn as accepted (0 when none is)
        row = children.gather(1, cur[:, None, None].expand(S, 1, M))[:, 0]  # [S, M]
        child = row.gather(1, rank[:, None])[:, 0]  # [S]
        take = alive & hits.any(-1) & (child >= 0)
        path.append(torch.where(take, child, -1))
        cur = torch.where(take, child, cur)
        n_acc = n_acc + take.long()
        alive = take
    return torch.stack(path, 1), n_acc


def simulated_verdict(tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None,
                      rates: torch.Tensor, u: torch.Tensor, max_depth: int, topk: int,
                      gen: torch.Generator | None, sibling: float = 0.0) -> Verdict:
    """One tree's simulated verdict: simulated_paths with S = 1, then the bonus token at
    the path's end, greedy (probs None) or drawn from the processed target probabilities.
    logits [N, V]; probs [N, V] or None; u [max_depth] or [max_depth, C]."""
    u = u[:, None] if u.dim() == 1 else u  # [max_depth, C]
    path, n_acc = simulated_paths(tree.parents[None], rates, u[None], max_depth, topk,
                                  sibling)
    path, n_acc = path[0], n_acc[0]
    end = path.gather(0, n_acc.reshape(1))  # [1]: the deepest accepted node
    if probs is None:
        bonus = _at(logits, end[0]).argmax(-1)
    else:
        p = _at(probs, end[0])  # [V]
        race = torch.empty_like(p).exponential_(generator=gen)
        bonus = (p / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(-1)
    return Verdict(path=path, num_accepted=n_acc, bonus=bonus)
