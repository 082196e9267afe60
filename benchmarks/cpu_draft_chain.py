"""Plain decoding against speculative decoding with the draft chain's steps (or the draft's
extend) in one native call and through Python, in one process, alternated (the CPU default
model and its draft).

    python benchmarks/cpu_draft_chain.py                  # 3 MT-Bench prompts x 256 tokens
    python benchmarks/cpu_draft_chain.py --path extend    # the extend's native call instead
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_draft_chain.py

Three engines' configurations on the same weights (the GGUF's 4-bit codes through the native
decoder, the draft's Q8_0 codes): plain decoding; a chain of 5 with the shipped draft, its
greedy steps run by `engine/draft_runner.py` through `NativeDraftChain`; the same with that
path switched off, so the steps go through `spec/drafter.py` draft_chain and the draft's
forward. Each round runs every configuration over the prompts (greedy, N new tokens, EOS
ignored), alternating the order, so the machine's drift falls on all three alike. Prints
each round's tok/s (tokens over wall time, the prefill included), the medians and their
ratios, and whether the three produced the same tokens (they must: greedy speculative
decoding equals greedy plain decoding, and the native chain equals the Python one). With
`--path extend` the switched path is the extend's (`native_draft_extend`: the projection,
the draft's layer and norm in one call), and each speculative configuration's extend calls
are also timed one by one (median ms a call): a whole run's rate moves with the machine by
more than the extend's share of a cycle.
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
    ap.add_argument("--path", choices=["chain", "extend"], default="chain",
                    help="the native path switched off in the third configuration")
    args = ap.parse_args()
    attr = "native_draft_chain" if args.path == "chain" else "native_draft_extend"
    native = getattr(draft_runner, attr)
    extend, calls = draft_runner.DraftRunner.extend, {}

    def timed_extend(self, *a, **k):
        t = time.perf_counter()
        out = extend(self, *a, **k)
        calls.setdefault(current[0], []).append(time.perf_counter() - t)
        return out

    draft_runner.DraftRunner.extend = timed_extend
    current = [""]
    spec = LLM(spec=SpecConfig(draft="default", num_steps=5))
    plain = LLM(spec=None)
    prompts = load_prompts("mt_bench", args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = ["plain", f"spec native {args.path}", f"spec python {args.path}"]
    tokens: dict[str, list[list[int]]] = {}

    def run(name: str) -> float:
        setattr(draft_runner, attr, native if name != names[2] else (lambda *a, **k: None))
        current[0] = name
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
    calls.clear()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(run(name))
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name in names:
        print(f"{name:18s} " + " ".join(f"{x:6.1f}" for x in rates[name])
              + f"   median {med[name]:6.1f} tok/s")
    same = tokens[names[0]] == tokens[names[1]] == tokens[names[2]]
    ratios = {"native_vs_plain": med[names[1]] / med["plain"],
              "python_vs_plain": med[names[2]] / med["plain"],
              "native_vs_python": med[names[1]] / med[names[2]]}
    print("  ".join(f"{k} {v:.3f}x" for k, v in ratios.items()), f" same tokens: {same}")
    extend_ms = {name: statistics.median(v) * 1e3 for name, v in calls.items() if v}
    print("extend a call (median ms): " + "  ".join(f"{k} {v:.3f}" for k, v in extend_ms.items()))
    print(json.dumps({"bench": "cpu_draft_chain", "path": args.path, "extend_ms": extend_ms,
                      "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "rates": rates, "medians": med, "ratios": ratios, "same_tokens": same}))


if __name__ == "__main__":
    main()
