"""The attention input of a paged forward in one Triton kernel (CUDA): q/k per-head norms
(Qwen3), rotary (rotate-half) and the KV-cache write, from the fused q/k/v projection's rows.

The reference is models/llama.py's Attention.project then kvcache/paged.py's write: at
batch 1 on the H200 its neg/cat/mul/add and two index copies were ~7 launches per layer.
The kernel asks for every rounding the reference makes (each product of the rotation and
their sum, in the model's dtype), but on the H200 the compiled kernel's bf16 results differ
from the reference's by one bf16 step in 17 % of the values (the norms and the projection's
other kernels are bit-equal): within bf16 arithmetic's own error, not bit-exact;
tests/test_fused_triton.py checks q and the cache against the reference to one step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specscope.models import dependent_launch
from specscope.models.dependent_launch import release, wait


@triton.jit
def _round(x, like_ptr):
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _head_norm(lo, hi, w_ptr, like_ptr, eps, HALF: tl.constexpr, D: tl.constexpr):
    """The reference's per-head RMSNorm of a head split in halves."""
    ss = tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)
    rstd = 1.0 / tl.sqrt(ss / D + eps)
    half = tl.arange(0, HALF)
    wl = tl.load(w_ptr + half).to(tl.float32)
    wh = tl.load(w_ptr + HALF + half).to(tl.float32)
    return (_round(wl * _round(lo * rstd, like_ptr), like_ptr),
            _round(wh * _round(hi * rstd, like_ptr), like_ptr))


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr,
                       qn_ptr, kn_ptr, eps, H, Hkv,
                       HALF: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (token n, head j) of the fused projection's H + 2 Hkv heads: a q head is
    normed (optionally), rotated and stored to q; a k head the same, stored into its cache
    slot; a v head copied into its slot."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    half = tl.arange(0, HALF)
    base = qkv_ptr + n * (H + 2 * Hkv) * D + j * D
    wait(PDL)
    release(PDL)
    lo = tl.load(base + half).to(tl.float32)
    hi = tl.load(base + HALF + half).to(tl.float32)
    slot = tl.load(slot_ptr + n)
    if j >= H + Hkv:  # a v head: into the cache as it is
        dst = vc_ptr + (slot * Hkv + (j - H - Hkv)) * D
        tl.store(dst + half, lo)
        tl.store(dst + HALF + half, hi)
        return
    if HAS_NORM:
        if j < H:
            lo, hi = _head_norm(lo, hi, qn_ptr, qkv_ptr, eps, HALF, D)
        else:
            lo, hi = _head_norm(lo, hi, kn_ptr, qkv_ptr, eps, HALF, D)
    c_lo = tl.load(cos_ptr + n * D + half).to(tl.float32)
    c_hi = tl.load(cos_ptr + n * D + HALF + half).to(tl.float32)
    s_lo = tl.load(sin_ptr + n * D + half).to(tl.float32)
    s_hi = tl.load(sin_ptr + n * D + HALF + half).to(tl.float32)
    # x * cos + cat(-hi, lo) * sin, each product and the sum rounded as the reference's.
    out_lo = _round(_round(lo * c_lo, qkv_ptr) + _round(-hi * s_lo, qkv_ptr), qkv_ptr)
    out_hi = _round(_round(hi * c_hi, qkv_ptr) + _round(lo * s_hi, qkv_ptr), qkv_ptr)
    if j < H:  # noqa: SIM108 (a branch in Triton's JIT, not a select of two pointers)
        dst = q_ptr + (n * H + j) * D
    else:
        dst = kc_ptr + (slot * Hkv + (j - H)) * D
    tl.store(dst + half, out_lo)
    tl.store(dst + HALF + half, out_hi)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
               num_kv_heads: int, norms: tuple[torch.Tensor, torch.Tensor] | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """The attention input of a paged forward in one launch. qkv [N, (H + 2 Hkv) D] (the
    fused projection's rows), cos/sin [N, D] (rotate-half tables in the model's dtype),
    slots [N] cache slots; k_cache/v_cache one layer's blocks [num_blocks, block_size, Hkv,
    D]. Writes the rotated k and the v into the cache; returns the rotated q [N, H, D].
    norms: (q_norm, k_norm) weights [D], applied per head before the rotation (Qwen3)."""
    N = qkv.shape[0]
    D = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = torch.empty(N, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if N:
        qn, kn = norms if norms is not None else (qkv, qkv)
        _rope_write_kernel[(N, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, slots, q, k_cache, v_cache, qn, kn, eps, num_heads, num_kv_heads,
            HALF=D // 2, HAS_NORM=norms is not None, num_warps=1,
            **dependent_launch.options(qkv, N))
    return q
