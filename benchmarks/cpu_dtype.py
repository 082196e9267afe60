"""fp32 against bf16 activations on the default model's GGUF codes (the native kernels), in
one process, alternated: plain decoding or speculative decoding with the shipped draft.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_dtype.py plain
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_dtype.py spec

Two engines (`--quantization int4-gguf`, `--dtype fp32` and `bf16`; with `spec` each with
the shipped draft and the CPU's default confidence stop), 8 MT-Bench first turns through the
chat template, greedy, --max-tokens new tokens each, one request at a time; each round runs
both, the order reversed every other round. Prints each dtype's tok/s per round (tokens over
wall time) and median, and, speculating, each one's accept length. The question it answers:
on a CPU without native bf16 (AVX2), is bf16 still the faster activation dtype once the
weights run as codes in C (engine/machine.py resolve_dtype)?
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specscope.bench.datasets import load_prompts
from specscope.config import SamplingParams, SpecConfig
from specscope.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["plain", "spec"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    spec = SpecConfig(draft="default") if args.mode == "spec" else None
    llms = {d: LLM(dtype=d, quantization="int4-gguf", spec=spec) for d in ("fp32", "bf16")}
    prompts = load_prompts("mt_bench", args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    accepted: dict[str, list[int]] = {d: [] for d in llms}

    def run(d: str) -> float:
        start, n = time.perf_counter(), 0
        for p in prompts:
            o = llms[d].generate([p], params)[0]
            n += len(o.outputs[0].token_ids)
            if o.spec:
                accepted[d] += o.spec["accepted_per_cycle"]
        return n / (time.perf_counter() - start)

    for d in llms:  # warm-up
        run(d)
        accepted[d].clear()
    rates: dict[str, list[float]] = {d: [] for d in llms}
    for r in range(args.rounds):
        for d in list(llms) if r % 2 == 0 else list(llms)[::-1]:
            rates[d].append(run(d))
    out = {}
    for d, v in rates.items():
        tau = 1 + sum(accepted[d]) / len(accepted[d]) if accepted[d] else None
        out[d] = {"tok_per_s": v, "median": statistics.median(v), "accept_length": tau}
        print(f"{args.mode} {d}: " + " ".join(f"{x:6.1f}" for x in v)
              + f"   median {statistics.median(v):6.1f} tok/s"
              + (f", accept length {tau:.2f}" if tau else ""))
    print(json.dumps({"bench": "cpu_dtype", "mode": args.mode,
                      "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "dtypes": out}))


if __name__ == "__main__":
    main()
