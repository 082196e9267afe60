"""The MoE experts as a grouped GEMM in Triton (CUDA): the fast path of experts_looped.

Static shapes, no host sync, so a step with MoE layers is still one CUDA graph per batch
bucket and one device->host read:

1. Dispatch (`dispatch`, torch): the M = N * k token-expert pairs are sorted by expert
   (stable: token order within an expert) and laid out in a buffer of P rows, each
   expert's segment padded to a multiple of BM rows. P is a bound known from the shapes
   alone: sum over the used experts of ceil(c_e / BM) * BM <= M + min(E, M) * (BM - 1).
   Every BM-row block then belongs to one expert (block_expert; E marks blocks past the
   used rows, which the kernels skip), and padding rows point at token N (masked: zeros).
2. gate_up kernel: per (block, column tile), rows gathered from x by row_token, times the
   block's expert's gate and up rows, SwiGLU in fp32 -> act [P, I].
3. down kernel: act [P, I] times the block's expert's down -> y [P, H].
4. Combine (torch): out[n] = sum_j w[n, j] * y[pair_row[n, j]]: a gather, not an atomic
   scatter, so the sum's order (and the result) is deterministic.

A step of few pairs (decode at small batch sizes: `experts_pairs`) skips the dispatch:
its ~20 small sort/scan/scatter launches cost more than its GEMMs there. One program per
(pair, column tile) runs the pair's gate_up as a GEMV straight from the routing ids; one
per (token, column tile) runs its k pairs' down GEMVs side by side and sums them by their
weights (a fixed order: deterministic), writing the token's output row: no fp32
intermediate, no combine launch. Each pair reads its expert's rows itself, so pairs that
share an expert read it again (from L2 when close): the sorted path wins once pairs share
experts enough (PAIR_PATH_MAX_PAIRS, measured).
On Hopper the two pair kernels launch dependently (models/dependent_launch.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specscope.models import dependent_launch
from specscope.models.dependent_launch import release, wait
from specscope.models.moe_experts import expert_counts

# Triton 3.9's CPU interpreter (the tests' CUDA stand-in) multiplies bf16 dot operands as
# their raw bits; under it, bf16 tiles are widened to fp32 before each dot (same products).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class Dispatch:
    """The block-padded expert-sorted layout of one forward's token-expert pairs."""

    row_token: torch.Tensor  # [P] int32: the token of each row; N on padding rows
    block_expert: torch.Tensor  # [P // BM] int32: each block's expert; E past the used rows
    pair_row: torch.Tensor  # [N, k] int64: the row each (token, pick) pair landed in
    block_m: int


def block_rows(num_pairs: int) -> int:
    """Rows per block: 16 for decode and verify sized batches (a few rows per expert, so
    little padding), 64 for prefill (fewer, fuller tiles)."""
    return 16 if num_pairs <= 1024 else 64


def dispatch(ids: torch.Tensor, num_experts: int, block_m: int) -> Dispatch:
    """ids [N, k] -> the layout of step 1 (module docstring). Device ops only."""
    N, k = ids.shape
    M, E, dev = N * k, num_experts, ids.device
    P = -(-(M + min(E, M) * (block_m - 1)) // block_m) * block_m
    flat = ids.reshape(-1)
    counts = expert_counts(ids, E)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)  # [E]
    pad_start, raw_start = pad_end - padded, counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # [M] pairs grouped by expert
    e = flat[order]
    dest = pad_start[e] + torch.arange(M, device=dev) - raw_start[e]  # [M] row of each
    row_token = torch.full((P,), N, dtype=torch.int32, device=dev)
    row_token[dest] = (order // k).to(torch.int32)
    pair_row = torch.empty(M, dtype=torch.long, device=dev)
    pair_row[order] = dest
    starts = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_max(E)
    return Dispatch(row_token, block_expert.to(torch.int32), pair_row.view(N, k), block_m)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, tok_ptr, blk_ptr, out_ptr, N, H, I, E,
                    stride_x, stride_we, stride_wr, stride_o,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """act[r, c] = silu(x[tok[r]] . gate[e, c]) * (x[tok[r]] . up[e, c]) for the rows r
    of block program_id(0) (expert e) and the columns c of tile program_id(1)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(blk_ptr + pid_m)
    if e < E:
        rows = pid_m * BM + tl.arange(0, BM)
        tok = tl.load(tok_ptr + rows)
        live = tok < N
        cols = pid_n * BN + tl.arange(0, BN)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_x + ks[None, :],
                        mask=live[:, None] & (ks[None, :] < H), other=0.0)
            wmask = (cols[None, :] < I) & (ks[:, None] < H)
            wg = tl.load(w_base + cols[None, :] * stride_wr + ks[:, None], mask=wmask,
                         other=0.0)  # [BK, BN]: gate rows, transposed
            wu = tl.load(w_base + (cols[None, :] + I) * stride_wr + ks[:, None], mask=wmask,
                         other=0.0)
            acc_g = _dot(a, wg, acc_g, PRECISION, UPCAST)
            acc_u = _dot(a, wu, acc_u, PRECISION, UPCAST)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :],
                 act.to(out_ptr.dtype.element_ty), mask=cols[None, :] < I)


@triton.jit
def _down_kernel(a_ptr, w_ptr, blk_ptr, out_ptr, H, I, E,
                 stride_a, stride_we, stride_wr, stride_o,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y[r, c] = act[r] . down[e, c] for the rows of block program_id(0) (expert e)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(blk_ptr + pid_m)
    if e < E:
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :],
                        mask=ks[None, :] < I, other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wr + ks[:, None],
                        mask=(cols[None, :] < H) & (ks[:, None] < I), other=0.0)
            acc = _dot(a, w, acc, PRECISION, UPCAST)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=cols[None, :] < H)


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, H, I, K,
                         stride_x, stride_we, stride_wr, stride_o,
                         BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """act[p, c] = silu(x[p // K] . gate[e, c]) * (x[p // K] . up[e, c]), e = ids[p], for
    pair p = program_id(0) and the columns c of tile program_id(1): a GEMV in fp32, on the
    CUDA cores or (DOT) on the tensor cores with x as row 0 of a 16-row tile, whose
    operand loads Triton pipelines through shared memory (more bytes in flight)."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    wait(PDL)  # the routing ids and x come from the kernels before
    release(PDL)
    e = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // K).to(tl.int64) * stride_x
    cols = pid_n * BN + tl.arange(0, BN)
    w_base = w_ptr + e * stride_we
    m = tl.arange(0, 16)
    if DOT:
        acc_g = tl.zeros((16, BN), dtype=tl.float32)
        acc_u = tl.zeros((16, BN), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        wmask = (cols[:, None] < I) & (ks[None, :] < H)
        wg = tl.load(w_base + cols[:, None] * stride_wr + ks[None, :], mask=wmask, other=0.0)
        wu = tl.load(w_base + (cols[:, None] + I) * stride_wr + ks[None, :], mask=wmask,
                     other=0.0)  # [BN, BK]: rows contiguous along K
        if DOT:
            a = tl.load(x_row + m[:, None] * 0 + ks[None, :],
                        mask=(m == 0)[:, None] & (ks < H)[None, :], other=0.0)  # [16, BK]
            acc_g = _dot(a, tl.trans(wg), acc_g, PRECISION, UPCAST)
            acc_u = _dot(a, tl.trans(wu), acc_u, PRECISION, UPCAST)
        else:
            a = tl.load(x_row + ks, mask=ks < H, other=0.0).to(tl.float32)  # [BK]
            acc_g += tl.sum(wg.to(tl.float32) * a[None, :], 1)
            acc_u += tl.sum(wu.to(tl.float32) * a[None, :], 1)
    if DOT:  # row 0 holds the pair's products; the other rows are zeros
        acc_g = tl.sum(acc_g, 0)
        acc_u = tl.sum(acc_u, 0)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, act.to(out_ptr.dtype.element_ty),
             mask=cols < I)


@triton.jit
def _pair_down_kernel(a_ptr, w_ptr, ids_ptr, wt_ptr, r_ptr, out_ptr, H, I,
                      stride_a, stride_we, stride_wr, stride_r, stride_o, K: tl.constexpr,
                      K_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """out[n, c] = sum_j wt[n, j] * (act[n * K + j] . down[ids[n, j], c]) for token n =
    program_id(0) and the columns c of tile program_id(1): the token's K pairs' down
    products side by side in fp32 (K_PAD streams of weight rows in flight; DOT: on the
    tensor cores, pair j's activation alone in row j of a 16-row tile, so one accumulator
    gathers every pair's product in its own row and Triton pipelines the weight loads),
    summed by their routing weights and rounded once to out's dtype; HAS_RES: plus r[n, c],
    added in fp32 to the rounded sum and rounded again (the reference's `r + out`)."""
    n, pid_n = tl.program_id(0), tl.program_id(1)
    wait(PDL)  # act, the ids and their weights come from the kernels before
    release(PDL)
    j = tl.arange(0, K_PAD)
    j_ok = j < K
    pair = n.to(tl.int64) * K + j  # [K_PAD]
    e = tl.load(ids_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    wt = tl.load(wt_ptr + pair, mask=j_ok, other=0.0).to(tl.float32)
    cols = pid_n * BN + tl.arange(0, BN)
    if DOT:
        y = _pair_down_dot(a_ptr, w_ptr, e, n, cols, wt, H, I, stride_a, stride_we,
                           stride_wr, K, K_PAD, BN, BK, PRECISION, UPCAST)
    else:
        w_rows = w_ptr + e[:, None, None] * stride_we + cols[None, :, None] * stride_wr
        w_ok = j_ok[:, None, None] & (cols < H)[None, :, None]  # [K_PAD, BN, 1]
        a_rows = a_ptr + pair[:, None] * stride_a  # [K_PAD, 1]
        acc = tl.zeros((K_PAD, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(a_rows + ks[None, :], mask=j_ok[:, None] & (ks < I)[None, :],
                        other=0.0).to(tl.float32)  # [K_PAD, BK]
            w = tl.load(w_rows + ks[None, None, :], mask=w_ok & (ks < I)[None, None, :],
                        other=0.0)  # [K_PAD, BN, BK]: rows contiguous along I
            acc += tl.sum(w.to(tl.float32) * a[:, None, :], 2)
        y = tl.sum(acc * wt[:, None], 0)
    dt = out_ptr.dtype.element_ty
    y = y.to(dt)  # [BN]
    if HAS_RES:
        r = tl.load(r_ptr + n.to(tl.int64) * stride_r + cols, mask=cols < H, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(out_ptr + n.to(tl.int64) * stride_o + cols, y, mask=cols < H)


@triton.jit
def _pair_down_dot(a_ptr, w_ptr, e, n, cols, wt, H, I, stride_a, stride_we, stride_wr,
                   K: tl.constexpr, K_PAD: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """_pair_down_kernel's weighted sum on the tensor cores (K <= 16 pairs; e, wt [K_PAD]:
    their experts and weights): [BN] fp32."""
    m = tl.arange(0, 16)
    j = tl.arange(0, K_PAD)
    a_rows = a_ptr + (n.to(tl.int64) * K + m)[:, None] * stride_a  # row j: pair j's act
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_rows + ks[None, :], mask=(m < K)[:, None] & (ks < I)[None, :],
                    other=0.0)  # [16, BK]
        for jj in tl.static_range(K):
            e_j = tl.sum(tl.where(j == jj, e, 0))  # loop-invariant: from registers
            w = tl.load(w_ptr + e_j * stride_we + cols[:, None] * stride_wr + ks[None, :],
                        mask=(cols < H)[:, None] & (ks < I)[None, :], other=0.0)  # [BN, BK]
            acc = _dot(tl.where((m == jj)[:, None], a, 0.0).to(a.dtype), tl.trans(w), acc,
                       PRECISION, UPCAST)
    wt16 = tl.sum(tl.where(m[:, None] == j[None, :], wt[None, :], 0.0), 1)  # row j: wt[j]
    return tl.sum(acc * wt16[:, None], 0)


# Up to this many token-expert pairs, and no more than half the experts, a forward runs
# `experts_pairs` (module docstring). Measured on the H200 (benchmarks/moe_experts.py): the
# pair path is 30 % faster for Qwen3-30B-A3B's experts at 1-4 tokens and even at 16;
# DeepSeek-V3's win at 2-4 tokens (8-32 pairs) and lose from 8; Mixtral's 8 experts are
# shared by any few tokens, and the sorted GEMMs win from 4 pairs.
PAIR_PATH_MAX_PAIRS = 32


def use_pairs(num_pairs: int, num_experts: int) -> bool:
    return num_pairs <= min(PAIR_PATH_MAX_PAIRS, num_experts // 2)


# (BN, BK, num_warps, num_stages, on the tensor cores) of the pair kernels: bytes in flight
# per program are what a GEMV of one row needs to stream at full bandwidth
# (benchmarks/moe_experts.py --sweep). gate_up: best on Qwen3-30B-A3B's and DeepSeek-V3's
# experts at 1 and 4 tokens on the H200 (Mixtral's within 5 %). down (a token's k pairs a
# program, BN columns of each): best of 24 for Qwen3-30B-A3B at 1 token on the H200. The
# tensor-core forms (whose weight loads Triton pipelines) are not yet measured.
PAIR_GATE_UP_TILE = (64, 256, 8, 3, False)
PAIR_DOWN_TILE = (8, 256, 4, 3, False)


@torch.compiler.disable  # as experts_grouped
def experts_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """experts_grouped's contract for a few pairs: x [N, H], ids/weights [N, k], gate_up
    [E, 2I, H], down [E, H, I] -> [N, H]. Two launches: gate_up's GEMVs over the pairs,
    then each token's k down GEMVs summed by its weights (and residual [N, H] added to the
    rounded sum, as `residual + out` adds it)."""
    N, H = x.shape
    k = ids.shape[1]
    i = gate_up.shape[1] // 2
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    ids = ids.contiguous()
    act = torch.empty(N * k, i, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages, dot = PAIR_GATE_UP_TILE
    _pair_gate_up_kernel[(N * k, triton.cdiv(i, BN))](
        x, gate_up, ids, act, H, i, k, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), BN=BN, BK=_tile(H, BK), DOT=dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
        **dependent_launch.options(x, N))
    out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    BN, BK, warps, stages, dot = PAIR_DOWN_TILE
    dot = dot and k <= 16
    _pair_down_kernel[(N, triton.cdiv(H, BN))](
        act, down, ids, weights.float().contiguous(), out if residual is None else residual,
        out, H, i, act.stride(0), down.stride(0), down.stride(1),
        0 if residual is None else residual.stride(0), out.stride(0), K=k,
        K_PAD=triton.next_power_of_2(k), BN=BN, BK=_tile(i, BK), DOT=dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16, HAS_RES=residual is not None,
        num_warps=warps, num_stages=stages, **dependent_launch.options(x, N))
    return out


def _tile(n: int, largest: int) -> int:
    """A power-of-two tile width in [16, largest] covering n where it can (tl.dot needs
    at least 16)."""
    return max(16, min(largest, triton.next_power_of_2(n)))


@torch.compiler.disable  # kernel launches with host-side grids; CUDA graphs still capture
def experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], ids/weights [N, k], gate_up [E, 2I, H], down [E, H, I] -> [N, H] (plus
    residual [N, H], added to the output rounded to x's dtype): the pair path for few pairs
    (use_pairs), else the sorted, block-padded GEMMs."""
    if use_pairs(ids.numel(), gate_up.shape[0]):
        return experts_pairs(x, ids, weights, gate_up, down, residual)
    N, H = x.shape
    E, two_i, _ = gate_up.shape
    i = two_i // 2
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    d = dispatch(ids, E, block_rows(ids.numel()))
    P, BM = d.row_token.shape[0], d.block_m
    # fp32 stays fp32 (no TF32): the reference is exact fp32.
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = _INTERPRET and x.dtype == torch.bfloat16
    act = torch.empty(P, i, dtype=x.dtype, device=x.device)
    BN, BK = _tile(i, 64), _tile(H, 64)
    _gate_up_kernel[(P // BM, triton.cdiv(i, BN))](
        x, gate_up, d.row_token, d.block_expert, act, N, H, i, E,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BM=BM, BN=BN, BK=BK, PRECISION=prec, UPCAST=upcast)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    BN, BK = _tile(H, 64), _tile(i, 64)
    _down_kernel[(P // BM, triton.cdiv(H, BN))](
        act, down, d.block_expert, y, H, i, E,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BM=BM, BN=BN, BK=BK, PRECISION=prec, UPCAST=upcast)
    picked = y[d.pair_row]  # [N, k, H]
    out = (picked.float() * weights[..., None].float()).sum(1).to(x.dtype)
    return out if residual is None else residual + out
