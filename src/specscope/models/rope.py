"""Rotary position embeddings: tables built once per model, gathered by position per step.

Tables are indexed by a positions *tensor* (a gather), so a decode step needs no host value
of the position: the step stays free of host syncs and capturable in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specscope.config import SUPPORTED_ROPE_TYPES


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
    raise ValueError(
        f"unsupported rope_scaling type {rtype!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


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
