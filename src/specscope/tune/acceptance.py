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

The accepted depth a(t) is the number of leading depths accepted. tau is not the mean of a(t)
over all positions: cycles do not start at every position. They start right after the
previous cycle's bonus token, and rejections cluster at hard positions. So the model replays
the engine's walk over each answer: the first cycle's extend ends at the last prompt position
t0, and a cycle at t is followed by one at t + a(t) + 1. Then tau = 1 + mean a over the
replayed cycles. For a chain (topk 1) this is the engine's greedy accept length on the same
tokens. For trees it ignores competition from other branches' descendants, so it is an upper
estimate, which the tuner confirms with real runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specscope.doctor.probe import ProbeData
from specscope.draft.eagle3 import Eagle3Draft
from specscope.train.ttt import shift_left, unroll, walk_cycles

INF_RANK = 1 << 30


@dataclass
class AcceptanceModel:
    ranks: torch.Tensor  # [B, T, D] int64: r_d at index t (INF_RANK: not on the path / out)
    starts: list[int]  # per answer: index of the last prompt token (the first cycle's t)
    ends: list[int]  # per answer: the index after its last token
    path_lp: torch.Tensor | None = None  # [B, T, D] draft log-prob of the path token
    top_lp: torch.Tensor | None = None  # [B, T, D, K] the draft's K best log-probs, sorted
    _outrank: dict | None = field(default=None, repr=False)  # (s, k) -> [B, T, s] cache
    # Positions drawn independently (a simulated profile): the walk's cycles are then a
    # plain sample of a(t), so tau is 1 + the mean of a(t), without replaying the walk.
    iid: bool = False

    @property
    def depth(self) -> int:
        return int(self.ranks.shape[2])

    def accepted_depths(self, num_steps: int, topk: int, num_draft_tokens: int | None = None
                        ) -> torch.Tensor:
        """a(t) [B, T]: depths a cycle at index t would accept under this configuration."""
        n = num_draft_tokens if num_draft_tokens is not None else num_steps + 1
        if num_steps > self.depth:
            raise ValueError(f"acceptance model measured {self.depth} steps; cannot predict "
                             f"num_steps {num_steps}")
        r = self.ranks[..., :num_steps]
        inside = (r <= topk).long().cumprod(-1).bool()  # every node up to d in the top-k
        kept = inside & (self._outranking(num_steps, topk) < n - 1)
        return kept.long().cumprod(-1).sum(-1)

    def _outranking(self, num_steps: int, topk: int) -> torch.Tensor:
        """[B, T, s]: tree nodes whose cumulative score beats the path node at depth d.

        EAGLE-2 keeps the num_draft_tokens - 1 best-scoring candidates (cumulative draft
        log-prob). Counted: at every depth i <= d, the topk children of the path node at
        depth i-1 scoring above the path node at d (its ancestors among them). Descendants of
        off-path nodes are not counted (their scores are unknown without running them): a
        lower bound. Without scores, the rank-only bound (d-1) + sum(r_i - 1) is used."""
        if self.path_lp is None or self.top_lp is None:
            r = self.ranks[..., :num_steps].clamp(max=INF_RANK)
            return torch.arange(num_steps) + (r - 1).cumsum(-1)
        if self._outrank is None:
            self._outrank = {}
        key = (num_steps, min(topk, self.top_lp.shape[-1]))
        if key not in self._outrank:
            s, k = key
            S = self.path_lp[..., :s].cumsum(-1)  # [B, T, s] path score at depth d
            prev = S - self.path_lp[..., :s]  # score of the parent at each depth
            cand = prev[..., None] + self.top_lp[..., :s, :k]  # [B, T, s, k] siblings' scores
            counts = [(cand[..., :d + 1, :] > S[..., d, None, None]).sum((-1, -2))
                      for d in range(s)]
            self._outrank[key] = torch.stack(counts, -1)
        return self._outrank[key]

    def cycles(self, num_steps: int, topk: int, num_draft_tokens: int | None = None
               ) -> list[int]:
        """Accepted draft tokens of every replayed cycle (the engine's walk)."""
        a = self.accepted_depths(num_steps, topk, num_draft_tokens).tolist()
        return walk_cycles(a, [[(s, e)] for s, e in zip(self.starts, self.ends, strict=True)])

    def tau(self, num_steps: int, topk: int, num_draft_tokens: int | None = None) -> float:
        if self.iid:
            a = self.accepted_depths(num_steps, topk, num_draft_tokens)
            return 1.0 + float(a.float().mean())
        c = self.cycles(num_steps, topk, num_draft_tokens)
        return 1.0 + sum(c) / len(c) if c else 1.0

    @classmethod
    def simulated(cls, rates: tuple[float, ...], sibling: float = 0.0, depth: int = 10,
                  positions: int = 8_000, seed: int = 0) -> AcceptanceModel:
        """The acceptance model of a simulated-acceptance profile (spec/simulate.py): ranks
        drawn as the engine draws them, independently at every position and depth (rank 1
        with rates[d], else each lower rank in turn with `sibling`), over one long answer.
        Rates past the end of `rates` repeat its last (SpecConfig.acceptance_rates)."""
        g = torch.Generator().manual_seed(seed)
        a = torch.tensor([rates[min(d, len(rates) - 1)] for d in range(depth)])
        u = torch.rand(positions, depth, 8, generator=g)
        hits = torch.cat([u[..., :1] < a[:, None], u[..., 1:] < sibling], -1)  # [T, D, 8]
        first = hits.long().argmax(-1) + 1  # 1-based rank of the first hit
        ranks = torch.where(hits.any(-1), first, torch.full_like(first, INF_RANK))
        return cls(ranks=ranks[None], starts=[0], ends=[positions], iid=True)

    def taus(self, configs: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], float]:
        """tau of many configurations at once (the tuner predicts thousands). Within one
        (num_steps, topk) the tree's shape depends on num_draft_tokens only through a
        threshold: the node at depth d is kept when n >= need[d] = outranking[d] + 2, so
        a(t) for any n counts the leading depths whose running maximum of need is <= n."""
        out: dict[tuple[int, int, int], float] = {}
        groups: dict[tuple[int, int], list[int]] = {}
        for s, k, n in configs:
            groups.setdefault((s, k), []).append(n)
        for (s, k), ns in groups.items():
            if s > self.depth:
                raise ValueError(f"acceptance model measured {self.depth} steps; cannot "
                                 f"predict num_steps {s}")
            inside = (self.ranks[..., :s] <= k).long().cumprod(-1).bool()
            need = torch.where(inside, self._outranking(s, k) + 2,
                               torch.full_like(self.ranks[..., :s], INF_RANK))
            lead = need.cummax(-1).values  # [B, T, s]: n needed to keep depths 0..d
            for n in sorted(set(ns)):
                a = (lead <= n).sum(-1)  # [B, T] leading depths kept (lead is monotone)
                if self.iid:
                    out[(s, k, n)] = 1.0 + float(a.float().mean())
                else:
                    c = walk_cycles(a.tolist(), [[(st, e)] for st, e in
                                                 zip(self.starts, self.ends, strict=True)])
                    out[(s, k, n)] = 1.0 + sum(c) / len(c) if c else 1.0
        return out

    def acceptance_by_rank(self, max_rank: int = 8) -> list[list[float]]:
        """[depth][rank-1]: P(r_d == rank | the path is in a full tree up to d-1)."""
        out = []
        flat = self.ranks.reshape(-1, self.depth)
        flat = flat[flat[:, 0] < INF_RANK]
        alive = torch.ones(flat.shape[0], dtype=torch.bool)
        for d in range(self.depth):
            r = flat[:, d][alive]
            out.append([float((r == k).float().mean()) if r.numel() else 0.0
                        for k in range(1, max_rank + 1)])
            alive = alive & (flat[:, d] <= max_rank)
        return out


@torch.inference_mode()
def measure_acceptance(draft: Eagle3Draft, data: ProbeData, depth: int = 10
                       ) -> AcceptanceModel:
    """Ranks of the target's greedy path under the draft, `depth` steps deep."""
    B, T = data.input_ids.shape
    taps = data.taps(draft.config.aux_layer_ids, draft.fc.weight.dtype)
    draft.ensure_rope(T + depth + 1)
    logits = unroll(draft, taps, data.input_ids, depth)  # each [B, T, Vd]
    top = data.logits.argmax(-1)  # [B, T] the target's greedy token after each position
    t2d = draft.t2d.to(top.device)
    # draft id of each target id (valid where t2d): rank of the draft vocabulary position
    d_of_t = torch.cumsum(t2d.long(), 0) - 1
    ranks, path_lp, top_lp = [], [], []
    on_path = torch.ones(B, T, dtype=torch.bool, device=top.device)
    for j, lg in enumerate(logits):
        label = shift_left(data.input_ids, j + 2, -1)  # the token fed after depth j
        tgt = shift_left(top, j + 1, -1)  # the target's greedy token at depth j
        mask = shift_left(data.label_mask, j + 2, False)  # the predicted token is an answer's
        in_vocab = t2d[tgt.clamp(min=0)] & (tgt >= 0)
        did = d_of_t[tgt.clamp(min=0)].clamp(min=0)
        own = lg.gather(-1, did[..., None])  # [B, T, 1]
        rank = (lg > own).sum(-1) + 1  # [B, T]
        lp = torch.log_softmax(lg.float(), -1)
        path_lp.append(lp.gather(-1, did[..., None])[..., 0])
        top_lp.append(lp.topk(8, dim=-1).values)
        rank = torch.where(in_vocab & on_path & mask, rank, torch.full_like(rank, INF_RANK))
        ranks.append(rank)
        on_path = on_path & (label == tgt)  # later depths follow the target's own path
    r = torch.stack(ranks, -1).cpu()  # [B, T, D]
    lm = data.label_mask.cpu()
    starts = [int(row.nonzero()[0]) - 1 for row in lm]  # last prompt index
    ends = [int(row.nonzero()[-1]) + 1 for row in lm]
    return AcceptanceModel(ranks=r, starts=starts, ends=ends,
                           path_lp=torch.stack(path_lp, -1).cpu(),
                           top_lp=torch.stack(top_lp, -2).cpu())
