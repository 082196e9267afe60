"""Run a GGUF's quantised weights natively on the CPU, as llama.cpp computes them.

A GGUF Q4_1 block holds 32 weights as 4-bit codes q with an fp16 scale d and min m:
w = d * q + m; Q4_0 has no min (w = d * (q - 8), here m = -8 d); Q8_0 holds signed 8-bit codes
(w = d * q), as the default model's output matrix. The codes are kept as they are, in the
tiled layout of native/quant_kernels.c, and each product quantises its activations to 8
bits per block of 32 (llama.cpp's Q8 activations) and sums the codes' products in integers:
a 6-token verify costs ~2.5-3x one token's product instead of fp32's ~3x (docs/cpu.md), and
a decode step streams ~4.5-8.5 bits a weight instead of 16 or 32.

GgufLinear.reference is the torch form of the same arithmetic (the C kernels' scalar loop is
their bit-equal reference); it runs where the native library is not built.

Linears whose GGUF tensors are not Q4_0/Q4_1 stay dense; the lm_head runs its GGUF codes when
they are Q8_0, Q4_0 or Q4_1 (the embedding lookup keeps dense rows). A draft beside such a
target has no GGUF: quantize_q8_0 makes Q8_0 codes of its dense linears at load, as llama.cpp's
quantizer does (its proposals may change slightly; the output cannot, the target verifies).
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
TILE = 8  # weight rows a tile of quant_kernels.c's layout holds: 8, or WIDE_TILE (default_tile)
WIDE_TILE = 16
QUANT_MODES = ("none", "int4-gguf")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def default_tile() -> int:
    """Rows a tile of the weights' layout, 4- and 8-bit codes alike: WIDE_TILE where the
    native library runs 16-row tiles in 512-bit vectors (AVX-512 VNNI: fewer instructions a
    product of several rows, native/quant_kernels.c), else TILE. The layout lives in memory
    only; nothing stores it."""
    from specscope import native

    kernels = native.cpu_kernels()
    return WIDE_TILE if kernels is not None and kernels.wide else TILE


def tile_codes(q: np.ndarray, bits: int, tile: int = TILE) -> np.ndarray:
    """Codes [N, K] (N a multiple of `tile`) in quant_kernels.c's layout: per tile of `tile`
    rows and block of 32 inputs, 8 groups of 4 inputs as `tile` rows x 4 codes; 4-bit codes
    pack group g (low nibble) with group g + 4 (high), 8-bit codes q (-128..127) are stored
    as q + 128. uint8, flat."""
    N, K = q.shape
    if bits == 8:
        q = (q.astype(np.int16) + 128).astype(np.uint8)
    x = q.reshape(N // tile, tile, K // GROUP, 8, 4).transpose(0, 2, 3, 1, 4)
    if bits == 4:
        x = x[:, :, 0:4].astype(np.uint8) | (x[:, :, 4:8].astype(np.uint8) << 4)
    return np.ascontiguousarray(x).view(np.uint8).reshape(-1)


def untile_codes(w: torch.Tensor, bits: int, N: int, K: int, tile: int = TILE) -> torch.Tensor:
    """tile_codes undone: [N, K] int32 codes (N padded to a multiple of `tile`)."""
    T, nb = N // tile, K // GROUP
    if bits == 4:
        x = w.view(T, nb, 4, tile, 4).to(torch.int32)
        x = torch.cat([x & 0x0F, x >> 4], dim=2)  # [T, nb, 8 groups, rows, 4]
    else:
        x = w.view(T, nb, 8, tile, 4).to(torch.int32) - 128
    return x.permute(0, 3, 1, 2, 4).reshape(N, K)


def tile_rows(v: np.ndarray, tile: int = TILE) -> np.ndarray:
    """Per-block values [N, K/32] as [N/tile, K/32, tile] fp32 (the layout's scales and
    offsets; their last dimension tells the kernels the tile)."""
    N, nb = v.shape
    return np.ascontiguousarray(v.reshape(N // tile, tile, nb).transpose(0, 2, 1),
                                dtype=np.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8-valued codes a [M, K/32, 32] (fp32), scales e and e * (block code
    sums) s [M, K/32]: quant_kernels.c's quantize_row in torch."""
    M, K = x.shape
    xb = x.float().reshape(M, K // GROUP, GROUP)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    a = torch.round(xb * inv[..., None]).clamp(-127, 127)
    e = amax / 127.0
    return a, e, e * a.sum(-1)


class GgufLinear(nn.Module):
    """y = x W^T (+ b) for W [N, K] as a GGUF's quantised blocks (w = d q + m per block of
    32), run against 8-bit activations (native/quant_kernels.c)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bits: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("codes", codes)  # uint8, tile_codes' layout
        self.register_buffer("scales", scales)  # [N/tile, K/32, tile] fp32
        self.register_buffer("offsets", offsets)  # the same, or None (no offsets)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.bits, self.in_features, self.out_features = bits, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specscope.native import cpu_kernels_for

        rows = x.reshape(-1, self.in_features)
        rows = rows if rows.is_contiguous() else rows.contiguous()
        kernels = cpu_kernels_for(rows)
        if kernels is not None:
            y = kernels.quant_linear(rows, self.codes, self.scales, self.offsets,
                                     self.out_features, self.bits)
        else:
            y = self.reference(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def greedy_ids(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float().argmax(-1) -> int64 [...], the same ids: with the native kernels,
        the product's rows picked in C."""
        from specscope.native import cpu_kernels_for

        y = self(x)
        kernels = cpu_kernels_for(y)
        return y.float().argmax(-1) if kernels is None else kernels.argmax_rows(y)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic in torch: x [M, K] -> [M, N] in x's dtype (the integer block
        sums exact, the per-block scaling summed in another order than the C loop)."""
        a, e, s = quantize_activations(x)
        q, d, m = self._blocks()
        isum = torch.einsum("mbi,nbi->mnb", a, q)  # integers below 2^24: exact in fp32
        y = (isum * (d[None] * e[:, None])).sum(-1)
        if m is not None:
            y = y + s @ m.T
        return y[:, :self.out_features].to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weights [N, K] fp32 (for code that reads a head's rows, such as a
        draft initialised from the target's lm_head): built on each access."""
        q, d, m = self._blocks()
        w = q * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(q.shape[0], -1)[:self.out_features]

    @property
    def tile(self) -> int:
        """Rows a tile of the codes' layout (8 or 16)."""
        return self.scales.shape[-1]

    def _blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layout undone: codes [N, K/32, 32] fp32, scales d and offsets m [N, K/32]
        (N padded to a whole tile; m None without offsets)."""
        N, K = self.scales.shape[0] * self.tile, self.in_features
        q = untile_codes(self.codes, self.bits, N, K, self.tile).float()
        q = q.reshape(N, K // GROUP, GROUP)
        d = self.scales.permute(0, 2, 1).reshape(N, -1)
        m = None if self.offsets is None else self.offsets.permute(0, 2, 1).reshape(N, -1)
        return q, d, m

    @staticmethod
    def from_codes(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, bits: int,
                   bias: torch.Tensor | None, tile: int | None = None) -> GgufLinear:
        """q [N, K] codes (0..15 at 4 bits, -127..127 at 8), d and m [N, K/32]: w = d q + m
        (m None: no offsets), in tiles of `tile` rows (default: default_tile()). Rows are
        padded to a whole tile with zero weights."""
        tile = tile or default_tile()
        N, K = q.shape
        pad = (-N) % tile
        if pad:
            q = np.concatenate([q, np.zeros((pad, K), q.dtype)])
            d = np.concatenate([d, np.zeros((pad, d.shape[1]), d.dtype)])
            m = None if m is None else np.concatenate([m, np.zeros((pad, m.shape[1]), m.dtype)])
        codes = tile_codes(q.astype(np.int8 if bits == 8 else np.uint8), bits, tile)
        offsets = None if m is None else torch.from_numpy(tile_rows(m, tile))
        return GgufLinear(torch.from_numpy(codes), torch.from_numpy(tile_rows(d, tile)), offsets,
                          bits, K, N, bias)


def gguf_codes(data: np.ndarray, qtype: str, rows: int,
               cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Decode raw Q4_0/Q4_1/Q8_0 blocks [rows, cols/32 * bytes] -> codes [rows, cols] and d,
    m [rows, cols/32] fp32 with w = d q + m: 4-bit codes 0..15 (Q4_0: m = -8 d), Q8_0's int8
    codes with m None."""
    nb = cols // GROUP
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, nb, BLOCK_BYTES[qtype])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if qtype == "Q8_0":
        return raw[..., 2:].copy().view(np.int8).reshape(rows, cols), d, None
    if qtype == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:]
    else:
        qs = raw[..., 2:]
        m = -8.0 * d
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, d, m


def _row_perm(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation (see gguf.reverse_permute)."""
    from specscope.models.gguf import reverse_permute

    return reverse_permute(np.arange(rows)[:, None], n_head)[:, 0]


def _gguf_linear(tensors: list, perms: list[np.ndarray | None],
                 bias: torch.Tensor | None) -> GgufLinear:
    """One GgufLinear from GGUF tensors of one code type stacked by rows (q/k/v, gate/up),
    each row-permuted where its perm says."""
    codes, scales, offsets = [], [], []
    for t, perm in zip(tensors, perms, strict=True):
        cols, rows = (int(d) for d in t.shape)  # GGUF dims are reversed
        q, d, m = gguf_codes(t.data, t.tensor_type.name, rows, cols)
        if perm is not None:
            q, d, m = q[perm], d[perm], None if m is None else m[perm]
        codes.append(q)
        scales.append(d)
        offsets.append(m)
    bits = 8 if tensors[0].tensor_type.name == "Q8_0" else 4
    m = None if offsets[0] is None else np.concatenate(offsets)
    return GgufLinear.from_codes(np.concatenate(codes), np.concatenate(scales), m, bits, bias)


def quantize_from_gguf(model: CausalLM, gguf_path: Path) -> int:
    """Swap dense linears of `model` for GgufLinear where the GGUF stores Q4_0/Q4_1 (layer
    linears) or Q4_0/Q4_1/Q8_0 (the output matrix, or the tied embedding it reads).

    Returns the number of linears swapped. The model must hold its weights on the CPU.
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
            if any(t is None or t.tensor_type.name not in ("Q4_0", "Q4_1") for t in ts) \
                    or len({t.tensor_type.name for t in ts}) > 1:
                continue
            perms = []
            for part, t in zip(parts, ts, strict=True):
                heads = cfg.num_heads if part.endswith("q_proj") else cfg.num_kv_heads
                perms.append(_row_perm(int(t.shape[1]), heads) if arch == "llama" and part in
                             ("self_attn.q_proj", "self_attn.k_proj") else None)
            dense: nn.Linear = getattr(parent, attr)
            bias = None if dense.bias is None else dense.bias.detach().clone()
            setattr(parent, attr, _gguf_linear(ts, perms, bias))
            swapped += 1
    head = tensors.get("lm_head.weight") or (tensors.get("model.embed_tokens.weight")
                                             if cfg.tie_word_embeddings else None)
    if head is not None and head.tensor_type.name in BLOCK_BYTES and model.lm_head.bias is None:
        model.lm_head = _gguf_linear([head], [None], None)  # the embedding keeps dense rows
        swapped += 1
    log.info("int4-gguf: %d linears run on the GGUF's quantised codes", swapped)
    return swapped


def q8_0_codes(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Dense weights [N, K] (K a multiple of 32) -> Q8_0 codes [N, K] int8 and scales
    [N, K/32] fp32, as llama.cpp quantizes: d = amax / 127 per block of 32, q = round(w / d)
    with d in fp32, then d stored as fp16."""
    N, K = w.shape
    wb = w.detach().float().reshape(N, K // GROUP, GROUP)
    d = wb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(wb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(N, K).numpy(), d.half().float().numpy()


def quantize_q8_0(module: nn.Module) -> int:
    """Swap every dense CPU nn.Linear under `module` whose input width is a multiple of 32
    for a GgufLinear of its Q8_0 codes (quantize_from_gguf's kernels, 8.5 bits a weight).
    Returns how many were swapped."""
    swapped = 0
    for child in list(module.modules()):
        for attr, lin in list(child.named_children()):
            if not isinstance(lin, nn.Linear) or lin.weight.device.type != "cpu" \
                    or lin.in_features % GROUP:
                continue
            q, d = q8_0_codes(lin.weight)
            bias = None if lin.bias is None else lin.bias.detach().clone()
            setattr(child, attr, GgufLinear.from_codes(q, d, None, 8, bias))
            swapped += 1
    if swapped:
        log.info("q8_0: %d linears run on Q8_0 codes made at load", swapped)
    return swapped
