"""The tuner against an exhaustive grid, both measured in process on the same prompts.

    python benchmarks/tune.py [--dataset mt_bench --num-prompts 3 --max-tokens 96]

The grid: plain decoding, chains of 1..8 steps, and trees topk {2, 4, 8} x steps {2, 3, 4, 6}
x num_draft_tokens {8, 16, 32} (those the shape allows). Reported: the best grid
configuration and its tok/s; the tuner's pick and its tok/s measured the same way; the
measurement time of each (wall seconds of all runs, weights loaded once, no reloads).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specscope import LLM, SamplingParams
from specscope.bench.datasets import load_prompts
from specscope.tune.tuner import max_nodes, run_config, tune


def grid() -> list:
    cfgs = [None] + [(s, 1, s + 1) for s in range(1, 9)]
    for k in (2, 4, 8):
        for s in (2, 3, 4, 6):
            for n in (8, 16, 32):
                if n <= max_nodes(s, k):
                    cfgs.append((s, k, n))
    return cfgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = load_prompts(args.dataset, args.num_prompts)
    llm = LLM(None, dtype="fp32", device="cpu")
    lines = []
    t = time.perf_counter()
    res = tune(llm, args.draft, prompts, max_tokens=args.max_tokens, log=lines.append)
    tune_s = time.perf_counter() - t
    lines += [res.table(), res.recommendation()]
    params = SamplingParams(max_tokens=args.max_tokens)
    t = time.perf_counter()
    rows = []
    for cfg in grid():
        m, _ = run_config(llm, cfg, args.draft, prompts, params)
        rows.append(m)
        lines.append(f"grid {str(cfg or 'plain'):<14} {m.tok_per_s:7.2f} tok/s  tau "
                     f"{m.accept_length or 1:.2f}")
    grid_s = time.perf_counter() - t
    best = max(rows, key=lambda m: m.tok_per_s)
    pick = next((m for m in rows if m.config == res.recommended), None)
    if pick is None:  # the tuner's pick is not in the grid: measure it like the grid
        pick, _ = run_config(llm, res.recommended, args.draft, prompts, params)
    summary = {
        "grid_configs": len(rows), "grid_seconds": round(grid_s, 1),
        "grid_best": str(best.config or "plain"), "grid_best_tok_per_s": round(best.tok_per_s, 2),
        "tuner_pick": str(res.recommended or "plain"),
        "tuner_pick_tok_per_s": round(pick.tok_per_s, 2),
        "pick_vs_best": round(pick.tok_per_s / best.tok_per_s - 1, 4),
        "tuner_seconds": round(tune_s, 1), "tuner_time_share": round(tune_s / grid_s, 3),
        "weight_reloads": 0,
    }
    lines.append(json.dumps(summary, indent=1))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
