"""Tensor-parallel benchmark: plain and speculative tok/s at one tensor-parallel size, the
draft replicated (draft TP 1) against sharded (draft TP N), the phase table with each
phase's collective share, per-rank skew, and the cost model's price of each draft
placement from the other's measurement.

One run measures one size: the world torchrun starts (or 1 under plain python). Random
weights of a real shape (benchmarks/shapes.py), built sharded on every rank; speculation
uses a random EAGLE-3-shaped draft with SIMULATED acceptance (default tau 3.9, a chain of
7), labelled so. Rank 0 drives the engine; the others follow it (docs/tensor-parallel.md).

    # GPUs (NCCL; NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set in every rank)
    python benchmarks/tensor_parallel.py --device cuda --shape llama-3.1-8b --out tp.jsonl
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --device cuda \
        --shape llama-3.1-8b --out tp.jsonl
    ...  (4, 8), then:  python benchmarks/tensor_parallel.py --summarize tp.jsonl

    # CPU dry run (gloo), the tiny shape
    python benchmarks/tensor_parallel.py --device cpu --shape tiny --concurrency 1,4
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --device cpu --shape tiny \
        --concurrency 1,4

CUDA graphs replay whole segments, inside which collectives cannot be timed one by one:
tok/s is what to read from a run with graphs (the default), the collective split from a run
with --no-cuda-graphs. Prints the tables, then one JSON line (also appended to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import layers  # noqa: E402  (benchmarks/ is not a package)

from specscope.config import SamplingParams, SpecConfig  # noqa: E402
from specscope.engine.llm import LLM  # noqa: E402
from specscope.kvcache.budget import parse_bytes  # noqa: E402
from specscope.models.loader import random_model  # noqa: E402
from specscope.models.registry import config_from_hf  # noqa: E402
from specscope.parallel import launch  # noqa: E402
from specscope.profiler import format_summary  # noqa: E402
from specscope.tune.cost import CostModel  # noqa: E402
from specscope.tune.placement import with_draft_placement  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="llama-3.1-8b",
                   help="benchmarks/shapes.py: tiny, llama-3.1-8b, llama-3.1-70b, "
                        "qwen3-30b-a3b, deepseek-v3, ...")
    p.add_argument("--layers", type=int, default=None,
                   help="the shape's first N decoder layers (a DeepSeek-V3 subset)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-steps", type=int, default=7)
    p.add_argument("--simulate", type=float, default=3.9, help="simulated accept length")
    p.add_argument("--modes", default="plain,spec", help="plain, spec or both")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dist-timeout", type=float, default=launch.DEFAULT_DIST_TIMEOUT)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (CPU; default: the cores / the ranks)")
    p.add_argument("--out", default=None, help="append the run's JSON line to this file")
    p.add_argument("--summarize", default=None, metavar="JSONL",
                   help="print the table of several runs' JSON lines (all sizes) and exit")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[LLM, int]:
    """The LLM on this rank (on ranks other than 0 this never returns: they follow)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // size))
    tp = launch.start(size, args.device, None, args.dist_timeout)
    dev = tp.group.device if tp is not None else torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    cfg = config_from_hf(layers(args.shape, args.layers), name=args.shape)
    model = random_model(cfg, dtype, dev, tp=tp.group if tp is not None else None)
    max_len = args.prompt_len + args.output_len + 64
    llm = LLM.from_model(model, name=args.shape, tp=tp, max_model_len=max_len,
                         max_num_seqs=args.max_num_seqs, cuda_graphs=args.cuda_graphs,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         kv_cache_memory=args.kv_cache_memory,
                         max_num_batched_tokens=max(2048, args.max_num_seqs))
    return llm, size


def run_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once through the engine loop: tok/s, TPOT and TTFT medians, tau."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [llm.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outs = {}
    while len(outs) < len(rids):
        for d in llm.step():
            now = time.perf_counter()
            if d.token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
            if d.finished:
                outs[d.request_id] = d.output
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs.values())
    tpot = [(last[r] - first[r]) / (len(outs[r].token_ids) - 1) for r in rids
            if len(outs[r].token_ids) > 1]
    acc = [a for o in outs.values() if o.spec for a in o.spec["accepted_per_cycle"]]
    return {"output_tok_s": tokens / wall, "wall_s": wall,
            "tpot_ms_p50": 1e3 * statistics.median(tpot) if tpot else None,
            "ttft_ms_p50": 1e3 * statistics.median(first[r] - t0 for r in rids),
            "tau": 1 + sum(acc) / len(acc) if acc else None}


def modes(args: argparse.Namespace, size: int) -> list[tuple[str, SpecConfig | None]]:
    out: list[tuple[str, SpecConfig | None]] = []
    if "plain" in args.modes:
        out.append(("plain", None))
    if "spec" in args.modes:
        for d in sorted({1, size}):
            out.append((f"spec draft TP {d}", SpecConfig(
                draft="random", num_steps=args.num_steps, simulate_acceptance=args.simulate,
                draft_tensor_parallel_size=d)))
    return out


def comm_fit(summary: dict) -> tuple[float, float]:
    """(ms per collective, ms per MB) fitted on the phases' collectives (least squares,
    non-negative; a phase is one point: its count, its bytes, its time per cycle)."""
    pts = [(p["comm_count"], p["comm_bytes"] / 1e6, p["comm_ms"])
           for p in summary["phases"].values() if p.get("comm_count")]
    if not pts:
        return 0.0, 0.0
    from specscope.tune.cost import _lstsq

    a, b = _lstsq([[n, mb] for n, mb, _ in pts], [ms for _, _, ms in pts])
    return a, b


def draft_split(summary: dict) -> tuple[float, float]:
    """The draft's (compute, collectives) ms per cycle."""
    compute = comm = 0.0
    for name, p in summary["phases"].items():
        if name.split("[")[0] in ("draft", "draft_extend", "draft_step", "tree_build"):
            comm += p.get("comm_ms", 0.0)
            compute += p["mean_ms"] - p.get("comm_ms", 0.0)
    return compute, comm


def predicted_other(llm: LLM, summary: dict, draft_tp: int, size: int, batch: int,
                    steps: int, tau: float) -> float | None:
    """The cost model's draft ms per cycle at the other placement, from this run alone."""
    if size == 1 or llm.draft is None:
        return None
    compute, comm = draft_split(summary)
    alpha, beta = comm_fit(summary)
    zero = dict.fromkeys(("b_step", "c_tree", "e_tree", "b_row", "a_verify", "b_verify",
                          "c_tree_verify", "d_tree_verify", "other"), 0.0)
    cost = CostModel(a_draft=compute, **zero, plain=1.0, a_draft_comm=comm,
                     comm_alpha_ms=alpha, comm_beta_ms_per_mb=beta, tp=size,
                     draft_tp=draft_tp)
    other = size if draft_tp == 1 else 1
    elem = torch.empty((), dtype=llm.dtype).element_size()
    return with_draft_placement(cost, other, llm.draft.config, elem, batch=batch,
                                extend_rows=tau).draft_ms(steps, 1, steps + 1)


def measure(llm: LLM, args: argparse.Namespace, size: int) -> list[dict]:
    rows = []
    conc = [int(c) for c in args.concurrency.split(",")]
    vocab = llm.model_config.vocab_size
    for label, spec in modes(args, size):
        llm.set_spec(spec)
        for c in conc:
            rng = random.Random(c)
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                       for _ in range(c)]
            run_batch(llm, prompts[:1], 8)  # warm-up: graphs captured, kernels loaded
            llm.reset_simulation()
            llm.enable_profiling(True, interval=None)
            row = {"tp": size, "mode": label, "concurrency": c, **run_batch(
                llm, prompts, args.output_len)}
            (summary,) = llm.profile_summary()
            llm.enable_profiling(False)
            row["draft_ms"] = sum(draft_split(summary)) if spec is not None else None
            row["draft_ms_predicted_other_placement"] = None if spec is None else \
                predicted_other(llm, summary, spec.draft_tensor_parallel_size, size, c,
                                args.num_steps, row["tau"] or args.simulate)
            row["collectives"] = summary.get("collectives")
            row["max_rank_skew"] = (summary.get("ranks") or {}).get("max_skew")
            row["summary"] = format_summary(summary)
            rows.append(row)
            print(f"[tp {size}] {label:<16} concurrency {c:>3}: "
                  f"{row['output_tok_s']:9.1f} tok/s", file=sys.stderr, flush=True)
    llm.set_spec(None)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'TP':>3} {'mode':<16} {'conc':>5} {'tok/s':>10} {'TPOT ms':>8} {'tau':>5} "
            f"{'coll %':>7} {'skew':>5} {'draft ms':>9} {'other placement (pred.)':>24}")
    out = [head]
    for r in rows:
        coll = r.get("collectives")
        pred = r.get("draft_ms_predicted_other_placement")
        out.append(
            f"{r['tp']:>3} {r['mode']:<16} {r['concurrency']:>5} {r['output_tok_s']:>10.1f} "
            f"{r['tpot_ms_p50'] or 0:>8.2f} {r['tau'] or 1:>5.2f} "
            f"{(coll['share'] if coll else 0):>6.0%} {r.get('max_rank_skew') or 1:>5.2f} "
            + (f"{r['draft_ms']:>9.2f}" if r.get("draft_ms") is not None else f"{'-':>9}")
            + (f" {pred:>24.2f}" if pred is not None else f" {'-':>24}"))
    return "\n".join(out)


def summarize(path: str) -> None:
    """The runs of one file (one line per tensor-parallel size) as one table, with each
    row's speedup over TP 1 at the same concurrency, plain over plain and speculative over
    speculative (at TP 1 the draft has one placement)."""
    runs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for run in runs for r in run["rows"]]

    def kind(r: dict) -> str:
        return r["mode"].split()[0]  # "plain" or "spec"

    base = {(kind(r), r["concurrency"]): r["output_tok_s"] for r in rows if r["tp"] == 1}
    print(table(rows))
    print("\nspeedup over TP 1 (plain over plain, speculative over speculative):")
    for r in rows:
        ref = base.get((kind(r), r["concurrency"]))
        if ref:
            print(f"  TP {r['tp']} {r['mode']:<16} concurrency {r['concurrency']:<4} "
                  f"{r['output_tok_s'] / ref:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return
    llm, size = build(args)  # ranks other than 0 follow rank 0 inside, then exit
    rows = measure(llm, args, size)
    print(llm.describe())
    print(f"shape {args.shape}" + (f" ({args.layers} layers)" if args.layers else "")
          + f", {args.prompt_len}-token prompts, {args.output_len} output tokens; "
          f"speculation SIMULATED at tau {args.simulate} (chain of {args.num_steps})")
    print(table(rows))
    for r in rows:
        if r["concurrency"] == rows[0]["concurrency"]:
            print(f"\n{r['mode']}, concurrency {r['concurrency']}:\n{r['summary']}")
    record = {"shape": args.shape, "layers": args.layers, "device": args.device,
              "tp": size, "cuda_graphs": args.cuda_graphs,
              "rows": [{k: v for k, v in r.items() if k != "summary"} for r in rows]}
    line = json.dumps(record)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    print(line)
    llm.close()


if __name__ == "__main__":
    main()
