"""Drafting: grow a chain (topk = 1) or an EAGLE-2 dynamic tree (topk > 1) with the draft head.

Input is the output of the draft extend at the last accepted position: its pre-norm hidden
h0 and its normed output, whose logits predict the first draft token. Each further draft
step feeds the tokens just chosen together with the draft's own pre-norm output of their
parent. A greedy chain without adjustments or a constraint takes each step's token from
the head's rows directly (Eagle3Draft.greedy_ids: on CUDA the lm_head, argmax and
vocabulary map in one pass); everything else computes the logits.

Tree expansion (EAGLE-2, as SGLang's `topk`): every beam proposes its topk children scored by
cumulative log-probability (parent score + log q(child)); the topk best of those topk^2
candidates become the next step's beams. After num_steps, all candidates are reranked by
score and the best num_draft_tokens - 1 kept. A child's score never exceeds its parent's, so
the kept set contains every kept node's ancestors (a stable sort keeps parents first on
ties). Draft steps of a tree attend to the committed prefix plus their own ancestors only.

Logits adjustments (penalties, logit_bias, min_tokens: sampling.py `LogitsAdjustment`, over
the draft's vocabulary) are applied to every draft distribution as the verify will apply them
to the target's at the same node: with the counts of the sequence's tokens plus the draft
path's so far, and the node's depth. Draft tokens then follow what the target will want,
and a sampled chain's proposal q is the distribution it was really drawn from.

Batch-first: S sequences draft at once, each draft step one forward for all of them through
a `DraftStep` callback (the engine's runs it over the paged draft KV). All shapes are static
for a given (S, num_steps, topk, num_draft_tokens); nothing reads the device from the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from specscope.config import SamplingParams
from specscope.draft.eagle3 import Eagle3Draft
from specscope.profiler import Phase, Profiler
from specscope.sampling import LogitsAdjustment, processed_logits
from specscope.spec.tree import DraftTree

_ARGMAX = SamplingParams()  # greedy: a pick that draws nothing


def _draft_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities used to rank candidates: raw for greedy, else after the same
    temperature/top-k/top-p as the target (so drafting and verification agree). [.., Vd]"""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(processed_logits(logits.reshape(-1, logits.shape[-1]), params),
                             dim=-1).reshape(logits.shape)


def _to_target_probs(draft: Eagle3Draft, q: torch.Tensor) -> torch.Tensor:
    """A distribution over the draft vocabulary [Vd] as one over the target vocabulary [V]."""
    ids = draft.to_target(torch.arange(q.shape[-1], device=q.device))  # [Vd]
    return torch.zeros(draft.config.vocab_size, dtype=q.dtype, device=q.device).index_copy_(
        0, ids, q)


# One draft forward for S sequences, Q query tokens each: (tokens [S, Q], hidden [S, Q, Hd],
# rope [S, Q], query_slots [Q] or None, ancestors [S, Q, T] or None) -> (next hidden
# [S, Q, Hd], normed output [S, Q, Hd], the head's input). query_slots None: a chain step
# (causal; each token writes at its rope position). Otherwise a tree step: query q writes
# at the sequence's committed length + query_slots[q] and sees the committed prefix plus
# the tree slots its ancestors row marks. The engine implements it over its paged draft KV.
DraftStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                      torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]

# An optional constraint on the draft's choices (structured output, engine/grammar.py):
# (logits [S, B, Vd] of B beams, paths [S, B, j] of the target-vocabulary draft tokens each
# beam's prediction follows) -> the logits masked. None: unconstrained, and nothing below
# builds the paths.
DraftMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _choose(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, list]:
    """One draft token per row [S] (draft vocabulary): greedy rows by argmax, sampled rows
    by the exponential race on their processed distribution q, which is returned per row
    (None for greedy rows) for lossless verification."""
    out = logits.argmax(-1)
    qs: list[torch.Tensor | None] = [None] * len(params)
    for r, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        q = processed_logits(logits[r:r + 1], p).softmax(-1)[0]  # [Vd]
        race = torch.empty_like(q).exponential_(generator=g)
        out[r] = (q / race.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(-1)
        qs[r] = q
    return out, qs


def _choose_ongoing(logits: torch.Tensor, params: list[SamplingParams],
                    generators: list[torch.Generator | None], lengths: list[int], j: int
                    ) -> tuple[torch.Tensor, list]:
    """_choose at draft step j, where a chain that ended before j (lengths[r] < j) picks by
    argmax and draws nothing from its generator."""
    done = [n < j for n in lengths]
    return _choose(logits, [_ARGMAX if x else p for x, p in zip(done, params, strict=True)],
                   [None if x else g for x, g in zip(done, generators, strict=True)])


def pick_probs(logits: torch.Tensor, d: torch.Tensor, qs: list[torch.Tensor | None]
               ) -> torch.Tensor:
    """[S] fp32: the draft's probability of each row's pick d [S] (draft vocabulary): a
    greedy row's softmax of its logits [S, Vd], a sampled row's processed distribution
    q (what it drew from)."""
    p = logits.float().softmax(-1).gather(1, d[:, None])[:, 0]
    for r, q in enumerate(qs):
        if q is not None:
            p[r] = q[d[r]]
    return p


def _one_hot_add(counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """counts [..., Vd] int32 plus one at ids [...] (a new tensor)."""
    return counts.scatter_add(-1, ids[..., None], torch.ones_like(ids[..., None],
                                                                  dtype=counts.dtype))


def draft_chain(step: DraftStep, draft: Eagle3Draft, h0: torch.Tensor,
                      normed0: torch.Tensor, root: torch.Tensor, n: torch.Tensor,
                      num_steps: int, params: list[SamplingParams],
                      generators: list[torch.Generator | None],
                      prof: Profiler | None = None,
                      adjust: LogitsAdjustment | None = None,
                      mask: DraftMask | None = None, stop: float = 0.0) -> DraftTree:
    """S chains of up to num_steps draft tokens, chain s after root[s] (the token at
    position n[s]). h0, normed0 [S, Hd]: the extend's outputs at position n - 1. Draft step
    j (1-based, j < num_steps) runs at draft position n + j - 1. Sampled rows draw their
    tokens from their processed draft distribution, returned (in target vocabulary) as
    draft_probs [S, k + 1, V] (zero rows for greedy sequences, which never read them).
    adjust: over the draft vocabulary; draft token j's logits are adjusted after the
    j - 1 draft tokens before it (depth j - 1). mask: constrains each step's choice given
    the chain's draft tokens so far (after the adjustment).
    stop: the confidence stop (0: off). A chain's confidence after token j is the product
    of the draft's probabilities of its tokens 1..j (pick_probs); at the first j where
    every chain's is below `stop`, token j is dropped and drafting ends, so the chains hold
    the j - 1 tokens before it (a host read a step: the CPU's eager path). With a sampled
    row among them, each chain ends at its own first such j instead (the tree's lengths)
    and draws nothing more: what a sampled chain draws from its generator, and so a
    seeded request's tokens, must not depend on the chains beside it."""
    S, dev, k = root.shape[0], root.device, num_steps
    tokens, qs = [root], []
    normed, h = normed0, h0
    counts = None  # [R, Vd] int32: the adjusted rows' draft tokens so far
    conf = None  # [S] fp32: each chain's confidence so far
    argmax_only = greedy_only(params, adjust, mask) and not stop
    lengths = [k] * S if stop and not all(p.greedy for p in params) else None
    for j in range(1, k + 1):
        if prof:
            prof.mark(Phase.DRAFT_STEP, step=j)
        if argmax_only:
            t = draft.greedy_ids(normed)  # [S], target vocabulary
        else:
            logits = draft.compute_logits(normed)
            if adjust is not None:
                if counts is None:
                    counts = torch.zeros(adjust.num_rows, logits.shape[-1], dtype=torch.int32,
                                         device=dev)
                depth = torch.full((counts.shape[0], 1), j - 1, dtype=torch.long, device=dev)
                logits = adjust.apply(logits[:, None], counts[:, None], depth)[:, 0]
            if mask is not None:
                path = torch.stack(tokens[1:], 1) if j > 1 else root.new_empty(S, 0)
                logits = mask(logits[:, None], path[:, None])[:, 0]
            if lengths is None:
                d, q = _choose(logits, params, generators)
            else:
                d, q = _choose_ongoing(logits, params, generators, lengths, j)
            if stop:
                p = pick_probs(logits, d, q)
                conf = p if conf is None else conf * p
                if lengths is not None:
                    below = (conf < stop).tolist()
                    lengths = [j - 1 if b and m == k else m
                               for b, m in zip(below, lengths, strict=True)]
                    if all(m < j for m in lengths):
                        break
                elif bool((conf < stop).all()):
                    break
            if adjust is not None:
                counts = _one_hot_add(counts, adjust.take(d))
            qs.append(q)
            t = draft.to_target(d)  # [S]
        tokens.append(t)
        if j < k:
            h, normed = (x[:, 0] for x in step(t[:, None], h[:, None], (n + (j - 1))[:, None],
                                                None, None))
    if prof:
        prof.mark(Phase.TREE_BUILD)
    draft_probs = None
    if not argmax_only and any(not p.greedy for p in params):
        draft_probs = _chain_probs(draft, qs, S, len(tokens), dev)
    tree = chain_tree(torch.stack(tokens, 1), draft_probs)
    if lengths is not None and min(lengths) < tree.size - 1:
        tree.lengths = [min(m, tree.size - 1) for m in lengths]
    return tree


def _chain_probs(draft: Eagle3Draft, qs: list[list], S: int, N: int, dev: torch.device
                 ) -> torch.Tensor:
    """[S, N, V]: each sampled row's draft distribution at each step (qs[j][r], draft
    vocabulary) in the target's vocabulary; zero rows where a row picked by argmax."""
    probs = torch.zeros(S, N, draft.config.vocab_size, device=dev)
    for j, per_row in enumerate(qs):
        for r, q in enumerate(per_row):
            if q is not None:
                probs[r, j] = _to_target_probs(draft, q)
    return probs


def chain_tree(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
    """S chains as DraftTrees: tokens [S, k + 1] (each root, then its k draft tokens)."""
    S, k1 = tokens.shape
    parents, depth = _chain_shape(k1, tokens.device)
    return DraftTree(tokens=tokens, parents=parents.expand(S, k1), depth=depth.expand(S, k1),
                     draft_probs=draft_probs, chain=True)


@functools.cache
def _chain_shape(k1: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of k1 nodes' parents and depths [k1] (read-only, shared by every chain of
    that length: a CPU cycle's two aranges cost more than its tree build otherwise)."""
    return (torch.arange(-1, k1 - 1, device=device), torch.arange(k1, device=device))


def greedy_only(params: list[SamplingParams], adjust: LogitsAdjustment | None,
                mask: DraftMask | None) -> bool:
    """Whether every draft token is the argmax of the draft's logits as they are: greedy
    sequences, no logits adjustments, no constraint."""
    return adjust is None and mask is None and all(p.greedy for p in params)


def _scores_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """_draft_scores per row of logits [S, ..., Vd], each with its sequence's params."""
    if all(p.greedy for p in params):
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.stack([_draft_scores(logits[r], p) for r, p in enumerate(params)])


def draft_tree(step: DraftStep, draft: Eagle3Draft, h0: torch.Tensor,
                     normed0: torch.Tensor, root: torch.Tensor, n: torch.Tensor,
                     num_steps: int, topk: int, num_draft_tokens: int,
                     params: list[SamplingParams], prof: Profiler | None = None,
                     adjust: LogitsAdjustment | None = None,
                     mask: DraftMask | None = None) -> DraftTree:
    """S EAGLE-2 dynamic trees of num_draft_tokens nodes each (root included), children
    chosen deterministically (top-k of each sequence's processed draft distribution).
    h0, normed0 [S, Hd], root [S], n [S] as draft_chain. adjust: over the draft
    vocabulary; a beam's children are scored after the beam's own path (its depth). mask:
    constrains each beam's children given the beam's path of draft tokens."""
    S, dev, k = root.shape[0], root.device, topk
    Hd = h0.shape[-1]
    logits0 = draft.compute_logits(normed0)  # [S, Vd]
    if adjust is not None:
        logits0 = adjust.apply(logits0[:, None])[:, 0]
    if mask is not None:
        logits0 = mask(logits0[:, None], root.new_empty(S, 1, 0))[:, 0]
    s1, ids1 = _scores_batch(logits0, params).topk(k, dim=-1)  # [S, k]
    beam_counts = None  # [R, k, Vd] int32: each adjusted row's beams' draft tokens
    if adjust is not None:
        zero = torch.zeros(adjust.num_rows, k, logits0.shape[-1], dtype=torch.int32,
                           device=dev)
        beam_counts = _one_hot_add(zero, adjust.take(ids1))
    cand_tok = [draft.to_target(ids1)]  # per level: [S, k] then [S, k*k]
    cand_par = [torch.full((S, k), -1, dtype=torch.long, device=dev)]
    cand_score = [s1]
    cand_depth = [torch.ones(S, k, dtype=torch.long, device=dev)]
    beam_tok, beam_score = cand_tok[0], s1  # [S, k]
    beam_cand = torch.arange(k, device=dev).expand(S, k)  # candidate index of each beam
    beam_h = h0[:, None].expand(S, k, Hd)
    T = max(num_steps - 1, 1) * k  # tree slots of the draft steps
    beam_anc = torch.zeros(S, k, T, dtype=torch.bool, device=dev)  # ancestors' slots
    beam_path = beam_tok[..., None]  # [S, k, j]: each beam's draft tokens (for the mask)
    n_cand = k
    for j in range(1, num_steps):
        if prof:
            prof.mark(Phase.DRAFT_STEP, step=j)
        own = (j - 1) * k + torch.arange(k, device=dev)  # this step's tree slots [k]
        anc = beam_anc | (own[:, None] == torch.arange(T, device=dev))  # [S, k, T]
        h_out, normed = step(beam_tok, beam_h, (n + (j - 1))[:, None].expand(S, k), own, anc)
        lg = draft.compute_logits(normed)  # [S, k, Vd]
        if adjust is not None:  # every beam sits at depth j
            depth = torch.full(beam_counts.shape[:2], j, dtype=torch.long, device=dev)
            lg = adjust.apply(lg, beam_counts, depth)
        if mask is not None:
            lg = mask(lg, beam_path)
        child_s, child_id = (beam_score[..., None] + _scores_batch(lg, params)).topk(k, -1)
        flat_s = child_s.reshape(S, k * k)  # candidate (b, c) at b*k + c
        cand_tok.append(draft.to_target(child_id.reshape(S, k * k)))
        cand_par.append(beam_cand.repeat_interleave(k, dim=1))
        cand_score.append(flat_s)
        cand_depth.append(torch.full((S, k * k), j + 1, dtype=torch.long, device=dev))
        beam_score, best = flat_s.topk(k, dim=-1)  # next beams [S, k]
        parent_beam = best // k
        beam_tok = cand_tok[-1].gather(1, best)
        beam_cand = n_cand + best
        beam_h = h_out.gather(1, parent_beam[..., None].expand(S, k, Hd))
        beam_anc = anc.gather(1, parent_beam[..., None].expand(S, k, T))
        if adjust is not None:  # a new beam's path: its parent beam's, then its own token
            par = adjust.take(parent_beam)
            ids = adjust.take(child_id.reshape(S, k * k).gather(1, best))
            beam_counts = _one_hot_add(beam_counts.gather(
                1, par[..., None].expand(*par.shape, beam_counts.shape[-1])), ids)
        if mask is not None:
            beam_path = torch.cat([beam_path.gather(1, parent_beam[..., None].expand(
                S, k, j)), beam_tok[..., None]], -1)
        n_cand += k * k
    if prof:
        prof.mark(Phase.TREE_BUILD)
    return _keep_best(root, torch.cat(cand_tok, 1), torch.cat(cand_par, 1),
                      torch.cat(cand_score, 1), torch.cat(cand_depth, 1), num_draft_tokens - 1)


def _keep_best(root: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, score: torch.Tensor,
               depth: torch.Tensor, keep: int) -> DraftTree:
    """The tree of each row's `keep` best-scored candidates [S, C] under its root. A
    stable sort keeps parents before children on ties; creation order is topological."""
    S, C = tok.shape
    dev = tok.device
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values  # [S, keep]
    node_of = torch.full((S, C), -1, dtype=torch.long, device=dev).scatter_(
        1, chosen, torch.arange(1, keep + 1, device=dev).expand(S, keep))
    pc = par.gather(1, chosen)
    parents = torch.where(pc >= 0, node_of.gather(1, pc.clamp_min(0)), 0)
    first = torch.full((S, 1), -1, dtype=torch.long, device=dev)
    return DraftTree(tokens=torch.cat([root[:, None], tok.gather(1, chosen)], 1),
                     parents=torch.cat([first, parents], 1),
                     depth=torch.cat([torch.zeros_like(first), depth.gather(1, chosen)], 1))
