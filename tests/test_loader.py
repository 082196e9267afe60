"""Tests for specscope.models.loader (strict loading, error paths, dtypes) and ModelConfig.from_hf.

Checkpoints are tiny random HF models saved with `save_pretrained` (fp32, CPU); each error
test mutates its own copy and asserts the error type and that the message names the culprit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specscope.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specscope.models.loader import LoadedModel, load_model, weight_files

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers")

VOCAB = 128
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def build_hf(cls_name: str = "LlamaConfig", seed: int = 0, **overrides: Any):
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomise all of it
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Pristine saved checkpoints, built once: name -> (HF model, dir)."""
    out = {}
    for name, cls_name, kw, save_kw in [
        ("llama", "LlamaConfig", {}, {}),
        ("tied", "LlamaConfig", {"tie_word_embeddings": True}, {}),
        ("qwen2", "Qwen2Config", {"tie_word_embeddings": True}, {}),
        ("sharded", "LlamaConfig", {}, {"max_shard_size": "20KB"}),
    ]:
        hf = build_hf(cls_name, seed=len(out), **kw)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, **save_kw)
        out[name] = (hf, path)
    return out


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    """A private, mutable copy of a pristine checkpoint: ckpt(name) -> dir."""

    def copy(name: str = "llama") -> Path:
        dst = tmp_path / name
        shutil.copytree(checkpoints[name][1], dst)
        return dst

    return copy


def rewrite_weights(path: Path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def edit_config(path: Path, **changes: Any) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    hidden, _ = model(ids, torch.arange(T).expand(B, T))
    return model.compute_logits(hidden)


def rand_ids(B: int = 2, T: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# -- the happy path -----------------------------------------------------------------------


def test_load_model_returns_loaded_model(checkpoints):
    hf, path = checkpoints["llama"]
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == path and loaded.source == str(path)
    assert loaded.config.family == "llama" and loaded.config.num_layers == 2
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    ids = rand_ids()
    with torch.no_grad():
        ref = hf(ids).logits
    assert (logits(loaded.model, ids) - ref).abs().max() <= 1e-4


def test_load_model_accepts_config_json_path(checkpoints):
    _, path = checkpoints["llama"]
    assert load_model(path / "config.json").path == path
    assert load_model(str(path)).path == path


def test_weight_files_sharded_maps_every_tensor(checkpoints):
    _, path = checkpoints["sharded"]
    files = weight_files(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(files) == set(index)
    assert len(set(files.values())) >= 2
    assert all(p.parent == path and p.exists() for p in files.values())


def test_generation_config_eos_ids_are_merged(ckpt):
    path = ckpt("llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(path).config.eos_token_ids == (2, 7)


def test_ignored_inv_freq_and_tied_head_tensors_load(ckpt, checkpoints):
    """Old checkpoints carry rotary inv_freq, and tied ones sometimes a redundant lm_head."""
    path = ckpt("tied")

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    rewrite_weights(path, add)
    model = load_model(path).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf, _ = checkpoints["tied"]
    ids = rand_ids()
    with torch.no_grad():
        assert (logits(model, ids) - hf(ids).logits).abs().max() <= 1e-4


# -- 4. error paths -------------------------------------------------------------------------


def test_unsupported_architecture_lists_supported(ckpt):
    path = ckpt()
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError) as exc:
        load_model(path)
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_missing_tensor_is_named(ckpt):
    path = ckpt()
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as exc:
        load_model(path)
    assert name in str(exc.value)
    assert "unexpected" not in str(exc.value)


def test_missing_untied_head_is_named(ckpt):
    path = ckpt()
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(ckpt):
    path = ckpt()
    name = "model.layers.0.self_attn.extra_proj.weight"

    def add(t):
        t[name] = torch.zeros(3, 3)

    rewrite_weights(path, add)
    with pytest.raises(ValueError, match="unexpected") as exc:
        load_model(path)
    assert name in str(exc.value)
    assert "missing" not in str(exc.value)


def test_misshaped_tensor_names_it_and_both_shapes(ckpt):
    path = ckpt()
    name = "model.layers.1.self_attn.k_proj.weight"  # 2 kv heads * 8 = 16 rows of 32

    def reshape(t):
        assert tuple(t[name].shape) == (16, 32)
        t[name] = torch.zeros(8, 32)

    rewrite_weights(path, reshape)
    with pytest.raises(ValueError) as exc:
        load_model(path)
    msg = str(exc.value)
    assert name in msg and "[8, 32]" in msg and "[16, 32]" in msg


def test_sharded_index_with_missing_shard_names_file(ckpt):
    path = ckpt("sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(index.values()))[-1]
    (path / victim).unlink()
    with pytest.raises(FileNotFoundError) as exc:
        load_model(path)
    assert victim in str(exc.value)


def test_directory_without_config_json(ckpt):
    path = ckpt()
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_directory_without_weights(ckpt):
    path = ckpt()
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_directory_with_only_bin_weights_hints_conversion(ckpt):
    path = ckpt()
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_model(path)


@pytest.mark.parametrize("bad_file", ["config.json", "generation_config.json"])
def test_invalid_json_is_value_error(ckpt, bad_file):
    path = ckpt()
    (path / bad_file).write_text("{\"architectures\": [\"LlamaForCausalLM\",")
    with pytest.raises(ValueError, match="not valid JSON") as exc:
        load_model(path)
    assert bad_file in str(exc.value)


def test_config_missing_required_field_is_named(ckpt):
    path = ckpt()
    cfg = json.loads((path / "config.json").read_text())
    del cfg["intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="intermediate_size"):
        load_model(path)


@pytest.mark.parametrize("spec", ["./nope/model", "nope/model/deeper", "~/specscope-nope-x"])
def test_nonexistent_local_path(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as exc:
        load_model(spec)
    assert spec in str(exc.value)


def test_hub_id_unreachable_is_runtime_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the env at import (transformers already imported it): patch too.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # so the id cannot resolve as a local directory
    repo = "specscope-test/definitely-not-a-model"
    with pytest.raises(RuntimeError) as exc:
        load_model(repo)
    msg = str(exc.value)
    assert "could not download" in msg and repo in msg
    assert "--local-dir" in msg  # suggests downloading to a local dir and passing that


# -- 5. dtypes and tied storage ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_low_precision_load(checkpoints, dtype, name):
    _, path = checkpoints[name]
    ref_model = load_model(path).model
    model = load_model(path, dtype=dtype).model
    assert all(p.dtype == dtype for p in model.parameters())
    assert model.model.layers[0].input_layernorm.weight.dtype == dtype
    ids = rand_ids(2, 17, seed=3)
    ref, low = logits(ref_model, ids), logits(model, ids)
    assert low.dtype == torch.float32  # compute_logits upcasts for sampling
    assert torch.isfinite(low).all()
    agree = (low.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    assert (low - ref).abs().max() <= 0.1 * ref.abs().max() + 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["tied", "qwen2"])
def test_tied_head_shares_storage(checkpoints, dtype, name):
    _, path = checkpoints[name]
    loaded = load_model(path, dtype=dtype)
    assert loaded.config.tie_word_embeddings
    model = loaded.model
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()
    assert model.lm_head.weight is emb
    assert emb.abs().sum() > 0  # loaded, not left as to_empty garbage / zeros
    ids = rand_ids(1, 5)
    hidden, _ = model(ids, torch.arange(5)[None])
    manual = (hidden @ emb.T).float()
    assert torch.equal(model.compute_logits(hidden), manual)


def test_untied_head_has_own_storage(checkpoints):
    model = load_model(checkpoints["llama"][1]).model
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


# -- 6. ModelConfig.from_hf on real configs -----------------------------------------------------

LLAMA_31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768,
}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(LLAMA_31_8B_INSTRUCT, dict(
            family="llama", head_dim=128, num_heads=32, num_kv_heads=8, num_layers=32,
            hidden_size=4096, intermediate_size=14336, vocab_size=128256, qkv_bias=False,
            o_bias=False, qk_norm=False, tie_word_embeddings=False, rope_theta=500000.0,
            rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=None,
            bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)), id="llama-3.1-8b"),
        pytest.param(LLAMA_32_1B, dict(
            family="llama", head_dim=64, num_kv_heads=8, qkv_bias=False, qk_norm=False,
            tie_word_embeddings=True, eos_token_ids=(128001,)), id="llama-3.2-1b"),
        pytest.param(QWEN25_7B, dict(
            family="qwen2", head_dim=128, num_heads=28, num_kv_heads=4, qkv_bias=True,
            o_bias=False, qk_norm=False, tie_word_embeddings=False, rope_theta=1e6,
            rope_scaling=None, sliding_window=None, bos_token_id=151643,
            eos_token_ids=(151643,)), id="qwen2.5-7b"),
        pytest.param(QWEN3_8B, dict(
            family="qwen3", head_dim=128, num_heads=32, num_kv_heads=8, num_layers=36,
            qkv_bias=False, o_bias=False, qk_norm=True, tie_word_embeddings=False,
            rope_theta=1e6, rope_scaling=None, sliding_window=None,
            max_position_embeddings=40960, eos_token_ids=(151645,)), id="qwen3-8b"),
        pytest.param(MISTRAL_7B_V03, dict(
            family="mistral", head_dim=128, num_kv_heads=8, qkv_bias=False, o_bias=False,
            qk_norm=False, tie_word_embeddings=False, rope_theta=1e6, rope_scaling=None,
            sliding_window=None, vocab_size=32768, bos_token_id=1, eos_token_ids=(2,)),
            id="mistral-7b-v0.3"),
    ],
)
def test_from_hf_real_configs(raw, expected):
    cfg = ModelConfig.from_hf(json.loads(json.dumps(raw)), name="x")
    assert cfg.architecture == raw["architectures"][0]
    for field, want in expected.items():
        assert getattr(cfg, field) == want, field


def test_from_hf_llama31_rope_scaling():
    scaling = ModelConfig.from_hf(LLAMA_31_8B_INSTRUCT).rope_scaling_dict
    assert scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_from_hf_transformers5_rope_parameters():
    """transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling."""
    raw = {k: v for k, v in LLAMA_31_8B_INSTRUCT.items() if k not in ("rope_scaling",
                                                                       "rope_theta")}
    raw["rope_parameters"] = {**LLAMA_31_8B_INSTRUCT["rope_scaling"], "rope_theta": 500000.0}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling_dict == LLAMA_31_8B_INSTRUCT["rope_scaling"]
    plain = {k: v for k, v in QWEN3_8B.items() if k not in ("rope_scaling", "rope_theta")}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg = ModelConfig.from_hf(plain)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_from_hf_sliding_window_flags():
    mistral_v01 = {**MISTRAL_7B_V03, "sliding_window": 4096}
    assert ModelConfig.from_hf(mistral_v01).sliding_window == 4096
    # Qwen carries sliding_window but only uses it with use_sliding_window.
    assert ModelConfig.from_hf(QWEN25_7B).sliding_window is None
    qwen_sw = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096}
    assert ModelConfig.from_hf(qwen_sw).sliding_window == 4096


def test_from_hf_rejects_unsupported_and_incomplete():
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as exc:
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert all(a in str(exc.value) for a in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    incomplete = {k: v for k, v in QWEN3_8B.items() if k != "num_attention_heads"}
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_hf(incomplete)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({**QWEN3_8B, "num_key_value_heads": 5})
