"""The acceptance model: predicted accept length tau for any (num_steps, topk, num_draft_tokens)
from one teacher-forced measurement of the draft.

The target answers a few prompts greedily (doctor/probe.py); the draft is unrolled D steps
along those answers exactly as the engine runs it (train/ttt.py). At every answer position t
and depth d the measurement keeps r_d(t): the rank of the target's greedy token among the
draft's candidates at depth d (1 = the draft's top choice; infinity when the target's token
is outside the draft vocabulary, or when an earlier token of the path was not the target's
own, so the path is not the one a greedy verification would walk).

A configuration accepts depth d of the path at t when every node on it is in the tree:

    r_i(t) <= topk  for i <= d   (each node is among its parent's topk children, so among
                                  the topk beams expanded next: a lower bound that is exact
                                  for chains)
    (d - 1) + sum_{i<=d} (r_i(t) - 1) < num_draft_tokens - 1
                                 (at least that many nodes outrank it in the final rerank:
                                  its ancestors and the higher-ranked siblings along the path,
                                  each of which has a higher cumulative score)

and tau = 1 + sum_{d=1..num_steps} mean_t [depth d accepted]. For a chain (topk 1) this is the
engine's greedy accept length on the same tokens; for trees it ignores competition from other
branches' descendants, so it is an upper estimate that the tuner confirms by real runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.doctor.probe import ProbeData
from specscope.draft.eagle3 import Eagle3Draft
from specscope.train.ttt import shift_left, unroll

INF_RANK = 1 << 30


@dataclass
class AcceptanceModel:
    ranks: torch.Tensor  # [N, D] int64: r_d at each usable answer position (INF_RANK: out)

    @property
    def depth(self) -> int:
        return int(self.ranks.shape[1])

    def tau(self, num_steps: int, topk: int, num_draft_tokens: int | None = None) -> float:
        n = num_draft_tokens if num_draft_tokens is not None else num_steps + 1
        if num_steps > self.depth:
            raise ValueError(f"acceptance model measured {self.depth} steps; cannot predict "
                             f"num_steps {num_steps}")
        r = self.ranks[:, :num_steps].clamp(max=INF_RANK)
        inside = (r <= topk).long().cumprod(1)  # [N, s]: every node up to d in the top-k
        outrank = (torch.arange(num_steps) + (r - 1).cumsum(1))  # [N, s]: (d-1) + sum(r-1)
        kept = inside.bool() & (outrank < n - 1)
        return 1.0 + float(kept.long().cumprod(1).sum(1).float().mean())

    def acceptance_by_rank(self, max_rank: int = 8) -> list[list[float]]:
        """[depth][rank-1]: P(r_d == rank | the path is in a full tree up to d-1)."""
        out = []
        alive = torch.ones(self.ranks.shape[0], dtype=torch.bool)
        for d in range(self.depth):
            r = self.ranks[:, d][alive]
            out.append([float((r == k).float().mean()) if r.numel() else 0.0
                        for k in range(1, max_rank + 1)])
            alive = alive & (self.ranks[:, d] <= max_rank)
        return out


@torch.inference_mode()
def measure_acceptance(draft: Eagle3Draft, data: ProbeData, depth: int = 10
                       ) -> AcceptanceModel:
    """Ranks of the target's greedy path under the draft, `depth` steps deep."""
    B, T = data.input_ids.shape
    ids = torch.tensor(draft.config.aux_layer_ids, device=data.layers.device) + 1
    taps = data.layers.index_select(2, ids).reshape(B, T, -1).to(draft.fc.weight.dtype)
    if draft._rope is None or draft._rope[0].shape[0] < T + depth + 1:
        draft.init_rope(max(T + depth + 1, draft.config.max_position_embeddings))
    logits = unroll(draft, taps, data.input_ids, depth)  # each [B, T, Vd]
    top = data.logits.argmax(-1)  # [B, T] the target's greedy token after each position
    t2d = draft.t2d.to(top.device)
    # draft id of each target id (valid where t2d): rank of the draft vocabulary position
    d_of_t = torch.cumsum(t2d.long(), 0) - 1
    ranks, valid = [], None
    on_path = torch.ones(B, T, dtype=torch.bool, device=top.device)
    for j, lg in enumerate(logits):
        label = shift_left(data.input_ids, j + 2, -1)  # the token fed after depth j
        tgt = shift_left(top, j + 1, -1)  # the target's greedy token at depth j
        mask = shift_left(data.label_mask, j + 2, False)
        valid = mask if valid is None else valid & mask
        in_vocab = t2d[tgt.clamp(min=0)] & (tgt >= 0)
        did = d_of_t[tgt.clamp(min=0)].clamp(min=0)
        own = lg.gather(-1, did[..., None])  # [B, T, 1]
        rank = (lg > own).sum(-1) + 1  # [B, T]
        rank = torch.where(in_vocab & on_path, rank, torch.full_like(rank, INF_RANK))
        ranks.append(rank)
        on_path = on_path & (label == tgt)  # later depths follow the target's own path
    r = torch.stack(ranks, -1)  # [B, T, D]
    return AcceptanceModel(ranks=r[valid].cpu())
