"""The few-row linear (specscope.models.linear_triton) against cuBLAS's F.linear on CUDA, bf16.

    python benchmarks/linear.py             # the table, then one JSON line
    python benchmarks/linear.py --sweep     # also every candidate tile config per shape

Shapes: the Llama-3.1-8B layer's four weights and lm_head, the EAGLE-3 draft's fc, fused
qkv and 32k lm_head, Qwen3-30B-A3B's attention. Each call is timed inside a CUDA graph over
weights rotated among copies three times the L2 (so no weight is read from the L2), mean of
the middle of five replays; "of floor" = weight bytes / measured copy bandwidth / time.
Each shape is first checked against F.linear (max abs error over the output's max).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from specscope.models import linear_triton as lt

SHAPES = {  # name: (out, in)
    "8b o_proj": (4096, 4096), "8b qkv_proj": (6144, 4096), "8b down_proj": (4096, 14336),
    "8b gate_up_proj": (28672, 4096), "8b lm_head": (128256, 4096),
    "draft fc": (4096, 12288), "draft qkv": (6144, 8192), "draft lm_head": (32000, 4096),
    "qwen3-moe qkv": (5120, 2048), "qwen3-moe o_proj": (2048, 4096),
}
SWEEP = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4, 6)))


def time_us(fn, copies: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(times)[2]


def run(name: str, n: int, k: int, m: int, peak: float, sweep: bool) -> dict:
    L2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, -(-3 * L2 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
          for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0])
    err = ((lt.linear(x, ws[0]).float() - ref.float()).abs().max()
           / ref.float().abs().max()).item()

    def loop(f):
        def body():
            for w in ws:
                f(x, w)
        return body

    floor = n * k * 2 / peak * 1e6
    row = {"shape": name, "out": n, "in": k, "M": m, "err": err, "floor_us": floor,
           "cublas_us": time_us(loop(F.linear), copies),
           "triton_us": time_us(loop(lt.linear), copies), "config": list(lt.config(n, k))}
    if sweep:
        best = None
        for tile in SWEEP:
            try:
                us = time_us(loop(lambda a, w, t=tile: lt.linear(a, w, tile=t)), copies)
            except Exception:  # noqa: BLE001 - a tile out of resources: skip it
                continue
            if best is None or us < best[1]:
                best = (tile, us)
        row["best_tile"], row["best_us"] = list(best[0]), best[1]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--peak-gbs", type=float, default=4280.0)
    ap.add_argument("--shapes", nargs="*", help="names of shapes to run (default all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/linear.py needs a CUDA device")
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':18}{'M':>3}{'rel err':>10}{'floor':>8}{'cuBLAS':>8}{'triton':>8}"
          f"{'of floor':>10}" + (f"{'best':>8}  best tile" if args.sweep else ""))
    for name, (n, k) in SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        for m in (int(t) for t in args.tokens.split(",")):
            r = run(name, n, k, m, args.peak_gbs * 1e9, args.sweep)
            rows.append(r)
            line = (f"{name:18}{m:>3}{r['err']:10.1e}{r['floor_us']:8.1f}{r['cublas_us']:8.1f}"
                    f"{r['triton_us']:8.1f}{r['floor_us'] / r['triton_us']:10.1%}")
            if args.sweep:
                line += f"{r['best_us']:8.1f}  {tuple(r['best_tile'])}"
            print(line, flush=True)
    print(json.dumps({"benchmark": "linear", "rows": rows}))


if __name__ == "__main__":
    main()
