"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), as one nn.Module (docs/mla.md).

Per token, with H heads, nope/rope query-key widths dn/dr, value width dv, latent width c:

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x)      # [H, dn + dr]
    latent, kr   = kv_a_proj_with_mqa(x) split (c, dr);  latent = kv_a_layernorm(latent)
    q_rope, kr   = rope(q_rope), rope(kr)                # kr: ONE rope key shared by all heads
    kv_b_proj    = [W_uk; W_uv] per head: k_nope = W_uk latent [dn], v = W_uv latent [dv]
    score_h      = q_nope_h . k_nope_h + q_rope_h . kr  = (W_uk_h^T q_nope_h) . latent + ...

Two forms of the same function:
- expanded (no cache: full recompute, the trainer's taps, the reference): k and v per head
  through kv_b_proj, then ordinary attention with key width dn + dr and value width dv.
- absorbed (the paged cache: prefill, decode and verify alike): q_nope is absorbed through
  W_uk, so attention is MQA over the cached entries [latent | kr] (width c + dr) with the
  latent as the value (width c); the output goes through W_uv, then o_proj. The cache holds
  c + dr elements per token and layer, never per-head K and V.

The x-side projections (q_a_proj or q_proj, and kv_a_proj_with_mqa) are one matmul
(`a_proj`, rows in that order; checkpoint_layout maps HF's names onto them).

Tensor parallelism splits the heads: a rank holds its heads' rows of q_b_proj (or of
q_proj), of kv_b_proj (W_uk and W_uv per head) and its heads' columns of o_proj, which
all-reduces. What every head shares is replicated: q_a_proj and its norm, and
kv_a_proj_with_mqa, so every rank computes the same latent and rope key, and every rank's
latent cache holds all of it (MLA's cache has no head axis to split).
"""

from __future__ import annotations

import torch
from torch import nn

from specscope.config import ModelConfig
from specscope.kvcache import attention
from specscope.kvcache.latent import latent_attend
from specscope.kvcache.paged import BatchMeta
from specscope.models.linear import Linear
from specscope.models.llama import ForwardContext, RMSNorm
from specscope.models.rope import apply_rope, apply_rope_interleaved, yarn_mscale
from specscope.parallel.group import TPGroup
from specscope.parallel.layers import RowParallelLinear
from specscope.parallel.shard import Shard, even_split

# HF's and DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(dn + dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope that sets
    mscale_all_dim (DeepSeek's YaRN: the softmax is sharpened as much as the longer
    context flattens it; HF applies it for any non-default rope type)."""
    m = cfg.mla
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling_dict or {}
    if rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


class MLAttention(nn.Module):
    """One decoder layer's MLA; the same call signature as llama.Attention. With a
    TPGroup: this rank's heads (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        m = cfg.mla
        self.dn, self.dr, self.dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        h0, h1 = (0, cfg.num_heads) if tp is None else \
            even_split(cfg.num_heads, tp.rank, tp.size, "num_attention_heads")
        self.H = h1 - h0
        self.c, self.lora = m.kv_lora_rank, m.q_lora_rank
        qk = self.H * (self.dn + self.dr)
        self.q_width = self.lora or qk  # a_proj's query rows: q_a_proj's, or q_proj's
        self.a_proj = Linear(cfg.hidden_size, self.q_width + self.c + self.dr,
                                bias=cfg.qkv_bias)
        if self.lora:
            self.q_a_layernorm = RMSNorm(self.lora, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.lora, qk, bias=False)
        self.kv_a_layernorm = RMSNorm(self.c, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.c, self.H * (self.dn + self.dv), bias=False)
        if tp is None:
            self.o_proj = Linear(self.H * self.dv, cfg.hidden_size, bias=cfg.o_bias)
        else:
            self.o_proj = RowParallelLinear(self.H * self.dv, cfg.hidden_size, cfg.o_bias,
                                            tp, Shard(1, ((h0 * self.dv, h1 * self.dv, 0),)))
            self.shards = self._head_shards(cfg.num_heads, h0, h1)
        self.rope = apply_rope_interleaved if m.rope_interleave else apply_rope
        self.scale = mla_softmax_scale(cfg)

    def _head_shards(self, H: int, h0: int, h1: int) -> dict[str, Shard]:
        """Rows of heads [h0, h1): q_b_proj's (or q_proj's, the first rows of a_proj, whose
        latent rows every rank holds), and kv_b_proj's."""
        q, kv = self.dn + self.dr, self.dn + self.dv
        out = {"kv_b_proj.weight": Shard(0, ((h0 * kv, h1 * kv, 0),))}
        if self.lora:
            out["q_b_proj.weight"] = Shard(0, ((h0 * q, h1 * q, 0),))
        else:  # a_proj = [q_proj rows | latent and rope-key rows]
            rows = Shard(0, ((h0 * q, h1 * q, 0), (H * q, H * q + self.c + self.dr,
                                                   self.q_width)))
            out["a_proj.weight"] = out["a_proj.bias"] = rows
        return out

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q_nope [B, H, T, dn], rotated q_rope [B, H, T, dr], the normed
        latent [B, T, c], the rotated shared rope key [B, 1, T, dr]."""
        B, T, _ = x.shape
        q, latent, k_rope = self.a_proj(x).split((self.q_width, self.c, self.dr), dim=-1)
        if self.lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, self.H, self.dn + self.dr).transpose(1, 2)  # [B, H, T, dn + dr]
        q_nope, q_rope = q.split((self.dn, self.dr), dim=-1)
        k_rope = self.rope(k_rope[:, None], cos, sin)  # cos/sin [B, 1, T, dr]
        return q_nope, self.rope(q_rope, cos, sin), self.kv_a_layernorm(latent), k_rope

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        q_nope, q_rope, latent, k_rope = self.project(x, ctx.cos, ctx.sin)
        if ctx.paged is not None:
            return self._absorbed(q_nope, q_rope, latent, k_rope, kv, ctx.paged)
        if kv is not None or ctx.ttt is not None:
            raise NotImplementedError("MLA runs without a cache (full recompute) or over the "
                                      "paged latent cache (PagedKV); the contiguous KVCache "
                                      "and the draft's TTT hook hold per-head K/V")
        return self._expanded(q_nope, q_rope, latent, k_rope, ctx.mask)

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  k_rope: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-head k and v from the latent; attention over the T tokens themselves."""
        B, H, T, _ = q_nope.shape
        kv = self.kv_b_proj(latent).view(B, T, H, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split((self.dn, self.dv), dim=-1)  # [B, H, T, dn], [B, H, T, dv]
        k = torch.cat((k_nope, k_rope.expand(B, H, T, self.dr)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, H, T, dn + dr]
        return self.o_proj(attention(q, k, v, mask, self.scale))  # [B, T, hidden]

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  k_rope: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                  meta: BatchMeta) -> torch.Tensor:
        """MQA over the paged latent cache (a flattened batch: B = 1, T = N tokens)."""
        w = self.kv_b_proj.weight.view(self.H, self.dn + self.dv, self.c)
        w_uk, w_uv = w[:, :self.dn], w[:, self.dn:]  # [H, dn, c], [H, dv, c]
        q_lat = torch.einsum("htd,hdc->thc", q_nope[0], w_uk)  # [N, H, c]
        q = torch.cat((q_lat, q_rope[0].transpose(0, 1)), dim=-1)  # [N, H, c + dr]
        entry = torch.cat((latent[0], k_rope[0, 0]), dim=-1)  # [N, c + dr]
        cache, values = kv
        o = latent_attend(q, entry, cache, values, meta, self.scale)  # [N, H, c]
        out = torch.einsum("nhc,hvc->nhv", o, w_uv)  # [N, H, dv]
        return self.o_proj(out.reshape(1, out.shape[0], self.H * self.dv))  # [1, N, hidden]
