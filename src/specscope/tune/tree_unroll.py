"""EAGLE-2 draft trees unrolled at every answer position at once, exactly as the engine builds
them (spec/drafter.py draft_tree), teacher-forced on the target's taps.

The chain unroll (train/ttt.py) gives, at every index t, the draft's steps along the target's
own path. A tree also needs what the draft proposes off that path: every beam's children, fed
the beam's own token and its parent's output. This module runs those beams. Index t is the
cycle whose draft extend ends at t (its root is tok_{t+1}); step 0 is the extend over the
whole sequence; step j >= 1 runs the topk beams of depth j at every index t at once, at rope
position t + j, and each beam attends to

    step-0 keys at indices <= t   (the committed prefix)
    its own ancestors' keys and its own, one per step 1 .. j   (its tree slots)

which is the engine's tree mask after an extend ending at t. A test checks the candidates and
their scores against draft_tree run in the engine at several positions.

For each index t and depth d the result keeps every candidate's cumulative score (the
reranking competition) and where the target's path is among them: the node at depth d whose
token is the answer's tok_{t+1+d} and whose parent is the path's node at d - 1, present only
when that parent was one of its depth's beams (so it was expanded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specscope.draft.eagle3 import Eagle3Draft
from specscope.train.ttt import shift_left


@dataclass
class TreeCandidates:
    """Every candidate of one topk's trees, D depths deep, at every index of B sequences.

    scores [B, T, D, M] fp64: cumulative draft log-probs, depth-major as the engine creates
        them (M = topk^2; depth 1 holds topk, the rest -inf).
    path [B, T, D] fp64: the score of the path's node at each depth (-inf where absent).
    present [B, T, D] bool: the path's node at depth d is a candidate (every ancestor too).
    """

    scores: torch.Tensor
    path: torch.Tensor
    present: torch.Tensor


class BeamKeys:
    """The `ttt` attention hook of Eagle3Draft.forward for a tree unroll of B sequences.

    Step 0 attends causally over the T indices. Step j >= 1 gets the queries of Tq indices
    (t_lo .. T-1) x topk beams (index-major) and attends to step 0's keys at indices <= t
    plus one key per step 1 .. j: its ancestors' (beam `anc[..., i - 1]` of step i) and its
    own."""

    def __init__(self, topk: int, t_lo: int) -> None:
        self.topk, self.t_lo = topk, t_lo
        self.anc: torch.Tensor | None = None  # [B, Tq, k, j - 1] this step's beams' ancestors
        self.kv: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def attend(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [B, H, N, D], k/v [B, Hkv, N, D] -> [B, N, H * D]."""
        steps = self.kv.setdefault(module, [])
        B, H, N, D = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        if not steps:
            steps.append((k, v))
            kr, vr = (k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)) if G > 1 else (k, v)
            out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)
            return out.transpose(1, 2).reshape(B, N, H * D)
        kk = self.topk
        Tq = N // kk
        qg = q.view(B, Hkv, G, Tq, kk, D)
        steps.append((k.view(B, Hkv, Tq, kk, D), v.view(B, Hkv, Tq, kk, D)))
        k0, v0 = steps[0]
        T = k0.shape[2]
        s0 = torch.einsum("bhgtkd,bhsd->bhgtks", qg, k0).float() * scale  # [B,Hkv,G,Tq,k,T]
        t_idx = torch.arange(self.t_lo, self.t_lo + Tq, device=q.device)
        late = torch.arange(T, device=q.device)[None, :] > t_idx[:, None]  # [Tq, T]
        s0 = s0.masked_fill(late[:, None, :], float("-inf"))
        own = torch.arange(kk, device=q.device).expand(B, Tq, kk)
        idx = [self.anc[..., i] for i in range(len(steps) - 2)] + [own]  # each [B, Tq, k]
        ka, va = [], []
        for (ki, vi), ix in zip(steps[1:], idx, strict=True):
            g = ix[:, None, :, :, None].expand(B, Hkv, Tq, kk, D)
            ka.append(ki.gather(3, g))
            va.append(vi.gather(3, g))
        sa = [(qg * kj[:, :, None]).sum(-1, keepdim=True).float() * scale for kj in ka]
        p = torch.cat([s0, *sa], dim=-1).softmax(-1).to(q.dtype)  # [B,Hkv,G,Tq,k,T+j]
        out = torch.einsum("bhgtks,bhsd->bhgtkd", p[..., :T], v0)
        for i, vj in enumerate(va):
            out = out + p[..., T + i:T + i + 1] * vj[:, :, None]
        return out.reshape(B, H, N, D).transpose(1, 2).reshape(B, N, H * D)


def _log_probs(draft: Eagle3Draft, normed: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(draft.compute_logits(normed), dim=-1)


def _path_score(present: torch.Tensor, hit: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The score of the candidate `hit` marks in each row [R] (-inf where none)."""
    return torch.where(present, s.double().masked_fill(~hit, -torch.inf).max(-1).values,
                       -torch.inf)


@torch.inference_mode()
def unroll_tree(draft: Eagle3Draft, taps: torch.Tensor, input_ids: torch.Tensor,
                label_mask: torch.Tensor, t_lo: int, topk: int, depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """B sequences' trees at indices t_lo .. T-1: (scores [B, Tq, D, M], path [B, Tq, D],
    present [B, Tq, D]) as TreeCandidates holds them, and each candidate's target token
    [B, Tq, D, M] (-1 in depth 1's unused columns). taps [B, T, n * Ht]; input_ids,
    label_mask [B, T] (padding past an end: label_mask off). The draft's rope must cover
    T + depth positions."""
    B, T = input_ids.shape
    k, dev = topk, input_ids.device
    Tq = T - t_lo
    R = B * Tq  # one row per (sequence, index)
    keys = BeamKeys(k, t_lo)
    pos = torch.arange(T, device=dev).expand(B, T)
    h, normed = draft(shift_left(input_ids, 1), draft.project(taps), pos, ttt=keys)
    lp = _log_probs(draft, normed[:, t_lo:]).reshape(R, -1)  # [R, Vd]: depth 1
    tgt = [shift_left(input_ids, d + 1, -1)[:, t_lo:].reshape(R) for d in range(1, depth + 1)]
    valid = [shift_left(label_mask, d + 1, False)[:, t_lo:].reshape(R)
             for d in range(1, depth + 1)]
    scores = torch.full((R, depth, k * k), float("-inf"), dtype=torch.float64, device=dev)
    path = torch.full((R, depth), float("-inf"), dtype=torch.float64, device=dev)
    present = torch.zeros(R, depth, dtype=torch.bool, device=dev)
    tokens = torch.full((R, depth, k * k), -1, dtype=torch.long, device=dev)
    beam_s, ids = lp.topk(k, dim=-1)  # [R, k]
    beam_tok = draft.to_target(ids)
    hit = (beam_tok == tgt[0][:, None]) & valid[0][:, None]  # [R, k]
    present[:, 0] = hit.any(-1)
    path[:, 0] = _path_score(present[:, 0], hit, beam_s)
    scores[:, 0, :k] = beam_s.double()
    tokens[:, 0, :k] = beam_tok
    path_beam = torch.where(present[:, 0], hit.long().argmax(-1), -1)  # [R]
    Hd = h.shape[-1]
    beam_h = h[:, t_lo:].reshape(R, 1, Hd).expand(R, k, Hd)
    anc = torch.zeros(R, k, 0, dtype=torch.long, device=dev)
    parent = torch.arange(k, device=dev).repeat_interleave(k)  # [k * k]
    for j in range(1, depth):
        keys.anc = anc.view(B, Tq, k, j - 1)
        bpos = (pos[:, t_lo:] + j)[..., None].expand(B, Tq, k).reshape(B, Tq * k)
        h_out, normed = draft(beam_tok.reshape(B, Tq * k), beam_h.reshape(B, Tq * k, Hd), bpos,
                              ttt=keys)
        lp = _log_probs(draft, normed).view(R, k, -1)  # [R, k, Vd]
        child_s, child_id = (beam_s[..., None] + lp).topk(k, dim=-1)  # [R, k, k]
        flat_s = child_s.reshape(R, k * k)
        flat_tok = draft.to_target(child_id.reshape(R, k * k))
        hit = (parent[None] == path_beam[:, None]) & (flat_tok == tgt[j][:, None]) \
            & valid[j][:, None]  # [R, k * k]
        present[:, j] = hit.any(-1)
        scores[:, j] = flat_s.double()
        tokens[:, j] = flat_tok
        path[:, j] = _path_score(present[:, j], hit, flat_s)
        path_cand = torch.where(present[:, j], hit.long().argmax(-1), -1)  # [R]
        beam_s, best = flat_s.topk(k, dim=-1)  # [R, k] the next beams
        in_beams = best == path_cand[:, None]
        path_beam = torch.where(in_beams.any(-1), in_beams.long().argmax(-1), -1)
        pb = best // k  # parent beam of each new beam
        beam_tok = flat_tok.gather(1, best)
        beam_h = h_out.view(R, k, Hd).gather(1, pb[..., None].expand(-1, -1, Hd))
        anc = torch.cat([anc.gather(1, pb[..., None].expand(-1, -1, anc.shape[-1])),
                         pb[..., None]], -1)
    return (scores.view(B, Tq, depth, -1), path.view(B, Tq, depth),
            present.view(B, Tq, depth), tokens.view(B, Tq, depth, -1))
