"""The MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE): logits equal HF transformers' on tiny
random configs, loaded strictly from save_pretrained directories (per-expert tensors, the
fused in-memory form, sharded); the paged batched engine equals full recompute; greedy
speculative decoding with a random EAGLE-3 draft equals plain decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import solo_greedy

from specscope.config import SamplingParams, SpecConfig
from specscope.draft.eagle3 import random_draft
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.loader import load_model, read_config
from specscope.models.moe import SparseMoe

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers")

VOCAB = 96
ATOL = 1e-4
BASE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, rms_norm_eps=1e-6)
# name -> (HF config class, overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=24)),
    "mixtral_sw": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                         intermediate_size=24, sliding_window=5)),
    # A shared expert with its sigmoid gate, q/k/v bias, layer 1 dense (mlp_only_layers).
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=16, intermediate_size=40,
                                         shared_expert_intermediate_size=48,
                                         mlp_only_layers=[1], norm_topk_prob=False)),
    # q/k norm, head_dim 16 != 32 / 4, renormalised top-4 of 16, every 2nd layer sparse.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=16, num_experts_per_tok=4,
                                         moe_intermediate_size=16, intermediate_size=40,
                                         head_dim=16, norm_topk_prob=True,
                                         decoder_sparse_step=2)),
    "qwen3_moe_bias": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=8,
                                              moe_intermediate_size=16, intermediate_size=40,
                                              attention_bias=True, norm_topk_prob=False)),
}


def build_hf(family: str, seed: int):
    cls, overrides = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomise it all
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, saved dir, our loaded model), built once per module."""
    cache: dict[str, tuple[Any, Path, Any]] = {}

    def get(family: str):
        if family not in cache:
            hf = build_hf(family, seed=len(cache) + 1)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            cache[family] = (hf, path, load_model(path).model)
        return cache[family]

    return get


def rand_ids(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours(model, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    hidden, _ = model(ids, torch.arange(T).expand(B, -1))
    return model.compute_logits(hidden)


@torch.no_grad()
def theirs(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(saved, family):
    hf, _, model = saved(family)
    ids = rand_ids(2, 19, seed=1)
    ref = theirs(hf, ids)
    assert ref.abs().max() > 0.1
    assert max_diff(ours(model, ids), ref) <= ATOL


def test_config_fields_reach_the_model(saved):
    _, path, q2 = saved("qwen2_moe")
    moe = q2.config.moe
    assert moe.sparse_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert isinstance(q2.model.layers[0].mlp, SparseMoe)
    assert not isinstance(q2.model.layers[1].mlp, SparseMoe)
    assert moe.shared_expert_gate and moe.shared_intermediate_size == 48
    assert q2.config.qkv_bias and not q2.config.o_bias
    _, _, q3 = saved("qwen3_moe")
    assert q3.config.moe.sparse_layers == (False, True, False, True)  # decoder_sparse_step 2
    assert q3.config.qk_norm and q3.config.head_dim == 16 and q3.config.moe.norm_topk_prob
    _, _, mx = saved("mixtral")
    assert mx.config.moe.num_experts == 8 and mx.config.moe.top_k == 2
    _, _, sw = saved("mixtral_sw")
    assert sw.config.sliding_window == 5


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_and_sharded_checkpoints_load(tmp_path, family):
    """transformers' in-memory fused experts (save_original_format=False), and per-expert
    tensors spread over shards."""
    hf = build_hf(family, seed=7)
    ids = rand_ids(2, 11, seed=3)
    ref = theirs(hf, ids)
    fused, sharded = tmp_path / "fused", tmp_path / "sharded"
    hf.save_pretrained(fused, save_original_format=False)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    shards = set(json.loads((sharded / "model.safetensors.index.json").read_text())
                 ["weight_map"].values())
    assert len(shards) >= 2
    for path in (fused, sharded):
        assert max_diff(ours(load_model(path).model, ids), ref) <= ATOL, path.name


def test_strict_loading_names_missing_experts(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = build_hf("mixtral", seed=2)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: .*experts\.5\.w3"):
        load_model(tmp_path)


@pytest.mark.parametrize(("family", "field", "value"), [
    ("mixtral", "hidden_act", "gelu"),
    ("qwen2_moe", "use_sliding_window", True),
    ("qwen3_moe", "rope_scaling", {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32}),
])
def test_unsupported_variants_fail_naming_the_field(tmp_path, family, field, value):
    hf = build_hf(family, seed=3)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        read_config(tmp_path)


def test_qwen3_moe_reads_num_experts_under_either_name(saved):
    _, path, _ = saved("qwen3_moe")
    cfg = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in cfg  # what transformers 5 writes; the hub says num_experts
    cfg["num_experts"] = cfg.pop("num_local_experts")
    from specscope.models.registry import config_from_hf

    assert config_from_hf(cfg).moe.num_experts == 16


# -- the paged engine ---------------------------------------------------------------------


def _run(engine: Engine, seqs: list[Sequence]) -> None:
    for s in seqs:
        engine.add(s)
    for _ in range(2000):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine did not finish")


def _workload(seed: int, n: int = 4) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(n)]
    return prompts, [rng.randrange(4, 14) for _ in prompts]


@pytest.mark.parametrize("family", ["mixtral_sw", "qwen2_moe", "qwen3_moe"])
def test_paged_engine_equals_full_recompute(saved, family):
    """Chunked prefill (8 tokens a step) beside decodes, four sequences at once."""
    _, _, model = saved(family)
    prompts, lens = _workload(seed=len(family))
    engine = Engine(model, BatchConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                       max_num_seqs=4, max_model_len=64))
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, seqs)
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    assert engine.pool.all_free()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, None), (3, 2, 6)])
def test_speculative_greedy_equals_plain(saved, family, steps, topk, ndt):
    """A random EAGLE-3 draft tapping layers 0, 1 and 3 (taps from sparse and dense
    layers alike)."""
    _, _, model = saved(family)
    draft = random_draft(model.config, torch.float32, "cpu", layer_ids=(0, 1, 3), seed=4,
                         std=0.1)
    draft.attach_target(model)
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt)
    engine = Engine(model, BatchConfig(num_blocks=64, block_size=4, max_num_batched_tokens=32,
                                       max_num_seqs=4, max_model_len=64),
                    draft=draft, spec=spec)
    prompts, lens = _workload(seed=steps * 10 + topk)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, seqs)
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    assert engine.pool.all_free() and engine.draft_pool.all_free()
