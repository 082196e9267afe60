"""The acceptance model: predicted accept length tau for any (num_steps, topk, num_draft_tokens)
from one teacher-forced measurement of the draft.

The target's answers are the engine's own greedy outputs (the tuner's plain run), teacher-
forced once through the target (doctor/probe.py) for its taps. The draft is unrolled D steps
along them exactly as the engine runs it (train/ttt.py). At every answer position t and depth
d the measurement keeps r_d(t): the rank of the answer's token among the draft's candidates at
depth d (1 = the draft's top choice; infinity when the token is outside the draft vocabulary,
or when an earlier token of the path was not the target's own, so the path is not the one a
greedy verification would walk).

A configuration accepts depth d of the path at t when every node on it is in the tree. For
trees (topk 2 .. 8) the engine's EAGLE-2 trees are unrolled at every position at once
(tune/tree_unroll.py): every beam runs, so whether the path's node at d is a candidate and how
many candidates outrank it (the final rerank keeps num_draft_tokens - 1) are the engine's own.
A simulated profile (ranks drawn, not measured) has no tree to unroll; it approximates the
tree from the path (_beam_terms), every beam's children given the path node's children's
log-probs at that depth, with the scores borrowed from the draft that will run
(`draft_scores`): a random draft's nearly flat scores fill the tree breadth first, which cuts
the top-ranked path at a depth the ranks alone do not show. Without any scores the rank-only
bound is used: r_i <= topk for i <= d and (d - 1) + sum_{i<=d} (r_i - 1) < num_draft_tokens - 1.

The accepted depth a(t) is the number of leading depths accepted. tau is not the mean of a(t)
over all positions: cycles do not start at every position. They start right after the
previous cycle's bonus token, and rejections cluster at hard positions. So the model replays
the engine's walk over each answer: the first cycle's extend ends at the last prompt position
t0, and a cycle at t is followed by one at t + a(t) + 1. Then tau = 1 + mean a over the
replayed cycles. In fp32 this replays the engine's cycles one for one, chains and trees
(tests/test_tune.py), but for each answer's last cycle, which the engine drafts past the
answer's end; in bf16 the speculative run's text can part from the plain run's at a near-tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specscope.doctor.probe import ProbeData
from specscope.draft.eagle3 import Eagle3Draft
from specscope.train.ttt import shift_left, unroll, walk_cycles, walk_totals
from specscope.tune.tree_unroll import TreeCandidates, unroll_tree

INF_RANK = 1 << 30


@dataclass
class AcceptanceModel:
    ranks: torch.Tensor  # [B, T, D] int64: r_d at index t (INF_RANK: not on the path / out)
    starts: list[int]  # per answer: index of the last prompt token (the first cycle's t)
    ends: list[int]  # per answer: the index after its last token
    path_lp: torch.Tensor | None = None  # [B, T, D] draft log-prob of the path token
    top_lp: torch.Tensor | None = None  # [B, T, D, K] the draft's K best log-probs, sorted
    _terms: dict | None = field(default=None, repr=False)  # topk -> _full_terms
    # topk -> the engine's trees unrolled at every index (measure_acceptance): exact terms
    # instead of the path-borrowed approximation of _beam_terms.
    trees: dict[int, TreeCandidates] = field(default_factory=dict, repr=False)
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
        inside, outrank = self._tree_terms(num_steps, topk)
        kept = inside & (outrank < n - 1)
        return kept.long().cumprod(-1).sum(-1)

    def _tree_terms(self, num_steps: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, s] bool, [B, T, s]): whether the path node at depth d can be in a tree of
        this (num_steps, topk) at all, and how many candidates of depths <= s outrank it.
        A tree's depths do not depend on num_steps (it only stops the growth), so each topk
        is worked out once, all D depths deep, and sliced."""
        if self._terms is None:
            self._terms = {}
        if topk not in self._terms:
            self._terms[topk] = self._full_terms(topk)
        ok, by_depth = self._terms[topk]  # [B, T, D], [B, T, D, D]
        return ok[..., :num_steps], by_depth[..., :num_steps, :num_steps].sum(-1)

    def _full_terms(self, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ok [B, T, D] bool, by_depth [B, T, D, D]): the path's node at depth d is a
        candidate (its ancestors too), and by_depth[..., d, i] candidates of depth i outrank
        it."""
        if topk in self.trees:
            tc = self.trees[topk]
            by_depth = (tc.scores[..., None, :, :] > tc.path[..., :, None, None]).sum(-1)
            return tc.present, by_depth
        r = self.ranks
        ok = r <= topk  # among its parent's topk children
        if self.path_lp is not None and self.top_lp is not None and \
                topk <= self.top_lp.shape[-1]:
            by_depth, beam = self._beam_terms(topk)
            # its parent must also have been one of the topk beams expanded
            ok = ok & torch.cat([torch.ones_like(beam[..., :1]), beam[..., :-1]], -1)
        else:
            # Without scores, the rank-only bound (d - 1) + sum(r_i - 1): one ancestor and
            # r_i - 1 elder siblings per depth i <= d outrank the node at d.
            D = self.depth
            step = (r.clamp(max=INF_RANK) - 1) + (torch.arange(D) > 0)  # [B, T, D]
            by_depth = step[..., None, :] * torch.ones(D, D, dtype=torch.long).tril()
        return ok.long().cumprod(-1).bool(), by_depth

    def _beam_terms(self, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-2's tree, approximated from the path: every beam's children are given the
        path node's children's top-k log-probs at that depth (the only ones measured).

        Candidates at depth 1 are the root's top-k children (exact); at depth i each of the
        topk best candidates of depth i-1 (the beams) proposes topk children. The final tree
        keeps the num_draft_tokens - 1 best candidates of all depths. Returns by_depth
        [B, T, D, D] (candidates of depth i outranking the path node at depth d) and whether
        the path node at depth d is among its depth's topk beams [B, T, D]. Off-path
        competition is what makes wide trees accept less than their paths alone suggest."""
        k = topk
        # float64, and a tie tolerance: the path's own node is also among the candidates,
        # summed in another order, and a rounding difference must not let it outrank itself
        # (that cut the deepest node of a chain in about 1 position of 40).
        S = self.path_lp.double().cumsum(-1) + 1e-9  # [B, T, D] path node scores
        lp = self.top_lp[..., :k].double()  # [B, T, D, k]
        cands = [lp[..., 0, :]]  # [B, T, k] depth 1
        beams = cands[0]
        for i in range(1, self.depth):
            c = (beams[..., :, None] + lp[..., i, None, :]).flatten(-2)  # [B, T, k * k]
            cands.append(c)
            beams = c.topk(k, dim=-1).values
        by_depth = torch.stack([torch.stack([(c > S[..., d, None]).sum(-1) for c in cands], -1)
                                for d in range(self.depth)], -2)  # [B, T, D, D]
        beam = torch.stack([(cands[d] > S[..., d, None]).sum(-1) < k
                            for d in range(self.depth)], -1)
        return by_depth, beam

    def cycles(self, num_steps: int, topk: int, num_draft_tokens: int | None = None
               ) -> list[int]:
        """Accepted draft tokens of every replayed cycle (the engine's walk)."""
        a = self.accepted_depths(num_steps, topk, num_draft_tokens).tolist()
        return walk_cycles(a, [[(s, e)] for s, e in zip(self.starts, self.ends, strict=True)])

    def tau(self, num_steps: int, topk: int, num_draft_tokens: int | None = None) -> float:
        if self.iid:
            a = self.accepted_depths(num_steps, topk, num_draft_tokens)
            return 1.0 + float(a.double().mean())
        c = self.cycles(num_steps, topk, num_draft_tokens)
        return 1.0 + sum(c) / len(c) if c else 1.0

    @classmethod
    def simulated(cls, rates: tuple[float, ...], sibling: float = 0.0, depth: int = 10,
                  positions: int = 8_000, seed: int = 0, scores: torch.Tensor | None = None
                  ) -> AcceptanceModel:
        """The acceptance model of a simulated-acceptance profile (spec/simulate.py): ranks
        drawn as the engine draws them, independently at every position and depth (rank 1
        with rates[d], else each lower rank in turn with `sibling`), over one long answer.
        Rates past the end of `rates` repeat its last (SpecConfig.acceptance_rates).
        `scores` [N, >= depth, 8]: the running draft's sorted top log-probs at N measured
        positions (draft_scores). Each simulated position takes one of them, and the path
        node of rank r the r-th best log-prob, so EAGLE-2's tree is shaped as that draft
        shapes it. Without scores, the rank-only bound."""
        g = torch.Generator().manual_seed(seed)
        a = torch.tensor([rates[min(d, len(rates) - 1)] for d in range(depth)])
        u = torch.rand(positions, depth, 8, generator=g)
        hits = torch.cat([u[..., :1] < a[:, None], u[..., 1:] < sibling], -1)  # [T, D, 8]
        first = hits.long().argmax(-1) + 1  # 1-based rank of the first hit
        ranks = torch.where(hits.any(-1), first, torch.full_like(first, INF_RANK))
        if scores is None:
            return cls(ranks=ranks[None], starts=[0], ends=[positions], iid=True)
        if scores.dim() != 3 or scores.shape[1] < depth or scores.shape[2] < 8 or \
                scores.shape[0] == 0:
            raise ValueError(f"scores must be [N >= 1, depth >= {depth}, 8] sorted log-probs, "
                             f"got {tuple(scores.shape)}")
        pick = torch.randint(0, scores.shape[0], (positions,), generator=g)
        top = scores[pick, :depth, :8].float()  # [T, D, 8]
        path = top.gather(-1, (first.clamp(max=8) - 1)[..., None])[..., 0]  # [T, D]
        return cls(ranks=ranks[None], starts=[0], ends=[positions], path_lp=path[None],
                   top_lp=top[None], iid=True)

    def taus(self, configs: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], float]:
        """tau of many configurations at once (the tuner predicts thousands). Within one
        (num_steps, topk) the tree's shape depends on num_draft_tokens only through a
        threshold: the node at depth d is kept when n >= need[d] = outranking[d] + 2, so
        a(t) for any n counts the leading depths whose running maximum of need is <= n."""
        out: dict[tuple[int, int, int], float] = {}
        walked: list[torch.Tensor] = []  # a(t) of the walked configurations, by group
        walked_ns: list[list[tuple[int, int, int]]] = []
        groups: dict[tuple[int, int], list[int]] = {}
        for s, k, n in configs:
            groups.setdefault((s, k), []).append(n)
        for (s, k), ns in groups.items():
            if s > self.depth:
                raise ValueError(f"acceptance model measured {self.depth} steps; cannot "
                                 f"predict num_steps {s}")
            inside, outrank = self._tree_terms(s, k)
            need = torch.where(inside, outrank + 2,
                               torch.full_like(self.ranks[..., :s], INF_RANK))
            lead = need.cummax(-1).values  # [B, T, s]: n needed to keep depths 0..d
            if self.iid:  # mean a(t) = sum over d of the share of positions with lead_d <= n
                srt = lead.reshape(-1, s).T.contiguous().sort(-1).values  # [s, B * T]
                uniq = sorted(set(ns))
                q = torch.tensor(uniq, dtype=srt.dtype)[None].expand(s, -1).contiguous()
                kept = torch.searchsorted(srt, q, right=True).sum(0)  # [len(uniq)]
                for n, c in zip(uniq, kept.tolist(), strict=True):
                    out[(s, k, n)] = 1.0 + c / srt.shape[1]
                continue
            uniq = sorted(set(ns))
            # [len(uniq), B, T]: leading depths kept (lead is monotone), as small ints
            walked_ns.append([(s, k, n) for n in uniq])
            walked.append((lead[None] <= torch.tensor(uniq)[:, None, None, None]).sum(
                -1, dtype=torch.int8))
        if walked:
            tokens, cycles = walk_totals(torch.cat(walked), self.starts, self.ends)
            keys = [c for group in walked_ns for c in group]
            for c, tok, cyc in zip(keys, tokens.tolist(), cycles.tolist(), strict=True):
                out[c] = 1.0 + tok / cyc if cyc else 1.0
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
def measure_acceptance(draft: Eagle3Draft, data: ProbeData, depth: int = 10,
                       max_topk: int = 8) -> AcceptanceModel:
    """Ranks of the target's greedy path under the draft, `depth` steps deep, and the
    engine's trees of every topk from 2 to max_topk unrolled along it."""
    B, T = data.input_ids.shape
    taps = data.taps(draft.config.aux_layer_ids, draft.dtype)
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
    trees = {k: measure_trees(draft, data, taps, starts, ends, k, depth)
             for k in range(2, max_topk + 1)}
    return AcceptanceModel(ranks=r, starts=starts, ends=ends,
                           path_lp=torch.stack(path_lp, -1).cpu(),
                           top_lp=torch.stack(top_lp, -2).cpu(), trees=trees)


def measure_trees(draft: Eagle3Draft, data: ProbeData, taps: torch.Tensor, starts: list[int],
                  ends: list[int], topk: int, depth: int) -> TreeCandidates:
    """The engine's trees of one topk at every answer index of every sequence, padded to
    [B, T, ...] (indices outside an answer: no candidates, path absent). On a GPU all
    sequences run as one batch (the unroll is launch-bound there); on a CPU one at a time,
    so no index before a sequence's own answer is unrolled."""
    B, T = data.input_ids.shape
    M = topk * topk
    scores = torch.full((B, T, depth, M), float("-inf"), dtype=torch.float64)
    path = torch.full((B, T, depth), float("-inf"), dtype=torch.float64)
    present = torch.zeros(B, T, depth, dtype=torch.bool)
    groups = [list(range(B))] if data.input_ids.is_cuda else [[b] for b in range(B)]
    for rows in groups:
        lo, end = min(starts[b] for b in rows), max(ends[b] for b in rows)
        sel = torch.tensor(rows, device=data.input_ids.device)
        sc, pa, pr, _ = unroll_tree(draft, taps[sel, :end], data.input_ids[sel, :end],
                                    data.label_mask[sel, :end], lo, topk, depth)
        sc, pa, pr = sc.cpu(), pa.cpu(), pr.cpu()
        for i, b in enumerate(rows):  # each row's own answer span only
            a, e = starts[b], ends[b]
            scores[b, a:e], path[b, a:e] = sc[i, a - lo:e - lo], pa[i, a - lo:e - lo]
            present[b, a:e] = pr[i, a - lo:e - lo]
    return TreeCandidates(scores=scores, path=path, present=present)


@torch.inference_mode()
def draft_scores(draft: Eagle3Draft, data: ProbeData, depth: int = 10) -> torch.Tensor:
    """[N, depth, 8]: the draft's sorted top-8 log-probs at every depth of its unroll, at the
    N positions of `data` whose whole unroll runs over real tokens (a simulated profile's tree
    shape; all unpadded positions when the sequences are too short for that)."""
    m = measure_acceptance(draft, data, depth, max_topk=1)  # the scores only
    lm = data.label_mask.cpu()
    ends = [int(row.nonzero()[-1]) + 1 if row.any() else lm.shape[1] for row in lm]
    full = [max(e - depth - 1, 0) for e in ends]
    if sum(full) == 0:
        full = ends
    return torch.cat([m.top_lp[b, :e] for b, e in enumerate(full)])  # type: ignore[index]
