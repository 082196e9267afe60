"""EAGLE-3 on MoE targets: taps from any layer (sparse or dense) equal HF's hidden states;
the doctor's static checks and wiring probe run on a MoE target; a draft in SpecForge's
published Qwen3-30B-A3B layout (EAGLE-3.1 fc_norm, norm_output) loads and decodes
losslessly; train-draft trains a tiny draft for a tiny MoE target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TOKENIZER_FILES
from safetensors.torch import save_file

from specscope import LLM
from specscope.config import SamplingParams, SpecConfig
from specscope.doctor import run_doctor
from specscope.doctor.checks import ERROR, static_checks
from specscope.draft.eagle3 import random_draft
from specscope.draft.formats import detect_format, parse_config, save_draft
from specscope.draft.loader import load_draft
from specscope.models.loader import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers")

V, H, L = 96, 32, 8
QWEN3_MOE: dict[str, Any] = dict(
    vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=L,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
    mlp_only_layers=[3], max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6)


def _hf_moe(tmp: Path, **over: Any) -> tuple[Any, Path]:
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **over}), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + 0.5 * noise if name.endswith("norm.weight") else noise)
    hf.save_pretrained(tmp)
    return hf.eval(), tmp


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf, path = _hf_moe(tmp_path_factory.mktemp("qwen3_moe"))
    return hf, path, load_model(path).model


def test_taps_from_any_layer_equal_hf_hidden_states(target):
    hf, _, model = target
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    taps_ids = [-1, 0, 3, 4, L - 1]  # embedding, sparse, the dense layer 3, the last
    model.set_taps(taps_ids)
    try:
        with torch.no_grad():
            _, taps = model(ids, torch.arange(9).expand(2, -1), return_taps=True)
            ref = hf(ids, output_hidden_states=True).hidden_states
    finally:
        model.set_taps([])
    for j, k in enumerate(taps_ids):
        got = taps[..., j * H:(j + 1) * H]
        want = ref[k + 1] if k < L - 1 else None  # HF's last entry is post-norm
        if want is not None:
            assert (got - want).abs().max() <= 1e-4, k
    last = taps[..., -H:]
    assert (model.final_norm(last) - ref[L]).abs().max() <= 1e-4


def _random_sglang_draft(model, out: Path, layer_ids=(1, 3, 6)) -> Path:
    draft = random_draft(model.config, torch.float32, "cpu", layer_ids=layer_ids,
                         draft_vocab_size=40, seed=3, std=0.2, fc_norm=True)
    return save_draft(draft, draft.config, out, "sglang")


def test_doctor_runs_on_a_moe_target(target, tmp_path):
    _, _, model = target
    d = _random_sglang_draft(model, tmp_path / "draft")
    errors = [f for f in static_checks(d, model.config) if f.severity == ERROR]
    assert not errors, errors
    llm = LLM.from_model(model, kv_cache_memory=8 << 20)
    prompts = [" ".join(str((7 * i + j) % V) for j in range(6)) for i in range(3)]
    report = run_doctor(llm, str(d), prompts=prompts, max_new_tokens=8, steps=3)
    # The probe measured every candidate wiring over the MoE target's activations, and
    # judges a random draft for what it is.
    assert "probe.untrained" in report.codes(), report.format()
    assert len(report.wirings) > 3 and all(w.accept_length >= 1.0 for w in report.wirings)
    assert report.wirings and report.wirings[0].ids == (1, 3, 6)
    assert report.probe_tokens == 3 * 8
    # A planted fault is still found: an fc width for another target.
    bad = _random_sglang_draft(model, tmp_path / "bad", layer_ids=(1, 3))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert "static.fc_width" in {f.code for f in static_checks(bad, model.config)}


# SpecForge's configs/qwen3-30B-A3B-eagle3.1.json, field for field (the published draft
# layout for Qwen3-30B-A3B: hidden 2048, EAGLE-3.1 fc_norm, norm_output, 32k draft vocab).
SPECFORGE_QWEN3_30B_A3B = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "fc_norm": True, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 2048,
    "max_window_layers": 48, "model_type": "llama", "norm_output": True,
    "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.53.2", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936, "draft_vocab_size": 32000,
}


def test_specforge_qwen3_30b_a3b_config_parses():
    fmt = detect_format(SPECFORGE_QWEN3_30B_A3B)
    f = parse_config(SPECFORGE_QWEN3_30B_A3B, fmt).fields
    assert fmt == "sglang"
    assert f["fc_norm"] and not f["norm_before_fc"] and not f["norm_output"]
    assert (f["hidden_size"], f["target_hidden_size"], f["head_dim"], f["num_heads"],
            f["num_kv_heads"], f["intermediate_size"], f["draft_vocab_size"]) == \
        (2048, 2048, 128, 32, 4, 12288, 32000)


def _specforge_checkpoint(out: Path, seed: int = 5, Vd: int = 40) -> dict[str, torch.Tensor]:
    """A tiny draft in SpecForge's saved layout (LlamaForCausalLMEagle3's state dict:
    embed_tokens, fc, fc_norm.{0,1,2}, midlayer.*, norm, lm_head, d2t, t2d) with the
    Qwen3-30B-A3B config's fields at this target's size, and no tap ids (SpecForge's
    default: EAGLE-3's [1, L//2 - 1, L - 4])."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    d, heads, kv, inter = 8, 4, 2, 48
    vocab = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    m = "midlayer."
    tensors = {
        "embed_tokens.weight": w(V, H), "fc.weight": w(H, 3 * H), "norm.weight": 1 + w(H),
        "lm_head.weight": w(Vd, H), "d2t": vocab - torch.arange(Vd), "t2d": t2d,
        **{f"fc_norm.{i}.weight": 1 + w(H) for i in range(3)},
        m + "hidden_norm.weight": 1 + w(H), m + "input_layernorm.weight": 1 + w(H),
        m + "post_attention_layernorm.weight": 1 + w(H),
        m + "self_attn.q_proj.weight": w(heads * d, 2 * H),
        m + "self_attn.k_proj.weight": w(kv * d, 2 * H),
        m + "self_attn.v_proj.weight": w(kv * d, 2 * H),
        m + "self_attn.o_proj.weight": w(H, heads * d),
        m + "mlp.gate_proj.weight": w(inter, H), m + "mlp.up_proj.weight": w(inter, H),
        m + "mlp.down_proj.weight": w(H, inter),
    }
    cfg = {**SPECFORGE_QWEN3_30B_A3B, "hidden_size": H, "head_dim": d,
           "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
           "vocab_size": V, "draft_vocab_size": Vd, "max_position_embeddings": 128,
           "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return tensors


def test_specforge_qwen3_moe_draft_loads_and_is_lossless(target, tmp_path):
    _, _, model = target
    d = tmp_path / "specforge"
    tensors = _specforge_checkpoint(d)
    loaded = load_draft(d, model.config)
    draft = loaded.model
    assert loaded.source_format == "sglang" and draft.config.fc_norm
    assert draft.config.aux_layer_ids == (1, 3, 4)  # EAGLE-3's default for 8 layers
    for i in range(3):
        assert torch.equal(draft.fc_norm[i].weight, tensors[f"fc_norm.{i}.weight"])
    # SpecForge's project_hidden_states: each tap RMS-normed by its own fc_norm, then fc.
    taps = torch.randn(2, 5, 3 * H, generator=torch.Generator().manual_seed(2))

    def rms(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return wt * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    ref = torch.cat([rms(c, tensors[f"fc_norm.{i}.weight"])
                     for i, c in enumerate(taps.split(H, -1))], -1) @ tensors["fc.weight"].T
    with torch.no_grad():
        assert (draft.project(taps) - ref).abs().max() <= 1e-5
    errors = [f for f in static_checks(d, model.config) if f.severity == ERROR]
    assert not errors, errors
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = "3 14 15 92 65 35"
    plain = LLM.from_model(model, kv_cache_memory=8 << 20).generate(prompt, params)[0]
    spec = LLM.from_model(model, spec=SpecConfig(draft=str(d), num_steps=3, topk=2,
                                                 num_draft_tokens=6),
                          kv_cache_memory=8 << 20).generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids and spec.spec["cycles"] > 0


def test_train_draft_for_a_moe_target(tmp_path, default_model_dir):
    """A few CPU steps of train-draft on a 2-layer Qwen3-MoE with a real tokenizer: the loss
    falls, and the exported draft speculates losslessly on the MoE target."""
    from specscope.train.config import TrainConfig
    from specscope.train.trainer import train_draft

    vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    tdir = tmp_path / "moe_target"
    _hf_moe(tdir, vocab_size=vocab, hidden_size=64, num_hidden_layers=4, mlp_only_layers=[],
            head_dim=16, intermediate_size=64)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, tdir / name)
    prompts = tmp_path / "prompts.jsonl"
    topics = ["cats", "rivers", "trains", "bread", "stars", "music", "rain", "chess"]
    prompts.write_text("".join(json.dumps({"prompt": f"Write about {topics[i % 8]} {i}."})
                               + "\n" for i in range(16)))
    cfg = TrainConfig(target=str(tdir), data=[str(prompts)], out=str(tmp_path / "run"),
                      draft_vocab_size=300, ttt_length=2, epochs=4, lr=3e-3,
                      batch_tokens=256, max_len=64, eval_fraction=0.1, eval_every=0,
                      save_every=100, log_every=1, regen_max_new_tokens=12,
                      regen_batch_size=8, device="cpu", progress=False,
                      export_dtype="float32")
    exported = train_draft(cfg)
    hist = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [h["loss"] for h in hist if "loss" in h]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    prov = json.loads((exported / "config.json").read_text())["specscope_provenance"]
    assert prov["target_num_layers"] == 4
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM(str(tdir), dtype="fp32", device="cpu").generate("Write about cats 3.",
                                                              params)[0].token_ids
    spec = LLM(str(tdir), dtype="fp32", device="cpu",
               spec=SpecConfig(draft=str(exported), num_steps=2))
    got = spec.generate("Write about cats 3.", params)[0]
    assert got.token_ids == ref and got.spec["cycles"] > 0
