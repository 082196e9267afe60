"""Speculative vs plain decoding in one process (weights loaded once), with the cycle split.

CPU: the default model with a random EAGLE-3 draft in simulated-acceptance mode:

    python benchmarks/spec.py --tau 3.0 --num-steps 5 --tokens 128

GPU: a random-weight Llama-3.1-8B-shape target with an EAGLE-3-shaped draft (hidden 4096,
draft vocab 32000), 7 steps, topk 1:

    python benchmarks/spec.py --device cuda --shape llama-3.1-8b --num-steps 7 --tau 3.0

Acceptance is SIMULATED (the draft is random): the real draft and verify computation runs
and real tokens are emitted, but how many are accepted follows --tau. The table gives tok/s,
the measured accept length, and the mean time per cycle in each phase (phase timer: CUDA
events on the GPU, perf_counter on the CPU). A JSON line follows the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

PROMPT = "The history of the printing press begins"
ID_PROMPT = " ".join(str(i) for i in range(100, 132))  # 32 token ids, for id-tokenizers


def run_engine(llm, args, label: str) -> dict:
    from specscope import SamplingParams

    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = PROMPT if llm.model_path is not None else ID_PROMPT
    llm.generate(prompt, params)  # warm-up: captures graphs for every KV window used
    rows = []
    for _ in range(args.repeat):
        prof = llm.enable_profiling(True, interval=None)  # fresh profiler per run
        llm.reset_simulation()  # every run sees the same accept decisions
        out = llm.generate(prompt, params)[0]
        summary = prof.summary(prof.config)
        rows.append({"decode_tok_s": out.metrics.decode_tokens_per_s, "spec": out.spec,
                     "cycles": summary["cycles"], "attributed": summary["attributed"],
                     "phases": {k: v["mean_ms"] for k, v in summary["phases"].items()}})
    llm.enable_profiling(False)
    mid = sorted(rows, key=lambda r: r["decode_tok_s"])[len(rows) // 2]
    return {"label": label, "decode_tok_s_runs": [r["decode_tok_s"] for r in rows], **mid}


def build_cpu(args):
    from specscope import LLM

    return LLM(args.model, dtype=args.dtype, device="cpu", quantization=args.quantization,
               cache_dir=args.cache_dir)


def build_gpu(args):
    """A random-weight real-shape target (token ids as text: there is no tokenizer)."""
    from specscope import LLM
    from specscope.config import ModelConfig
    from specscope.models.loader import random_model

    cfg = ModelConfig.from_hf(SHAPES[args.shape], name=args.shape)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return LLM.from_model(random_model(cfg, dtype, args.device), name=args.shape,
                          max_model_len=4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--tau", type=float, default=3.0, help="simulated mean accept length")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--random", action="store_true",
                    help="random-weight --shape target on --device (default on CUDA)")
    args = ap.parse_args()

    from specscope.config import SpecConfig

    random_target = args.device.startswith("cuda") or args.random
    llm = build_gpu(args) if random_target else build_cpu(args)
    results = [run_engine(llm, args, "plain")]
    spec = SpecConfig(draft="random", num_steps=args.num_steps, topk=args.topk,
                      draft_layer_ids=None,
                      num_draft_tokens=args.num_draft_tokens, simulate_acceptance=args.tau)
    llm.set_spec(spec)
    results.append(run_engine(llm, args, f"spec steps={args.num_steps} topk={args.topk} "
                                         f"SIMULATED tau={args.tau}"))
    base = results[0]["decode_tok_s"]
    print(f"{'mode':<44} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'cycle ms':>9}  phases "
          f"(mean ms per cycle)")
    for r in results:
        ph = r["phases"]
        cyc = sum(ph.values())
        tau = r["spec"]["accept_length"] if r["spec"] else 1.0
        parts = " ".join(f"{k}={v:.2f}" for k, v in ph.items())
        print(f"{r['label']:<44} {r['decode_tok_s']:>8.1f} {r['decode_tok_s'] / base:>7.2f}x "
              f"{tau:>6.2f} {cyc:>9.2f}  {parts}")
    spec_ph = results[1]["phases"]
    draft_ms = sum(v for k, v in spec_ph.items()
                   if k.split("[")[0] in ("draft_extend", "draft_step", "tree_build", "draft"))
    verify_ms = sum(v for k, v in spec_ph.items() if k in ("verify", "accept", "kv_commit",
                                                              "verify_commit"))
    print(f"cycle split: draft {draft_ms:.2f} ms, verify+accept+commit {verify_ms:.2f} ms "
          f"(acceptance SIMULATED; draft weights random)")
    dev = llm.device
    meta = {"device": str(dev), "gpu": torch.cuda.get_device_name() if dev.type == "cuda"
            else None, "torch": torch.__version__, "tokens": args.tokens,
            "model": args.shape if random_target else (args.model or "default"),
            "dtype": str(llm.dtype), "quantization": args.quantization,
            "draft_ms": draft_ms, "verify_ms": verify_ms,
            "median_of": args.repeat, "simulated": True}
    print(json.dumps({"benchmark": "spec", **meta, "results": results}))


if __name__ == "__main__":
    main()
