"""DeepSeek-V3 and Kimi-K2 (`DeepseekV3ForCausalLM`; model_type deepseek_v3 or kimi_k2, and
multimodal wrappers such as Kimi-K2.5 whose text_config is one of these).

A Llama-shaped decoder (models/llama.py's CausalLM) with two replacements per layer:
- attention: multi-head latent attention (models/mla.py), its paged cache MLA's latent
  layout (kv_lora_rank + qk_rope_head_dim elements per token and layer, docs/mla.md);
- MLP: the first first_k_dense_replace layers a dense SwiGLU MLP, the rest a sparse MoE
  with shared experts and DeepSeek's router (sigmoid scores, e_score_correction_bias for the
  choice only, grouped top-k over n_group groups keeping topk_group, norm_topk_prob,
  routed_scaling_factor).

Rope: default or YaRN (beta_fast/beta_slow interpolation, mscale / mscale_all_dim), applied
to interleaved rotary pairs as HF does; the softmax scale gains mscale(factor,
mscale_all_dim)^2. Variants HF's DeepseekV3 modelling does not compute the same way (another
topk_method, moe_layer_freq != 1, a quantized checkpoint) fail at load naming the field.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specscope.config import MLAConfig, ModelConfig, MoEConfig, hf_common_fields, hf_need
from specscope.kvcache.budget import KVLayout
from specscope.kvcache.paged import PagedKV
from specscope.models.llama import mlp_layout
from specscope.models.mla import MLAttention
from specscope.models.moe import MoeCausalLM, hf_check_activation, moe_layout
from specscope.models.registry import Family
from specscope.models.rope import COMPUTED_ROPE_TYPES

ARCHITECTURE = "DeepseekV3ForCausalLM"
# noaux_tc: DeepSeek-V3's router (the correction bias steers the choice); greedy: the same
# routing with no bias. HF's DeepseekV3 modelling computes both this way and no other.
TOPK_METHODS = ("noaux_tc", "greedy")
SCORING_FUNCS = ("sigmoid", "softmax")


def _fail(name: str, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{name or 'config.json'}: unsupported {field} {value!r} (field "
                      f"{field}); supported: {supported}")


def _yarn_defaults(cfg: dict[str, Any], scaling: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """Fill in what HF derives when a YaRN config leaves it out: the original context (the
    config's own original_max_position_embeddings, else max_position_embeddings) and the
    factor (their ratio)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return scaling
    out = dict(scaling)
    if out.get("original_max_position_embeddings") is None:
        out["original_max_position_embeddings"] = cfg.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    if out.get("factor") is None:
        out["factor"] = cfg.get("max_position_embeddings", 4096) / float(
            out["original_max_position_embeddings"])
    return out


def _mla_config(cfg: dict[str, Any], name: str) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    if q_lora is None and cfg.get("attention_bias"):
        raise _fail(name, "attention_bias", True, "false when q_lora_rank is null (q_proj has "
                    "no bias in HF's DeepseekV3)")
    return MLAConfig(
        kv_lora_rank=int(hf_need(cfg, "kv_lora_rank", name)),
        qk_nope_head_dim=int(hf_need(cfg, "qk_nope_head_dim", name)),
        qk_rope_head_dim=int(hf_need(cfg, "qk_rope_head_dim", name)),
        v_head_dim=int(hf_need(cfg, "v_head_dim", name)),
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        rope_interleave=bool(cfg.get("rope_interleave", True)))


def _moe_config(cfg: dict[str, Any], num_layers: int, name: str) -> MoEConfig:
    """The sparse layers and their routing, with HF DeepseekV3Config's defaults."""
    experts = int(hf_need(cfg, "n_routed_experts", name))
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        # DeepSeek's own code skips layers by moe_layer_freq, HF's does not: no reference.
        raise _fail(name, "moe_layer_freq", cfg["moe_layer_freq"], "1")
    method = cfg.get("topk_method", "noaux_tc")
    if method not in TOPK_METHODS:
        raise _fail(name, "topk_method", method, ", ".join(TOPK_METHODS))
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring not in SCORING_FUNCS:
        raise _fail(name, "scoring_func", scoring, ", ".join(SCORING_FUNCS))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    shared = int(cfg.get("n_shared_experts") or 0)
    width = int(hf_need(cfg, "moe_intermediate_size", name))
    return MoEConfig(
        num_experts=experts, top_k=int(cfg.get("num_experts_per_tok") or 8),
        expert_intermediate_size=width,
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        scoring=scoring, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
        correction_bias=method == "noaux_tc", num_shared_experts=shared,
        shared_intermediate_size=shared * width)


def parse_config(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """A DeepSeek-V3 / Kimi-K2 ModelConfig from its HF config dict (already unwrapped from a
    multimodal wrapper by the registry)."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise _fail(name, "quantization_config", method, "none: load a bf16 (dequantized) "
                    "checkpoint")
    hf_check_activation(cfg, name)
    common = hf_common_fields(cfg, name, COMPUTED_ROPE_TYPES)
    scaling = _yarn_defaults(cfg, common["rope_scaling"] and dict(common["rope_scaling"]))
    mla = _mla_config(cfg, name)
    bias = bool(cfg.get("attention_bias", False))
    common.update(
        # MLA has no KV heads: every query head reads the one latent (ModelConfig's
        # num_kv_heads only sizes the no-cache path's mask, one group per head).
        num_kv_heads=common["num_heads"],
        # HF writes head_dim = qk_rope_head_dim; a query/key head is nope + rope wide.
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None)
    return ModelConfig(
        architecture=ARCHITECTURE, family="deepseek_v3",
        intermediate_size=int(hf_need(cfg, "intermediate_size", name)),
        qkv_bias=bias, o_bias=bias, mla=mla,
        moe=_moe_config(cfg, common["num_layers"], name),
        unused_checkpoint_layers=int(cfg.get("num_nextn_predict_layers") or 0), **common)


class DeepseekV3ForCausalLM(MoeCausalLM):
    """DeepSeek-V3 / Kimi-K2 as a TargetModel (see the module docstring): MoeCausalLM's
    layers (a SparseMoe where sparse, else the dense MLP; experts per expert or fused in
    the checkpoint) with MLA's attention and latent cache."""

    def attention_for(self, layer: int) -> nn.Module:
        return MLAttention(self.config, self.tp)

    @property
    def rope_dim(self) -> int:
        return self.config.mla.qk_rope_head_dim

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """MLA's latent layout: one entry of kv_lora_rank + rope_dim elements per token and
        layer, the values its first kv_lora_rank."""
        m = self.config.mla
        return KVLayout(self.config.num_layers, 1, m.kv_lora_rank + m.qk_rope_head_dim, dtype,
                        latent_values=m.kv_lora_rank)

    def paged_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> PagedKV:
        return PagedKV.from_layout(self.kv_layout(dtype), num_blocks, block_size, device)

    def layer_layout(self, n: int, fused: bool = False
                     ) -> dict[str, tuple[str, Any, tuple[int, ...]]]:
        """HF names of decoder layer n: MLA's projections (q_a_proj or q_proj, and
        kv_a_proj_with_mqa, onto rows of a_proj), and a dense MLP or the MoE block's (its
        experts fused: transformers' in-memory form, see MoeCausalLM)."""
        cfg, m = self.config, self.config.mla
        h, H, p = cfg.hidden_size, cfg.num_heads, f"model.layers.{n}."
        a = p + "self_attn."
        qk = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_rows = m.q_lora_rank or qk
        kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
        out: dict[str, tuple[str, Any, tuple[int, ...]]] = {
            p + "input_layernorm.weight": (p + "input_layernorm.weight", 0, (h,)),
            p + "post_attention_layernorm.weight":
                (p + "post_attention_layernorm.weight", 0, (h,)),
            a + "kv_a_proj_with_mqa.weight": (a + "a_proj.weight", q_rows, (kv_rows, h)),
            a + "kv_a_layernorm.weight": (a + "kv_a_layernorm.weight", 0, (m.kv_lora_rank,)),
            a + "kv_b_proj.weight": (a + "kv_b_proj.weight", 0,
                                     (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
            a + "o_proj.weight": (a + "o_proj.weight", 0, (h, H * m.v_head_dim)),
        }
        if m.q_lora_rank:
            r = m.q_lora_rank
            out[a + "q_a_proj.weight"] = (a + "a_proj.weight", 0, (r, h))
            out[a + "q_a_layernorm.weight"] = (a + "q_a_layernorm.weight", 0, (r,))
            out[a + "q_b_proj.weight"] = (a + "q_b_proj.weight", 0, (qk, r))
        else:
            out[a + "q_proj.weight"] = (a + "a_proj.weight", 0, (qk, h))
        if cfg.qkv_bias:  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
            out[a + "q_a_proj.bias"] = (a + "a_proj.bias", 0, (q_rows,))
            out[a + "kv_a_proj_with_mqa.bias"] = (a + "a_proj.bias", q_rows, (kv_rows,))
            out[a + "o_proj.bias"] = (a + "o_proj.bias", 0, (h,))
        if cfg.moe.sparse_layers[n]:
            out.update(moe_layout(p + "mlp.", hidden=h, moe=cfg.moe, shared="shared_experts.",
                                  fused=fused))
        else:
            out.update(mlp_layout(p + "mlp.", hidden=h, intermediate=cfg.intermediate_size))
        return out


FAMILIES = (Family("deepseek_v3", (ARCHITECTURE,),
                   {"deepseek_v3": ARCHITECTURE, "kimi_k2": ARCHITECTURE},
                   parse_config, DeepseekV3ForCausalLM, tensor_parallel=True),)

