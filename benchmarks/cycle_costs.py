"""Where a speculative cycle's time goes, by configuration: the data a cost model must fit.

    python benchmarks/cycle_costs.py --device cuda [--model M.gguf] [--draft default] \
        [--dataset mt_bench --num-prompts 4 --max-tokens 128] [--out costs.json]

For each configuration (plain, chains, trees of several depths, widths and sizes), three runs
of the same prompts in one process, weights loaded once:

- **steady**: CUDA graphs, after a warm-up that ran every prompt to its end, so every KV
  window's graphs exist and (nearly) every measured cycle is a replay: the segments draft and
  verify_commit, and the cycle time a long-running server sees;
- **cold**: CUDA graphs after the tuner's usual 8-token warm-up: the KV windows first reached
  during the run are captured in it (their cycles timed by phase), as in a short benchmark;
- **eager**: no CUDA graphs: every phase timed (draft_extend, each draft step, tree_build,
  verify, accept, kv_commit), which shows what a tree adds to a chain and where.

On the CPU there are no graphs: one eager run per configuration. Prints a table and writes
every summary as JSON (the profiler's summaries, split by timing mode).

`--repeats R` (CUDA) separates a configuration's own cost from run-to-run noise: after one
untimed pass over every configuration, R rounds each run every configuration once in turn,
as the tuner runs one (an 8-token warm-up, then the prompts; graph replays read), and the
table gives each configuration's median over the rounds, its spread, and each segment's
mean against its median cycle (a mean above the median is a few slow cycles, e.g. a pause
of the host). `--gc-freeze` moves every object alive after the load out of the collector's
reach first (gc.freeze), to see what the collector's pauses cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from specscope import LLM, SamplingParams
from specscope.bench.datasets import load_prompts
from specscope.tune.tuner import run_config

CONFIGS = [None, (1, 1, 2), (2, 1, 3), (3, 1, 4), (4, 1, 5), (5, 1, 6), (6, 1, 7), (7, 1, 8),
           (8, 1, 9), (2, 2, 4), (2, 4, 8), (3, 2, 6), (3, 4, 8), (3, 4, 12), (3, 8, 16),
           (4, 2, 8), (4, 4, 16), (5, 2, 10), (5, 3, 21), (5, 4, 16), (5, 4, 26), (5, 8, 40),
           (6, 4, 16), (6, 8, 32), (8, 2, 16), (8, 4, 32)]


def _row(s: dict) -> dict:
    """The figures of one summary that the table and the fit need."""
    modes = {m: {"cycles": v["cycles"], "cycle_ms": round(v["cycle_ms"], 4),
                 "phases": {n: round(p["mean_ms"], 4) for n, p in v["phases"].items()}}
             for m, v in s.get("modes", {}).items()}
    return {"tok_per_s": round(s["tok_per_s"], 2),
            "tok_per_s_steady": round(s["steady_tok_per_s"], 2),
            "accept_length": s["accept_length"], "cycles": s["cycles"], "modes": modes}


def measure(llm: LLM, cfg, draft: str, prompts: list, params: SamplingParams,
            steady: bool) -> dict:
    s = run_config(llm, cfg, draft, prompts, params, warmup_tokens=8, warm_all=steady).summary
    return _row(s)


def repeated(llm: LLM, configs: list, draft: str, prompts: list, params: SamplingParams,
             repeats: int) -> list[dict]:
    """Every configuration once untimed, then `repeats` rounds of all of them in turn."""
    for cfg in configs:
        run_config(llm, cfg, draft, prompts, params, warmup_tokens=8, warm_all=True)
    runs: dict = {str(cfg or "plain"): [] for cfg in configs}
    for _ in range(repeats):
        for cfg in configs:
            s = run_config(llm, cfg, draft, prompts, params, warmup_tokens=8).summary
            # Graph replays on CUDA, the eager phases elsewhere; the whole phase rows.
            mode = s["modes"].get("segments") or s["modes"].get("phases") or {}
            runs[str(cfg or "plain")].append({
                "tok_per_s_steady": s["steady_tok_per_s"], "accept_length": s["accept_length"],
                "cycles": s["cycles"], "mode": mode})
    print(f"{'config':<12} {'tok/s med':>9} {'min':>7} {'max':>7} {'spread':>6} "
          f"{'cycle':>6} {'draft mean/p50':>15} {'ver+com mean/p50':>17} "
          f"{'other mean/p50':>15} {'tau':>5}", flush=True)
    rows = []
    for name, rs in runs.items():
        tps = [r["tok_per_s_steady"] for r in rs]
        med = statistics.median(tps)
        segs = [r["mode"] for r in rs]

        def ph(key: str, stat: str, segs=segs) -> float:
            return statistics.median(s.get("phases", {}).get(key, {}).get(stat, 0.0)
                                     for s in segs)
        cyc = statistics.median(s.get("cycle_ms", 0.0) for s in segs)
        tau = statistics.median(r["accept_length"] or 1.0 for r in rs)
        print(f"{name:<12} {med:>9.1f} {min(tps):>7.1f} {max(tps):>7.1f} "
              f"{(max(tps) - min(tps)) / med:>6.1%} {cyc:>6.3f} "
              f"{ph('draft', 'mean_ms'):>7.3f}/{ph('draft', 'p50_ms'):<7.3f} "
              f"{ph('verify_commit', 'mean_ms'):>8.3f}/{ph('verify_commit', 'p50_ms'):<8.3f} "
              f"{ph('other', 'mean_ms'):>7.3f}/{ph('other', 'p50_ms'):<7.3f} {tau:>5.2f}",
              flush=True)
        rows.append({"config": name, "tok_per_s": tps, "runs": rs})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default=None, help="semicolon-separated s,k,n (default: all)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="CUDA: rounds of every configuration in turn, graphs only")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the load (the collector's share of the noise)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = load_prompts(args.dataset, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    configs = CONFIGS if not args.configs else [
        None if c == "plain" else tuple(int(x) for x in c.split(","))
        for c in args.configs.split(";")]
    cuda = args.device.startswith("cuda")
    if args.repeats:
        llm = LLM(args.model, device=args.device, cuda_graphs=cuda)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        t0 = time.perf_counter()
        rows = repeated(llm, configs, args.draft, prompts, params, args.repeats)
        meta = {"device": args.device, "model": llm.model_name, "repeats": args.repeats,
                "gc_freeze": args.gc_freeze, "num_prompts": len(prompts),
                "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - t0, 1)}
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}) + "\n")
        print(json.dumps(meta))
        return
    engines = {"eager": LLM(args.model, device=args.device, cuda_graphs=False)}
    if cuda:
        engines["graphs"] = LLM(args.model, device=args.device, cuda_graphs=True)
    results = []
    print(f"{'config':<12} {'steady tok/s':>12} {'cycle ms':>9} {'draft':>7} {'ver+com':>8} "
          f"{'cold tok/s':>10} {'captures':>8} {'eager tok/s':>11} {'tau':>5}", flush=True)
    t0 = time.perf_counter()
    for cfg in configs:
        row: dict = {"config": list(cfg) if cfg else "plain"}
        if cuda:
            row["steady"] = measure(engines["graphs"], cfg, args.draft, prompts, params, True)
            row["cold"] = measure(engines["graphs"], cfg, args.draft, prompts, params, False)
        row["eager"] = measure(engines["eager"], cfg, args.draft, prompts, params, False)
        results.append(row)
        st = row.get("steady", row["eager"])
        seg = st["modes"].get("segments", next(iter(st["modes"].values()), {}))
        ph = seg.get("phases", {})
        cold = row.get("cold", {})
        caps = cold.get("modes", {}).get("phases", {}).get("cycles", 0) if cfg else 0
        print(f"{str(cfg or 'plain'):<12} {st['tok_per_s']:>12.1f} "
              f"{seg.get('cycle_ms', 0):>9.3f} {ph.get('draft', 0):>7.3f} "
              f"{ph.get('verify_commit', 0):>8.3f} {cold.get('tok_per_s', 0):>10.1f} "
              f"{caps:>8} {row['eager']['tok_per_s']:>11.1f} "
              f"{row['eager']['accept_length'] or 1:>5.2f}", flush=True)
    meta = {"device": args.device, "model": engines["eager"].model_name,
            "dataset": args.dataset, "num_prompts": len(prompts),
            "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - t0, 1)}
    out = {"meta": meta, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
