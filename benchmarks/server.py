"""The server's cost over HTTP, and its behaviour under many clients, in one process.

1. The same prompts, one at a time: in-process `LLM.generate` vs streaming over HTTP to
   `specscope serve`'s app (same loaded engine), output tok/s = tokens / wall for each.
2. N concurrent streaming clients (default 64): all must complete, none lost or failed.

    python benchmarks/server.py --num-prompts 4 --max-tokens 64 --clients 64
    python benchmarks/server.py --draft random --simulate-acceptance 3 ...   # speculative

A table, then a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-tokens", type=int, default=16)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--simulate-acceptance", type=float, default=None)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()

    from specscope import LLM, SamplingParams, SpecConfig
    from specscope.bench.client import run_bench
    from specscope.bench.datasets import load_prompts
    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    spec = None
    if args.draft:
        spec = SpecConfig(draft=args.draft, num_steps=args.num_steps,
                          simulate_acceptance=args.simulate_acceptance)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", cache_dir=args.cache_dir, spec=spec)
    prompts = load_prompts(args.dataset, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    llm.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up

    def same_acceptance() -> None:  # simulated accepts: the same draws in both paths
        if hasattr(llm.decoder, "reset_simulation"):
            llm.decoder.reset_simulation()

    # 1. in-process, one prompt at a time (greedy, same stopping as the server's requests)
    same_acceptance()
    t0 = time.perf_counter()
    local = [llm.generate(p, params)[0] for p in prompts]
    local_wall = time.perf_counter() - t0
    local_tokens = sum(len(o.token_ids) for o in local)
    local_tps = local_tokens / local_wall

    server = BackgroundServer(create_app(llm))
    try:
        same_acceptance()
        http = asyncio.run(run_bench(server.url, model=None, prompts=prompts, concurrency=1,
                                     max_tokens=args.max_tokens, temperature=0.0,
                                     progress=False))
        many_prompts = [prompts[i % len(prompts)] for i in range(args.clients)]
        many = asyncio.run(run_bench(server.url, model=None, prompts=many_prompts,
                                     concurrency=args.clients,
                                     max_tokens=args.client_tokens, temperature=0.0,
                                     progress=False))
    finally:
        server.stop()

    ratio = http["output_tok_s"] / local_tps
    print(f"{'path':<28} {'tokens':>7} {'wall s':>8} {'tok/s':>8}")
    print(f"{'in-process LLM.generate':<28} {local_tokens:>7} {local_wall:>8.2f} "
          f"{local_tps:>8.2f}")
    print(f"{'HTTP streaming (1 client)':<28} {http['total_completion_tokens']:>7} "
          f"{http['wall_s']:>8.2f} {http['output_tok_s']:>8.2f}")
    print(f"HTTP / in-process tok/s: {ratio:.4f} ({(ratio - 1) * 100:+.2f} %)")
    print(f"{args.clients} concurrent clients: completed {many['completed']}, errors "
          f"{many['errors']}, wall {many['wall_s']:.1f} s, TTFT p50/p99 "
          f"{many['ttft_ms']['p50']:.0f}/{many['ttft_ms']['p99']:.0f} ms")
    spec_local = [o.spec["accept_length"] for o in local if o.spec]
    if spec_local:
        print(f"accept length (SIMULATED): in-process {sum(spec_local) / len(spec_local):.2f}, "
              f"HTTP {http['accept_length']:.2f}")
    print(json.dumps({"benchmark": "server", "model": args.model or "default",
                      "dtype": args.dtype, "spec": bool(spec), "local_tok_s": local_tps,
                      "local_tokens": local_tokens, "http": http, "http_over_local": ratio,
                      "concurrent": many}))


if __name__ == "__main__":
    main()
