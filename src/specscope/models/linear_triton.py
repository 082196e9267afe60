"""The few-row linear in Triton (CUDA): y = x @ W.T (+ b) for up to 16 rows of x, the fast
path of F.linear at decode and verify sizes, with the elementwise work around a decoder
layer's products folded in.

A batch-1 decode step multiplies one row by every weight, and a verify by a few rows: the
work is reading W once. cuBLAS picks split-K kernels for the 4096-wide matrices of an 8B
model and a separate reduce kernel after each (benchmarks/step_floor.py: o_proj at 62 % of
the copy bandwidth, qkv_proj at 73 %, down_proj 86 % plus 64 reduce launches a step). Here
one program owns BLOCK_N output columns and streams their BLOCK_N weight rows over all of K
(contiguous loads, several in flight), multiplying the x rows on the tensor cores: no split,
no reduce, one launch.

Rows are padded to 16 (the tensor cores' smallest tile), so a row's result does not depend
on how many rows share the call: a verify of 8 tokens computes each row exactly as a decode
step computes its one (the fp32 sum over K runs in the same order), which cuBLAS does not
promise across its M-dependent kernel choices. Accumulation is fp32, rounded once to the
output dtype, as cuBLAS's.

Two pieces of a decoder layer's elementwise work ride along in the epilogue, where they
cost one operation an output (each was a launch of ~2 us at batch 1):
- `gated`: the weight is SwiGLU's [gate | up] (2I rows) and the output is silu(gate) * up
  [I]: each program multiplies x by its gate rows and by the matching up rows and combines
  them, rounded as F.linear then models/fused_triton.py's silu_mul round them (bit for bit);
- `residual`: the rounded product is added to the residual stream in the output dtype, the
  reference's `residual + y` (bit for bit);
- `linear_argmax`: a greedy pick over a head's rows (a draft step's token, a verify's target
  tokens): each program keeps its columns' largest rounded output per row, a second small
  launch picks among the programs, and the logits are never written (torch's argmax over
  one 32k-128k row ran as a single thread block, ~12 us a call on the H200).
On Hopper the kernel launches dependently (models/dependent_launch.py): its programs are
scheduled while the kernel before finishes and pull the first lines of their weight rows
into L2 before waiting for it.
Work before the product (a norm, silu · up as the input) does not fold as well: every
program would redo it for all of x, and the transformed x loses the loads' pipelining into
the tensor cores (tried on an H100: the batch-1 step 6.2 -> 11.4 ms; docs/gpu-floor.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specscope.models import dependent_launch
from specscope.models.dependent_launch import prefetch_l2, release, wait

MAX_ROWS = 16


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, idx_ptr, M, N, K,
                   stride_xm, stride_wn, stride_rm, stride_om,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
                   ARGMAX: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """Output columns n of y [M, N]; GATED: the weight has 2N rows, gate then up. ARGMAX:
    instead of y, each row's largest rounded output among the program's columns and its
    column (the first on ties), at [program, row] of out (fp32) and idx (int32)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    u_rows = w_rows + N * stride_wn  # GATED: the up rows of the same columns
    if PDL and PREFETCH > 0:
        # While the kernel before finishes: the first lines of this program's weight rows
        # (rows past N clamped to the last, so every address is inside the weight).
        lines = w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_wn \
            + tl.arange(0, PREFETCH // 64)[None, :] * 64
        prefetch_l2(lines)
        if GATED:
            prefetch_l2(lines + N * stride_wn)
    wait(PDL)
    x_rows = x_ptr + m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_ok, x_ok = n_ok[:, None], m_ok[:, None]
        else:
            w_ok = n_ok[:, None] & (k < K)[None, :]
            x_ok = m_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if GATED:
            u = tl.load(u_rows + k[None, :], mask=w_ok, other=0.0)
            acc_u += tl.dot(x, tl.trans(u), input_precision=PRECISION)
    release(PDL)
    dt = x_ptr.dtype.element_ty  # y's dtype: the products are rounded as F.linear's output
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt)
    if GATED:  # silu(gate) * up from the rounded products, as silu_mul computes it
        g = y.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (s * acc_u.to(dt).to(tl.float32)).to(dt)
    ok = m_ok[:, None] & n_ok[None, :]
    if ARGMAX:
        yf = tl.where(n_ok[None, :], y.to(tl.float32), float("-inf"))
        best = tl.max(yf, axis=1)  # [BLOCK_M]
        col = tl.argmax(yf, axis=1, tie_break_left=True) + tl.program_id(0) * BLOCK_N
        part = tl.program_id(0) * BLOCK_M + m
        tl.store(out_ptr + part, best, mask=m_ok)
        tl.store(idx_ptr + part, col.to(tl.int32), mask=m_ok)
    else:
        if HAS_RES:  # the residual stream's add, in the output dtype as the reference's
            r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=ok)


@triton.jit
def _argmax_finish_kernel(best_ptr, col_ptr, map_ptr, out_ptr, P,
                          HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                          PDL: tl.constexpr):
    """Row m's column of its largest value over the P programs' [P, BLOCK_M] partials, the
    first on ties (the programs cover the columns in order); mapped by map[col] + col."""
    m = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < P
    wait(PDL)
    release(PDL)
    v = tl.load(best_ptr + p * BLOCK_M + m, mask=p_ok, other=float("-inf"))
    c = tl.load(col_ptr + p * BLOCK_M + m, mask=p_ok, other=0)
    top = tl.max(v, axis=0)
    col = tl.min(tl.where(p_ok & (v == top), c, 2147483647), axis=0).to(tl.int64)
    if HAS_MAP:
        col += tl.load(map_ptr + col).to(tl.int64)
    tl.store(out_ptr + m, col)


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight [n, k]: enough programs to
    fill the GPU from few output columns, wider column tiles (fewer, longer streams) as n
    grows. The best tiles of a sweep on an H200 (bf16, M = 1 and 8; benchmarks/linear.py
    --sweep): 16 columns for n <= 2048, 32 for 4096 (o_proj, down_proj, the draft's fc),
    64 for 5k-32k (qkv_proj, gate_up_proj, a 32k draft lm_head), 32 for a 128k lm_head."""
    if n <= 2048:
        return 16, 512, 4, 4
    if n <= 4096:
        return 32, 512, 4, 4
    if n <= 8192:
        return 64, 256, 4, 4
    if n <= 65536:
        return 64, 256, 4, 3
    return 32, 256, 4, 4


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this path serves F.linear(x, weight): CUDA, 16-bit floats of one dtype, at
    most MAX_ROWS rows, a contiguous weight with K a multiple of 16."""
    return rows_fit(x) and weight_fits(weight, x.dtype) and x.shape[-1] == weight.shape[1]


def rows_fit(x: torch.Tensor) -> bool:
    """Whether x [..., K] is a few-row input: on CUDA, 1 to MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.is_cuda and 0 < rows <= MAX_ROWS


def weight_fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this weight for activations of `dtype`: 16-bit floats of
    that dtype, 2-D, contiguous, K a multiple of 16."""
    return (dtype in (torch.bfloat16, torch.float16) and weight.dtype == dtype
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 16 == 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile: tuple[int, int, int, int] | None = None, *, gated: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] for at most MAX_ROWS rows of x
    (check `applies`). tile: force (BLOCK_N, BLOCK_K, num_warps, num_stages) (the sweep).

    gated: weight (and bias) are [gate | up], 2I rows, and the result is silu(gate) * up
    [..., I]. residual [..., N]: returns residual + the rounded product."""
    x2 = _rows(x)
    M, N = x2.shape[0], weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.reshape(M, N)
    if res is not None and res.stride(-1) != 1:
        res = res.contiguous()
    _launch(x2, weight, bias, res, out, out, N, _tile(weight, x2.shape[1], tile, gated),
            gated=gated)
    return out.view(*x.shape[:-1], N)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  token_map: torch.Tensor | None = None,
                  tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(x [..., K] @ weight [N, K].T (+ bias)).argmax(-1) -> int64 [...] for at most MAX_ROWS
    rows (check `applies`): the products rounded to x's dtype as `linear` rounds them, the
    first column on ties as torch.argmax; with token_map [N] (a draft's d2t), col +
    token_map[col]. A greedy draft step's lm_head and argmax in one pass over the weight:
    each program reduces its own columns, and a second launch of one program a row picks
    among the programs' [programs, 16] partials; the [rows, N] logits are never written."""
    x2 = _rows(x)
    M, N = x2.shape[0], weight.shape[0]
    cfg = _tile(weight, x2.shape[1], tile, False)
    P = triton.cdiv(N, cfg[0])
    best = torch.empty(P, MAX_ROWS, dtype=torch.float32, device=x.device)
    col = torch.empty(P, MAX_ROWS, dtype=torch.int32, device=x.device)
    launch = _launch(x2, weight, bias, None, best, col, N, cfg, argmax=True)
    out = torch.empty(M, dtype=torch.long, device=x.device)
    block_p = triton.next_power_of_2(P)
    _argmax_finish_kernel[(M,)](best, col, token_map if token_map is not None else col, out, P,
                                HAS_MAP=token_map is not None, BLOCK_M=MAX_ROWS,
                                BLOCK_P=block_p, num_warps=4 if block_p <= 2048 else 8,
                                **launch)
    return out.view(x.shape[:-1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K] rows with a unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _tile(weight: torch.Tensor, K: int, tile: tuple[int, int, int, int] | None,
          gated: bool) -> tuple[int, int, int, int]:
    """The launch's (BLOCK_N, BLOCK_K, num_warps, num_stages): `tile` or config()'s; a gated
    product's programs take half the columns (each streams gate and up rows)."""
    bn, bk, warps, stages = tile or config(weight.shape[0], K)
    if gated:
        bn = max(16, bn // 2)
    return bn, min(bk, triton.next_power_of_2(K)), warps, stages


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            res: torch.Tensor | None, out: torch.Tensor, idx: torch.Tensor, N: int,
            tile: tuple[int, int, int, int], *, gated: bool = False,
            argmax: bool = False) -> dict:
    """_linear_kernel over N output columns of x2 [M, K]; returns the launch's dependent-
    launch options (a launch right after it takes the same)."""
    (M, K), (bn, bk, warps, stages) = x2.shape, tile
    launch = dependent_launch.options(x2, M)
    _linear_kernel[(triton.cdiv(N, bn),)](
        x2, weight, bias if bias is not None else weight, res if res is not None else out,
        out, idx, M, N, K, x2.stride(0), weight.stride(0),
        res.stride(0) if res is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, HAS_RES=res is not None, ARGMAX=argmax,
        BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0,
        PRECISION="ieee" if x2.dtype == torch.float32 else None,
        PREFETCH=dependent_launch.prefetch_columns(K) if launch["PDL"] else 0,
        num_warps=warps, num_stages=stages, **launch)
    return launch


__all__ = ["MAX_ROWS", "applies", "config", "linear", "linear_argmax", "rows_fit",
           "weight_fits"]
