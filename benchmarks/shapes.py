"""Real model shapes as HF config dicts, for random-weight benchmarks (no weights needed).

Each is the published config.json's architecture fields; `layers(shape, n)` keeps a shape's
layer width and cuts its depth to n layers (a DeepSeek-V3 / Kimi-K2 subset that fits one GPU).
"""

from __future__ import annotations

from typing import Any

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
    },
    "tiny-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 4096,
    },
    "smollm2-135m": {  # the embedded default model's shape
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": _LLAMA31_ROPE,
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": _LLAMA31_ROPE,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
    },
}

# Kimi-K2: DeepSeek-V3's architecture, with half the heads, 384 experts in one group, one
# dense layer, its own vocabulary and YaRN factor.
SHAPES["kimi-k2"] = {
    **SHAPES["deepseek-v3"], "model_type": "kimi_k2", "vocab_size": 163840,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "rope_theta": 50000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
}


def layers(shape: str, n: int | None) -> dict[str, Any]:
    """SHAPES[shape] cut to its first n decoder layers (None: all)."""
    raw = dict(SHAPES[shape])
    if n is not None:
        if not 0 < n <= raw["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{raw['num_hidden_layers']} for {shape}")
        raw["num_hidden_layers"] = n
    return raw
