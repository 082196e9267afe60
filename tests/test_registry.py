"""The target model registry: family lookup by HF names, wrappers, and the protocol."""

from __future__ import annotations

import pytest
import torch

from specscope.config import SUPPORTED_ARCHITECTURES
from specscope.models.loader import allocate
from specscope.models.registry import (
    TargetModel,
    build_model,
    config_from_hf,
    family_for,
    supported_architectures,
)

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def test_every_dense_architecture_is_registered():
    assert set(SUPPORTED_ARCHITECTURES) <= set(supported_architectures())
    for arch in SUPPORTED_ARCHITECTURES:
        cfg = config_from_hf({**TINY, "architectures": [arch]})
        assert cfg.architecture == arch
        assert isinstance(build_model(cfg), TargetModel)


def test_unknown_architecture_names_it_and_lists_the_supported():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supports: .*LlamaForCausalLM"):
        family_for({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "x")


def test_model_type_alone_finds_the_family():
    cfg = config_from_hf({**TINY, "model_type": "qwen3"})
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm


def test_multimodal_wrapper_loads_its_language_model():
    raw = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
           "text_config": {**TINY, "model_type": "mistral"}, "vision_config": {}}
    cfg = config_from_hf(raw, "wrapper")
    assert cfg.architecture == "MistralForCausalLM" and cfg.hidden_size == 16


def test_allocate_gives_a_tied_model_on_the_device():
    cfg = config_from_hf({**TINY, "architectures": ["LlamaForCausalLM"],
                          "tie_word_embeddings": True})
    m = allocate(cfg, torch.bfloat16, "cpu")
    assert m.dtype == torch.bfloat16 and m.device.type == "cpu"
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    layout = m.kv_layout(torch.bfloat16)
    assert layout.bytes_per_token == 2 * 2 * 2 * 4 * 2  # K+V, layers, kv heads, dim, bf16
    kv = m.paged_kv(3, 4, torch.bfloat16, "cpu")
    assert kv.nbytes == 3 * 4 * layout.bytes_per_token
