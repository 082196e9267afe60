"""The routed experts of one MoE layer on CUDA: the sorted grouped GEMMs against the few-pairs
GEMV path (models/moe_triton.py), by token count, and the rest of the block (router, routing,
expert count) at batch 1. Each timing is a CUDA-graph replay of 20 calls, so launch gaps
count as they do in the engine's graphs.

    python benchmarks/moe_experts.py --shape qwen3-30b-a3b mixtral-8x7b deepseek-v3
    python benchmarks/moe_experts.py --sweep --tokens 1,4   # the pair kernels' tiles
    python benchmarks/moe_experts.py --sweep --quick --tokens 1   # defaults + a few

Reports us per call, the bytes of the distinct experts the call's routing touches (the
floor's bytes) and the bandwidth that makes; then one JSON line. Routing is uniform at
random (k distinct experts a token), the case that touches the most experts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402

from specscope.models import moe_triton  # noqa: E402
from specscope.models.moe import Router  # noqa: E402
from specscope.models.registry import config_from_hf  # noqa: E402

REPLAYS = 20


def graph_us(fn, reps: int = 5) -> float:
    """Median us per call of fn over `reps` replays of a graph of REPLAYS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPLAYS):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPLAYS)
    return sorted(times)[len(times) // 2]


def shape_rows(name: str, tokens: list[int]) -> dict:
    cfg = config_from_hf(SHAPES[name], name=name)
    moe = cfg.moe
    E, k, H, i = moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_intermediate_size
    dev, dt = "cuda", torch.bfloat16
    gate_up = torch.randn(E, 2 * i, H, device=dev, dtype=dt) * 0.02
    down = torch.randn(E, H, i, device=dev, dtype=dt) * 0.02
    per_expert = 3 * i * H * 2
    rows, default_choice = [], moe_triton.use_pairs
    for N in tokens:
        g = torch.Generator(device=dev).manual_seed(N)
        ids = torch.rand(N, E, device=dev, generator=g).argsort(-1)[:, :k].contiguous()
        w = torch.rand(N, k, device=dev, generator=g)
        x = torch.randn(N, H, device=dev, dtype=dt)
        distinct = int(ids.unique().numel())
        row = {"tokens": N, "pairs": N * k, "distinct_experts": distinct,
               "bytes": distinct * per_expert}
        for path in ("sorted", "pairs"):  # each path forced, whatever the pair count
            moe_triton.use_pairs = lambda *a, p=path: p == "pairs"
            args = (x, ids, w, gate_up, down)
            us = graph_us(lambda a=args: moe_triton.experts_grouped(*a))
            row[path + "_us"] = us
            row[path + "_gb_s"] = row["bytes"] / us / 1e3
        moe_triton.use_pairs = default_choice
        rows.append(row)
    router = Router(H, moe).to(dev, dt)
    x1 = torch.randn(1, H, device=dev, dtype=dt)
    router_us = graph_us(lambda: router(x1))
    return {"shape": name, "experts": E, "top_k": k, "hidden": H, "expert_width": i,
            "router_and_routing_us_bs1": router_us, "rows": rows}


TILES = {"PAIR_GATE_UP_TILE": [(bn, bk, w, st, False) for bn in (16, 32, 64)
                               for bk in (128, 256) for w in (4, 8) for st in (1, 3)]
         + [(bn, bk, 4, st, True) for bn in (16, 32, 64) for bk in (64, 128, 256)
            for st in (2, 3, 4)],
         # a down program holds a token's k pairs: k times the rows of a gate_up tile
         "PAIR_DOWN_TILE": [(bn, bk, w, 3, False) for bn in (2, 4, 8, 16)
                            for bk in (64, 128, 256) for w in (4, 8)]
         + [(bn, bk, 4, st, True) for bn in (16, 32) for bk in (64, 128, 256)
            for st in (2, 3, 4)]}
# --quick: the defaults beside a few tensor-core tiles of each kernel
QUICK = {"PAIR_GATE_UP_TILE": [(64, 256, 8, 3, False), (16, 128, 4, 3, True),
                               (32, 128, 4, 3, True), (32, 256, 4, 3, True),
                               (64, 128, 4, 3, True), (16, 256, 4, 4, True)],
         "PAIR_DOWN_TILE": [(8, 256, 4, 3, False), (16, 128, 4, 3, True),
                            (16, 256, 4, 3, True), (32, 128, 4, 3, True),
                            (16, 64, 4, 4, True)]}


def sweep(name: str, tokens: list[int], kernels: list[str], quick: bool = False) -> dict:
    """The pair path's us per call for each gate_up tile (down at its default), then each
    down tile (gate_up at the best found), summed over `tokens`; `kernels`: which of the
    two to sweep (the other stays at its default)."""
    cfg = config_from_hf(SHAPES[name], name=name)
    moe = cfg.moe
    E, k, H, i = moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_intermediate_size
    gate_up = torch.randn(E, 2 * i, H, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, i, device="cuda", dtype=torch.bfloat16) * 0.02
    cases = []
    for N in tokens:
        ids = torch.rand(N, E, device="cuda").argsort(-1)[:, :k].contiguous()
        cases.append((torch.randn(N, H, device="cuda", dtype=torch.bfloat16), ids,
                      torch.rand(N, k, device="cuda"), gate_up, down))
    out = {"shape": name, "tokens": tokens}
    for which in ("PAIR_GATE_UP_TILE", "PAIR_DOWN_TILE"):
        if which.split("_")[1].lower() not in kernels:
            continue
        times = {}
        for tile in (QUICK if quick else TILES)[which]:
            setattr(moe_triton, which, tile)
            times[tile] = sum(graph_us(lambda a=c: moe_triton.experts_pairs(*a))
                              for c in cases)
            print(f"  {which} {tile}: {times[tile]:.1f} us", flush=True)
        best = min(times, key=times.get)
        setattr(moe_triton, which, best)
        out[which] = {"best": best, "us": {str(t): v for t, v in times.items()}}
        print(f"{name} {which}: best {best} {times[best]:.1f} us (sum over tokens "
              f"{tokens}); worst {max(times.values()):.1f}", flush=True)
    return out


def fmt(res: dict) -> str:
    lines = [f"{res['shape']}: E {res['experts']}, top-{res['top_k']}, hidden {res['hidden']}, "
             f"expert width {res['expert_width']}; router + routing at batch 1: "
             f"{res['router_and_routing_us_bs1']:.1f} us",
             f"{'tokens':>6} {'pairs':>5} {'experts':>7} {'MB':>7} {'sorted us':>10} "
             f"{'GB/s':>6} {'pairs us':>9} {'GB/s':>6}"]
    for r in res["rows"]:
        lines.append(f"{r['tokens']:>6} {r['pairs']:>5} {r['distinct_experts']:>7} "
                     f"{r['bytes'] / 1e6:>7.1f} {r['sorted_us']:>10.1f} {r['sorted_gb_s']:>6.0f} "
                     f"{r['pairs_us']:>9.1f} {r['pairs_gb_s']:>6.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"],
                    choices=[s for s in sorted(SHAPES) if "n_routed_experts" in SHAPES[s]
                             or "num_experts" in SHAPES[s] or "num_local_experts" in SHAPES[s]])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--sweep", action="store_true", help="sweep the pair kernels' tiles")
    ap.add_argument("--sweep-kernels", nargs="+", choices=["gate", "down"],
                    default=["gate", "down"], help="with --sweep: gate (gate_up), down")
    ap.add_argument("--quick", action="store_true",
                    help="with --sweep: only the defaults and a few tensor-core tiles")
    args = ap.parse_args()
    out = []
    if args.sweep:
        print(json.dumps([sweep(name, args.tokens, args.sweep_kernels, args.quick)
                          for name in args.shape]))
        return
    for name in args.shape:
        res = shape_rows(name, args.tokens)
        torch.cuda.empty_cache()
        print(fmt(res), flush=True)
        out.append(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
