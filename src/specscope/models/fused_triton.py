"""Fused elementwise work of a decoder layer in Triton (CUDA): the fast paths of RMSNorm,
the residual add before it and SwiGLU's silu(gate) * up (the attention input's norms, rotary
and KV-cache write are kvcache/rope_write_triton.py).

At batch 1 a Llama-3.1-8B layer ran ~25 small torch kernels beside its four matmuls (the
norm's casts, its weight multiply, the rotary's neg/cat/mul/add, two index copies into the
cache, silu and mul), 1.5 ms of a 6 ms step on the H200 (benchmarks/step_floor.py). Each
kernel here is one launch that reads its inputs once and writes its outputs once.

Each reproduces its torch reference's roundings (models/llama.py): every
intermediate the reference rounds to the model's dtype is rounded here too, so in bf16 the
results are those of the reference up to the fp32 reductions' order;
tests/test_fused_triton.py checks each against its reference. On Hopper they launch
dependently (models/dependent_launch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specscope.models import dependent_launch
from specscope.models.dependent_launch import release, wait


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, D, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    wait(PDL)
    release(PDL)
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    if HAS_RES:
        # h = x + residual in the model's dtype (the reference's bf16 add), kept for the
        # next layer's residual stream.
        r = tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * D + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, w * normed, mask=m)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * rms_norm(h) with h = x (+ residual): (the normed rows, h). x [..., D]
    contiguous; the output's dtype is weight * x's, as the reference's."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    h = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, D) if residual is not None else x2
    block = triton.next_power_of_2(D)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, res, weight, out, h, D, eps,
                                         HAS_RES=residual is not None, BLOCK=block,
                                         num_warps=_warps(block),
                                         **dependent_launch.options(x, x2.shape[0]))
    return out.view(*x.shape[:-1], D), h.view(x.shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    wait(PDL)
    release(PDL)
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + cols, s * u, mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate columns, then up): [..., I]."""
    two_i = gate_up.shape[-1]
    x = gate_up.reshape(-1, two_i)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape[0], two_i // 2, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(two_i // 2, block))](
            x, out, two_i // 2, BLOCK=block, num_warps=4, **dependent_launch.options(x, x.shape[0]))
    return out.view(*gate_up.shape[:-1], two_i // 2)
