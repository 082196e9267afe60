"""The native CPU kernels' Python side: tensors in, ctypes calls out (native/__init__.py
builds and loads the library). The same calls as the fused Triton kernels on CUDA
(models/fused_triton.py rms_norm and silu_mul; kvcache/paged.py paged_attend_qkv), for CPU
tensors of fp32 or bf16."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specscope.kvcache.paged import BatchMeta

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# At most this many query tokens a forward go through the native decoder (decode steps,
# verifies and draft steps: native/decoder.c holds their rows in its own scratch).
ATTENTION_MAX_TOKENS = 16
# The native attention takes prefill chunks too: it attends each token over the keys it
# sees, where the reference computes the whole square and masks it (a 1,024-token prompt's
# prefill 2.18 -> 1.01 s on the default model, docs/cpu.md). Its scratch for a call (each
# run of tokens' key slots, the parts of rows split by keys) may take this many bytes;
# past it the call goes to the reference (a chunk of thousands of tokens over tens of
# thousands of keys).
ATTENTION_MAX_SCRATCH = 256 << 20


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else \
        t.to(torch.int64).contiguous()


def _meta_args(meta: BatchMeta) -> tuple[list[torch.Tensor], tuple]:
    """A BatchMeta's index tensors as sc_attend_qkv takes them (int64 and bool, contiguous;
    kept alive beside their addresses) and the arguments they give it, in order: slots,
    seq_index, block_tables, max_blocks, visible, window_start, tree_start, tree_mask, T."""
    tables = _i64(meta.block_tables)
    mask = meta.tree_mask.contiguous()
    index = [_i64(t) for t in (meta.slots, meta.seq_index, meta.visible, meta.window_start,
                               meta.tree_start)]
    args = (index[0].data_ptr(), index[1].data_ptr(), tables.data_ptr(), tables.shape[1],
            index[2].data_ptr(), index[3].data_ptr(), index[4].data_ptr(), mask.data_ptr(),
            mask.shape[1])
    return [tables, mask, *index], args


class CpuKernels:
    """The loaded library's kernels. Every call takes contiguous CPU tensors of one dtype
    (fp32 or bf16) and returns new ones; each row's result depends on that row alone."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.lib = lib
        self._norm = lib.sc_rms_norm
        self._norm.argtypes = [_P, _P, _P, _P, _P, _I, _I, _F, _INT]
        self._norm.restype = None
        self._silu = lib.sc_silu_mul
        self._silu.argtypes = [_P, _P, _I, _I, _INT]
        self._silu.restype = None
        self._attend = lib.sc_attend_qkv
        self._attend.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P,
                                 _P, _P, _P, _I, _I, _P, _P, _F, _F, _P, _INT, _I]
        self._attend.restype = _INT
        self._quant = lib.sc_quant_linear
        self._quant.argtypes = [_P, _I, _I, _P, _P, _P, _I, _INT, _INT, _P, _INT, _P, _INT]
        self._quant.restype = None
        lib.sc_quant_wide.restype = _INT
        # Whether 16-row tiles run on the vector path here (models/quant.py default_tile).
        self.wide = bool(lib.sc_quant_wide())
        self._argmax = lib.sc_argmax_rows
        self._argmax.argtypes = [_P, _I, _I, _INT, _P]
        self._argmax.restype = None
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(h), h) with h = x (+ residual), rounded as HF's RMSNorm
        rounds (fp32 statistics, the normed row cast back before the weight). x and
        residual [..., D] contiguous, weight [D] of x's dtype."""
        if weight.dtype != x.dtype:  # the reference's result type: leave it to torch
            raise TypeError("native rms_norm takes a weight of the activation's dtype")
        D = x.shape[-1]
        out = torch.empty_like(x)
        h = torch.empty_like(x) if residual is not None else x
        self._norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(),
                   h.data_ptr() if residual is not None else None, x.numel() // max(D, 1), D,
                   eps, x.dtype == torch.bfloat16)
        return out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [..., 2I] (gate columns, then up): [..., I]."""
        two_i = gate_up.shape[-1]
        x = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
        out = torch.empty(*x.shape[:-1], two_i // 2, dtype=x.dtype)
        self._silu(x.data_ptr(), out.data_ptr(), x.numel() // max(two_i, 1), two_i // 2,
                   x.dtype == torch.bfloat16)
        return out

    @staticmethod
    def attend_applies(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cos: torch.Tensor, head_dim: int,
                       norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Whether attend_qkv may serve this call: one dtype throughout (the q/k norms'
        weights included), a K/V cache of separate contiguous tensors (not MLA's shared
        latent). attend_qkv may still decline a call too big for its scratch."""
        return (head_dim % 8 == 0
                and k_cache.dtype == qkv.dtype == v_cache.dtype == cos.dtype
                and (norms is None or all(w.dtype == qkv.dtype for w in norms))
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.shape[-1] == v_cache.shape[-1] == head_dim)

    def attend_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                   scale: float, num_heads: int, num_kv_heads: int,
                   norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float
                   ) -> torch.Tensor | None:
        """kvcache/paged.py paged_attend_qkv on the CPU: q/k norms, rotary (cos/sin [N,
        D]), the KV write at meta.slots, attention over the paged cache. qkv [N, (H + 2 Hkv)
        D] -> [N, H * D]; None, with nothing written, for a call whose scratch would pass
        ATTENTION_MAX_SCRATCH. Check attend_applies first."""
        N = qkv.shape[0]
        H, Hkv = num_heads, num_kv_heads
        D = qkv.shape[1] // (H + 2 * Hkv)
        qkv, cos, sin = (t if t.is_contiguous() else t.contiguous() for t in (qkv, cos, sin))
        out = torch.empty(N, H * D, dtype=qkv.dtype)
        if meta.native_args is None:
            meta.native_args = _meta_args(meta)
        tensors, args = meta.native_args
        qn, kn = norms if norms is not None else (None, None)
        rc = self._attend(qkv.data_ptr(), N, H, Hkv, D, cos.data_ptr(), sin.data_ptr(),
                          k_cache.data_ptr(), v_cache.data_ptr(), *args[:4], k_cache.shape[1],
                          *args[4:], meta.max_len, _ptr(qn), _ptr(kn), eps, scale,
                          out.data_ptr(), qkv.dtype == torch.bfloat16, ATTENTION_MAX_SCRATCH)
        if rc == -2:  # too big for the scratch it may take: nothing was written
            return None
        if rc != 0:
            raise MemoryError(f"native CPU attention could not allocate its scratch for {N} "
                              f"tokens over {meta.max_len} keys")
        return out

    def quant_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     offsets: torch.Tensor | None, out_features: int, bits: int,
                     reference: bool = False) -> torch.Tensor:
        """x [M, K] (fp32 or bf16, contiguous) times quantised weights in quant_kernels.c's
        tiled layout (models/quant.py GgufLinear builds it; scales [N/T, K/32, T] give the
        tile's rows T): [M, out_features] in x's dtype, the activations quantised to 8 bits
        per block of 32 as llama.cpp does. `reference` runs the C scalar loop the vector
        paths equal bit for bit."""
        M, K = x.shape
        need = M * K + 12 * M * (K // 32) + 64  # kernels.h SC_QUANT_SCRATCH, aligned
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        y = torch.empty(M, out_features, dtype=x.dtype)
        self._quant(x.data_ptr(), M, K, codes.data_ptr(), scales.data_ptr(), _ptr(offsets),
                    out_features, bits, scales.shape[-1], y.data_ptr(),
                    x.dtype == torch.bfloat16, self._scratch.data_ptr(), reference)
        return y

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N] (fp32 or bf16) -> int64 [...]: each row's first largest column, NaN
        counting as the largest: x.float().argmax(-1), the same ids."""
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.is_contiguous() else rows.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.long)
        self._argmax(rows.data_ptr(), rows.shape[0], rows.shape[1],
                     rows.dtype == torch.bfloat16, out.data_ptr())
        return out.view(x.shape[:-1])
