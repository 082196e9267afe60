"""Sequential against interleaved measurement of the same configurations, in one process.

    python benchmarks/confirm_modes.py --device cuda --shape smollm2-135m

A random-weight target of a real shape and a random EAGLE-3 draft, SIMULATED acceptance
(per-position rates): each configuration measured over every prompt in turn (run_config, as
the grid does), then all of them prompt by prompt (measure_interleaved, as the tuner's
confirmation does), `--rounds` times. The cycle times compare (the simulated draws differ
between the two: each configuration's stream goes on). Equal cycles: interleaving costs nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specscope import SamplingParams, SpecConfig
from specscope.tune.tuner import measure_interleaved, run_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)
from tune import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    # The tune benchmark's random target of this shape (on the CPU too) and its prompts.
    args.model, args.random_target, args.dataset, args.dtype = None, True, None, "fp32"
    llm, prompts = build(args)
    base = SpecConfig(draft="random", simulate_acceptance=(0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35))
    cfgs = [(3, 1, 4), (5, 1, 6), (4, 4, 16)]
    params = SamplingParams(max_tokens=args.max_tokens)
    warm = args.max_tokens if args.device != "cpu" else 8
    for c in cfgs:  # warm-up: every configuration's kernels and graphs
        run_config(llm, c, "random", prompts[:1], params, base, warm)
    for r in range(args.rounds):
        seq = [run_config(llm, c, "random", prompts, params, base, warm) for c in cfgs]
        inter = measure_interleaved(llm, cfgs, "random", prompts, params, base, warm)
        for s, i in zip(seq, inter, strict=True):
            ms_s, ms_i = 1e3 * s.accept_length / s.tok_per_s, 1e3 * i.accept_length / i.tok_per_s
            print(f"round {r} {s.config}: sequential {s.tok_per_s:8.1f} tok/s tau "
                  f"{s.accept_length:.2f} cycle {ms_s:.3f} ms | interleaved {i.tok_per_s:8.1f} "
                  f"tok/s tau {i.accept_length:.2f} cycle {ms_i:.3f} ms "
                  f"({ms_i / ms_s - 1:+.1%})", flush=True)

if __name__ == "__main__":
    main()
