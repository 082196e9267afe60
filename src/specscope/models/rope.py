"""Rotary position embeddings: tables built once per model, gathered by position per step.

Tables are indexed by a positions *tensor* (a gather), so a decode step needs no host value
of the position: the step stays free of host syncs and capturable in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specscope.config import SUPPORTED_ROPE_TYPES

# Every rope type the tables below compute. A family admits a subset at load (config.hf_rope):
# the dense Llama family SUPPORTED_ROPE_TYPES, DeepSeek-V3 / Kimi-K2 those plus yarn.
COMPUTED_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] fp32, attention scaling factor) for a rope config."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default":
        return inv_freq, 1.0
    if rtype == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rtype == "dynamic":
        # NTK-aware dynamic scaling only changes frequencies beyond the original context;
        # within it (the only range we admit, see llm.py context checks) it is the default.
        return inv_freq, 1.0
    if rtype == "llama3":
        # Llama-3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low_ff = float(scaling.get("low_freq_factor", 1.0))
        high_ff = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low_ff
        high_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rtype == "yarn":
        return yarn_frequencies(head_dim, theta, scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rtype!r}; supported: {', '.join(COMPUTED_ROPE_TYPES)}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 * mscale *
    ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]
                     ) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF computes it: (inv_freq [head_dim/2], cos/sin factor).

    Frequencies that turn more than beta_fast times over the original context are kept
    (extrapolated), those under beta_slow turns are divided by `factor` (interpolated), and
    a linear ramp over the dimension index blends the band between. The cos/sin factor is
    attention_factor when given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    (DeepSeek), else mscale(factor). Needs factor and original_max_position_embeddings (the
    DeepSeek parser fills them in from the config when a checkpoint leaves them out)."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:  # the dimension index that turns `turns` times
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-point band: keep the ramp finite
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: extrapolated (high frequency), 0: interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                else yarn_mscale(factor))
    return inv_freq, float(attn)


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_len: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_len, head_dim] in fp32 (HF's cat(freqs, freqs) layout)."""
    inv_freq, attn_factor = inverse_frequencies(head_dim, theta, scaling, max_len)
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return (emb.cos() * attn_factor).to(device), (emb.sin() * attn_factor).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, 1, T, D] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                      ) -> torch.Tensor:
    """apply_rope in four ops instead of seven, for x [..., D] and cos [..., D]: the rotated
    half is x rolled by D / 2 with the sign of its first half folded into the table,
    sin_signed = cat(-sin[:D/2], sin[D/2:]) (`signed_sin`). The same products exactly
    (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated: apply_rope_rolled's table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotate x [..., D] whose rotary pairs are adjacent, (x0, x1), (x2, x3), ... (DeepSeek's
    checkpoints), by cos/sin [..., D] (the cat(freqs, freqs) tables above).

    The result is de-interleaved, the pairs' first members then their second, as HF
    transformers returns it: queries and keys go through the same permutation, so their
    dot products are those of the interleaved rotation, and the rope keys in the cache are
    in this order."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # cat(freqs, freqs): the first half has each angle
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1)
