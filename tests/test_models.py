"""Tests for specscope.models.llama: logits parity with HF transformers, taps, KV-cached decoding.

Every family is built as a tiny random HF model (fp32, CPU), saved with `save_pretrained` and
loaded back through `specscope.models.loader.load_model`, so the checkpoint mapping (fused
q/k/v and gate/up rows, biases, q/k norms, tied heads) is exercised end to end.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specscope.kvcache import KVCache
from specscope.models.llama import CausalLM
from specscope.models.loader import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers")

VOCAB = 128
LAYERS = 4
ATOL = 1e-4
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
LLAMA3_ROPE = {
    # original context 16 with head_dim 8 puts one frequency in each llama3 band (kept,
    # smoothed, divided by factor), so every branch of the scaling matters for the logits.
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (HF config class name, overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "llama3_rope": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "llama2": ("LlamaConfig", {"num_key_value_heads": 4, "rope_theta": 10000.0}),  # MHA
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama_linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("MistralConfig", {"sliding_window": None, "rope_theta": 1e6}),
    "mistral_sw": ("MistralConfig", {"sliding_window": 4, "rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6}),
    # head_dim 16 != hidden 32 / 4 heads: the explicit head_dim must be honoured.
    "qwen3": ("Qwen3Config", {"head_dim": 16, "rope_theta": 1e6}),
}
PARITY_FAMILIES = [f for f in FAMILIES if f != "mistral_sw"]  # sliding window: own test


def hf_config(family: str, **extra: Any):
    cls_name, overrides = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**BASE, **overrides, **extra})


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF zero-inits biases and one-inits norms: randomise everything so all of it matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def build_hf(family: str, seed: int = 0, attn: str | None = None, **extra: Any):
    kwargs = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family, **extra), dtype=torch.float32, **kwargs)
    randomize_(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, saved dir, our loaded CausalLM), built once per module."""
    cache: dict[str, tuple[Any, Path, CausalLM]] = {}

    def get(family: str):
        if family not in cache:
            hf = build_hf(family, seed=len(cache) + 1)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            cache[family] = (hf, path, load_model(path).model)
        return cache[family]

    return get


def rand_ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def positions(B: int, start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end).expand(B, -1)


@torch.no_grad()
def full_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """No-cache full recompute (the reference path)."""
    B, T = ids.shape
    hidden, taps = model(ids, positions(B, 0, T))
    assert taps is None
    return model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# -- 1. logits parity with HF ---------------------------------------------------------------


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_logits_match_hf(saved, family):
    hf, _, model = saved(family)
    ids = rand_ids(2, 17, seed=1)
    ours, ref = full_logits(model, ids), hf_logits(hf, ids)
    assert ours.dtype == torch.float32
    assert ours.shape == (2, 17, VOCAB)
    assert ref.abs().max() > 0.1  # the comparison is not vacuous
    assert max_diff(ours, ref) <= ATOL


def test_family_flags_reach_the_model(saved):
    """The randomised biases / norms / head_dim actually made it into our modules."""
    _, _, qwen2 = saved("qwen2")
    attn = qwen2.model.layers[0].self_attn
    assert qwen2.config.qkv_bias and attn.qkv_proj.bias is not None
    assert attn.qkv_proj.bias.abs().min() > 0  # no zero (HF-init) bias rows left
    assert attn.q_norm is None
    _, _, qwen3 = saved("qwen3")
    attn = qwen3.model.layers[0].self_attn
    assert qwen3.config.head_dim == 16 and qwen3.config.qk_norm
    assert attn.q_norm is not None and not torch.equal(attn.q_norm.weight, torch.ones(16))
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 32)
    _, _, llama3 = saved("llama3_rope")
    assert llama3.config.rope_scaling_dict["rope_type"] == "llama3"
    assert llama3.config.rope_theta == 500000.0
    _, _, llama2 = saved("llama2")
    assert llama2.config.num_kv_heads == llama2.config.num_heads == 4
    _, _, tied = saved("llama_tied")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_llama3_rope_scaling_changes_logits(saved):
    """Guard against the llama3 parity passing because the scaling were a no-op."""
    hf, _, model = saved("llama3_rope")
    ids = rand_ids(1, 17, seed=2)
    plain = CausalLM(dataclasses.replace(model.config, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    assert max_diff(full_logits(plain.eval(), ids), hf_logits(hf, ids)) > 1e-3


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("qwen3", {"attention_bias": True}),  # HF Qwen3 biases q/k/v and o
        ("mistral", {"attention_bias": True}),  # HF Mistral ignores the flag: no biases
    ],
)
def test_attention_bias_flag_matches_hf(tmp_path, family, extra):
    hf = build_hf(family, seed=11, **extra)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path).model
    ids = rand_ids(2, 17, seed=12)
    assert max_diff(full_logits(model, ids), hf_logits(hf, ids)) <= ATOL


def test_unsupported_rope_type_is_a_clear_error(tmp_path):
    """yarn is not implemented: loading must fail naming the type, never run with wrong rope."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    build_hf("qwen2", rope_scaling=rope).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="yarn"):
        load_model(tmp_path)


@pytest.mark.parametrize("family", ["llama_tied", "qwen2"])
def test_sharded_checkpoint_loads_and_matches(tmp_path, family):
    hf = build_hf(family, seed=7)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) >= 2
    assert not (tmp_path / "model.safetensors").exists()
    model = load_model(tmp_path).model
    ids = rand_ids(2, 17, seed=3)
    assert max_diff(full_logits(model, ids), hf_logits(hf, ids)) <= ATOL


# -- 2. taps -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_taps_match_hf_hidden_states(saved, family):
    hf, _, model = saved(family)
    L = model.config.num_layers
    assert L == LAYERS
    tap_ids = [0, L // 2 - 1, L - 2]
    model.set_taps(tap_ids)
    try:
        ids = rand_ids(2, 9, seed=4)
        with torch.no_grad():
            hidden, taps = model(ids, positions(2, 0, 9), return_taps=True)
            ref = hf(ids, output_hidden_states=True).hidden_states
        H = model.config.hidden_size
        assert taps.shape == (2, 9, len(tap_ids) * H)
        assert len(ref) == L + 1
        for j, k in enumerate(tap_ids):  # output of layer k == HF hidden_states[k + 1]
            assert max_diff(taps[..., j * H:(j + 1) * H], ref[k + 1]) <= ATOL, k
        # HF's last entry is post-norm: it equals our returned (normed) hidden.
        assert max_diff(hidden, ref[L]) <= ATOL
        # Tapping the last layer gives the pre-norm residual: norm(tap) == hidden.
        model.set_taps([L - 1])
        with torch.no_grad():
            hidden2, last = model(ids, positions(2, 0, 9), return_taps=True)
            assert last.shape == (2, 9, H)
            assert max_diff(model.model.norm(last), hidden2) <= 1e-6
            assert max_diff(last, hidden2) > 1e-2  # and it is not already normed
        # Without return_taps, no taps even when configured.
        with torch.no_grad():
            hidden3, none = model(ids, positions(2, 0, 9))
        assert none is None
        assert torch.equal(hidden3, hidden2)
    finally:
        model.set_taps([])


def test_taps_order_follows_set_taps(saved):
    _, _, model = saved("llama")
    ids = rand_ids(1, 5, seed=5)
    H = model.config.hidden_size
    try:
        with torch.no_grad():
            model.set_taps([0, 2])
            _, a = model(ids, positions(1, 0, 5), return_taps=True)
            model.set_taps([2, 0])
            _, b = model(ids, positions(1, 0, 5), return_taps=True)
        assert torch.equal(a[..., :H], b[..., H:]) and torch.equal(a[..., H:], b[..., :H])
    finally:
        model.set_taps([])


@pytest.mark.parametrize("bad", [[LAYERS], [0, -2], [0, 1, 99]])
def test_set_taps_out_of_range_raises(saved, bad):
    _, _, model = saved("llama")
    before = model.tap_layer_ids
    with pytest.raises(ValueError, match="out of range") as exc:
        model.set_taps(bad)
    assert str([i for i in bad if not -1 <= i < LAYERS]) in str(exc.value)
    assert model.tap_layer_ids == before  # a failed call changes nothing


def test_return_taps_without_set_taps_raises(saved):
    _, _, model = saved("llama")
    model.set_taps([])
    with pytest.raises(ValueError, match="set_taps"), torch.no_grad():
        model(rand_ids(1, 3), positions(1, 0, 3), return_taps=True)


# -- 3. KV-cached decoding == full recompute ------------------------------------------------


def make_cache(model: CausalLM, B: int, capacity: int) -> KVCache:
    cfg = model.config
    return KVCache(cfg.num_layers, B, cfg.num_kv_heads, capacity, cfg.head_dim,
                   torch.float32, "cpu")


def kv_len_for(mode: str, end: int, capacity: int) -> int | None:
    if mode == "tight":
        return end
    if mode == "block":  # what the runner does: round up to a block, capped at capacity
        return min(-(-end // 8) * 8, capacity)
    return None  # default: the whole cache


@torch.no_grad()
def cached_logits(model: CausalLM, ids: torch.Tensor, prompt_len: int, chunk: int,
                  kv_mode: str = "tight", capacity: int = 40) -> torch.Tensor:
    """Prefill ids[:, :prompt_len] into a fresh cache, then feed the rest `chunk` at a time."""
    B, T = ids.shape
    cache = make_cache(model, B, capacity)
    bounds = [0, prompt_len, *range(prompt_len + chunk, T, chunk), T]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        hidden, _ = model(ids[:, s:e], positions(B, s, e), cache,
                          kv_len=kv_len_for(kv_mode, e, capacity))
        outs.append(model.compute_logits(hidden))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral_sw"])
def test_cached_decode_equals_full_recompute(saved, family, chunk, B):
    _, _, model = saved(family)
    ids = rand_ids(B, 20, seed=6)
    ref = full_logits(model, ids)
    ours = cached_logits(model, ids, prompt_len=6, chunk=chunk)
    assert max_diff(ours, ref) <= ATOL


@pytest.mark.parametrize("kv_mode", ["tight", "block", "capacity"])
def test_cached_decode_kv_len_modes(saved, kv_mode):
    """Slots past the written prefix (zeros) must stay masked however wide kv_len is."""
    _, _, model = saved("llama3_rope")
    ids = rand_ids(2, 19, seed=7)
    ref = full_logits(model, ids)
    assert max_diff(cached_logits(model, ids, 5, 1, kv_mode, capacity=32), ref) <= ATOL
    assert max_diff(cached_logits(model, ids, 5, 3, kv_mode, capacity=32), ref) <= ATOL


@pytest.mark.parametrize("family", ["llama_tied", "mistral_sw", "qwen3"])
def test_greedy_generation_cached_equals_recompute(saved, family):
    hf, _, model = saved(family)
    prompt = rand_ids(1, 5, seed=8)
    steps = 24
    # Greedy with the cache: prefill, then one token per step.
    cache = make_cache(model, 1, prompt.shape[1] + steps)
    with torch.no_grad():
        hidden, _ = model(prompt, positions(1, 0, 5), cache, kv_len=5)
        tok = model.compute_logits(hidden[:, -1]).argmax(-1)
        cached = [tok.item()]
        for t in range(5, 5 + steps - 1):
            hidden, _ = model(tok[:, None], positions(1, t, t + 1), cache, kv_len=t + 1)
            tok = model.compute_logits(hidden[:, -1]).argmax(-1)
            cached.append(tok.item())
    # Greedy by re-running the whole sequence without a cache each step (ours and HF's).
    seq = prompt
    recomputed, hf_tokens = [], []
    for _ in range(steps):
        nxt = full_logits(model, seq)[:, -1].argmax(-1)
        hf_tokens.append(hf_logits(hf, seq)[:, -1].argmax(-1).item())
        recomputed.append(nxt.item())
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert cached == recomputed
    assert hf_tokens == recomputed
    assert len(set(cached)) > 1  # not a degenerate constant stream


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_matches_hf(saved, attn):
    """Mistral with sliding_window=4 over 17 tokens: the window mask must match HF's."""
    saved_hf, _, model = saved("mistral_sw")
    assert model.config.sliding_window == 4
    hf = build_hf("mistral_sw", attn=attn)
    hf.load_state_dict(saved_hf.state_dict())
    assert hf.config._attn_implementation == attn
    ids = rand_ids(2, 17, seed=9)
    ref = hf_logits(hf, ids)
    assert max_diff(full_logits(model, ids), ref) <= ATOL
    # The window matters over 17 tokens: without it the logits differ.
    no_window = CausalLM(dataclasses.replace(model.config, sliding_window=None))
    no_window.load_state_dict(model.state_dict())
    assert max_diff(full_logits(no_window.eval(), ids), ref) > 1e-3


def test_tap_minus_one_is_the_embedding_output(saved):
    """Id -1 taps the embedding output (input to layer 0, vLLM's input-to-layer 0)."""
    _, _, model = saved("llama")
    ids = rand_ids(1, 5, seed=6)
    try:
        with torch.no_grad():
            model.set_taps([-1, 1])
            _, taps = model(ids, positions(1, 0, 5), return_taps=True)
        H = model.config.hidden_size
        assert torch.equal(taps[..., :H], model.model.embed_tokens(ids))
    finally:
        model.set_taps([])
