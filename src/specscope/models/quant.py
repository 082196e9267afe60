"""Run a GGUF's 4-bit weights natively on the CPU instead of dequantising them.

A GGUF Q4_1 block holds 32 weights as 4-bit codes q with an fp16 scale d and min m:
w = d * q + m. Q4_0 has no min: w = d * (q - 8). PyTorch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`, gpt-fast's "tinygemm" layout) computes with groups of 32
and w = (q - 8) * scale + zero, so both map exactly: scale = d, zero = m + 8d (Q4_1) or 0
(Q4_0). The codes are kept as they are; only scale and zero are rounded to bf16, the
kernel's activation dtype. Decode streams ~4.5 bits per weight instead of 32 (fp32) or 16.

Linears whose GGUF tensors are not Q4_0/Q4_1 (and the embedding / lm_head) stay dense.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specscope.models.llama import CausalLM

log = logging.getLogger("specscope.quant")

GROUP = 32
QUANT_MODES = ("none", "int4-gguf")


class Int4Linear(nn.Module):
    """y = x W^T (+ b), W [N, K] as packed 4-bit codes with a scale and zero per 32 inputs."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # uint8, kernel-specific layout
        self.register_buffer("scales_zeros", scales_zeros)  # [K/32, N, 2] bf16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                              self.scales_zeros)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    @staticmethod
    def from_codes(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype,
                   bias: torch.Tensor | None) -> Int4Linear:
        """q [N, K] codes 0..15, scale/zero [N, K/32] fp32: w = (q - 8) * scale + zero."""
        N, K = q.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(q.astype(np.int32)), 1)
        sz = torch.from_numpy(np.stack([scale.T, zero.T], axis=-1)).to(dtype).contiguous()
        return Int4Linear(packed, sz, K, N, bias)


def q4_codes(data: np.ndarray, qtype: str, rows: int,
             cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode raw Q4_0/Q4_1 blocks [rows, cols/32 * bytes] -> codes [rows, cols] uint8 and
    scale, zero [rows, cols/32] fp32 in the (q - 8) * scale + zero convention."""
    nb = cols // GROUP
    size = {"Q4_0": 18, "Q4_1": 20}[qtype]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, nb, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if qtype == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = raw[..., 2:]
        zero = np.zeros_like(d)
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, d, zero


def _row_perm(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation (see gguf.reverse_permute)."""
    from specscope.models.gguf import reverse_permute

    return reverse_permute(np.arange(rows)[:, None], n_head)[:, 0]


def quantize_from_gguf(model: CausalLM, gguf_path: Path) -> int:
    """Swap dense linears of `model` for Int4Linear where the GGUF stores Q4_0/Q4_1.

    Returns the number of linears swapped. The model must hold bf16 weights on the CPU.
    """
    import gguf as gguf_lib

    from specscope.models.gguf import hf_tensor_name

    cfg = model.config
    reader = gguf_lib.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    tensors = {hf_tensor_name(t.name): t for t in reader.tensors}
    swapped = 0
    for n, layer in enumerate(model.model.layers):
        p = f"model.layers.{n}."
        groups = {
            (layer.self_attn, "qkv_proj"): ["self_attn.q_proj", "self_attn.k_proj",
                                            "self_attn.v_proj"],
            (layer.self_attn, "o_proj"): ["self_attn.o_proj"],
            (layer.mlp, "gate_up_proj"): ["mlp.gate_proj", "mlp.up_proj"],
            (layer.mlp, "down_proj"): ["mlp.down_proj"],
        }
        for (parent, attr), parts in groups.items():
            ts = [tensors.get(p + part + ".weight") for part in parts]
            if any(t is None or t.tensor_type.name not in ("Q4_0", "Q4_1") for t in ts):
                continue
            codes, scales, zeros = [], [], []
            for part, t in zip(parts, ts, strict=True):
                cols, rows = (int(d) for d in t.shape)  # GGUF dims are reversed
                q, s, z = q4_codes(t.data, t.tensor_type.name, rows, cols)
                if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                    heads = cfg.num_heads if part.endswith("q_proj") else cfg.num_kv_heads
                    perm = _row_perm(rows, heads)
                    q, s, z = q[perm], s[perm], z[perm]
                codes.append(q)
                scales.append(s)
                zeros.append(z)
            dense: nn.Linear = getattr(parent, attr)
            bias = None if dense.bias is None else dense.bias.detach().clone()
            setattr(parent, attr, Int4Linear.from_codes(
                np.concatenate(codes), np.concatenate(scales), np.concatenate(zeros),
                torch.bfloat16, bias))
            swapped += 1
    log.info("int4-gguf: %d linears run on packed 4-bit GGUF codes", swapped)
    return swapped
