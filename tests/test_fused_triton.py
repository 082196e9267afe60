"""The fused Triton kernels of a decoder layer against their torch references.

models/fused_triton.py (RMSNorm with and without the residual add, silu(gate) * up) and
kvcache/rope_write_triton.py (q/k norms, rotary, the KV write) must compute what
models/llama.py's reference path computes: in fp32 to rounding, in bf16 to the reference's
own roundings (every intermediate it rounds is rounded by the kernel too), so almost every
element is bit-equal. Runs the compiled kernels on CUDA when there is a GPU, else Triton's
CPU interpreter; skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import CUDA, DEV  # noqa: F401  (imported first: it skips without triton)

from specscope.kvcache.rope_write_triton import rope_write
from specscope.models.fused_triton import rms_norm, silu_mul
from specscope.models.llama import RMSNorm
from specscope.models.rope import apply_rope, rope_tables

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, bit_equal: bool = True
          ) -> None:
    """fp32: to rounding. bf16: none more than a bf16 step of an operand apart, and on CUDA
    (bit_equal) almost every element bit-equal: an fp32 reduction in another order can move
    a rounding. Triton's CPU interpreter rounds fp32 -> bf16 by truncation, not to nearest:
    there, a step or two apart."""
    assert a.shape == b.shape and a.dtype == b.dtype
    a, b = a.float().cpu(), b.float().cpu()
    assert torch.isfinite(a).all()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    elif CUDA:
        torch.testing.assert_close(a, b, rtol=8e-3, atol=4e-3)
        assert not bit_equal or (a == b).float().mean() > 0.99
    else:
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=2e-2)


def exact(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit-equal, where the rounding is to nearest (see close)."""
    if CUDA or dtype == torch.float32:
        assert torch.equal(a.cpu(), b)
    else:
        close(a, b, dtype)


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return w * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (3, 100), (2, 4096)])
def test_rms_norm_equals_the_reference(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g).to(dtype) * 3
    r = torch.randn(rows, dim, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    out, h = rms_norm(x.to(DEV), w.to(DEV), 1e-5)
    close(out, reference_norm(x, w, 1e-5), dtype)
    assert h.data_ptr() == x.to(DEV).data_ptr() or torch.equal(h.cpu(), x)
    out, h = rms_norm(x.to(DEV), w.to(DEV), 1e-6, residual=r.to(DEV))
    exact(h, r + x, dtype)  # the residual add in the model's dtype
    close(out, reference_norm(r + x, w, 1e-6), dtype)


def test_rms_norm_keeps_leading_dims_and_empty_input():
    x = torch.randn(2, 3, 8).to(DEV)
    w = torch.ones(8).to(DEV)
    out, h = rms_norm(x, w, 1e-6)
    assert out.shape == (2, 3, 8) and h.shape == (2, 3, 8)
    out, _ = rms_norm(torch.empty(0, 8, device=DEV), w, 1e-6)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 100), (2, 2048)])
def test_silu_mul_equals_the_reference(dtype, rows, width):
    g = torch.Generator().manual_seed(width)
    gu = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    gate, up = gu.split(width, dim=-1)
    close(silu_mul(gu.to(DEV)), F.silu(gate) * up, dtype)
    # A leading batch dim and a non-contiguous view are accepted.
    wide = torch.randn(3, 1, 4 * width, generator=g).to(dtype)
    view = wide[..., : 2 * width]
    gate, up = view.split(width, dim=-1)
    close(silu_mul(view.to(DEV)), F.silu(gate) * up, dtype)


def reference_attention_input(qkv, cos, sin, slots, k_cache, v_cache, H, Hkv, norms, eps):
    """models/llama.py's Attention.project then kvcache/paged.py's write, on [N] tokens."""
    N = qkv.shape[0]
    D = qkv.shape[1] // (H + 2 * Hkv)
    qk, v = qkv[None].split(((H + Hkv) * D, Hkv * D), dim=-1)
    qk = qk.view(1, N, H + Hkv, D)
    if norms is not None:
        qn, kn = norms
        qk = torch.cat((reference_norm(qk[:, :, :H], qn, eps),
                        reference_norm(qk[:, :, H:], kn, eps)), dim=2)
    qk = apply_rope(qk.transpose(1, 2), cos[None, None], sin[None, None])  # [1, H+Hkv, N, D]
    q, k = qk[0, :H].transpose(0, 1), qk[0, H:].transpose(0, 1)  # [N, *, D]
    kf, vf = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    kf.index_copy_(0, slots, k)
    vf.index_copy_(0, slots, v[0].view(N, Hkv, D))
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("H,Hkv,D,N", [(4, 2, 64, 5), (3, 1, 16, 1), (2, 2, 128, 3)])
def test_rope_write_equals_project_then_write(dtype, qk_norm, H, Hkv, D, N):
    g = torch.Generator().manual_seed(H * D + N)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos_t, sin_t = rope_tables(D, 10000.0, None, 64, torch.device("cpu"))
    pos = torch.randint(0, 64, (N,), generator=g)
    cos, sin = cos_t[pos].to(dtype), sin_t[pos].to(dtype)
    blocks, bs = 4, 8
    slots = torch.randperm(blocks * bs, generator=g)[:N]
    poison = torch.full((blocks, bs, Hkv, D), 7.0).to(dtype)
    norms = None
    if qk_norm:
        norms = tuple((1 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2))
    k_ref, v_ref = poison.clone(), poison.clone()
    q_ref = reference_attention_input(qkv, cos, sin, slots, k_ref, v_ref, H, Hkv, norms, 1e-6)
    k_dev, v_dev = poison.clone().to(DEV), poison.clone().to(DEV)
    q = rope_write(qkv.to(DEV), cos.to(DEV), sin.to(DEV), slots.to(DEV), k_dev, v_dev, H, Hkv,
                   None if norms is None else tuple(n.to(DEV) for n in norms), 1e-6)
    # On the H200 17 % of the rotated bf16 values differ from the reference's by one step:
    # the compiled kernel forms x * cos + rot * sin without every intermediate rounding the
    # reference makes (the interpreter keeps them), so bit-equality is not asked there.
    close(q, q_ref.contiguous(), dtype, bit_equal=False)
    close(k_dev, k_ref, dtype, bit_equal=False)  # written slots the reference's, others kept
    assert torch.equal(v_dev.cpu(), v_ref)


def test_the_layer_norm_add_matches_its_reference_path():
    """RMSNorm.add is (norm(residual + x), residual + x) on either path."""
    norm = RMSNorm(32, 1e-6)
    x, r = torch.randn(3, 32), torch.randn(3, 32)
    normed, h = norm.add(x, r)
    assert torch.equal(h, r + x)
    torch.testing.assert_close(normed, norm(r + x))
