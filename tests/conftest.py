"""Shared fixtures: a session cache dir, the converted default model, a tiny random model.

Everything here is generic and session-scoped, so the (slow) GGUF conversion of the
default model runs at most once per test session.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

# The Triton attention tests run on Triton's CPU interpreter where there is no GPU. Triton
# reads the switch when it is first imported, and torch.compile imports it too, so it is
# set here, before any test module loads. (No effect where triton is not installed.)
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not pathlib.Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tokenizer files copied from the default model into the tiny random model's directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: intra-op threads only add hand-off overhead (10-100x slower on a small
    shared CPU). Modules opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`;
    the previous setting is restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def specscope_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Cache root for GGUF conversions: $SPECSCOPE_CACHE_DIR if set, else a session tmp dir."""
    env = os.environ.get("SPECSCOPE_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return tmp_path_factory.mktemp("specscope_cache")


@pytest.fixture(scope="session")
def default_model_dir(specscope_cache_dir: pathlib.Path) -> pathlib.Path:
    """The default SmolLM2-135M-Instruct GGUF converted into a HF directory (cached)."""
    from specscope.models import gguf

    try:
        src = gguf.default_model_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"default model unavailable: {e}")
    return gguf.gguf_to_hf_dir(src, specscope_cache_dir)


def make_tiny_llama_dir(out: pathlib.Path, tokenizer_dir: pathlib.Path, *, seed: int = 0,
                        hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, intermediate_size: int = 128,
                        max_position_embeddings: int = 256, tie_word_embeddings: bool = False,
                        weight_std: float = 0.3) -> pathlib.Path:
    """Write a random-weight Llama checkpoint with the tokenizer of `tokenizer_dir` to `out`.

    Weights are drawn with a large std (not HF's 0.02) so logits are well spread: greedy
    argmax has no near-ties and sampling has real choices to make.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    cfg = LlamaConfig(
        vocab_size=tok_cfg["vocab_size"], hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok_cfg.get("bos_token_id"), eos_token_id=tok_cfg.get("eos_token_id"),
        pad_token_id=tok_cfg.get("pad_token_id"),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, weight_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory,
                   default_model_dir: pathlib.Path) -> pathlib.Path:
    """A 2-layer, hidden-64 random Llama (vocab 49152) with the default model's tokenizer."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_llama"), default_model_dir)


@pytest.fixture(scope="session")
def long_tiny_dir(tiny_model_dir: pathlib.Path,
                  tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny model with a 4096-token context (RoPE has no learned positions), so one
    stream can outlast the reaction to a signal."""
    out = tmp_path_factory.mktemp("tiny_long")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(cfg))
    return out
