"""EAGLE-3 drafts for DeepSeek-V3 / Kimi-K2 targets: a checkpoint in SpecForge's published
Kimi-K2.5 layout (configs/kimi-k25-eagle3.json: hidden 7168, 64 heads of an explicit
head_dim 128, draft vocab 32000, taps [2, 30, 58] of the target's 61 layers; and
kimi-k2-eagle3.json, which writes the target's model_type kimi_k2), shrunk to tiny widths but
with the real layer count and taps, loads through draft/formats.py, passes the doctor's
static checks against the DeepSeek target, and speculates greedily to the plain output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import solo_greedy
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specscope.config import SamplingParams, SpecConfig
from specscope.doctor.checks import ERROR, static_checks
from specscope.draft.eagle3 import random_draft
from specscope.draft.formats import save_draft
from specscope.draft.loader import load_draft
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.loader import allocate
from specscope.models.registry import config_from_hf

pytestmark = pytest.mark.usefixtures("single_thread")

V, VD, HIDDEN = 96, 24, 32
IDS = [2, 30, 58]
# Kimi-K2's shape at tiny widths: 61 layers, the first dense, n_group 1, YaRN.
TARGET = dict(architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=V,
              hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=61, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
              qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
              first_k_dense_replace=1, routed_scaling_factor=2.827, topk_method="noaux_tc",
              scoring_func="sigmoid", max_position_embeddings=256, rope_theta=50000.0,
              bos_token_id=0, eos_token_id=1,
              rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 64})
TCFG = config_from_hf(TARGET, "tiny-kimi-k2")
# SpecForge's kimi-k25-eagle3.json, every field, with the widths shrunk.
SPECFORGE = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "draft_vocab_size": VD, "dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS, "use_aux_hidden_state": True},
    "eos_token_id": 1, "head_dim": 16, "hidden_act": "silu", "hidden_size": HIDDEN,
    "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 256,
    "max_window_layers": 48, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 4,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": V,
}
# The tensors a SpecForge EAGLE-3 checkpoint holds (its frozen embedding copy included).
SPECFORGE_TENSORS = {
    "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
        "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")),
}


@pytest.fixture(scope="module")
def target():
    model = allocate(TCFG, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model.eval().requires_grad_(False)


def _specforge_dir(root: Path, target, model_type: str) -> Path:
    """A draft directory as SpecForge publishes one: its config verbatim (model_type as
    written: llama for Kimi-K2.5, the target's kimi_k2 for Kimi-K2), midlayer.* tensors."""
    draft = random_draft(TCFG, torch.float32, "cpu", layer_ids=IDS, draft_vocab_size=VD,
                         num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=64,
                         rope_theta=1e6, rope_scaling=None, max_position_embeddings=256,
                         seed=3, std=0.3)
    out = save_draft(draft, draft.config, root / model_type, "sglang")
    (out / "config.json").write_text(json.dumps({**SPECFORGE, "model_type": model_type}))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.clone()
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("model_type", ["llama", "kimi_k2"])
def test_specforge_kimi_layout_loads_checks_and_speculates(tmp_path, target, model_type):
    d = _specforge_dir(tmp_path, target, model_type)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == SPECFORGE_TENSORS
    loaded = load_draft(d, TCFG)
    cfg = loaded.config
    assert loaded.source_format == "sglang" and cfg.aux_layer_ids == tuple(IDS)
    assert (cfg.head_dim, cfg.num_heads, cfg.draft_vocab_size) == (16, 4, VD)
    assert "embed_tokens.weight is ignored" in loaded.message

    tdir = tmp_path / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(TARGET))
    findings = static_checks(d, TCFG, tdir)
    errors = [f for f in findings if f.severity == ERROR]
    assert not errors, errors
    codes = {f.code for f in findings}
    assert "static.layer_ids" in codes and "static.rope" in codes  # yarn target, plain draft

    draft = loaded.model
    draft.attach_target(target)
    spec = SpecConfig(draft=str(d), num_steps=3, topk=2, num_draft_tokens=5)
    engine = Engine(target, BatchConfig(num_blocks=32, block_size=4, max_num_seqs=2,
                                        max_model_len=48), draft=draft, spec=spec)
    prompts = [[5, 9, 2, 33, 71, 8, 40], [17, 3, 88, 60]]
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_ids == solo_greedy(target, p, 6)
    assert any(s.spec.accepted for s in seqs)  # it speculated
    assert engine.pool.all_free() and engine.draft_pool.all_free()
