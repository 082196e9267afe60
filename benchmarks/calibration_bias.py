"""Where the tuner's calibration and its confirmation part: the same configurations' cycle
terms measured the calibration's way, the confirmation's way and the steps between, in one
process, round after round.

    python benchmarks/calibration_bias.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf

Modes, each configuration's draft / verify / other ms per steady cycle (the terms the cost
model is fitted to, calibration_from_summary):
  cal        one prompt x --calibration-tokens, configurations back to back (the calibration)
  cal-long   one prompt x --max-tokens, back to back (the calibration at the workload's length)
  seq-short  every prompt x --calibration-tokens, back to back
  seq        every prompt x --max-tokens, back to back (as the grid runs)
  inter      every prompt x --max-tokens, prompt by prompt in turn (the confirmation)
  cal-full   as cal, warmed up over the whole calibration length (every window's graphs
             captured and replayed before the clock runs) where cal warms up over 8 tokens
  plain      plain decoding over the first prompt (untimed): switching to and from plain
             rebuilds the engine, as the tuner's plain run before its calibration does
A gap between cal and cal-long is the length; between cal and seq-short the prompts;
between seq and inter the interleaving; between cal right after plain and cal after cal the
fresh engine. Rounds alternate the modes' order (--same-order: they do not), so a drift of
the machine's speed does not line up with one mode. --configs calibration: the tuner's own
calibration shapes on this engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specscope import SamplingParams, SpecConfig
from specscope.engine.machine import freeze_heap
from specscope.tune.cost import calibration_from_summary
from specscope.tune.tuner import (
    Measured,
    all_configs,
    measure_interleaved,
    run_config,
    tuner_calibration_shapes,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune import build  # noqa: E402  (benchmarks/ is not a package)

Config = tuple[int, int, int]


def terms(m: Measured) -> tuple[float, float, float]:
    c = calibration_from_summary(m.summary, *m.config)
    return c.draft_ms, c.verify_ms, c.other_ms


def run_mode(mode: str, llm, cfgs: list[Config], draft: str, prompts: list, args,
             base: SpecConfig | None) -> list[Measured]:
    short = SamplingParams(max_tokens=args.calibration_tokens, ignore_eos=True)
    long_ = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warm = 8 if mode in ("cal", "cal-long") else args.max_tokens
    if mode == "plain":
        run_config(llm, None, draft, prompts[:1], long_, base, 8)
        return []
    if mode == "cal-full":
        return [run_config(llm, c, draft, prompts[:1], short, base, args.calibration_tokens)
                for c in cfgs]
    if mode == "inter":
        return measure_interleaved(llm, cfgs, draft, prompts, long_, base, warm)
    ps, params = {"cal": (prompts[:1], short), "cal-long": (prompts[:1], long_),
                  "seq-short": (prompts, short), "seq": (prompts, long_)}[mode]
    return [run_config(llm, c, draft, ps, params, base, warm) for c in cfgs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--calibration-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="5,1,6;4,5,21;6,1,7")
    ap.add_argument("--modes", default="cal,cal-long,seq-short,seq,inter")
    ap.add_argument("--same-order", action="store_true")
    ap.add_argument("--no-prewarm", action="store_true")
    args = ap.parse_args()
    args.random_target = args.model is None and args.device != "cpu"
    llm, prompts = build(args)
    base = None
    if args.model is None:  # a random target: a random draft, SIMULATED acceptance
        args.draft = "random"
        base = SpecConfig(draft="random", simulate_acceptance=(0.8, 0.7, 0.6, 0.5, 0.4))
    freeze_heap()
    if args.configs == "calibration":
        cfgs = tuner_calibration_shapes(llm, all_configs(10))
    else:
        cfgs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
    modes = args.modes.split(",")
    for c in cfgs if not args.no_prewarm else []:  # every window's graphs, untimed
        run_config(llm, c, args.draft, prompts, SamplingParams(max_tokens=args.max_tokens),
                   base, args.max_tokens, warm_all=True)
    for r in range(args.rounds):
        sums: dict[str, list[float]] = {}
        order = modes if r % 2 == 0 or args.same_order else modes[::-1]
        for i, mode in enumerate(order):
            for m in run_mode(mode, llm, cfgs, args.draft, prompts, args, base):
                d, v, o = terms(m)
                cycle = 1e3 * (m.accept_length or 1) / m.tok_per_s
                sums.setdefault(f"{i}:{mode}", []).append(d + v + o)
                print(f"round {r} {mode:<9} {str(m.config):<11} draft {d:.3f} verify {v:.3f} "
                      f"other {o:.3f} sum {d + v + o:.3f} cycle {cycle:.3f} ms tau "
                      f"{m.accept_length:.2f}", flush=True)
        print(f"round {r} each mode's terms summed over its configurations: " + ", ".join(
            f"{k} {sum(v):.3f} ms" for k, v in sums.items()), flush=True)


if __name__ == "__main__":
    main()
