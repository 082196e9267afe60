"""Which slice of each weight a rank holds, and how it is read from a full tensor.

A sharded parameter has a `Shard`: the dimension it is split along and the pieces of the
global index range along it that this rank holds, each landing at a local offset. A fused
projection is several pieces (qkv: this rank's q rows, k rows and v rows; gate_up: its gate
rows and up rows), so the one rule serves every layout. A parameter without a Shard is
replicated. Modules declare their shards in a `shards` dict (parameter name within the
module -> Shard); `param_shards` collects them under full names.

`shard_reads` turns a checkpoint placement (models/registry.py Placement: leading indices,
then the first row) into the (source index, destination index) pairs to copy: the loader
reads exactly those slices from the safetensors file (`get_slice`), so a rank never reads a
tensor or a row it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Piece = tuple[int, int, int]  # (global start, global stop, local start) along Shard.dim
Index = tuple[slice | int, ...]


@dataclass(frozen=True)
class Shard:
    dim: int
    pieces: tuple[Piece, ...]

    @property
    def local_size(self) -> int:
        return max(lo + b - a for a, b, lo in self.pieces)


def even_split(size: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank's equal share of size items; an error naming `what` if the
    items do not split evenly."""
    if size % world:
        raise ValueError(f"tensor parallelism over {world} ranks needs {what} ({size}) to be "
                         f"a multiple of {world}")
    n = size // world
    return rank * n, (rank + 1) * n


def vocab_split(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """A vocab-parallel rank's rows: [start, stop) and the padded rows every rank holds
    (ceil(V / world): the last rank's tail is padding, masked in the embedding and cut off
    the gathered logits)."""
    per = -(-vocab // world)
    start = min(rank * per, vocab)
    return start, min(start + per, vocab), per


def kv_heads_split(num_heads: int, num_kv_heads: int, rank: int, world: int
                   ) -> tuple[int, int]:
    """[start, stop) of the KV heads rank holds. With at least as many KV heads as ranks
    each holds its share; with fewer, world / num_kv_heads ranks hold a copy of one (the KV
    head of their query heads: query head j reads KV head j // (H / Hkv))."""
    if num_kv_heads >= world:
        return even_split(num_kv_heads, rank, world, "num_key_value_heads")
    if world % num_kv_heads:
        raise ValueError(f"tensor parallelism over {world} ranks with {num_kv_heads} KV heads "
                         f"needs the ranks to be a multiple of the KV heads (each KV head is "
                         f"replicated on world / num_kv_heads ranks)")
    head = rank * num_kv_heads // world
    return head, head + 1


def attention_pieces(num_heads: int, num_kv_heads: int, head_dim: int, rank: int,
                     world: int) -> tuple[int, int, Shard, Shard]:
    """This rank's query and KV head counts, the fused qkv rows' Shard (dim 0) and the
    output projection's (dim 1): [q | k | v] rows of its heads, packed the same way."""
    q0, q1 = even_split(num_heads, rank, world, "num_attention_heads")
    k0, k1 = kv_heads_split(num_heads, num_kv_heads, rank, world)
    D, H, Hkv = head_dim, num_heads, num_kv_heads
    hq, hk = q1 - q0, k1 - k0
    qkv = Shard(0, ((q0 * D, q1 * D, 0),
                    (H * D + k0 * D, H * D + k1 * D, hq * D),
                    ((H + Hkv) * D + k0 * D, (H + Hkv) * D + k1 * D, (hq + hk) * D)))
    return hq, hk, qkv, Shard(1, ((q0 * D, q1 * D, 0),))


def gated_mlp_pieces(intermediate: int, rank: int, world: int) -> tuple[int, Shard, Shard]:
    """This rank's MLP width, the fused gate_up rows' Shard (its gate rows, then its up
    rows) and down_proj's (dim 1)."""
    a, b = even_split(intermediate, rank, world, "intermediate_size")
    n, i = b - a, intermediate
    return n, Shard(0, ((a, b, 0), (i + a, i + b, n))), Shard(1, ((a, b, 0),))


def param_shards(module: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter of `module` under its full name."""
    out = {}
    for prefix, m in module.named_modules():
        for name, shard in getattr(m, "shards", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out


def shard_reads(row: int | tuple[int, ...], shape: tuple[int, ...], shard: Shard | None
                ) -> list[tuple[Index, Index]]:
    """(index into the checkpoint tensor, index into the local parameter) pairs that copy
    what this rank holds of a tensor of `shape` placed at `row` (models/registry.py
    Placement: leading indices, then the first row). Empty: the rank holds none of it."""
    lead = row[:-1] if isinstance(row, tuple) else ()
    r0 = row[-1] if isinstance(row, tuple) else row
    full = tuple(slice(None) for _ in shape)
    rows = slice(r0, r0 + shape[0])
    if shard is None:
        return [(full, (*lead, rows))]
    d, L = shard.dim, len(lead)
    if d < L:  # split over a leading index (an expert): held whole or not at all
        local = [lo + lead[d] - a for a, b, lo in shard.pieces if a <= lead[d] < b]
        if not local:
            return []
        return [(full, (*lead[:d], local[0], *lead[d + 1:], rows))]
    out = []
    for a, b, lo in shard.pieces:
        if d == L:  # split along the rows the tensor lands in
            s, e = max(a, r0), min(b, r0 + shape[0])
            if s < e:
                out.append(((slice(s - r0, e - r0), *full[1:]),
                            (*lead, slice(lo + s - a, lo + e - a))))
        else:  # split along one of the tensor's own later dims
            j = d - L
            src = full[:j] + (slice(a, b),) + full[j + 1:]
            dst = (*lead, rows) + full[1:j] + (slice(lo, lo + b - a),) + full[j + 1:]
            out.append((src, dst))
    return out


def copy_from_full(full: nn.Module, local: nn.Module) -> None:
    """Fill a sharded module from the unsharded one of the same architecture (same
    parameter names): the slices each Shard names, everything else whole."""
    shards = param_shards(local)
    src = dict(full.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in local.named_parameters(remove_duplicate=False):
            w = src[name]
            for s, d in shard_reads(0, tuple(w.shape), shards.get(name)):
                p[d].copy_(w[s])
        bufs = dict(full.named_buffers())
        for name, b in local.named_buffers():
            if name in bufs and bufs[name].shape == b.shape:
                b.copy_(bufs[name])
