"""Count first: a batch-1 step's bytes and FLOPs, its floor, and where the measured time goes.

For a random-weight real shape on CUDA (CUDA graphs, the engine's own loop):
  1. the floor: every weight read once (the embedding's one row, the rest whole) and the KV
     read at the step's context, over the measured copy bandwidth (--peak-gbs);
  2. each distinct linear of the step alone (torch's matmul at M = 1 and 8 tokens, weights
     rotated over copies larger than the L2), its time against its own floor;
  3. plain decode and a speculative cycle (chain, SIMULATED acceptance) under torch.profiler:
     every kernel of a step by name, how many per step, microseconds per step;
  4. the host's share (host_timeline.py): the engine's captured graphs replayed back to
     back against the engine's own step, unprofiled (after the profile: it reads high).

    python benchmarks/step_floor.py --device cuda --shape llama-3.1-8b

Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_timeline import host_gap  # noqa: E402
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

# Kernel-name patterns, first match wins: what a kernel is, for the per-category sums.
CATEGORIES = [
    ("matmul", r"gemv|gemm|xmma|cutlass|splitk|matmul|_mm_|sm90_|nvjet|linear_kernel"),
    ("attention", r"paged|attn|attention|flash|decode_kernel|fmha"),
    ("norm", r"rms|norm"),
    ("softmax/topk/sample", r"softmax|topk|sort|argmax|max_|radix|multinomial|exponential"),
    ("copy/index", r"copy|index|gather|scatter|cat|fill|memset|memcpy"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|triton"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def linear_shapes(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    """(out, in) of every 2-D weight a step multiplies by -> how many such weights."""
    shapes: dict[tuple[int, int], int] = defaultdict(int)
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed_tokens" not in name:
            shapes[tuple(p.shape)] += 1
    return dict(shapes)


def step_bytes(model: torch.nn.Module, cfg, context: int) -> dict[str, float]:
    """Bytes a batch-1 step must read: weights (the embedding's one row) and KV."""
    w = e = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if "embed_tokens" in name:
            e += p.shape[-1] * p.element_size()
        else:
            w += n
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * context
    return {"weights": float(w), "embedding_row": float(e), "kv": float(kv)}


def time_graph(fn, iters: int = 50) -> float:
    """Median-free mean of `iters` replays of one captured call, in microseconds."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def linear_table(shapes: dict[tuple[int, int], int], peak: float, tokens: list[int]
                 ) -> list[dict]:
    """Each distinct weight shape alone: torch's matmul at M tokens over rotated copies."""
    rows = []
    L2 = torch.cuda.get_device_properties(0).L2_cache_size
    for (n, k), count in sorted(shapes.items()):
        nbytes = n * k * 2
        copies = max(2, -(-3 * L2 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def run(ws=ws, x=x):
                for w in ws:
                    F.linear(x, w)

            us = time_graph(run) / copies
            floor = nbytes / peak * 1e6
            rows.append({"out": n, "in": k, "per_step": count, "tokens": m, "us": us,
                         "floor_us": floor, "of_floor": floor / us})
        del ws
    return rows


def kernel_profile(llm, prompt: list[int], tokens: int) -> tuple[dict, float, dict]:
    """Kernels of one request's decoding (its prefill left out) under torch.profiler:
    {name: (count, us)}, the decode wall seconds and the engine profiler's summary."""
    from torch.profiler import ProfilerActivity, profile

    from specscope.config import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in llm.stream(None, params, prompt_ids=prompt):  # warm-up: captures the graphs
        pass
    prof = llm.enable_profiling(True, interval=None)
    prof.reset()
    p = profile(activities=[ProfilerActivity.CUDA])
    t0 = None
    for _ in llm.stream(None, params, prompt_ids=prompt):
        if t0 is None:  # the first token is the prefill's: start after it
            torch.cuda.synchronize()
            p.start()
            t0 = time.perf_counter()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    p.stop()
    s = prof.summary(prof.config)
    llm.enable_profiling(False)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name][0] += 1
            kernels[ev.name][1] += ev.device_time
    return {k: tuple(v) for k, v in kernels.items()}, wall, s


def print_kernels(title: str, kernels: dict, steps: int, top: int = 25) -> dict[str, float]:
    cats: dict[str, float] = defaultdict(float)
    for name, (_, us) in kernels.items():
        cats[category(name)] += us / steps
    total = sum(cats.values())
    print(f"\n{title}: {steps} steps, kernel time {total:.1f} us per step")
    print(f"{'category':<22}{'us/step':>10}{'share':>8}")
    for c, us in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"{c:<22}{us:>10.1f}{us / total:>8.1%}")
    print(f"{'kernel':<70}{'n/step':>8}{'us/step':>10}")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name[:69]:<70}{n / steps:>8.1f}{us / steps:>10.1f}")
    return dict(cats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--spec-steps", type=int, default=7)
    ap.add_argument("--tau", type=float, default=3.9, help="SIMULATED accept length")
    ap.add_argument("--peak-gbs", type=float, default=4280.0,
                    help="measured copy bandwidth (read + write), GB/s")
    ap.add_argument("--linear-tokens", default="1,8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_floor.py needs CUDA (--device cuda)")

    from specscope import LLM
    from specscope.config import SpecConfig
    from specscope.models.loader import random_model
    from specscope.models.registry import config_from_hf

    cfg = config_from_hf(SHAPES[args.shape], name=args.shape)
    model = random_model(cfg, torch.bfloat16, torch.device(args.device))
    peak = args.peak_gbs * 1e9
    ctx = args.prompt_tokens + args.tokens // 2
    b = step_bytes(model, cfg, ctx)
    floor_us = sum(b.values()) / peak * 1e6
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    print(f"{args.shape}: weights {b['weights'] / 1e9:.2f} GB, KV at {ctx} tokens "
          f"{b['kv'] / 1e6:.1f} MB; decode floor {floor_us:.0f} us "
          f"({1e6 / floor_us:.1f} tok/s); {2 * params / 1e9:.1f} GFLOP per token")

    lin = linear_table(linear_shapes(model), peak,
                       [int(t) for t in args.linear_tokens.split(",")])
    print(f"\n{'linear (out x in)':<22}{'per step':>9}{'M':>4}{'us':>9}{'floor us':>10}"
          f"{'of floor':>10}")
    for r in lin:
        print(f"{r['out']:>8} x {r['in']:<11}{r['per_step']:>9}{r['tokens']:>4}"
              f"{r['us']:>9.1f}{r['floor_us']:>10.1f}{r['of_floor']:>10.1%}")
    lin_sum = sum(r["us"] * r["per_step"] for r in lin if r["tokens"] == 1)
    print(f"sum of the linears at M=1: {lin_sum:.0f} us")

    llm = LLM.from_model(model, name=args.shape, max_model_len=4096, cuda_graphs=True,
                         gpu_memory_utilization=0.5)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,)).tolist()
    out = {"shape": args.shape, "floor_us": floor_us, "bytes": b, "linears": lin}
    kern, wall, s = kernel_profile(llm, prompt, args.tokens)
    steps = max(1, s.get("cycles") or args.tokens - 1)
    step_us = 1e6 / s["steady_tok_per_s"] if s.get("steady_tok_per_s") else wall * 1e6 / steps
    print(f"\nplain decode: {s.get('steady_tok_per_s', 0):.1f} tok/s steady, step "
          f"{step_us:.0f} us = {floor_us / step_us:.1%} of the floor")
    out["plain"] = {"step_us": step_us, "categories": print_kernels("plain", kern, steps)}
    out["plain"]["host"] = host_gap(llm, prompt, args.tokens, spec=False)

    llm.set_spec(SpecConfig(draft="random", num_steps=args.spec_steps, topk=1,
                            num_draft_tokens=args.spec_steps + 1,
                            simulate_acceptance=args.tau))
    kern, wall, s = kernel_profile(llm, prompt, args.tokens * 2)
    cycles = max(1, s.get("cycles") or round(args.tokens * 2 / args.tau))
    tps = s.get("steady_tok_per_s") or args.tokens * 2 / wall
    tau = s.get("accept_length") or 0.0
    print(f"\nspeculative chain of {args.spec_steps}, SIMULATED tau {tau:.2f}: "
          f"{tps:.1f} tok/s steady")
    out["spec"] = {"tok_per_s": tps, "accept_length": s.get("accept_length"),
                   "categories": print_kernels("spec cycle", kern, cycles)}
    out["spec"]["host"] = host_gap(llm, prompt, args.tokens * 2, spec=True)
    print(json.dumps({"benchmark": "step_floor", **out}))


if __name__ == "__main__":
    main()
