"""Attention over a preallocated KV cache, without host syncs and with static shapes.

GQA without copying K/V: the G = H / Hkv query heads that share a KV head are folded into
the query-length axis, q [B, H, T, D] -> [B, Hkv, G*T, D], so one SDPA call attends all of
them to the shared [B, Hkv, S, D] keys. The mask is built once per forward in that folded
layout and shared by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store k, v [B, Hkv, T, D] at cache slots [B, T] (a scatter: capture-safe, no sync)."""
    B, Hkv, T, D = k.shape
    if B == 1:
        k_cache[0].index_copy_(1, slots[0], k[0])
        v_cache[0].index_copy_(1, slots[0], v[0])
        return
    idx = slots[:, None, :, None].expand(B, Hkv, T, D)
    k_cache.scatter_(2, idx, k)
    v_cache.scatter_(2, idx, v)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, groups: int,
                sliding_window: int | None = None) -> torch.Tensor:
    """Bool mask [B, 1, G*T, S]: query at position p sees keys at positions <= p.

    q_pos [B, T], k_pos [B, S] or [S]. With a sliding window w, keys older than p - w + 1
    are hidden too (Mistral semantics: a window of w tokens including the current one).
    """
    if k_pos.dim() == 1:
        k_pos = k_pos[None, :]
    qp = q_pos[:, :, None]  # [B, T, 1]
    kp = k_pos[:, None, :]  # [B, 1, S]
    mask = kp <= qp  # [B, T, S]
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    return fold_mask(mask, groups)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T, S] bool -> [B, 1, G*T, S], matching the folded query layout."""
    B, T, S = mask.shape
    return mask[:, None, None].expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (Dv may differ: MLA), folded
    mask [B, 1, G*T, S] -> out [B, T, H*Dv]."""
    B, H, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G = H // Hkv
    qf = q.reshape(B, Hkv, G * T, D)  # heads h = kv*G + g share kv head `kv`
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)  # [B,Hkv,G*T,Dv]
    return out.reshape(B, H, T, Dv).transpose(1, 2).reshape(B, T, H * Dv)
