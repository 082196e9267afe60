"""How well the draft's own probabilities predict acceptance, and what a confidence stop
would gain: the shipped draft's pick probabilities and verdicts over MT-Bench, replayed.

    python benchmarks/confidence_study.py --num-prompts 40 --steps 7 --out study.json
    python benchmarks/confidence_study.py --load study.json --cost 6.09,1.03

Runs the default model with chains of --steps through `spec/drafter.py` draft_chain with a
stop too small to end any chain (so every step's pick probability is recorded by
`pick_probs`) and records, per cycle, those probabilities and the draft tokens accepted.
Then, for a cost model of a cycle that drafts and verifies k tokens, base + k * per_token
ms (--cost; fit it from `specscope profile --spec K,1` runs at several K on the machine),
prints the simulated tok/s of every fixed chain length 1..steps, of the confidence stop
(the product of the picks' probabilities; a token below the stop and all after it are not
verified) at stops 0.02-0.88, of a stop on each pick's own probability, and the draft's
calibration (acceptance of a position reached, by the pick's probability). A replay: a
chain cut at k accepts min(accepted, k), which is exact for greedy verification.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

Cycle = tuple[list[float], int]


def record(num_prompts: int, steps: int, max_tokens: int) -> list[Cycle]:
    """(pick probabilities of steps 1..steps, accepted) per cycle of greedy chains."""
    import specscope.engine.draft_runner as draft_runner
    import specscope.spec.drafter as drafter
    from specscope.bench.datasets import load_prompts
    from specscope.config import SamplingParams, SpecConfig
    from specscope.engine.llm import LLM

    draft_runner.native_draft_chain = lambda *a, **k: None  # the reference path records
    probs: list[float] = []
    cycles: list[Cycle] = []

    def pick_probs(logits, d, qs, _f=drafter.pick_probs):
        p = _f(logits, d, qs)
        probs.append(float(p[0]))
        return p

    drafter.pick_probs = pick_probs
    llm = LLM(spec=SpecConfig(draft="default", num_steps=steps, confidence_stop=1e-30))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for p in load_prompts("mt_bench", num_prompts):
        out = llm.generate([p], params)[0]
        accepted = out.spec["accepted_per_cycle"]
        assert len(probs) == steps * len(accepted), (len(probs), len(accepted))
        cycles += [(probs[i * steps:(i + 1) * steps], a) for i, a in enumerate(accepted)]
        probs.clear()
    return cycles


def replay(cycles: list[Cycle], keep, base: float, per_token: float) -> tuple[float, float]:
    """(tok/s, accept length) of drafting keep(probs) tokens a cycle."""
    tokens = cost = 0.0
    for probs, a in cycles:
        k = keep(probs)
        tokens += min(a, k) + 1
        cost += base + per_token * k
    return tokens / cost * 1e3, tokens / len(cycles)


def product_stop(stop: float):
    def keep(probs: list[float]) -> int:
        c = 1.0
        for j, p in enumerate(probs):
            c *= p
            if c < stop:
                return j
        return len(probs)
    return keep


def each_stop(stop: float):
    def keep(probs: list[float]) -> int:
        return next((j for j, p in enumerate(probs) if p < stop), len(probs))
    return keep


def report(cycles: list[Cycle], base: float, per_token: float) -> None:
    steps = len(cycles[0][0])
    print(f"{len(cycles)} cycles, chains of {steps}; cost {base} + {per_token} ms a token")
    for k in range(1, steps + 1):
        rate, tau = replay(cycles, lambda p, k=k: k, base, per_token)
        print(f"fixed {k}: {rate:.1f} tok/s, accept length {tau:.2f}")
    stops = [x / 100 for x in range(2, 90, 2)]
    for name, policy in (("product", product_stop), ("each pick", each_stop)):
        rows = [(replay(cycles, policy(s), base, per_token), s) for s in stops]
        (best, tau), s = max(rows)
        print(f"stop on the {name}: best {best:.1f} tok/s at {s:g} (accept length {tau:.2f});"
              + " ".join(f" {s:g}: {r[0]:.1f}" for r, s in rows if s in (0.1, 0.14, 0.2, 0.3)))
    seen: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for probs, a in cycles:
        for j, p in enumerate(probs):
            if a >= j:  # position j + 1 was reached
                b = seen[min(int(p * 10), 9)]
                b[0] += 1
                b[1] += a > j
    print("calibration: the pick's probability, positions reached, accepted")
    for b in sorted(seen):
        n, took = seen[b]
        print(f"  {b / 10:.1f}-{(b + 1) / 10:.1f}: {n:5d}  {took / n:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None, help="save the recorded cycles (JSON)")
    ap.add_argument("--load", default=None, help="replay cycles saved by --out")
    ap.add_argument("--cost", default="6.09,1.03", metavar="BASE,PER_TOKEN",
                    help="a cycle's ms: base + per_token * tokens drafted")
    args = ap.parse_args()
    if args.load:
        with open(args.load) as f:
            cycles = [(p, a) for p, a in json.load(f)]
    else:
        cycles = record(args.num_prompts, args.steps, args.max_tokens)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(cycles, f)
    base, per_token = (float(x) for x in args.cost.split(","))
    report(cycles, base, per_token)


if __name__ == "__main__":
    main()
