"""Mixtral (MixtralForCausalLM): Mistral's attention with every MLP a sparse MoE of
num_local_experts SwiGLU experts, top num_experts_per_tok by softmax, renormalised.

HF checkpoints name a layer's MoE `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up, down); models/moe.py MoeCausalLM
maps them (or the fused in-memory form) onto the stacked experts.
"""

from __future__ import annotations

from typing import Any

from specscope.config import ModelConfig, MoEConfig, hf_common_fields, hf_need
from specscope.models.moe import MoeCausalLM, hf_check_activation
from specscope.models.registry import Family


def parse(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """A Mixtral config.json -> ModelConfig (unsupported values fail naming the field)."""
    hf_check_activation(cfg, name)
    common = hf_common_fields(cfg, name)
    width = int(hf_need(cfg, "intermediate_size", name))
    moe = MoEConfig(
        num_experts=int(hf_need(cfg, "num_local_experts", name)),
        top_k=int(hf_need(cfg, "num_experts_per_tok", name)),
        expert_intermediate_size=width,
        sparse_layers=(True,) * common["num_layers"],
        scoring="softmax", norm_topk_prob=True)  # HF Mixtral always renormalises the k
    sliding = cfg.get("sliding_window")
    return ModelConfig(architecture="MixtralForCausalLM", family="mixtral",
                       intermediate_size=width, sliding_window=int(sliding) if sliding else None,
                       moe=moe, **common)


class Mixtral(MoeCausalLM):
    hf_moe_prefix = "block_sparse_moe."
    hf_expert_names = ("w1", "w3", "w2")


FAMILIES = (Family("mixtral", ("MixtralForCausalLM",), {"mixtral": "MixtralForCausalLM"},
                   parse, Mixtral, tensor_parallel=True),)
