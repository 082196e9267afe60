"""The default configuration on the CPU it runs on: quantization "auto" runs a GGUF's 4-bit
weights natively where the CPU has no native bf16 (AVX2), dense weights where it has, and
the AVX2 emulation (ATEN_CPU_CAPABILITY=avx2) counts as no native bf16."""

from __future__ import annotations

import json

import pytest
import torch

import specscope.engine.llm as llm_mod
from specscope.config import SamplingParams, SpecConfig
from specscope.engine.llm import LLM, cpu_has_native_bf16, resolve_quantization
from specscope.models.gguf import q4_linears

CPU = torch.device("cpu")


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(llm_mod, "cpu_has_native_bf16", lambda: False)


def test_explicit_modes_are_kept():
    for mode in ("none", "int4-gguf"):
        assert resolve_quantization(mode, None, CPU, "auto") == (mode, "")


def test_auto_keeps_dense_weights_where_int4_does_not_apply(no_native_bf16, tiny_model_dir):
    assert resolve_quantization("auto", None, torch.device("cuda"), "auto") == ("none", "")
    assert resolve_quantization("auto", str(tiny_model_dir), CPU, "auto") == ("none", "")
    assert resolve_quantization("auto", None, CPU, "fp32") == ("none", "")  # asked for
    assert resolve_quantization("auto", None, CPU, "auto", tensor_parallel_size=2)[0] == "none"


def test_auto_with_native_bf16_keeps_dense_bf16(monkeypatch):
    monkeypatch.setattr(llm_mod, "cpu_has_native_bf16", lambda: True)
    mode, why = resolve_quantization("auto", None, CPU, "auto")
    assert mode == "none" and "natively" in why


def test_avx2_emulation_counts_as_no_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_has_native_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_has_native_bf16()


def test_q4_linears_reads_the_conversion_record(tmp_path):
    def record(types):
        (tmp_path / "config.json").write_text(json.dumps(
            {"specscope_source": {"gguf": "m.gguf", "linear_types": types}}))
        return q4_linears(tmp_path)

    assert record(["Q4_1"]) and record(["Q4_0", "Q4_1"])
    assert not record(["Q4_1", "Q8_0"]) and not record([])
    (tmp_path / "config.json").write_text("{}")  # an HF checkpoint: no record
    assert not q4_linears(tmp_path)
    assert not q4_linears(tmp_path / "missing")


def test_default_model_on_an_avx2_cpu_runs_int4_and_speculation_stays_lossless(
        no_native_bf16, specscope_cache_dir):
    """The default model's GGUF is Q4_1: on a CPU without native bf16 auto picks int4-gguf
    (bf16 activations), says so, and greedy speculation equals greedy plain decoding."""
    llm = LLM(device="cpu", cache_dir=str(specscope_cache_dir), spec=None)
    assert llm.quantization == "int4-gguf" and llm.dtype == torch.bfloat16
    assert "4-bit" in llm.config_note
    params = SamplingParams(max_tokens=24)
    prompt = "The capital of France is"
    plain = llm.generate(prompt, params)[0].token_ids
    llm.set_spec(SpecConfig(draft="default", num_steps=3))
    assert llm.generate(prompt, params)[0].token_ids == plain
