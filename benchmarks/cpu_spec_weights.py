"""Speculative decoding on the CPU with the default model and its shipped draft, the target
on different weights side by side in one process (alternating rounds): which weights make
the fastest speculative run on this CPU.

    python benchmarks/cpu_spec_weights.py --quantization auto,int4-gguf

For each token count and round: decode tok/s over MT-Bench first turns (chat template,
greedy; benchmarks/llamacpp.py's measurement), the accept length and the profiler's p50 of
the verify phase and the first draft step.
"""

from __future__ import annotations

import argparse

from llamacpp import run_specscope

from specscope import LLM
from specscope.bench.datasets import load_prompts
from specscope.config import SpecConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="auto,int4-gguf",
                    help="comma-separated --quantization values, one engine each")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--tokens", default="128,256")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    prompts = load_prompts("mt_bench", args.num_prompts)
    llms = {q: LLM(None, spec=SpecConfig(draft="default"), quantization=q, profile=False)
            for q in args.quantization.split(",")}
    for n in (int(t) for t in args.tokens.split(",")):
        for _ in range(args.rounds):
            for q, llm in llms.items():
                r = run_specscope(llm, prompts, n)
                ph = r["phases_ms"]
                print(f"{n} tokens  --quantization {q} ({llm.quantization}, {llm.dtype}): "
                      f"{r['decode_tok_s']:.1f} tok/s, accept length {r['accept_length']:.2f}, "
                      f"verify {ph.get('verify', 0):.2f} ms, draft step 1 "
                      f"{ph.get('draft_step[1]', 0):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
