"""DeepSeek-V3 / Kimi-K2 (models/deepseek.py, models/mla.py): logits equal HF transformers'
DeepseekV3ForCausalLM on tiny random configs, through our loader from save_pretrained
directories, both without a cache (MLA's expanded form) and over the paged latent cache
(the absorbed form); Kimi-K2 and wrapper configs; the failures that name a field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specscope.kvcache.paged import BatchMeta, with_pieces
from specscope.models.loader import load_model
from specscope.models.registry import config_from_hf

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers")

VOCAB, T, ATOL = 96, 20, 1e-4
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
    qk_nope_head_dim=10, n_group=4, topk_group=2, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6,
    routed_scaling_factor=2.5, bos_token_id=0, eos_token_id=1,
)
# Original context 16 < the test's 20 positions; mscale != mscale_all_dim, so both the
# cos/sin factor and the softmax's mscale^2 are not 1.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 16}
CASES: dict[str, dict[str, Any]] = {
    "base": {},  # q_lora_rank, one dense layer then MoE, n_group 4 keeping 2
    "no_q_lora": {"q_lora_rank": None},  # q_proj directly
    "yarn": {"rope_parameters": YARN},
    "dense_first_two": {"first_k_dense_replace": 2, "n_group": 2, "topk_group": 1},
    "rotate_half": {"rope_interleave": False},
    "attention_bias": {"attention_bias": True},  # q_a_proj, kv_a_proj_with_mqa, o_proj
    "unnormed": {"norm_topk_prob": False, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                 "n_group": 1, "topk_group": 1},
}


def build_hf(seed: int = 0, **overrides: Any):
    cfg = transformers.DeepseekV3Config(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF one-inits norms and zero-inits the correction bias
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (HF model, saved dir, our loaded model), built once per module."""
    cache: dict[str, tuple[Any, Path, Any]] = {}

    def get(case: str):
        if case not in cache:
            hf = build_hf(seed=len(cache) + 1, **CASES[case])
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            cache[case] = (hf, path, load_model(path).model)
        return cache[case]

    return get


def ids_(B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """No cache: MLA's expanded form."""
    hidden, _ = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1))
    return model.compute_logits(hidden)


@torch.no_grad()
def paged_logits(model, ids: torch.Tensor, chunk: int = 7) -> torch.Tensor:
    """Over the paged latent cache (the absorbed form), the B sequences side by side in each
    forward, prefilled in chunks of `chunk` tokens, their blocks scattered over the pool."""
    B, n = ids.shape
    bs = 4
    kv = model.paged_kv(16, bs, torch.float32, "cpu")
    tables = torch.tensor([[3, 7, 1, 9, 0, 12], [2, 5, 11, 4, 6, 14]])[:B]
    out = []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        pos = torch.arange(a, b).repeat(B)
        seq = torch.arange(B).repeat_interleave(b - a)
        meta = with_pieces(BatchMeta.causal(tables, seq, pos, bs),
                           [(b - a, s, b) for s in range(B)], 4, 4, torch.device("cpu"))
        hidden, _ = model(ids[:, a:b].reshape(1, -1), pos[None], kv, batch=meta)
        out.append(model.compute_logits(hidden[0]).view(B, b - a, -1))
    return torch.cat(out, 1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(saved, case):
    hf, _, model = saved(case)
    ids = ids_(seed=1)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert ref.abs().max() > 0.5  # not a vacuous comparison
    assert max_diff(full_logits(model, ids), ref) <= ATOL
    assert max_diff(paged_logits(model, ids), ref) <= ATOL


def test_config_reaches_the_model(saved):
    _, _, model = saved("base")
    cfg = model.config
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.family == "deepseek_v3"
    assert cfg.mla.q_lora_rank == 24 and cfg.head_dim == 18 and cfg.num_kv_heads == 4
    assert cfg.moe.sparse_layers == (False, True, True) and cfg.moe.correction_bias
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.scoring) == (4, 2, "sigmoid")
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # the checkpoint's bias, not a zero init
    _, _, no_lora = saved("no_q_lora")
    assert not hasattr(no_lora.model.layers[0].self_attn, "q_b_proj")


def test_yarn_is_not_a_no_op(saved):
    """Guard: the YaRN parity must not pass because scaling did nothing."""
    hf, _, model = saved("yarn")
    from specscope.models.deepseek import DeepseekV3ForCausalLM
    from specscope.models.mla import mla_softmax_scale

    assert mla_softmax_scale(model.config) != pytest.approx(18 ** -0.5)
    plain = DeepseekV3ForCausalLM(dataclasses.replace(model.config, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    ids = ids_(seed=2)
    with torch.no_grad():
        ref = hf(ids).logits
    assert max_diff(full_logits(plain.eval(), ids), ref) > 1e-3


@pytest.mark.parametrize("original", [True, False])
def test_sharded_checkpoint_loads_and_matches(tmp_path, original):
    """Sharded; experts per expert (the hub's form) or fused (transformers' in-memory
    form, save_original_format=False)."""
    hf = build_hf(seed=9)
    hf.save_pretrained(tmp_path, max_shard_size="20KB", save_original_format=original)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2
    assert ("model.layers.1.mlp.experts.gate_up_proj" in index) != original
    model = load_model(tmp_path).model
    ids = ids_(seed=3)
    with torch.no_grad():
        assert max_diff(full_logits(model, ids), hf(ids).logits) <= ATOL


def _copy(src: Path, dst: Path, config: dict[str, Any], rename=lambda n: n,
          extra: dict[str, torch.Tensor] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {rename(k): v for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file({**tensors, **(extra or {})}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_kimi_k2_model_type_and_a_kimi_k25_wrapper_load(saved, tmp_path):
    """Kimi-K2's config (model_type kimi_k2) and Kimi-K2.5's multimodal wrapper (its
    language model in text_config, tensors under language_model., a vision tower beside)."""
    hf, path, _ = saved("base")
    raw = json.loads((path / "config.json").read_text())
    kimi = {k: v for k, v in raw.items() if k != "architectures"} | {"model_type": "kimi_k2"}
    k2 = load_model(_copy(path, tmp_path / "k2", kimi)).model
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": kimi, "vision_config": {"hidden_size": 8}}
    vision = {"vision_tower.patch_embed.proj.weight": torch.zeros(8, 3),
              "mm_projector.proj.0.weight": torch.zeros(32, 8)}
    k25 = load_model(_copy(path, tmp_path / "k25", wrapper, lambda n: "language_model." + n,
                           vision)).model
    ids = ids_(seed=4)
    with torch.no_grad():
        ref = hf(ids).logits
    for model in (k2, k25):
        assert model.config.architecture == "DeepseekV3ForCausalLM"
        assert max_diff(full_logits(model, ids), ref) <= ATOL


def test_multi_token_prediction_layers_are_skipped(saved, tmp_path):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers MTP layers after the last
    decoder layer: skipped; a tensor past them is still an error."""
    _, path, _ = saved("base")
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(32, 64),
           "model.layers.3.enorm.weight": torch.ones(32)}
    load_model(_copy(path, tmp_path / "mtp", raw, extra=mtp))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.4\.x"):
        load_model(_copy(path, tmp_path / "bad", raw,
                         extra={**mtp, "model.layers.4.x": torch.zeros(1)}))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("topk_method", "group_limited_greedy", "topk_method"),
    ("scoring_func", "softmax_plus", "scoring_func"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, r"rope_scaling\.rope_type"),
])
def test_unsupported_variants_fail_naming_the_field(field, value, match):
    raw = {**BASE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           field: value}
    with pytest.raises(ValueError, match=match):
        config_from_hf(raw, "x")


def test_yarn_defaults_are_filled_in_as_hf_does():
    """A YaRN config without factor / original_max_position_embeddings (HF derives them)."""
    raw = {**BASE, "architectures": ["DeepseekV3ForCausalLM"], "max_position_embeddings": 64,
           "rope_scaling": {"type": "yarn", "mscale_all_dim": 1.0}}
    rope = config_from_hf(raw).rope_scaling_dict
    assert rope["original_max_position_embeddings"] == 64 and rope["factor"] == 1.0
