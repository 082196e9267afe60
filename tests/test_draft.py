"""Tests for specscope.draft: the EAGLE-3 head, its three checkpoint formats, strict loading.

A tiny random target (8 layers, vocab 96) and tiny random drafts (draft vocab 40, a random
subset of the target's) are saved in each format and loaded back; the head itself is checked
against an independent slow reference written here with plain tensor ops, and its KV-cached
forward against its full recompute.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specscope.config import ModelConfig
from specscope.draft.eagle3 import (
    DraftConfig,
    Eagle3Draft,
    default_layer_ids,
    random_draft,
)
from specscope.draft.formats import FORMATS, config_dict, save_draft
from specscope.draft.loader import load_draft
from specscope.draft.vocab import check_vocab_maps, vocab_maps
from specscope.kvcache import KVCache
from specscope.models.llama import CausalLM
from specscope.models.loader import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

V, L, HT, VD = 96, 8, 32, 40
IDS = (0, 3, 6)  # output-of-layer, not the default, so conversions show
LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 16), ("rope_type", "llama3"))
TARGET_HF: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=HT, intermediate_size=64,
    num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)

# name -> (DraftConfig overrides, formats that can express it)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "plain": ({}, FORMATS),
    "eagle31": ({"fc_norm": True, "norm_before_residual": True}, FORMATS),
    "norm_before_fc": ({"norm_before_fc": True}, FORMATS),
    "full_vocab": ({"draft_vocab_size": V}, FORMATS),
    "own_embed": ({"hidden_size": 48, "head_dim": 12}, ("sglang", "speculators")),
    "multi_layer": ({"num_layers": 2, "qk_norm": True, "attention_bias": True,
                     "mlp_bias": True, "norm_output": True}, ("speculators",)),
}
ROUNDTRIPS = [(f, v) for v, (_, fmts) in VARIANTS.items() for f in fmts]


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return random_model(ModelConfig.from_hf(TARGET_HF, name="tiny"), torch.float32, "cpu")


def make_draft(target: CausalLM, seed: int = 1, layer_ids: tuple[int, ...] | None = IDS,
               **overrides: Any) -> Eagle3Draft:
    fields: dict[str, Any] = dict(intermediate_size=48, rms_norm_eps=1e-5, rope_theta=5e5,
                                  rope_scaling=LLAMA3_ROPE, draft_vocab_size=VD)
    fields.update(overrides)
    vd = fields.pop("draft_vocab_size")
    draft = random_draft(target.config, torch.float32, "cpu", layer_ids=layer_ids,
                         draft_vocab_size=vd, seed=seed, std=0.3, **fields)
    draft.attach_target(target)
    return draft


def inputs(B: int = 2, T: int = 7, seed: int = 0, taps: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    tap = torch.randn(B, T, taps * HT, generator=g)
    pos = torch.arange(T)[None].expand(B, T)
    return ids, tap, pos


def run(draft: Eagle3Draft, ids, taps, pos):
    h, normed = draft(ids, draft.project(taps), pos)
    return h, normed, draft.compute_logits(normed)


def read_cfg(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def write_cfg(d: Path, cfg: dict[str, Any]) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


@pytest.fixture
def sglang_dir(tmp_path, target) -> Path:
    draft = make_draft(target)
    return save_draft(draft, draft.config, tmp_path / "sglang", "sglang")


# -- 1. the head: independent reference, cache, vocab maps ---------------------------------

def reference_forward(draft: Eagle3Draft, target: CausalLM, ids, taps, pos):
    """EAGLE-3 written out with unfused weights and explicit attention (slow reference)."""
    cfg, W = draft.config, draft.canonical_state()
    eps, d = cfg.rms_norm_eps, cfg.head_dim

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def lin(x, name):
        y = x @ W[name + ".weight"].T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    def rope(x):  # x [B, T, n, d], default rope with the draft's own theta
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
        ang = pos[..., None].float() * inv  # [B, T, d/2]
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    x = taps
    if cfg.norm_before_fc:
        x = rms(x, W["input_norm.weight"])
    if cfg.fc_norm:
        x = torch.cat([rms(c, W[f"fc_norm.{i}.weight"]) for i, c in enumerate(x.split(HT, -1))],
                      -1)
    h = lin(x, "fc")
    B, T = ids.shape
    emb = target.model.embed_tokens.weight[ids]
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        if layer == 0:
            g = rms(h, W[p + "hidden_norm.weight"])
            residual = g if cfg.norm_before_residual else h
            a_in = torch.cat((rms(emb, W[p + "input_layernorm.weight"]), g), -1)
        else:
            residual, a_in = h, rms(h, W[p + "input_layernorm.weight"])
        a = p + "self_attn."
        q = lin(a_in, a + "q_proj").view(B, T, cfg.num_heads, d)
        k = lin(a_in, a + "k_proj").view(B, T, cfg.num_kv_heads, d)
        v = lin(a_in, a + "v_proj").view(B, T, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q, k = rms(q, W[a + "q_norm.weight"]), rms(k, W[a + "k_norm.weight"])
        q, k = rope(q), rope(k)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, -1)
        h = residual + lin(o, a + "o_proj")
        m = rms(h, W[p + "post_attention_layernorm.weight"])
        mp = p + "mlp."
        h = h + lin(torch.nn.functional.silu(lin(m, mp + "gate_proj")) * lin(m, mp + "up_proj"),
                    mp + "down_proj")
    normed = rms(h, W["norm.weight"])
    return h, normed, normed @ W["lm_head.weight"].T


@pytest.mark.parametrize("variant", ["plain", "eagle31", "norm_before_fc", "multi_layer"])
def test_forward_matches_reference(target, variant):
    over = {**VARIANTS[variant][0], "rope_scaling": None}  # the reference has default rope
    draft = make_draft(target, **over)
    ids, taps, pos = inputs()
    h, normed, logits = run(draft, ids, taps, pos)
    ref_h, ref_normed, ref_logits = reference_forward(draft, target, ids, taps, pos)
    torch.testing.assert_close(normed, ref_normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_normed if draft.config.norm_output else ref_h,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert logits.shape == (2, 7, VD) and logits.dtype == torch.float32


def test_draft_uses_its_own_rope_and_embedding(target):
    """Changing the draft's theta changes its output; the embedding is the target's."""
    ids, taps, pos = inputs()
    a = run(make_draft(target, rope_theta=5e5), ids, taps, pos)[1]
    b = run(make_draft(target, rope_theta=1e4), ids, taps, pos)[1]
    assert (a - b).abs().max() > 1e-3
    draft = make_draft(target)
    torch.testing.assert_close(draft.embed(ids), target.model.embed_tokens(ids))
    assert "embed_tokens.weight" not in draft.state_dict()


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "multi_layer"])
def test_cached_forward_equals_full(target, chunk, variant):
    draft = make_draft(target, **VARIANTS[variant][0])
    ids, taps, pos = inputs(T=9)
    hidden = draft.project(taps)
    ref_h, ref_normed = draft(ids, hidden, pos)
    cfg = draft.config
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim, torch.float32, "cpu")
    outs = []
    for s in range(0, 9, chunk):
        e = min(9, s + chunk)
        outs.append(draft(ids[:, s:e], hidden[:, s:e], pos[:, s:e], cache, kv_len=e))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], 1), ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], 1), ref_normed, atol=1e-5,
                               rtol=1e-5)


def test_vocab_maps_and_to_target(target):
    draft = make_draft(target)
    check_vocab_maps(draft.d2t, draft.t2d, V, VD)
    targets = draft.to_target(torch.arange(VD))
    assert torch.equal(targets, torch.nonzero(draft.t2d).flatten())
    d2t, t2d = vocab_maps(torch.tensor([5, 1, 90]), V)
    assert d2t.tolist() == [1, 4, 88] and t2d.sum() == 3 and t2d[90]
    with pytest.raises(ValueError, match="inconsistent"):
        check_vocab_maps(d2t.flip(0), t2d, V, 3)


def test_attach_target_checks_the_target(target):
    other = random_model(ModelConfig.from_hf({**TARGET_HF, "vocab_size": V + 4}),
                         torch.float32, "cpu")
    with pytest.raises(ValueError, match="vocab size 100"):
        make_draft(target).attach_target(other)


def test_default_layer_ids():
    assert default_layer_ids(32) == (1, 15, 28)  # Llama-3.1-8B: input-to-layer [2, 16, 29]
    assert default_layer_ids(8) == (1, 3, 4)
    assert default_layer_ids(2) == (0, 0, 1)  # clamped for tiny models


def test_draft_config_validates():
    base = dict(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                num_layers=1, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT, target_num_layers=L,
                aux_layer_ids=IDS)
    DraftConfig(**base)
    with pytest.raises(ValueError, match="mutually exclusive"):
        DraftConfig(**base, fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match=r"\[8\] out of range"):
        DraftConfig(**{**base, "aux_layer_ids": (0, 3, 8)})
    with pytest.raises(ValueError, match="own_embed_tokens"):
        DraftConfig(**{**base, "hidden_size": 48, "head_dim": 12})


# -- 2. formats: save, load back, identical ------------------------------------------------

@pytest.mark.parametrize("fmt,variant", ROUNDTRIPS)
def test_roundtrip(tmp_path, target, fmt, variant):
    over = dict(VARIANTS[variant][0])
    ids = None if fmt == "eagle" else IDS  # EAGLE's taps are hard-wired to the default
    draft = make_draft(target, layer_ids=ids, **over)
    out = save_draft(draft, draft.config, tmp_path / fmt, fmt)
    assert (out / "model.safetensors").exists()  # every format: no pickle is written
    assert not (out / "pytorch_model.bin").exists()
    loaded = load_draft(out, target.config, dtype=torch.float32, device="cpu")
    assert loaded.source_format == fmt
    provenance = ("source_format", "layer_ids_source", "layer_ids_convention")
    assert dataclasses.replace(loaded.config, **{f: "" for f in provenance}) == \
        dataclasses.replace(draft.config, **{f: "" for f in provenance})
    assert loaded.config.aux_layer_ids == (ids or default_layer_ids(L))
    want, got = draft.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    loaded.model.attach_target(target)
    x = inputs()
    for a, b in zip(run(draft, *x), run(loaded.model, *x), strict=True):
        assert torch.equal(a, b)


def test_eagle_format_from_pytorch_model_bin_and_bf16(tmp_path, target):
    """Official EAGLE drafts ship as pytorch_model.bin (we write model.safetensors): both
    load; any dtype loads."""
    from safetensors.torch import load_file

    draft = make_draft(target, layer_ids=None)
    d = save_draft(draft, draft.config, tmp_path / "eagle", "eagle")
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    loaded = load_draft(d, target.config, dtype=torch.bfloat16)
    assert loaded.source_format == "eagle"
    assert loaded.model.fc.weight.dtype == torch.bfloat16
    assert loaded.model.d2t.dtype == torch.int64 and loaded.model.t2d.dtype == torch.bool
    assert torch.equal(loaded.model.fc.weight, draft.fc.weight.bfloat16())


def test_layout_covers_every_parameter(target):
    for over, _ in VARIANTS.values():
        draft = make_draft(target, **over)
        covered = {param for param, _, _ in draft.checkpoint_layout().values()}
        assert covered == {n for n, _ in draft.named_parameters()}


def test_written_names_and_conventions(tmp_path, target):
    draft = make_draft(target, fc_norm=True)
    sg = save_draft(draft, draft.config, tmp_path / "sg", "sglang")
    sp = save_draft(draft, draft.config, tmp_path / "sp", "speculators")
    sg_names, sp_names = set(load_file(str(sg / "model.safetensors"))), \
        set(load_file(str(sp / "model.safetensors")))
    assert {"midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "fc.weight",
            "fc_norm.2.weight", "d2t", "t2d", "lm_head.weight"} <= sg_names
    assert not any(n.startswith("layers.") for n in sg_names)
    assert {"layers.0.self_attn.q_proj.weight", "d2t", "t2d"} <= sp_names
    assert "embed_tokens.weight" not in sg_names | sp_names  # borrowed from the target
    assert read_cfg(sg)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    assert read_cfg(sg)["architectures"] == ["LlamaForCausalLMEagle3"]
    sp_cfg = read_cfg(sp)
    assert sp_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]  # input-to-layer
    assert sp_cfg["speculators_model_type"] == "eagle3"
    assert sp_cfg["transformer_layer_config"]["vocab_size"] == V
    with pytest.raises(ValueError, match="hard-wired"):
        config_dict(draft.config, "eagle")


def test_speculators_aliases_and_defaults(tmp_path, target):
    """vLLM's draft_id_to_target_id name loads as d2t; a missing norm_before_residual means
    True (vLLM's reading of speculators configs)."""
    draft = make_draft(target, norm_before_residual=True)
    d = save_draft(draft, draft.config, tmp_path / "sp", "speculators")
    edit_tensors(d, lambda t: t.update(draft_id_to_target_id=t.pop("d2t")))
    cfg = read_cfg(d)
    del cfg["norm_before_residual"]
    write_cfg(d, cfg)
    loaded = load_draft(d, target.config)
    assert loaded.config.norm_before_residual
    assert torch.equal(loaded.model.d2t, draft.d2t)


def test_checkpoint_embedding_is_ignored_when_widths_match(sglang_dir, target):
    edit_tensors(sglang_dir, lambda t: t.update({"embed_tokens.weight": torch.zeros(V, HT)}))
    loaded = load_draft(sglang_dir, target.config)
    assert "embed_tokens.weight is ignored" in loaded.message
    loaded.model.attach_target(target)
    ids = inputs()[0]
    torch.testing.assert_close(loaded.model.embed(ids), target.model.embed_tokens(ids))


def test_borrowed_lm_head(sglang_dir, target):
    """draft_vocab_size null and no lm_head: the target's lm_head over the whole vocab."""
    edit_tensors(sglang_dir, lambda t: [t.pop(k) for k in ("lm_head.weight", "d2t", "t2d")])
    cfg = read_cfg(sglang_dir)
    cfg["draft_vocab_size"] = None
    write_cfg(sglang_dir, cfg)
    loaded = load_draft(sglang_dir, target.config)
    assert not loaded.config.has_lm_head and loaded.config.draft_vocab_size == V
    assert "lm_head borrowed from the target" in loaded.message
    draft = loaded.model
    assert draft.d2t.eq(0).all() and draft.t2d.all()
    draft.attach_target(target)
    _, normed, logits = run(draft, *inputs())
    torch.testing.assert_close(logits, target.compute_logits(normed))
    assert torch.equal(draft.to_target(torch.arange(V)), torch.arange(V))


# -- 3. strict loading: every violation is an error naming it ------------------------------

def _rm(name):
    return lambda t: t.pop(name)


STRICT_CASES: dict[str, tuple[Any, Any, str]] = {
    # name -> (tensor edit, config edit, error pattern)
    "missing": (_rm("midlayer.mlp.down_proj.weight"), None,
                r"missing tensors: midlayer\.mlp\.down_proj\.weight"),
    "unexpected": (lambda t: t.update({"midlayer.extra.weight": torch.zeros(3)}), None,
                   r"unexpected tensors: midlayer\.extra\.weight"),
    "fc_width": (lambda t: t.update({"fc.weight": torch.zeros(HT, 2 * HT)}), None,
                 r"fc\.weight has shape \[32, 64\], expected \[32, 96\] \(fc input = num_taps "
                 r"3 x target hidden 32\)"),
    "vocab": (None, lambda c: c.update(vocab_size=V + 1), r"vocab_size 97 != the target's 96"),
    "target_hidden": (None, lambda c: c.update(target_hidden_size=64),
                      r"target_hidden_size 64 != the target's hidden_size 32"),
    "draft_vocab": (None, lambda c: c.update(draft_vocab_size=VD + 1),
                    r"lm_head\.weight has shape \[40, 32\], expected \[41, 32\]"),
    "t2d_length": (lambda t: t.update(t2d=torch.ones(V + 1, dtype=torch.bool)), None,
                   r"t2d has shape \[97\], expected \[96\]"),
    "d2t_permuted": (lambda t: t.update(d2t=t["d2t"][torch.randperm(VD)]), None,
                     r"d2t/t2d are inconsistent"),
    "d2t_missing": (_rm("d2t"), None, r"missing tensors: d2t"),
    "ids_out_of_range": (None, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[0, 3, 99]), r"\[99\] out of range for a 8-layer"),
    "lm_head_missing": (_rm("lm_head.weight"), None, r"missing tensors: lm_head\.weight"),
    "duplicate": (lambda t: t.update({"layers.0.hidden_norm.weight":
                                      t["midlayer.hidden_norm.weight"].clone()}), None,
                  r"same tensor twice: layers\.0\.hidden_norm\.weight and "
                  r"midlayer\.hidden_norm\.weight"),
    "not_a_draft": (None, lambda c: c.update(architectures=["Qwen2ForCausalLM"]),
                    r"not an EAGLE-3 draft config"),
    "multi_layer_sglang": (None, lambda c: c.update(num_hidden_layers=2),
                           r"num_hidden_layers 2: sglang drafts have one decoder layer"),
    "activation": (None, lambda c: c.update(hidden_act="gelu"), r"hidden_act 'gelu'"),
}


@pytest.mark.parametrize("case", list(STRICT_CASES))
def test_strict_loading_errors(sglang_dir, target, case):
    tensor_edit, cfg_edit, pattern = STRICT_CASES[case]
    if tensor_edit is not None:
        torch.manual_seed(0)
        edit_tensors(sglang_dir, tensor_edit)
    if cfg_edit is not None:
        cfg = read_cfg(sglang_dir)
        cfg_edit(cfg)
        write_cfg(sglang_dir, cfg)
    with pytest.raises(ValueError, match=pattern):
        load_draft(sglang_dir, target.config)


def test_override_with_wrong_tap_count_names_fc(sglang_dir, target):
    with pytest.raises(ValueError, match=r"fc\.weight has shape \[32, 96\], expected \[32, 64\]"):
        load_draft(sglang_dir, target.config, layer_ids=[2, 5])


def test_override_out_of_range(sglang_dir, target):
    with pytest.raises(ValueError, match=r"from the layer_ids override.*\[8\] out of range"):
        load_draft(sglang_dir, target.config, layer_ids=[0, 3, 8])


def test_speculators_input_id_zero_is_the_embedding(tmp_path, target):
    """Input-to-layer id 0 is the embedding output: output-of-layer id -1, which the target
    can tap (vLLM allows it); -2 does not exist."""
    draft = make_draft(target)
    d = save_draft(draft, draft.config, tmp_path / "sp", "speculators")
    cfg = read_cfg(d)
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 4, 7]
    write_cfg(d, cfg)
    assert load_draft(d, target.config).config.aux_layer_ids == (-1, 3, 6)
    cfg["eagle_aux_hidden_state_layer_ids"] = [-1, 4, 7]
    write_cfg(d, cfg)
    with pytest.raises(ValueError, match=r"\[-2\] out of range"):
        load_draft(d, target.config)


def test_own_embedding_required_when_widths_differ(tmp_path, target):
    draft = make_draft(target, hidden_size=48, head_dim=12)
    d = save_draft(draft, draft.config, tmp_path / "sg", "sglang")
    edit_tensors(d, _rm("embed_tokens.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: embed_tokens\.weight"):
        load_draft(d, target.config)


# -- 4. layer-id resolution messages -------------------------------------------------------

def _saved(tmp_path, target, fmt, ids=IDS):
    draft = make_draft(target, layer_ids=ids)
    return save_draft(draft, draft.config, tmp_path / fmt, fmt)


def test_message_sglang(tmp_path, target, caplog):
    with caplog.at_level(logging.INFO, logger="specscope.draft"):
        loaded = load_draft(_saved(tmp_path, target, "sglang"), target.config)
    want = ("draft layer ids [0, 3, 6] (output-of-layer) from "
            "eagle_config.eagle_aux_hidden_state_layer_ids [0, 3, 6] (output-of-layer, used "
            "as-is) (sglang format)")
    assert loaded.message == want
    assert want in caplog.text
    assert loaded.config.layer_ids_source == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert loaded.config.layer_ids_convention == "output-of-layer"


def test_message_speculators(tmp_path, target):
    loaded = load_draft(_saved(tmp_path, target, "speculators"), target.config)
    assert loaded.message == (
        "draft layer ids [0, 3, 6] (output-of-layer) from eagle_aux_hidden_state_layer_ids "
        "[1, 4, 7] (input-to-layer, minus 1) (speculators format)")
    assert loaded.config.layer_ids_convention == "input-to-layer"


def test_message_eagle(tmp_path, target):
    loaded = load_draft(_saved(tmp_path, target, "eagle", ids=None), target.config)
    assert loaded.message == (
        "draft layer ids [1, 3, 4] (output-of-layer) from EAGLE's hard-wired taps [2, 4, 5] "
        "(input-to-layer, minus 1) (eagle format)")
    assert loaded.config.layer_ids_source == "eagle-hardwired"


def test_message_override(tmp_path, target):
    loaded = load_draft(_saved(tmp_path, target, "sglang"), target.config, layer_ids=[5, 1, 2])
    assert loaded.config.aux_layer_ids == (1, 2, 5)
    assert loaded.config.layer_ids_source == "override"
    assert loaded.message == (
        "draft layer ids [1, 2, 5] (output-of-layer) from the layer_ids override (the "
        "config's eagle_config.eagle_aux_hidden_state_layer_ids [0, 3, 6], output-of-layer, "
        "is not used), sorted into layer order (taps are captured in layer order) "
        "(sglang format)")


def test_message_default(tmp_path, target):
    d = _saved(tmp_path, target, "sglang")
    cfg = read_cfg(d)
    del cfg["eagle_config"]
    write_cfg(d, cfg)
    loaded = load_draft(d, target.config)
    assert loaded.config.aux_layer_ids == (1, 3, 4)
    assert loaded.message == (
        "draft layer ids [1, 3, 4] (output-of-layer) from the EAGLE-3 default "
        "[1, L//2-1, L-4] for a 8-layer target (the config has no "
        "eagle_config.eagle_aux_hidden_state_layer_ids) (sglang format)")
