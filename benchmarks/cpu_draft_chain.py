"""Plain decoding against speculative decoding with the draft chain's steps in one native call
each and through Python, in one process, alternated (the CPU default model and its draft).

    python benchmarks/cpu_draft_chain.py                  # 3 MT-Bench prompts x 256 tokens
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_draft_chain.py

Three engines' configurations on the same weights (the GGUF's 4-bit codes through the native
decoder, the draft's Q8_0 codes): plain decoding; a chain of 5 with the shipped draft, its
greedy steps run by `engine/draft_runner.py` through `NativeDraftChain`; the same with that
path switched off, so the steps go through `spec/drafter.py` draft_chain and the draft's
forward. Each round runs every configuration over the prompts (greedy, N new tokens, EOS
ignored), alternating the order, so the machine's drift falls on all three alike. Prints
each round's tok/s (tokens over wall time, the prefill included), the medians and their
ratios, and whether the three produced the same tokens (they must: greedy speculative
decoding equals greedy plain decoding, and the native chain equals the Python one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specscope.engine.draft_runner as draft_runner
from specscope.bench.datasets import load_prompts
from specscope.config import SamplingParams, SpecConfig
from specscope.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    native_chain = draft_runner.native_draft_chain
    spec = LLM(spec=SpecConfig(draft="default", num_steps=5))
    plain = LLM(spec=None)
    prompts = load_prompts("mt_bench", args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = ["plain", "spec native chain", "spec python chain"]
    tokens: dict[str, list[list[int]]] = {}

    def run(name: str) -> float:
        draft_runner.native_draft_chain = native_chain if name != "spec python chain" else \
            (lambda *a, **k: None)
        llm = plain if name == "plain" else spec
        start, n, out = time.perf_counter(), 0, []
        for p in prompts:
            ids = list(llm.generate([p], params)[0].outputs[0].token_ids)
            out.append(ids)
            n += len(ids)
        tokens[name] = out
        return n / (time.perf_counter() - start)

    for name in names:  # warm-up
        run(name)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(run(name))
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name in names:
        print(f"{name:18s} " + " ".join(f"{x:6.1f}" for x in rates[name])
              + f"   median {med[name]:6.1f} tok/s")
    same = tokens["plain"] == tokens["spec native chain"] == tokens["spec python chain"]
    ratios = {"native_vs_plain": med["spec native chain"] / med["plain"],
              "python_vs_plain": med["spec python chain"] / med["plain"],
              "native_vs_python": med["spec native chain"] / med["spec python chain"]}
    print("  ".join(f"{k} {v:.3f}x" for k, v in ratios.items()), f" same tokens: {same}")
    print(json.dumps({"bench": "cpu_draft_chain",
                      "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "rates": rates, "medians": med, "ratios": ratios, "same_tokens": same}))


if __name__ == "__main__":
    main()
