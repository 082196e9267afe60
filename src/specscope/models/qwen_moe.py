"""Qwen-MoE: Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3MoeForCausalLM
(Qwen3-30B-A3B, Qwen3-235B-A22B). The two share everything but data:

- attention: Qwen2-MoE biases q/k/v (`qkv_bias`, default true) and never o; Qwen3-MoE has
  per-head q/k RMSNorm, an explicit head_dim and `attention_bias` on q/k/v/o;
- MLP: layer i is sparse unless in `mlp_only_layers`, every `decoder_sparse_step`-th
  layer; num_experts experts of moe_intermediate_size, top num_experts_per_tok by softmax,
  renormalised when norm_topk_prob (HF default false); dense layers use
  intermediate_size;
- Qwen2-MoE adds a shared expert of shared_expert_intermediate_size, scaled per token by
  sigmoid(shared_expert_gate(x)).

HF names: `mlp.gate`, `mlp.experts.{e}.gate_proj / up_proj / down_proj`, `mlp.shared_expert`,
`mlp.shared_expert_gate`.
"""

from __future__ import annotations

from typing import Any

from specscope.config import ModelConfig, MoEConfig, hf_common_fields, hf_need
from specscope.models.moe import MoeCausalLM, hf_check_activation, hf_sparse_layers
from specscope.models.registry import Family


def _moe(cfg: dict[str, Any], name: str, num_layers: int, shared: bool) -> MoEConfig:
    # Qwen3-MoE's config class maps num_experts onto num_local_experts, and save_pretrained
    # writes that name; hub configs say num_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"config.json of {name or 'model'} lacks required field "
                         f"'num_experts'")
    shared_width = int(hf_need(cfg, "shared_expert_intermediate_size", name)) if shared else 0
    if shared and shared_width <= 0:
        raise ValueError(f"{name or 'config.json'}: shared_expert_intermediate_size must be "
                         f"positive, got {shared_width}")
    return MoEConfig(
        num_experts=int(experts), top_k=int(hf_need(cfg, "num_experts_per_tok", name)),
        expert_intermediate_size=int(hf_need(cfg, "moe_intermediate_size", name)),
        sparse_layers=hf_sparse_layers(cfg, num_layers, int(experts)),
        scoring="softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        num_shared_experts=1 if shared else 0, shared_intermediate_size=shared_width,
        shared_expert_gate=shared)


def parse_qwen2_moe(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    hf_check_activation(cfg, name)
    if cfg.get("use_sliding_window"):
        # HF alternates sliding and full layers below max_window_layers: not implemented.
        raise ValueError(f"{name or 'config.json'}: use_sliding_window true is not supported "
                         f"for Qwen2MoeForCausalLM (field use_sliding_window)")
    common = hf_common_fields(cfg, name)
    return ModelConfig(
        architecture="Qwen2MoeForCausalLM", family="qwen2_moe",
        intermediate_size=int(hf_need(cfg, "intermediate_size", name)),
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        moe=_moe(cfg, name, common["num_layers"], shared=True), **common)


def parse_qwen3_moe(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    hf_check_activation(cfg, name)
    common = hf_common_fields(cfg, name)
    bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", family="qwen3_moe",
        intermediate_size=int(hf_need(cfg, "intermediate_size", name)),
        qkv_bias=bias, o_bias=bias, qk_norm=True,
        sliding_window=int(sliding) if sliding else None,
        moe=_moe(cfg, name, common["num_layers"], shared=False), **common)


FAMILIES = (
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), {"qwen2_moe": "Qwen2MoeForCausalLM"},
           parse_qwen2_moe, MoeCausalLM, tensor_parallel=True),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), {"qwen3_moe": "Qwen3MoeForCausalLM"},
           parse_qwen3_moe, MoeCausalLM, tensor_parallel=True),
)
