"""Batch-1 generation speed of the default configuration on this machine: three fixed prompts
one after another through LLM.generate, after one short untimed request; one JSON line.

    python benchmarks/generate_speed.py spec 128     # what `auto` picks (on an AVX-512 bf16
                                                     # CPU: dense bf16 with the shipped draft)
    python benchmarks/generate_speed.py plain 128    # the GGUF's 4-bit weights, no draft

Run it alternately on two checkouts to compare their code on a noisy machine (pair by pair).
"""

from __future__ import annotations

import json
import sys
import time

from specscope import LLM
from specscope.config import SamplingParams

PROMPTS = ["Compose an engaging travel blog post about a recent trip to Hawaii.",
           "Explain how a bicycle stays upright while it moves.",
           "Write a short story about a robot who learns to paint."]


def main() -> None:
    mode, tokens = sys.argv[1], int(sys.argv[2])
    kw = {} if mode == "spec" else {"quantization": "int4-gguf"}
    llm = LLM(None, device="cpu", profile=False, **kw)
    if mode != "spec":
        llm.set_spec(None)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True))
    t = time.perf_counter()
    outs = [o for p in PROMPTS for o in llm.generate([p], params)]
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"mode": mode, "tok_s": n / dt, "tokens": n}))


if __name__ == "__main__":
    main()
