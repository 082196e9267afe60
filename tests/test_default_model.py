"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) end to end, against HF.

specscope converts the GGUF itself and runs its own model code; the reference is HF
transformers loading the very same GGUF file with its own loader and modeling code.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import specscope
from specscope import SamplingParams
from specscope.cli import main

pytestmark = pytest.mark.slow

N_TOKENS = 32
RAW_PROMPT = "The capital of France is"
CHAT_PROMPT = [{"role": "user",
                "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def default_llm(specscope_cache_dir: pathlib.Path, default_model_dir: pathlib.Path):
    # Plain decoding, compared with HF's greedy (LLM() alone would load the shipped draft)
    llm = specscope.LLM(dtype="fp32", device="cpu", cache_dir=str(specscope_cache_dir),
                        spec=None)
    assert llm.model_path == default_model_dir  # the session's cached conversion
    return llm


@pytest.fixture(scope="module")
def hf_gguf():
    """(model, tokenizer) loaded by transformers straight from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specscope.models.gguf import default_model_gguf

    path = default_model_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def _hf_prompt_ids(tok, prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(tok(prompt)["input_ids"])
    enc = tok.apply_chat_template(prompt, add_generation_prompt=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """HF greedy generate() for exactly n tokens, not stopping at EOS (= ignore_eos)."""
    x = torch.tensor([prompt_ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, eos_token_id=None)
    ids = out[0, len(prompt_ids):].tolist()
    assert len(ids) == n, "HF generate stopped early: eos_token_id=None was not honoured"
    return ids


@pytest.mark.parametrize("prompt", [RAW_PROMPT, CHAT_PROMPT], ids=["raw", "chat"])
def test_greedy_matches_hf_gguf(default_llm, hf_gguf, prompt) -> None:
    model, tok = hf_gguf
    prompt_ids = _hf_prompt_ids(tok, prompt)
    assert default_llm.encode_prompt(prompt) == prompt_ids
    expected = _hf_greedy(model, prompt_ids, N_TOKENS)

    out = default_llm.generate(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == expected
    assert out.finish_reason == "length"
    assert out.text == tok.decode(expected, skip_special_tokens=True)

    # Without ignore_eos the engine stops at (and reports) the first EOS, if any.
    eos = tok.eos_token_id
    k = expected.index(eos) + 1 if eos in expected else N_TOKENS
    out = default_llm.generate(prompt, SamplingParams(max_tokens=N_TOKENS))[0]
    assert out.token_ids == expected[:k]
    assert out.finish_reason == ("stop" if eos in expected else "length")


def test_default_model_identity(default_llm) -> None:
    c = default_llm.model_config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert c.tie_word_embeddings
    assert default_llm.model_name == "default"
    assert default_llm.tokenizer.has_chat_template
    assert 2 in default_llm.tokenizer.eos_token_ids


# ---------------------------------------------------------------- CLI

CPU = ["--device", "cpu", "--dtype", "fp32"]


def test_cli_generate_json(capsys, specscope_cache_dir, default_llm) -> None:
    rc = main(["generate", "--prompt", "Hello", "--max-tokens", "8", "--json",
               "--cache-dir", str(specscope_cache_dir), *CPU])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert data["completion_tokens"] == len(data["token_ids"])
    assert 1 <= data["completion_tokens"] <= 8
    if data["finish_reason"] == "length":
        assert data["completion_tokens"] == 8
    else:
        assert data["finish_reason"] == "stop"
    ref = default_llm.generate("Hello", SamplingParams(max_tokens=8))[0]
    assert data["token_ids"] == ref.token_ids
    assert data["text"] == ref.text
    assert data["prompt_tokens"] == len(ref.prompt_token_ids)


def test_cli_generate_streams_text(capsys, specscope_cache_dir, default_llm) -> None:
    rc = main(["generate", "--prompt", "Hello", "--max-tokens", "8", "--chat",
               "--cache-dir", str(specscope_cache_dir), *CPU])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    ref = default_llm.generate("Hello", SamplingParams(max_tokens=8), chat=True)[0]
    assert captured.out == ref.text + "\n"
    assert "finish" in captured.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-k", "-5"], "top_k"),
        (["--model", "/nonexistent"], "/nonexistent"),
        (["--dtype", "fp8"], "dtype"),
    ],
)
def test_cli_errors_exit_2(capsys, specscope_cache_dir, args: list[str], needle: str) -> None:
    rc = main(["generate", "--prompt", "Hello", "--max-tokens", "4",
               "--cache-dir", str(specscope_cache_dir), *CPU, *args])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith("specscope: error:")
    assert needle in captured.err
    assert captured.out == ""


def test_cli_bad_messages_json(capsys, specscope_cache_dir) -> None:
    rc = main(["generate", "--messages", "[{not json", "--max-tokens", "2",
               "--cache-dir", str(specscope_cache_dir), *CPU])
    captured = capsys.readouterr()
    assert rc == 2
    assert "--messages" in captured.err


def test_cli_argparse_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--max-tokens", "many"])
    assert exc.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err
