"""Mixture-of-Experts: the router, the expert execution and the sparse MLP block.

Every MoE family (models/mixtral.py, models/qwen_moe.py, the DeepSeek family) builds its
sparse layers from `SparseMoe`, configured by a `MoEConfig` (config.py). The pieces:

- `route`: router logits [N, E] -> top-k expert ids [N, k] and weights [N, k]. A pure
  batch-first function covering every MoEConfig routing field: softmax or sigmoid scores,
  DeepSeek-V3's grouped top-k and correction bias, renormalisation, scaling. On CUDA the
  router runs its Triton form instead (models/moe_route_triton.py: `router_fused`, the
  logits, the routing and the expert count in one launch, up to 16 tokens; `route_fused`
  on F.linear's logits past that; both tested against route).
- the experts' execution, three ways with one contract (x [N, H], ids, weights -> [N, H]):
  `experts_looped` (the CPU path and the tests' reference: each expert over the tokens
  routed to it), `experts_dense` (every expert over every token, masked by the routing
  weights: static shapes and no host read, the oracle for the dispatch), and on CUDA the
  sorted, block-padded grouped GEMM in Triton (models/moe_triton.py), static in shape and
  free of host syncs so a step stays one CUDA graph and one device->host read.
- `SparseMoe`: router + stacked experts (gate_up [E, 2I, H], down [E, H, I]) + optional
  shared expert (with Qwen2-MoE's sigmoid gate); it records how many distinct experts it
  activated in the last forward on the device (`active`), for the profiler.

See docs/moe.md.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from specscope.config import ModelConfig, MoEConfig
from specscope.models.llama import MLP, CausalLM, ForwardContext, mlp_layout
from specscope.models.moe_experts import LiveSlots, expert_counts, live_mask, run_experts
from specscope.parallel.group import TPGroup
from specscope.parallel.shard import Shard, gated_mlp_pieces

# -- routing ------------------------------------------------------------------------------


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row of x [N, C], best first; equal values in
    ascending index order. A stable descending sort gives this on every device, where
    torch.topk's order among ties is unspecified (and differs between CPU and CUDA)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts. logits [N, E] -> ids [N, k] int64, weights [N, k] fp32.

    scores = softmax(logits) or sigmoid(logits), in fp32. Selection ranks `choice` = scores
    + bias (DeepSeek-V3's e_score_correction_bias: it balances the load by steering which
    experts are picked, so it is used for the choice only, never in the weights). With
    n_group > 1 the E experts form n_group consecutive groups; a group's score is the sum of
    its two best choice scores; only the topk_group best groups' experts are eligible.
    The top_k eligible experts by choice are picked, best first; their weights are their
    scores, divided by the k scores' sum when norm_topk_prob, times routed_scaling_factor.

    Ties (equal choice or group scores) go to the lower expert / group id, on every device,
    so routing is reproducible token for token. No host reads, static shapes.
    """
    N, E = logits.shape
    k = moe.top_k
    scores = logits.float().softmax(-1) if moe.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()  # [N, E]
    if moe.n_group > 1:
        G = moe.n_group
        per = E // G
        grouped = choice.view(N, G, per)
        # Values only: which of two equal members is "the" top-2 does not change their sum.
        group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros(N, G, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, _top(group_score, moe.topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = _top(choice, k)  # [N, k]
    weights = scores.gather(1, ids)  # [N, k]
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # sigmoid sums may be ~0
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return ids, weights


@cache
def _route_backend():
    """models/moe_route_triton (the fused Triton router and routing), or None without
    Triton. Cached: the import is tried once, not per layer per step."""
    try:
        from specscope.models import moe_route_triton
    except ImportError:
        return None
    return moe_route_triton


# -- the block ----------------------------------------------------------------------------


class Router(nn.Module):
    """HF's `gate`: the router's weight [E, H] and DeepSeek-V3's correction bias [E]."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        # A parameter, not a buffer, so the strict loader's table covers it like any weight.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts))
                                        if moe.correction_bias else None)
        # router_fused's count of its finished programs: zero between launches.
        self.register_buffer("ticket", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor, active: torch.Tensor | None = None,
                live: LiveSlots | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> ids [N, k], weights [N, k] fp32. active (a 0-d int64, or None): also
        set to how many distinct experts the real tokens (`live`, None: all) picked.

        Logits in fp32 whatever the model dtype: near-equal experts are ranked on exact
        scores (DeepSeek-V3's reference does the same; bf16 logits would flip close
        choices). On CUDA with Triton, up to 16 tokens (decode, verify) take one launch for
        the logits (the 16-bit products are exact in fp32, summed in fp32), the routing
        and the count (router_fused); more tokens take F.linear's fp32 logits and one
        routing launch (route_fused) in place of route()'s ~20 small kernels."""
        fused = _route_backend() if x.is_cuda else None
        bias = self.e_score_correction_bias
        if fused is not None and fused.router_fits(x, self.weight):
            return fused.router_fused(x, self.weight, self.moe, self.ticket, bias, active, live)
        logits = F.linear(x.float(), self.weight.float())  # [N, E]
        if fused is not None:
            return fused.route_fused(logits, self.moe, bias, active, live)
        ids, weights = route(logits, self.moe, bias)
        if active is not None:  # in place: a CUDA graph's replay updates what the engine reads
            counts = expert_counts(ids, self.moe.num_experts, live_mask(live))
            active.copy_((counts > 0).sum())
        return ids, weights


class Experts(nn.Module):
    """E stacked SwiGLU experts: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I], the layout transformers uses in memory (checkpoints store them
    per expert: the family's checkpoint layout places each into its expert's slice).

    Under tensor parallelism every rank holds every expert's slice of the width I (its gate
    and up rows, its down columns: the dense MLP's split, per expert), so each rank's
    output is a partial sum the MoE block all-reduces (docs/tensor-parallel.md says why
    this and not expert parallelism)."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        E, i = moe.num_experts, moe.expert_intermediate_size
        if tp is not None:
            i, gate_up, down = gated_mlp_pieces(i, tp.rank, tp.size)
            # The same pieces one dimension further in (dim 0 is the expert).
            self.shards = {"gate_up_proj": Shard(1, gate_up.pieces),
                           "down_proj": Shard(2, down.pieces)}
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(E, hidden, i))


class SparseMoe(nn.Module):
    """A sparse MoE MLP: route each token to top_k of E experts, add the shared expert.

    out = sum_j w_j * expert_{id_j}(x) + [sigmoid(shared_expert_gate(x)) *] shared(x).
    Takes the decoder layer's ForwardContext (`takes_context`) only to know which tokens are
    CUDA-graph padding, so `active` (distinct experts the last forward's real tokens
    activated, a 0-d int64 on the device: never read here) counts real tokens only.
    """

    takes_context = True

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.moe = moe = moe or cfg.moe
        self.tp = tp  # the router is replicated: every rank routes every token the same
        h = cfg.hidden_size
        self.gate = Router(h, moe)
        self.experts = Experts(h, moe, tp)
        self.shared_expert = (MLP(cfg, moe.shared_intermediate_size, tp)
                              if moe.num_shared_experts else None)
        self.shared_expert_gate = (nn.Linear(h, 1, bias=False)
                                   if moe.shared_expert_gate else None)
        self.register_buffer("active", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; residual [..., H]: residual + the block's output, the
        add inside the experts' last kernel when nothing else joins their sum (no shared
        expert, no tensor parallelism), else after."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        ids, weights = self.gate(flat, self.active,
                                 None if ctx is None else ctx.live_slots())  # [N, k] each
        inside = residual is not None and self.shared_expert is None and self.tp is None
        out = run_experts(flat, ids, weights, self.experts.gate_up_proj,
                          self.experts.down_proj,
                          residual.reshape(flat.shape) if inside else None)
        if self.shared_expert is not None:
            # Under tensor parallelism the shared expert's partial sum joins the experts'
            # (the gate scales each token's sum, so it may scale the parts): one all-reduce.
            shared = self.shared_expert(flat) if self.tp is None else \
                self.shared_expert.partial(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if residual is not None and not inside:
            out = residual.reshape(flat.shape) + out
        return out.view(shape)


def moe_layout(m: str, *, hidden: int, moe: MoEConfig, router: str = "gate.",
               expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
               shared: str = "shared_expert.", hf: str | None = None, fused: bool = False
               ) -> dict[str, tuple[str, int | tuple[int, ...], tuple[int, ...]]]:
    """A SparseMoe's checkpoint layout: HF names under `hf` (default m) onto our parameters
    under m. Per-expert tensors `experts.{e}.{gate,up,down}` (names in `expert`: Mixtral's
    w1, w3, w2) land in expert e's rows of the stacked parameters ((expert, row)
    placements); the router under `router`; the shared expert (HF prefix `shared`, e.g.
    DeepSeek's "shared_experts.") onto our shared_expert; its gate onto shared_expert_gate.
    fused: the experts as transformers holds them in memory (and writes them with
    save_pretrained(save_original_format=False)): experts.gate_up_proj [E, 2I, H] and
    experts.down_proj [E, H, I], each one tensor.
    """
    src = hf if hf is not None else m
    E, i, h = moe.num_experts, moe.expert_intermediate_size, hidden
    g, u, d = expert
    out: dict[str, tuple[str, int | tuple[int, ...], tuple[int, ...]]] = {
        src + router + "weight": (m + "gate.weight", 0, (E, h))}
    if moe.correction_bias:
        out[src + router + "e_score_correction_bias"] = (
            m + "gate.e_score_correction_bias", 0, (E,))
    if fused:
        out[src + "experts.gate_up_proj"] = (m + "experts.gate_up_proj", 0, (E, 2 * i, h))
        out[src + "experts.down_proj"] = (m + "experts.down_proj", 0, (E, h, i))
    for e in range(0 if fused else E):
        p = f"{src}experts.{e}."
        out[p + f"{g}.weight"] = (m + "experts.gate_up_proj", (e, 0), (i, h))
        out[p + f"{u}.weight"] = (m + "experts.gate_up_proj", (e, i), (i, h))
        out[p + f"{d}.weight"] = (m + "experts.down_proj", (e, 0), (h, i))
    if moe.num_shared_experts:
        out.update(mlp_layout(m + "shared_expert.", hidden=h,
                              intermediate=moe.shared_intermediate_size, hf=src + shared))
    if moe.shared_expert_gate:
        out[src + "shared_expert_gate.weight"] = (m + "shared_expert_gate.weight", 0, (1, h))
    return out


class MoeCausalLM(CausalLM):
    """The base of the MoE families: decoder layer i's MLP is a SparseMoe where
    cfg.moe.sparse_layers[i], else the dense MLP of cfg.intermediate_size.

    Checkpoints hold a sparse layer's experts one tensor per expert (the hub's, and what
    transformers' save_pretrained writes) or fused as transformers holds them in memory
    (save_original_format=False); `checkpoint_layout_for` picks per layer the form the
    checkpoint has, so loading stays strict either way.
    """

    # HF names of a sparse layer's MLP under "model.layers.{n}.", and of an expert's
    # gate, up and down matrices (Mixtral: "block_sparse_moe.", ("w1", "w3", "w2")).
    hf_moe_prefix = "mlp."
    hf_expert_names = ("gate_proj", "up_proj", "down_proj")

    def mlp_for(self, layer: int) -> nn.Module:
        if self.config.moe.sparse_layers[layer]:
            return SparseMoe(self.config, tp=self.tp)
        return MLP(self.config, tp=self.tp)

    def layer_layout(self, n: int, fused: bool = False
                     ) -> dict[str, tuple[str, int | tuple[int, ...], tuple[int, ...]]]:
        out = super().layer_layout(n)
        if not self.config.moe.sparse_layers[n]:
            return out
        p = f"model.layers.{n}."
        out = {k: v for k, v in out.items() if not k.startswith(p + "mlp.")}
        # The fused form uses transformers' module names, which are ours ("mlp.").
        hf = p + ("mlp." if fused else self.hf_moe_prefix)
        out.update(moe_layout(p + "mlp.", hidden=self.config.hidden_size,
                              moe=self.config.moe, expert=self.hf_expert_names, hf=hf,
                              fused=fused))
        return out

    def checkpoint_layout_for(self, names: set[str]
                              ) -> dict[str, tuple[str, int | tuple[int, ...], tuple]]:
        out = self.checkpoint_layout()
        for n, sparse in enumerate(self.config.moe.sparse_layers):
            if sparse and f"model.layers.{n}.mlp.experts.gate_up_proj" in names:
                for k in self.layer_layout(n):
                    del out[k]
                out.update(self.layer_layout(n, fused=True))
        return out

    def moe_blocks(self) -> list[SparseMoe]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]

    def expert_activity(self) -> torch.Tensor:
        """Distinct experts each sparse layer activated in the last forward [L_moe] int64,
        on the device (read with the engine's step read, never here)."""
        return torch.stack([b.active for b in self.moe_blocks()])


# -- reading HF configs -------------------------------------------------------------------


def hf_check_activation(cfg: dict, name: str = "") -> None:
    """The experts are SwiGLU: any other hidden_act fails at load, naming the field."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name or 'config.json'}: unsupported hidden_act {act!r} (field "
                         f"hidden_act); the MoE families support silu")


def hf_sparse_layers(cfg: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-MoE's rule for which layers are sparse: not in mlp_only_layers, and every
    decoder_sparse_step-th layer (1-based), when there are experts at all."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                 for i in range(num_layers))
