"""The MoE experts' execution, three ways with one contract: x [N, H], each token's expert
ids and weights [N, k], the stacked experts gate_up [E, 2I, H] and down [E, H, I] ->
[N, H] = sum_j w_j * expert_{id_j}(x).

- `experts_looped`: each expert over the tokens routed to it (the CPU path, and the
  reference the others are tested against);
- `experts_dense`: every expert over every token, masked by the routing weights (static
  shapes, no host read; CUDA's fallback without Triton);
- `experts_grouped` (models/moe_triton.py, CUDA): token-expert pairs sorted by expert into
  block-padded segments of a static-size buffer, one grouped GEMM each for gate_up and
  down in Triton: static shapes, no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

# (slots [N], first, end): token n is real (not CUDA-graph padding) where slots[n] is
# outside [first, end) (ForwardContext.live_slots).
LiveSlots = tuple[torch.Tensor, int, int]


def live_mask(live: LiveSlots | None) -> torch.Tensor | None:
    """[N] bool: the real tokens of `live` (None: every token)."""
    if live is None:
        return None
    slots, first, end = live
    return (slots < first) | (slots >= end)


def expert_counts(ids: torch.Tensor, num_experts: int,
                  live: torch.Tensor | None = None) -> torch.Tensor:
    """Token-expert pairs per expert [E] int64 from ids [N, k] (only tokens where live [N]
    is True). A scatter-add, not bincount: bincount sizes its output from the data, a host
    sync on CUDA."""
    ones = torch.ones_like(ids) if live is None else live[:, None].expand_as(ids).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(0, ids.reshape(-1), ones.reshape(-1))


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: x [n, H], gate_up [2I, H] (gate rows then up rows), down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_looped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The per-expert path (CPU, and the tests' reference): each expert runs on the tokens
    routed to it, weighted, summed per token in expert order.

    x [N, H], ids/weights [N, k], gate_up [E, 2I, H], down [E, H, I] -> [N, H]. Reads the
    per-expert counts to the host to slice the sorted pairs: on the CPU the host is the
    device, so that costs nothing; CUDA runs the grouped kernel instead.
    """
    N, k = ids.shape
    E = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order within
    counts = expert_counts(ids, E).tolist()
    out = torch.zeros_like(x)
    w = weights.reshape(-1)
    start = 0
    for e, c in enumerate(counts):
        if c:
            pairs = order[start:start + c]
            tok = pairs // k
            y = expert_mlp(x[tok], gate_up[e], down[e]) * w[pairs, None]
            out.index_add_(0, tok, y.to(out.dtype))
        start += c
    return out


def experts_dense(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, each output scaled by the token's routing weight for
    that expert (0 where not picked): E times the work, but static shapes and no host read
    at all. The oracle the dispatch is tested against; CUDA's fallback without Triton."""
    E = gate_up.shape[0]
    dense = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, ids, weights)  # [N, E]
    out = torch.zeros_like(x)
    for e in range(E):
        out += (expert_mlp(x, gate_up[e], down[e]) * dense[:, e:e + 1]).to(out.dtype)
    return out


@cache
def _grouped_backend():
    """The Triton grouped expert GEMM (models/moe_triton.py), or None without Triton."""
    try:
        from specscope.models.moe_triton import experts_grouped
    except ImportError:
        return None
    return experts_grouped


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output [N, H] (plus residual [N, H], added to the output rounded to
    x's dtype): the Triton grouped GEMM on CUDA, else the looped path."""
    if x.is_cuda:
        fast = _grouped_backend()
        if fast is not None:
            return fast(x, ids, weights, gate_up, down, residual)
        out = experts_dense(x, ids, weights, gate_up, down)
    else:
        out = experts_looped(x, ids, weights, gate_up, down)
    return out if residual is None else residual + out


