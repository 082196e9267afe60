"""Tensor-parallel modules: a row-parallel linear and the vocab-parallel embedding and head.

Column-parallel linears need no module of their own: a fused qkv or gate_up projection
holding only this rank's rows is a plain nn.Linear of fewer outputs whose activations stay
sharded (each rank computes its heads, or its slice of the MLP width); its `Shard` says
which rows it holds. Only where the shards meet again is there a collective:

- `RowParallelLinear` (o_proj, down_proj): each rank multiplies its slice of the input
  width; the partial sums are all-reduced, then the (replicated) bias is added once.
- `VocabParallelEmbedding`: each rank holds a contiguous block of vocabulary rows; a token
  outside it embeds to zero there, and the all-reduce sums the one rank that holds it.
- `ParallelLMHead`: each rank's logits over its vocabulary block, all-gathered (and the
  padding cut off) so that sampling sees the same full logits on every rank.

Parameter names are nn.Linear's and nn.Embedding's, so checkpoint layouts do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specscope.parallel.group import TPGroup
from specscope.parallel.shard import Shard, vocab_split


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's `in_features` columns of a linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 shard: Shard) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.shards = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, stop) of a [V, H] embedding, padded to ceil(V / size)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        start, stop, per = vocab_split(vocab_size, tp.rank, tp.size)
        super().__init__(per, dim)
        self.tp, self.start, self.stop, self.vocab_size = tp, start, stop, vocab_size
        self.shards = {"weight": Shard(0, ((start, stop, 0),))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)  # [B, T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[..., None], 0.0))

    def full_weight(self) -> torch.Tensor:
        """The whole [V, H] table, gathered (for a draft replicated on every rank)."""
        return gather_rows(self.weight, self.tp, self.vocab_size)


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the output head; forward returns the gathered logits
    over the whole vocabulary [..., V]."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup) -> None:
        start, stop, per = vocab_split(vocab_size, tp.rank, tp.size)
        super().__init__(dim, per, bias=False)
        self.tp, self.vocab_size = tp, vocab_size
        self.shards = {"weight": Shard(0, ((start, stop, 0),))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(x, self.weight))[..., :self.vocab_size]

    def full_weight(self) -> torch.Tensor:
        return gather_rows(self.weight, self.tp, self.vocab_size)


def gather_rows(w: torch.Tensor, tp: TPGroup, rows: int) -> torch.Tensor:
    """Every rank's row block of w concatenated, the padding cut: [rows, H]."""
    return tp.all_gather(w.detach().t().contiguous()).t()[:rows].contiguous()


def full_vocab_weight(module: nn.Module) -> torch.Tensor:
    """The whole vocabulary table of an embedding or a head, sharded or not."""
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return module.full_weight()
    return module.weight.detach()


def zero_padding(module: nn.Module) -> None:
    """Zero the padding rows of every vocab-parallel table (allocated uninitialised, and
    never loaded: garbage there could be inf or NaN, which masking does not remove from a
    matmul)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (VocabParallelEmbedding, ParallelLMHead)):
                real = m.shards["weight"].pieces[0]
                m.weight[real[1] - real[0]:].zero_()
