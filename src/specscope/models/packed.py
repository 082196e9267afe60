"""Linears on the CPU with weights pre-packed: bf16 in oneDNN's blocked layout, fp32 in
MKL's packed-GEMM layout for one row count.

At batch 1 every linear is a GEMV or a thin GEMM (M = tokens in the step). `F.linear`
on a plain [N, K] bf16 weight does not get a cached copy in oneDNN's preferred blocked
layout: measured on a 2-core AVX512-BF16 EPYC, [1, 576] x [576, 12288] takes 0.37 ms, the
same weight pre-packed once with `mkldnn._reorder_linear_weight` 0.13 ms, and 1.5-2.5x less
for every draft and target shape (M = 1 and M = 6). The results are bit-identical to
`F.linear` (measured for M = 1..300 and every shape here; tests/test_packed.py checks it),
so swapping it in changes no output, no acceptance. The runner packs the target (a decode
step of the default model 30 -> 24 ms, a 6-token verify 36 -> 25 ms: the thin GEMMs gain
most), the speculative decoder its draft. The price is a second copy of the linear weights.

fp32 (CPUs without native bf16): a GEMM of a few rows on a plain weight re-packs the weight
every call; measured on AVX2 kernels (2 threads, the default model's five linear shapes, one
of each), 6 rows take 12.3 ms with F.linear and 7.1 ms on MKL-packed weights, 1 row 5.5 and
5.2 ms. MKL's packed GEMM runs only at the row count it was packed for (any other falls back
to F.linear), and each count is a full copy of the weights, so the runner packs the target
for one count at a time: a speculative verify's tokens (num_draft_tokens), the step that is
slowest against its bytes. The copies of the last few counts are kept (FP32_COPIES, within
the memory share) and the active one is packed when it is chosen, not at its first GEMM: a
tuner switching between configurations prompt by prompt would otherwise repack the whole
model inside the first measured cycle of each switch (+46-68 % on that cycle). These
results are not bit-identical to F.linear (a different GEMM kernel; they differ in the last
bits, as F.linear's own M = 1 and M = 6 kernels do).

`PackedLinear` is an `nn.Linear` (same parameters, same state_dict names, so checkpoint
layouts and training see nothing new) whose forward uses the packed copy when it can and
`F.linear` — the reference path — otherwise: on other devices or dtypes, and whenever
autograd is recording. The packed copy is keyed on the weight's storage and version, so
an in-place update (load_state_dict, an optimizer step) repacks instead of going stale.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from specscope.models.linear import Linear

log = logging.getLogger("specscope.packed")
# The linears a packer may swap for a PackedLinear (the model's Linear is nn.Linear on the
# CPU); subclasses with their own forward (tensor-parallel all-reduces) are not.
_PLAIN = (nn.Linear, Linear)
# Row counts whose fp32 packed copies a linear keeps (each a full copy of its weight).
FP32_COPIES = 4


@cache
def packing_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops and this CPU runs oneDNN's
    bf16 kernels (F.linear then takes the same kernel family, which is what makes the two
    bit-identical; elsewhere F.linear stays)."""
    ops = torch.ops.mkldnn
    try:
        return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") \
            and hasattr(ops, "_reorder_linear_weight") and ops._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


@cache
def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed fp32 GEMM ops (x86 builds)."""
    ops = torch.ops.mkl
    try:
        return torch.backends.mkl.is_available() and hasattr(ops, "_mkl_linear") \
            and hasattr(ops, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def _version(w: torch.Tensor) -> int:
    # Inference tensors have no version counter; they cannot be updated in place outside
    # inference mode, and the engine never writes weights, so their storage is the key.
    try:
        return w._version
    except RuntimeError:
        return -1


class PackedLinear(nn.Linear):
    """nn.Linear with a cached oneDNN-packed copy of its weight for CPU bf16 inference."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, not copied (tied lm_heads stay tied)
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self.fp32_rows: int | None = None  # the row count an fp32 MKL pack serves
        # rows -> ((storage, version), packed copy), least recently chosen first.
        self._mkl: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def __getstate__(self) -> dict:
        # The packed copies are opaque oneDNN tensors (no storage to copy or pickle): copies
        # and pickles drop them and repack on first use.
        state = self.__dict__.copy()
        state["_packed"], state["_key"], state["_mkl"] = None, None, {}
        return state

    def set_fp32_rows(self, rows: int | None, keep: int = FP32_COPIES) -> None:
        """Serve fp32 GEMMs of exactly `rows` rows from an MKL-packed copy, packed now
        (None: none, and every copy dropped). The copies of the `keep` most recently chosen
        counts stay, so switching back to one costs nothing."""
        self.fp32_rows = rows
        if rows is None:
            self._mkl = {}
            return
        self.mkl_weight()
        self._mkl[rows] = self._mkl.pop(rows)  # most recently chosen last
        while len(self._mkl) > keep:
            del self._mkl[next(iter(self._mkl))]

    def mkl_weight(self) -> torch.Tensor:
        """The fp32 weight packed for fp32_rows rows, repacked when the weight changed."""
        w = self.weight
        key = (w.data_ptr(), _version(w))
        have = self._mkl.get(self.fp32_rows)
        if have is None or have[0] != key:
            with torch.no_grad():
                have = (key, torch.ops.mkl._mkl_reorder_linear_weight(w.detach(),
                                                                     self.fp32_rows))
            self._mkl[self.fp32_rows] = have
        return have[1]

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, repacked when the weight changed."""
        w = self.weight
        key = (w.data_ptr(), _version(w))
        if self._packed is None or key != self._key:
            with torch.no_grad():
                # The batch-size hint only picks the blocking; any M runs on it.
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        fast = (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))
        if fast and w.dtype == torch.float32 and self.fp32_rows is not None \
                and x.numel() == self.fp32_rows * self.in_features:
            y = torch.ops.mkl._mkl_linear(x.reshape(self.fp32_rows, -1), self.mkl_weight(), w,
                                          self.bias, self.fp32_rows)
            return y.reshape(*x.shape[:-1], self.out_features)
        if not fast or w.dtype != torch.bfloat16 or not packing_available():
            return F.linear(x, w, self.bias)
        x2 = x[None] if x.dim() == 1 else x  # the op wants [..., M, K]; a GEMV is M = 1
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight(), self.bias, "none",
                                               [], "")
        return y[0] if x.dim() == 1 else y


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_linears(module: nn.Module, dtype: torch.dtype) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, linear) for every plain nn.Linear (or the model's Linear, the same on
    the CPU) or PackedLinear under `module` whose weight is `dtype` on the CPU. A subclass
    (a tensor-parallel linear's all-reduce) keeps its own forward and is left out."""
    return [(parent, name, child) for parent in module.modules()
            for name, child in parent.named_children()
            if type(child) in (*_PLAIN, PackedLinear)
            and child.weight.device.type == "cpu" and child.weight.dtype == dtype]


def packable_bytes(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a packed copy of `module`'s CPU `dtype` linears would add (shared weights
    once)."""
    weights = {m.weight.data_ptr(): m.weight for _, _, m in _cpu_linears(module, dtype)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def _fits(module: nn.Module, dtype: torch.dtype, memory_fraction: float | None,
          what: str) -> bool:
    """Whether a packed copy of the `dtype` linears takes at most `memory_fraction` of the
    memory available now (None: no limit); logs why not."""
    if memory_fraction is None:
        return True
    avail, need = available_memory_bytes(), packable_bytes(module, dtype)
    if avail is not None and need > memory_fraction * avail:
        log.info("%s not packed: a packed copy (%.1f GB) would take over %.0f %% of the free "
                 "memory (%.1f GB)", what, need / 1e9, 100 * memory_fraction, avail / 1e9)
        return False
    return True


def pack_linears(module: nn.Module, memory_fraction: float | None = None) -> int:
    """Swap every plain nn.Linear under `module` whose weight is bf16 on the CPU for a
    PackedLinear sharing its parameters. Idempotent; returns how many were swapped.
    `memory_fraction`: pack only if the packed copies take at most this share of the memory
    available now (a large target on the CPU would otherwise double its weights' memory)."""
    if not packing_available() or not _fits(module, torch.bfloat16, memory_fraction,
                                            "linears"):
        return 0
    swapped = 0
    for parent, name, child in _cpu_linears(module, torch.bfloat16):
        if type(child) in _PLAIN:
            setattr(parent, name, PackedLinear(child))
            swapped += 1
    return swapped


def pack_fp32_rows(module: nn.Module, rows: int | None,
                   memory_fraction: float | None = 0.25) -> int:
    """Serve `module`'s CPU fp32 linears' GEMMs of `rows` rows from MKL-packed copies,
    packed now, swapping plain nn.Linears for PackedLinears first. The copies of the last
    FP32_COPIES counts are kept; None (or too little memory for a new copy: it costs the
    linear weights' bytes once more, made only within `memory_fraction` of the memory
    available now) drops them all. Returns how many linears serve `rows`."""
    if rows is not None and not mkl_packing_available():
        rows = None
    if rows is not None and not _has_fp32_copy(module, rows) and not _fits(
            module, torch.float32, memory_fraction, f"fp32 linears for {rows} rows"):
        rows = None
    served = 0
    for parent, name, child in _cpu_linears(module, torch.float32):
        if rows is not None and type(child) in _PLAIN:
            child = PackedLinear(child)
            setattr(parent, name, child)
        if isinstance(child, PackedLinear):
            child.set_fp32_rows(rows)
            served += rows is not None
    return served


def _has_fp32_copy(module: nn.Module, rows: int) -> bool:
    """Whether `module`'s packed fp32 linears already keep a copy for `rows` rows."""
    packed = [c for _, _, c in _cpu_linears(module, torch.float32) if isinstance(c, PackedLinear)]
    return bool(packed) and all(rows in c._mkl for c in packed)
