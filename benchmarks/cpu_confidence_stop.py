"""Plain decoding against speculative chains with and without the confidence stop, in one
process, alternated (the CPU default model and its shipped draft).

    python benchmarks/cpu_confidence_stop.py                      # 8 MT-Bench prompts x 128
    python benchmarks/cpu_confidence_stop.py --max-tokens 256 --stops 0,0.1,0.15,0.2
    python benchmarks/cpu_confidence_stop.py --steps 5,7 --stops 0.15
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_confidence_stop.py

The confidence stop (SpecConfig.confidence_stop, `--confidence-stop`) ends a chain's drafting
at the first token whose running product of the draft's probabilities falls below the stop,
and leaves that token out of the verify. Configurations: plain decoding (an engine without a
draft), then a chain of each length in --steps with each stop in --stops (0: off, every
cycle drafts that many tokens), switched in place on one engine (LLM.set_spec). Each round
runs every configuration over the prompts (MT-Bench first turns through the chat template, greedy,
--max-tokens new tokens each, EOS honoured), one request at a time, the order reversed
every other round so the machine's drift falls on all alike. Prints each round's tok/s
(tokens over wall time, the prefill included), the medians, each configuration's median of
its per-round ratio to plain, its accept length and mean draft tokens verified per cycle,
and whether every configuration produced plain decoding's tokens (it must: greedy
speculative decoding is lossless, with or without the stop). Then one JSON line.
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
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[5])
    ap.add_argument("--stops", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.0, 0.15])
    args = ap.parse_args()
    plain = LLM(spec=None)
    spec = LLM(spec=SpecConfig(draft="default", num_steps=args.steps[0], confidence_stop=0.0))
    prompts = load_prompts("mt_bench", args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    shapes = [(k, s) for k in args.steps for s in args.stops]
    names = ["plain"] + [f"chain {k}, stop {s:g}" for k, s in shapes]
    tokens: dict[str, list[list[int]]] = {}
    cycles: dict[str, list[tuple[int, int]]] = {name: [] for name in names}

    def run(name: str) -> float:
        llm = plain
        if name != "plain":
            steps, stop = shapes[names.index(name) - 1]
            spec.set_spec(SpecConfig(draft="default", num_steps=steps, confidence_stop=stop))
            llm = spec
        start, n, out = time.perf_counter(), 0, []
        for p in prompts:
            o = llm.generate([p], params)[0]
            out.append(list(o.outputs[0].token_ids))
            n += len(out[-1])
            if o.spec:
                cycles[name] += zip(o.spec["accepted_per_cycle"], o.spec["drafted_per_cycle"],
                                    strict=True)
        tokens[name] = out
        return n / (time.perf_counter() - start)

    for name in names:  # warm-up
        run(name)
    for name in names:
        cycles[name].clear()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(run(name))
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratio = {name: statistics.median(x / p for x, p in zip(rates[name], rates["plain"],
                                                            strict=True)) for name in names}
    summary = {}
    for name in names:
        cs = cycles[name]
        tau = 1 + sum(a for a, _ in cs) / len(cs) if cs else 1.0
        drafted = sum(d for _, d in cs) / len(cs) if cs else 0.0
        summary[name] = {"tok_per_s": rates[name], "median": med[name],
                         "ratio_to_plain": ratio[name], "accept_length": tau,
                         "drafted_per_cycle": drafted, "same_tokens": tokens[name] ==
                         tokens["plain"]}
        print(f"{name:20s} " + " ".join(f"{x:6.1f}" for x in rates[name])
              + f"   median {med[name]:6.1f} tok/s  {ratio[name]:.3f}x plain"
              + (f"  accept length {tau:.2f}, {drafted:.2f} drafted a cycle" if cs else "")
              + f"  same tokens: {tokens[name] == tokens['plain']}")
    print(json.dumps({"bench": "cpu_confidence_stop", "max_tokens": args.max_tokens,
                      "num_prompts": args.num_prompts, "steps": args.steps,
                      "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "configs": summary}))


if __name__ == "__main__":
    main()
