"""How much of a CPU engine step is outside the native calls, and what a Python pause costs
the next native product (the OpenMP workers' wake-up).

    python benchmarks/cpu_host_share.py                # both parts, the default model
    python benchmarks/cpu_host_share.py --part wake    # the products after pauses only
    OMP_WAIT_POLICY=active python benchmarks/cpu_host_share.py --part wake

Share: the default model plainly and with its shipped draft (3 MT-Bench prompts x 256
greedy tokens each, after a warm-up prompt); `Engine.step` is timed whole, and so are the
native calls inside it (`NativeDecoder.run` / `run_first`, `CpuKernels.quant_linear` /
`argmax_rows`, `NativeDraftChain.step`, `native_extend`), each by a wrapper. What is left is
Python, torch's own ops and the smaller native kernels called from them (norms, the
embedding). Wake: one 1-row gate_up product (3072 x 576, Q4_1 codes) timed after a busy
pause of G microseconds in Python, 300 times per G (median, 10th percentile): libgomp's
workers spin for a while after a parallel region, then sleep, and a product that has to
wake them pays for it. Prints a table, then a JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import numpy as np
import torch

import specscope.engine.draft_runner as draft_runner
import specscope.native.cpu as native_cpu
import specscope.native.decoder as native_decoder
from specscope import native
from specscope.bench.datasets import load_prompts
from specscope.config import SamplingParams
from specscope.engine.engine import Engine
from specscope.engine.llm import LLM
from specscope.models.quant import GgufLinear


def _wrap(owner: object, name: str, label: str, acc: dict) -> None:
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t

    setattr(owner, name, timed)


def share(spec: str | None, acc: dict) -> dict:
    prompts = load_prompts("mt_bench", 4)
    sp = SamplingParams(max_tokens=256, temperature=0)
    llm = LLM(spec=spec)
    llm.chat(prompts[0], sp)
    acc.clear()
    t, n = time.perf_counter(), 0
    for p in prompts[1:]:
        n += len(llm.chat(p, sp)[0].outputs[0].token_ids)
    wall = time.perf_counter() - t
    llm.close()
    host = acc["step"] - acc["native"]
    return {"mode": "speculative" if spec else "plain", "tokens": n, "wall_ms": wall * 1e3,
            "step_ms": acc["step"] * 1e3, "native_ms": acc["native"] * 1e3,
            "host_ms": host * 1e3, "host_share": host / wall}


def wake(gaps: list[int]) -> list[dict]:
    rng = np.random.default_rng(0)
    N, K = 3072, 576
    lin = GgufLinear.from_codes(rng.integers(0, 16, (N, K)).astype(np.uint8),
                                rng.uniform(0.001, 0.05, (N, K // 32)).astype(np.float32),
                                rng.uniform(-0.3, 0.0, (N, K // 32)).astype(np.float32), 4,
                                None)
    kernels = native.cpu_kernels()
    args = (lin.codes, lin.scales, lin.offsets, N, lin.bits)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    out = []
    for gap in gaps:
        ts = []
        for _ in range(300):
            until = time.perf_counter() + gap * 1e-6
            while time.perf_counter() < until:
                pass
            t = time.perf_counter()
            kernels.quant_linear(x, *args)
            ts.append(time.perf_counter() - t)
        ts.sort()
        out.append({"pause_us": gap, "median_us": statistics.median(ts) * 1e6,
                    "p10_us": ts[len(ts) // 10] * 1e6})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["share", "wake", "both"], default="both")
    ap.add_argument("--gaps", type=lambda s: [int(x) for x in s.split(",")],
                    default=[0, 20, 100, 300, 1000, 3000])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    res: dict = {"benchmark": "cpu_host_share"}
    if args.part in ("share", "both"):
        acc: dict = collections.defaultdict(float)
        for cls, names in ((native_decoder.NativeDecoder, ("run", "run_first")),
                           (native_cpu.CpuKernels, ("quant_linear", "argmax_rows")),
                           (native_decoder.NativeDraftChain, ("step",))):
            for name in names:
                _wrap(cls, name, "native", acc)
        _wrap(draft_runner, "native_extend", "native", acc)
        _wrap(Engine, "step", "step", acc)
        res["share"] = [share(None, acc), share("auto", acc)]
        print("mode          tokens   wall ms   step ms  native ms  host ms  host share")
        for r in res["share"]:
            print(f"{r['mode']:12s} {r['tokens']:7d} {r['wall_ms']:9.0f} {r['step_ms']:9.0f} "
                  f"{r['native_ms']:10.0f} {r['host_ms']:8.0f} {r['host_share']:10.1%}")
    if args.part in ("wake", "both"):
        res["wake"] = wake(args.gaps)
        print("pause us   product median us   p10 us")
        for r in res["wake"]:
            print(f"{r['pause_us']:8d} {r['median_us']:19.1f} {r['p10_us']:8.1f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
