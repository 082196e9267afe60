"""Drafting: grow a chain (topk = 1) or an EAGLE-2 dynamic tree (topk > 1) with the draft head.

Input is the output of the draft extend at the last accepted position: its pre-norm hidden
h0 and its logits, which predict the first draft token. Each further draft step feeds the
tokens just chosen together with the draft's own pre-norm output of their parent.

Tree expansion (EAGLE-2, as SGLang's `topk`): every beam proposes its topk children scored by
cumulative log-probability (parent score + log q(child)); the topk best of those topk^2
candidates become the next step's beams. After num_steps, all candidates are reranked by
score and the best num_draft_tokens - 1 kept. A child's score never exceeds its parent's, so
the kept set contains every kept node's ancestors (a stable sort keeps parents first on
ties). Draft steps of a tree attend to the committed prefix plus their own ancestors only.

All shapes are static for a given (num_steps, topk, num_draft_tokens); nothing reads the
device from the host.
"""

from __future__ import annotations

import torch

from specscope.config import SamplingParams
from specscope.draft.eagle3 import Eagle3Draft
from specscope.kvcache import KVCache
from specscope.profiler import Phase, Profiler
from specscope.sampling import processed_logits
from specscope.spec.tree import DraftTree


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


def draft_chain(draft: Eagle3Draft, cache: KVCache, h0: torch.Tensor, logits0: torch.Tensor,
                root: torch.Tensor, n: torch.Tensor, num_steps: int, kv_len: int,
                params: SamplingParams, generator: torch.Generator | None,
                prof: Profiler | None = None) -> DraftTree:
    """A chain of num_steps draft tokens after `root` (the token at position n).

    h0 [1, 1, Hd], logits0 [Vd]: the extend's output at position n - 1. n [1] int64 on the
    device (a tensor, so a captured graph replays for any n). Draft step j (1-based,
    j < num_steps) runs at draft position n + j - 1.
    At temperature > 0 tokens are sampled from the processed draft distribution q, which is
    returned (in target vocabulary) for lossless verification.
    """
    dev = root.device
    tokens = [root.reshape(1)]
    probs = []
    logits, h = logits0, h0
    for j in range(1, num_steps + 1):
        if prof:
            prof.mark(Phase.DRAFT_STEP, step=j)
        if params.greedy:
            d = logits.argmax(-1, keepdim=True)  # [1] draft-vocab id
        else:
            q = processed_logits(logits[None], params).softmax(-1)[0]  # [Vd]
            race = torch.empty_like(q).exponential_(generator=generator)
            d = (q / race.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(-1, keepdim=True)
            probs.append(_to_target_probs(draft, q))
        t = draft.to_target(d)  # [1] target id
        tokens.append(t)
        if j < num_steps:
            pos = (n + (j - 1)).view(1, 1)
            h, normed = draft(t[None], h, pos, cache, kv_len=kv_len)
            logits = draft.compute_logits(normed[0, -1])  # [Vd]
    if prof:
        prof.mark(Phase.TREE_BUILD)
    k = num_steps
    draft_probs = None
    if probs:
        last = torch.zeros_like(probs[0])  # leaf: no children were sampled from it
        draft_probs = torch.stack(probs + [last])  # [k + 1, V]
    return DraftTree(tokens=torch.cat(tokens), parents=torch.arange(-1, k, device=dev),
                     depth=torch.arange(k + 1, device=dev), draft_probs=draft_probs,
                     chain=True)


def draft_tree(draft: Eagle3Draft, cache: KVCache, h0: torch.Tensor, logits0: torch.Tensor,
               root: torch.Tensor, n: torch.Tensor, num_steps: int, topk: int,
               num_draft_tokens: int, kv_len: int, params: SamplingParams,
               prof: Profiler | None = None) -> DraftTree:
    """An EAGLE-2 dynamic tree of num_draft_tokens nodes (root included), children chosen
    deterministically (top-k of the processed draft distribution)."""
    dev = root.device
    k = topk
    lp0 = _draft_scores(logits0, params)  # [Vd]
    s1, ids1 = lp0.topk(k)  # [k]
    cand_tok = [draft.to_target(ids1)]  # per level: [k] then [k*k]
    cand_par = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    cand_score = [s1]
    cand_depth = [torch.ones(k, dtype=torch.long, device=dev)]
    beam_tok, beam_score = cand_tok[0], s1  # [k]
    beam_cand = torch.arange(k, device=dev)  # candidate index of each beam
    beam_h = h0.expand(1, k, h0.shape[-1])  # [1, k, Hd]
    tree_slots = max(num_steps - 1, 1) * k
    beam_anc = torch.zeros(k, tree_slots, dtype=torch.bool, device=dev)  # ancestors' slots
    n_cand = k
    k_pos = torch.arange(kv_len, device=dev)
    for j in range(1, num_steps):
        if prof:
            prof.mark(Phase.DRAFT_STEP, step=j)
        own = (j - 1) * k + torch.arange(k, device=dev)  # this step's tree slots
        anc = beam_anc | (own[:, None] == torch.arange(tree_slots, device=dev)[None, :])
        # Mask [1, k, kv_len]: the committed prefix, plus own and ancestors' tree slots.
        rel = k_pos - n  # tree slot of each key, negative for the prefix
        in_tree = (rel >= 0) & (rel < tree_slots)
        mask = (k_pos < n)[None, :] | (anc[:, rel.clamp(0, tree_slots - 1)] & in_tree[None, :])
        pos = (n + (j - 1)).expand(k)[None]  # [1, k]
        h_out, normed = draft(beam_tok[None], beam_h, pos, cache, kv_len=kv_len,
                              slots=(n + own)[None], attn_mask=mask[None])
        lp = _draft_scores(draft.compute_logits(normed[0]), params)  # [k, Vd]
        child_s, child_id = (beam_score[:, None] + lp).topk(k, dim=-1)  # [k, k]
        flat_s = child_s.reshape(-1)  # [k*k], candidate (b, c) at b*k + c
        cand_tok.append(draft.to_target(child_id.reshape(-1)))
        cand_par.append(beam_cand.repeat_interleave(k))
        cand_score.append(flat_s)
        cand_depth.append(torch.full((k * k,), j + 1, dtype=torch.long, device=dev))
        best_s, best = flat_s.topk(k)  # next beams
        parent_beam = best // k
        beam_tok = cand_tok[-1][best]
        beam_score = best_s
        beam_cand = n_cand + best
        beam_h = h_out[:, parent_beam]
        beam_anc = anc[parent_beam]
        n_cand += k * k
    if prof:
        prof.mark(Phase.TREE_BUILD)
    tok = torch.cat(cand_tok)
    par = torch.cat(cand_par)
    score = torch.cat(cand_score)
    depth = torch.cat(cand_depth)
    keep = num_draft_tokens - 1
    order = torch.sort(score, descending=True, stable=True).indices[:keep]
    chosen = torch.sort(order).values  # creation order is topological
    node_of = torch.full((n_cand,), -1, dtype=torch.long, device=dev)
    node_of[chosen] = torch.arange(1, keep + 1, device=dev)
    parents = torch.where(par[chosen] >= 0, node_of[par[chosen].clamp_min(0)], 0)
    return DraftTree(
        tokens=torch.cat([root.reshape(1), tok[chosen]]),
        parents=torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev), parents]),
        depth=torch.cat([torch.zeros(1, dtype=torch.long, device=dev), depth[chosen]]),
        draft_probs=None)
