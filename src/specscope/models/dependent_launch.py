"""Programmatic dependent launch (PDL) for the Triton kernels of a step, on Hopper and later.

A batch-1 decode step of an 8B model is ~260 kernels of a few microseconds each, and
without PDL each one's programs start only after the kernel before it has finished and
its writes are flushed: every boundary idles the SMs through a launch and a ramp-up. With
PDL (the launch attribute "programmatic stream serialization", which a CUDA graph keeps as
a programmatic edge) a kernel's programs are scheduled once every program of the kernel
before has signalled (`release`), do what does not depend on it (address arithmetic,
pulling their first weight lines into L2), then `wait` for it to finish before reading
anything it wrote.

The rules every kernel launched with `options` keeps, which make it safe:
- `wait` before loading anything an earlier kernel of the step may write and before any
  store (a kernel still running may be reading what we would overwrite);
- `release` only after `wait`, so at most one kernel runs ahead of the one that is
  finishing, and the chain back to the step's first kernel is complete;
- before `wait`, only what the kernel right before cannot be writing is read: weights (no
  kernel of a step writes them), and, in the attention kernels, the batch's layout (tile
  plan, visible lengths, block tables), built before the forward's first layer; a kernel
  whose launch wrapper has just built part of it reads that after its `wait`.
Kernels launched without the attribute (torch's, cuBLAS, the CPU) are ordered by the
stream as always. SPECSCOPE_PDL=0 turns the attribute off (the kernels then run as before:
`wait` and `release` are no-ops without it); SPECSCOPE_PDL_PREFETCH sets how many columns
of each weight row the few-row linear pulls into L2 before its wait (0: none).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: every launch plain
    gdc_launch_dependents = gdc_wait = None

ENV = "SPECSCOPE_PDL"
PREFETCH_ENV = "SPECSCOPE_PDL_PREFETCH"
# Launches of more tokens than this run without PDL (see `options`).
MAX_ROWS = 256
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _supported(index: int) -> bool:
    """Whether device `index` takes dependent launches: compute capability 9.0 or later
    (host-side property, cached)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: CUDA on Hopper or later, compiled
    (not Triton's interpreter) by a Triton with grid dependency control, not turned off by
    SPECSCOPE_PDL=0."""
    return (t.is_cuda and not _INTERPRET and gdc_wait is not None
            and os.environ.get(ENV, "1") != "0"
            and _supported(t.device.index if t.device.index is not None
                           else torch.cuda.current_device()))


def options(t: torch.Tensor, rows: int) -> dict:
    """Launch keyword arguments for a kernel of this module's rules on t's device serving
    `rows` tokens: PDL's constexpr flag and, where enabled, Triton's launch attribute. Only
    launches of at most MAX_ROWS tokens (decode steps, verifies, draft steps) launch
    dependently: a prefill's kernels are long, and there a dependent launch only crowds the
    kernel before (an H100's 16k-token prefill took 591 ms with it against 580)."""
    on = rows <= MAX_ROWS and enabled(t)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def prefetch_columns(k: int) -> int:
    """Columns of each weight row the few-row linear pulls into L2 before its wait: a
    power of two of whole 128-byte lines (64 16-bit values), at most k; 0 for none."""
    want = int(os.environ.get(PREFETCH_ENV, "512"))
    cols = 64
    while cols * 2 <= min(want, k):
        cols *= 2
    return cols if want >= 64 and k >= 64 else 0


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before has finished and its writes are visible (PDL only)."""
    if PDL:
        gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel's programs be scheduled (PDL only); call after `wait`."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (any shape); nothing is loaded into
    registers and nothing is waited for. Only for addresses inside an allocation."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["ENV", "MAX_ROWS", "PREFETCH_ENV", "enabled", "options", "prefetch_columns",
           "prefetch_l2", "release", "wait"]
