"""Where a CPU forward's time goes, op by op: the default model (or --model) at 1, 6 and 16
tokens a forward, each the engine's own step (decode of 1 token; a chain verify of 5 draft
tokens + 1; a 16-token prefill chunk), under torch.profiler.

    python benchmarks/cpu_ops.py --dtype bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_ops.py --dtype fp32

Per forward size: wall ms per step, the ops' own time (self CPU time summed over every op the
profiler records), the rest (Python, dispatch and framework time between the ops), the op
count per step, and the top ops by self time grouped by name. Then one JSON line. The CPU
features in effect are printed first (torch's ATen capability and oneDNN's ISA), so a run
says which CPU class it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specscope import LLM
from specscope.config import SamplingParams, SpecConfig


def cpu_features() -> dict:
    """The kernels' CPU class as torch sees it (what the AVX2 emulation variables change)."""
    cap = torch.backends.cpu.get_cpu_capability()
    try:
        isa = torch._C._get_onednn_isa() if hasattr(torch._C, "_get_onednn_isa") else None
    except RuntimeError:
        isa = None
    return {"aten_cpu_capability": cap, "onednn_isa": isa,
            "threads": torch.get_num_threads()}


def steps_of(llm: LLM, want: str, n: int) -> None:
    """Run n engine steps of the kind `want` (decode, verify or prefill) for one request."""
    eng = llm.engine
    done = 0
    while done < n:
        llm.step()
        st = eng.last_stats
        kind = ("prefill" if st.prefill_tokens else
                "verify" if st.num_speculating else "decode")
        done += kind == want
        if not llm.has_unfinished_requests():
            return


def profile_steps(llm: LLM, want: str, prompt: list[int], steps: int) -> dict:
    """Profile `steps` engine steps of kind `want`: per-step wall, op self time, ops."""
    max_tokens = 4 if want == "prefill" else steps * 8 + 16
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for _ in range(steps if want == "prefill" else 1):
        llm.add_request(prompt, params)
        if want != "prefill":
            steps_of(llm, "prefill", 1)
            steps_of(llm, want, 2)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            steps_of(llm, want, 1 if want == "prefill" else steps)
            wall = time.perf_counter() - t
        rows.append((wall, prof.key_averages()))
        while llm.has_unfinished_requests():
            llm.step()
    n = steps
    wall_ms = sum(r[0] for r in rows) * 1e3 / n
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for _, avgs in rows:
        for a in avgs:
            by_name[a.key][0] += a.self_cpu_time_total / 1e3 / n
            by_name[a.key][1] += a.count / n
    own = sum(v[0] for v in by_name.values())
    ops = sum(v[1] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {"kind": want, "wall_ms": wall_ms, "op_self_ms": own, "between_ops_ms": wall_ms - own,
            "ops_per_step": ops,
            "top": [{"op": k, "self_ms": v[0], "calls": v[1]} for k, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(cpu_features()))
    llm = LLM(args.model, dtype=args.dtype, device="cpu", quantization=args.quantization,
              profile=False)
    prompt = llm.tokenizer.encode("Explain how a bicycle stays upright while it moves.")
    out = []
    # A chain of 5 with SIMULATED acceptance: the verify forward is 6 tokens whatever the draft.
    for kind, spec in (("decode", None), ("prefill", None),
                       ("verify", SpecConfig(draft="random", num_steps=5,
                                             simulate_acceptance=2.0))):
        llm.set_spec(spec)
        p = prompt[:16] if kind == "prefill" else prompt
        r = profile_steps(llm, kind, p, args.steps)
        r["tokens"] = {"decode": 1, "prefill": len(p), "verify": 6}[kind]
        out.append(r)
        print(f"{kind} ({r['tokens']} tokens a forward): {r['wall_ms']:.2f} ms a step, ops' own "
              f"{r['op_self_ms']:.2f} ms, between ops {r['between_ops_ms']:.2f} ms, "
              f"{r['ops_per_step']:.0f} ops", flush=True)
        for t in r["top"]:
            print(f"    {t['op']:<40} {t['self_ms']:8.3f} ms {t['calls']:7.1f} calls")
    llm.set_spec(None)
    print(json.dumps({"features": cpu_features(), "dtype": args.dtype,
                      "quantization": args.quantization, "rows": out}))


if __name__ == "__main__":
    main()
