"""The default configuration on the CPU it runs on: quantization "auto" runs a GGUF's 4-bit
weights natively (a draft beside them as Q8_0) where the native kernels build; the
dtype "auto" is bf16 only where the CPU computes it natively, and the AVX2 emulation
(ATEN_CPU_CAPABILITY=avx2) counts as no native bf16."""

from __future__ import annotations

import contextlib
import json

import torch

from specscope.config import SamplingParams, SpecConfig
from specscope.engine.llm import LLM
from specscope.engine.machine import cpu_has_native_bf16, resolve_dtype, resolve_quantization
from specscope.models.gguf import q4_linears

CPU = torch.device("cpu")


def test_explicit_modes_are_kept():
    for mode in ("none", "int4-gguf"):
        assert resolve_quantization(mode, None, CPU, "auto") == (mode, "")


def test_auto_keeps_dense_weights_where_int4_does_not_apply(tiny_model_dir):
    assert resolve_quantization("auto", None, torch.device("cuda"), "auto") == ("none", "")
    assert resolve_quantization("auto", str(tiny_model_dir), CPU, "auto") == ("none", "")
    assert resolve_quantization("auto", None, CPU, "fp32") == ("none", "")  # asked for
    assert resolve_quantization("auto", None, CPU, "auto", tensor_parallel_size=2)[0] == "none"


def test_avx2_emulation_counts_as_no_native_bf16(monkeypatch):
    from specscope import native

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_has_native_bf16()
    assert resolve_dtype("auto", CPU) == torch.float32  # torch's bf16 would be emulated
    if native.cpu_kernels() is not None:  # GGUF codes on the native kernels: bf16
        assert resolve_dtype("auto", CPU, "int4-gguf") == torch.bfloat16
    assert resolve_dtype("fp32", CPU, "int4-gguf") == torch.float32
    monkeypatch.setattr(native, "cpu_kernels", lambda: None)  # the codes' torch reference
    assert resolve_dtype("auto", CPU, "int4-gguf") == torch.float32
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_has_native_bf16()


def test_emulated_capability_gets_its_own_compile_cache(monkeypatch, tmp_path):
    """Under ATEN_CPU_CAPABILITY torch.compile's cache moves to a directory of that
    capability (its keys leave the variable out: kernels compiled unrestricted were loaded
    under avx2 and decoded token 0); a cache the user chose is left alone."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from specscope.engine.machine import inductor_cache_for_capability

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert inductor_cache_for_capability() is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    path = inductor_cache_for_capability()
    assert path == os.path.join(os.path.abspath(default_cache_dir()), "aten-avx2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice
    assert inductor_cache_for_capability() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_auto_picks_int4_where_the_native_kernels_build(specscope_cache_dir, monkeypatch):
    """The default model's GGUF is Q4_1: 4-bit on the native kernels, speculating or not;
    without them (no C compiler) the codes' torch reference is slower: dense, and says why."""
    from specscope import native

    cache = str(specscope_cache_dir)
    if native.cpu_kernels() is not None:
        mode, why = resolve_quantization("auto", None, CPU, "auto", cache_dir=cache)
        assert mode == "int4-gguf" and "4-bit" in why
    monkeypatch.setenv("SPECSCOPE_NATIVE", "0")
    native.cpu_kernels.cache_clear()
    try:
        mode, why = resolve_quantization("auto", None, CPU, "auto", cache_dir=cache)
    finally:
        monkeypatch.delenv("SPECSCOPE_NATIVE")
        native.cpu_kernels.cache_clear()
    assert mode == "none" and "C compiler" in why


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


def test_default_model_plain_runs_int4_and_speculation_stays_lossless(specscope_cache_dir):
    """The default model's GGUF is Q4_1: auto picks int4-gguf (activations in auto's
    dtype) and says so; greedy speculation on it equals greedy plain decoding."""
    llm = LLM(device="cpu", cache_dir=str(specscope_cache_dir), spec=None)
    assert llm.quantization == "int4-gguf" and llm.dtype == torch.bfloat16  # on any CPU
    assert "4-bit" in llm.config_note
    params = SamplingParams(max_tokens=24)
    prompt = "The capital of France is"
    plain = llm.generate(prompt, params)[0].token_ids
    llm.set_spec(SpecConfig(draft="default", num_steps=3))
    assert llm.generate(prompt, params)[0].token_ids == plain
    from specscope.models.quant import GgufLinear  # the draft beside it runs Q8_0 codes

    assert isinstance(llm.draft.fc, GgufLinear) and isinstance(llm.draft.lm_head, GgufLinear)


def test_the_doctor_probes_the_draft_on_dense_weights(monkeypatch):
    """doctor builds its engine without a draft, then probes one: auto must resolve as
    speculating (on the 4-bit weights the shipped draft's wiring probe misreads the taps)."""
    import specscope.engine.llm as llm_mod
    from specscope.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(llm_mod, "LLM", fake_llm)
    with contextlib.suppress(Stop):
        main(["doctor", "--draft", "default", "--num-prompts", "1"])
    assert seen["quantization"] == "none"


def test_the_default_path(capsys, specscope_cache_dir):
    """generate with no flags: the shipped draft speculates, on the CPU with chains sized
    by the confidence stop, on the 4-bit codes where the native kernels build; the status
    line says so. --draft none decodes plainly."""
    from specscope import native
    from specscope.cli import main
    from specscope.engine.machine import CPU_CONFIDENCE_STOP

    cache = str(specscope_cache_dir)
    base = ["generate", "--prompt", "Hi", "--max-tokens", "4", "--device", "cpu",
            "--cache-dir", cache]
    llm = LLM(device="cpu", cache_dir=cache)
    assert llm.spec is not None and llm.spec.draft == "default"
    assert "shipped EAGLE-3 draft" in llm.config_note
    assert f"confidence falls below {CPU_CONFIDENCE_STOP:g}" in llm.config_note
    if native.cpu_kernels() is not None:
        assert llm.quantization == "int4-gguf" and "4-bit" in llm.config_note
    del llm
    assert main(base) == 0
    said = capsys.readouterr().err
    assert "[speculative" in said and "confidence falls below" in said
    assert main([*base, "--draft", "none"]) == 0
    assert "[speculative" not in capsys.readouterr().err


def test_generate_leaves_the_draft_to_the_machine_only_without_spec_flags():
    """Any spec flag, --spec-policy included, asks for the shipped draft; none leaves the
    choice to LLM's spec="auto"."""
    from specscope.cli import build_parser
    from specscope.cli_args import spec_from_args

    def spec(*flags: str):
        return spec_from_args(build_parser().parse_args(["generate", *flags]),
                              machine_default=True)

    assert spec() == "auto"
    for flags in (["--num-steps", "3"], ["--topk", "2"], ["--spec-policy", "1:5,1,6"],
                  ["--draft", "default"]):
        got = spec(*flags)
        assert isinstance(got, SpecConfig) and got.draft == "default", flags
    assert spec("--draft", "none") is None


def test_a_frozen_heap_still_frees_a_replaced_engine(tiny_model_dir):
    """freeze_heap keeps full collections from stalling decode cycles; an engine replaced
    after it (its pools and graphs hold each other) must still be collected, and the new
    engine is frozen in turn."""
    import gc
    import weakref

    from specscope.engine import machine

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=None)
    try:
        machine.freeze_heap()
        assert gc.get_freeze_count() > 0 and gc.collect() == 0
        llm.engine.cycle = [llm.engine]  # as captured CUDA graphs hold their engine
        old = weakref.ref(llm.engine)
        want = llm.generate("Once upon a time", SamplingParams(max_tokens=8))[0].token_ids
        llm.set_spec(SpecConfig(draft="random", num_steps=2))  # plain -> speculative: rebuilt
        assert old() is None  # frozen with the heap, collected all the same
        # The new engine is frozen in turn: out of the collector's generations.
        assert gc.get_freeze_count() > 0 and all(o is not llm.engine for o in gc.get_objects())
        llm.set_spec(None)
        assert llm.generate("Once upon a time", SamplingParams(max_tokens=8))[0].token_ids \
            == want
    finally:
        machine.thaw_heap()
    assert gc.get_freeze_count() == 0
