"""The model's linear layer: nn.Linear, with products of at most 16 rows on CUDA (decode
steps, verifies, draft steps) run by the few-row Triton kernel (models/linear_triton.py)
and everything else by F.linear, the reference.

Same parameters and state_dict names as nn.Linear, so checkpoints load unchanged and the
CPU packers (models/packed.py) and quantizers (models/quant.py) treat it as one."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


@cache
def _backend():
    """models/linear_triton, or None without Triton (the import is tried once)."""
    try:
        from specscope.models import linear_triton
    except ImportError:
        return None
    return linear_triton


def hand_kernels_apply(x: torch.Tensor) -> bool:
    """Whether the hand-written Triton kernels (this linear, the fused layer kernels) may
    serve x: on CUDA, at inference (they have no backward), outside torch.compile's tracing
    (inductor fuses and picks GEMMs for the reference itself)."""
    return x.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear(x, weight, bias), through the few-row kernel where it applies (see
    hand_kernels_apply; 16-bit weights, at most 16 rows)."""
    fast = few_row_kernel(x)
    if fast is not None and fast.applies(x, weight):
        return fast.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  token_map: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x, weight, bias).float().argmax(-1) -> int64 [...], plus token_map[id] where
    given (a draft's d2t): where the few-row kernel applies, in one pass over the weight
    with no [rows, N] logits written (linear_triton.linear_argmax); else that reference."""
    fast = few_row_kernel(x)
    if fast is not None and fast.applies(x, weight):
        return fast.linear_argmax(x, weight, bias, token_map)
    ids = linear(x, weight, bias).float().argmax(-1)
    return ids if token_map is None else ids + token_map[ids]


def few_row_kernel(x: torch.Tensor):
    """models/linear_triton where its few-row product may take x (hand kernels apply, at
    most 16 rows on CUDA); the caller checks the weight (`applies`, `weight_fits`). Else
    None."""
    if not hand_kernels_apply(x):
        return None
    fast = _backend()
    return fast if fast is not None and fast.rows_fit(x) else None


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
