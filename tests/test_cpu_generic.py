"""The generic CPU kernels (what an arm64 machine without torch's x86 paths gets), forced on
x86 with ATEN_CPU_CAPABILITY=default: the default model still runs dense and with its
native 4-bit weights, its logits match the vectorised kernels', and greedy speculative
decoding still equals greedy plain decoding.

The child process is told to use the generic kernels before torch loads (the variable is
read once, at import) and reports the capability torch took, so a run where the variable
had no effect fails instead of passing on the x86 kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specscope import LLM
from specscope.config import SamplingParams

CHILD = r"""
import json, sys, torch
from specscope import LLM
from specscope.config import SamplingParams, SpecConfig

cache, prompt = sys.argv[1], sys.argv[2]
out = {"capability": torch.backends.cpu.get_cpu_capability()}
dense = LLM(dtype="fp32", device="cpu", cache_dir=cache, spec=None, quantization="none")
ids = dense.encode_prompt(prompt)
out["logits"] = dense.prompt_logits(ids)[-1].tolist()
params = SamplingParams(max_tokens=12)
out["plain"] = dense.generate(prompt, params)[0].token_ids
dense.set_spec(SpecConfig(draft="default", num_steps=3))
out["spec"] = dense.generate(prompt, params)[0].token_ids
int4 = LLM(device="cpu", cache_dir=cache, spec=None, quantization="int4-gguf")
out["int4"] = int4.generate(prompt, params)[0].token_ids
print("RESULT " + json.dumps(out))
"""

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def generic(specscope_cache_dir) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(specscope_cache_dir), PROMPT],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_the_generic_kernels_took_effect(generic):
    assert generic["capability"] == "DEFAULT"


def test_generic_kernels_give_the_vectorised_logits(generic, specscope_cache_dir):
    llm = LLM(dtype="fp32", device="cpu", cache_dir=str(specscope_cache_dir), spec=None,
              quantization="none")
    ref = llm.prompt_logits(llm.encode_prompt(PROMPT))[-1]
    got = torch.tensor(generic["logits"])
    assert (got - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    assert got.argmax().item() == ref.argmax().item()
    assert generic["plain"] == llm.generate(PROMPT, SamplingParams(max_tokens=12))[0].token_ids


def test_generic_kernels_speculate_losslessly_and_run_4bit(generic):
    assert generic["spec"] == generic["plain"]
    assert len(generic["int4"]) == 12
    # The 4-bit weights are the GGUF's, not the fp32 dequantisation: most greedy tokens agree.
    agree = sum(a == b for a, b in zip(generic["int4"], generic["plain"], strict=True))
    assert agree >= 6, (generic["int4"], generic["plain"])
