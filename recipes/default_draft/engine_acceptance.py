"""Engine-measured accept length of a draft on a few prompts (CPU, fp32, greedy chain).

    python recipes/default_draft/engine_acceptance.py [--draft default] --data-dir DATA
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specscope import LLM, SamplingParams, SpecConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="default")
    ap.add_argument("--data-dir", dest="shared", required=True,
                    help="the directory holding the source JSONL files (not in this repo)")
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    shared = Path(args.shared)
    llm = LLM(None, dtype="fp32", device="cpu",
              spec=SpecConfig(draft=args.draft, num_steps=args.num_steps))
    print(llm.draft_info)
    with (shared / "gsm8k_train.jsonl").open() as f:
        qs = [json.loads(line)["question"] for line in f][:3]
    with (shared / "mt_bench.jsonl").open() as f:
        qs += [json.loads(line)["turns"][0] for line in f][:3]
    for q in qs:
        t = time.perf_counter()
        out = llm.generate([{"role": "user", "content": q}],
                           SamplingParams(max_tokens=args.max_tokens))[0]
        rate = len(out.token_ids) / (time.perf_counter() - t)
        print(f"{out.spec['accept_length']:.2f} {out.spec['acceptance_by_position']} "
              f"{rate:.1f} tok/s {out.text[:60]!r}")


if __name__ == "__main__":
    main()
