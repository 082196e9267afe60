"""Profiling on vs off on the same workload, in one process: overhead and attribution.

CPU (default model, random draft, SIMULATED tau 3, steps 5):
    python benchmarks/profile_overhead.py --rounds 5 --tokens 96
GPU (random Llama-3.1-8B shape, EAGLE-3-shaped random draft, SIMULATED tau 3, steps 7):
    python benchmarks/profile_overhead.py --device cuda --num-steps 7 --tokens 256 --rounds 5

Rounds alternate the order (off, on / on, off) so drift hits both equally; the overhead is
1 - median(on tok/s) / median(off tok/s). Attribution = share of cycle wall time in named
phases (the rest is `other`). A table, the phase summary, then a JSON line are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import ID_PROMPT, build_cpu, build_gpu  # noqa: E402  (benchmarks/ is not a package)


def decode_rate(outputs) -> float:
    """Tokens after the first over decode time, summed over the workload's requests."""
    toks = sum(len(o.token_ids) - 1 for o in outputs)
    secs = sum(o.metrics.decode_s for o in outputs)
    return toks / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--tau", type=float, default=3.0)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="profile plain decoding instead")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--random", action="store_true")
    args = ap.parse_args()

    from specscope import SamplingParams, SpecConfig
    from specscope.bench.datasets import load_prompts
    from specscope.profiler import format_summary

    random_target = args.device.startswith("cuda") or args.random
    llm = build_gpu(args) if random_target else build_cpu(args)
    if not args.plain:
        llm.set_spec(SpecConfig(draft="random", num_steps=args.num_steps, topk=args.topk,
                                num_draft_tokens=args.num_draft_tokens,
                                simulate_acceptance=args.tau))
    prompts = [ID_PROMPT] * args.num_prompts if random_target else \
        load_prompts("mt_bench", args.num_prompts)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up (graph capture, first-call costs)

    rates: dict[str, list[float]] = {"off": [], "on": []}
    summary = None
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            prof = llm.enable_profiling(mode == "on", interval=None)
            llm.reset_simulation()  # the same accept decisions in every run
            outs = llm.generate(prompts, params)
            rates[mode].append(decode_rate(outs))
            if prof is not None:
                summary = prof.summary(prof.config)
    llm.enable_profiling(False)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    overhead = 1.0 - on / off
    print(f"{'profiling':<10} {'median tok/s':>12}   runs")
    for mode in ("off", "on"):
        runs = " ".join(f"{x:.1f}" for x in rates[mode])
        print(f"{mode:<10} {statistics.median(rates[mode]):>12.2f}   {runs}")
    print(f"overhead {overhead:+.2%} of tok/s; attributed to named phases "
          f"{summary['attributed']:.2%} of cycle wall time")
    print(format_summary(summary))
    dev = llm.device
    print(json.dumps({"benchmark": "profile_overhead", "device": str(dev),
                      "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                      "model": args.shape if random_target else (args.model or "default"),
                      "dtype": str(llm.dtype), "config": summary["config"],
                      "tok_s_off": off, "tok_s_on": on, "runs": rates,
                      "overhead": overhead, "attributed": summary["attributed"],
                      "summary": summary}))


if __name__ == "__main__":
    main()
