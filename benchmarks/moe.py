"""MoE cost benchmark: decode against its floor, and what a verify of n draft tokens costs.

For a Mixture-of-Experts target the bytes a decode step reads depend on the experts its
tokens activate, so the floor is computed from the measured count: every non-expert weight
(attention, dense layers, shared experts, router, lm_head; one embedding row), plus, per MoE
layer, the experts that step activated, plus the KV cache it attends over. A verify of n
draft tokens activates more experts than a decode step: this measures how many, and what it
costs as a multiple of one decode step.

GPU (the issue's setting: random weights, bf16, batch 1, SIMULATED acceptance for the chains):

    python benchmarks/moe.py --device cuda --shape qwen3-30b-a3b
    python benchmarks/moe.py --device cuda --shape mixtral-8x7b
    python benchmarks/moe.py --device cuda --shape deepseek-v3 --layers 6

Speculative tok/s at the tuner's pick and the concurrency table come from serving.py on the
same shapes (SIMULATED tau 3):

    python benchmarks/serving.py --device cuda --shape qwen3-30b-a3b --simulate 3 \\
        --fit-policy 1,4,16,64

CPU dry run: --device cpu --shape tiny-moe. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serving import build_engine, prompts_for, run_batch  # noqa: E402
from shapes import SHAPES, layers  # noqa: E402

from specscope.config import SamplingParams  # noqa: E402
from specscope.engine.engine import end_profiled_cycle  # noqa: E402
from specscope.engine.sequence import Sequence  # noqa: E402
from specscope.kvcache.budget import parse_bytes  # noqa: E402
from specscope.models.loader import random_model  # noqa: E402
from specscope.models.registry import config_from_hf  # noqa: E402
from specscope.profiler.profiler import Profiler  # noqa: E402

H200_COPY_BANDWIDTH = 4.28e12  # bytes/s, measured (device-to-device copy)


def expert_params(model: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes of all non-expert weights, bytes of one routed expert, MoE layers)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    moe = model.config.moe
    experts = 0
    per_expert = 0
    n_moe = 0
    for name, p in model.named_parameters():
        # stacked routed experts: [E, ...] under an `experts.` module (models/moe.py)
        if ".experts." in name and moe is not None and p.shape[0] == moe.num_experts:
            experts += p.numel() * p.element_size()
            if name.endswith("down_proj"):
                n_moe += 1
    if n_moe:
        per_expert = experts // (n_moe * moe.num_experts)
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    # The embedding: one row a token read, not the table (unless it is also the lm_head).
    dense = total - experts - (0 if tied else embed.numel() * embed.element_size())
    return dense, per_expert, n_moe


def step_bytes(model, experts_per_layer: float, context: int) -> float:
    """Bytes one batch-1 decode step reads: see the module docstring."""
    dense, per_expert, n_moe = expert_params(model)
    kv = model.kv_layout(model.dtype).bytes_per_token * context
    return dense + n_moe * experts_per_layer * per_expert + kv


def timed(args, model, spec: bool, steps: int) -> dict:
    """One batch-1 request through a fresh engine with the profiler on: TPOT and the
    profiler's summary (phase means, experts per MoE layer)."""
    max_len = args.prompt_len + args.output_len + 64
    # A chain of k steps emits at most k + 1 tokens a cycle: cap the SIMULATED tau there.
    sim = argparse.Namespace(**{**vars(args), "simulate": min(args.simulate, steps + 0.9)})
    engine = build_engine(sim, model, spec, max_len, steps)
    vocab = model.config.vocab_size
    run_batch(engine, prompts_for(1, args.prompt_len, vocab, 99), args.output_len)  # warm-up
    prof = engine.timer = Profiler(engine.device, interval=None)
    if spec:
        engine.reset_simulation()
    r = profiled(engine, prof, prompts_for(1, args.prompt_len, vocab, 1)[0], args.output_len)
    r["summary"] = prof.summary(prof.config)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return r


def profiled(engine, prof: Profiler, prompt: list[int], output_len: int) -> dict:
    """One request, every engine step a profiler cycle (as LLM.step records them): TPOT,
    tau, and the cycles' phases and experts."""
    seq = Sequence("r", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True))
    engine.add(seq)
    stamps = []
    while engine.has_work:
        prof.begin_cycle()
        outs = engine.step()
        end_profiled_cycle(prof, engine.last_stats, outs)
        if any(o.new_tokens for o in outs):
            stamps.append(time.perf_counter())
    n = len(seq.output_ids)
    tpot = (stamps[-1] - stamps[0]) / (n - 1) * 1e3 if n > 1 else None
    acc = seq.spec.accepted if seq.spec else []
    return {"tpot_ms_p50": tpot, "tau": 1 + sum(acc) / len(acc) if acc else None}


def cycle_ms(summary: dict) -> float | None:
    """Mean cycle time: graph replays first, else eager cycles."""
    for mode in ("segments", "phases"):
        m = summary.get("modes", {}).get(mode)
        if m and m["cycles"]:
            return m["cycle_ms"]
    return None


def segment_ms(summary: dict, names: tuple[str, ...]) -> float | None:
    """A phase's own mean time per cycle that ran it: graph replays first, else eager."""
    for mode in ("segments", "phases"):
        m = summary.get("modes", {}).get(mode)
        if not m:
            continue
        for n in names:
            if n in m["phases"]:
                return m["phases"][n]["mean_ms"]
    return None


def run(args) -> dict:
    raw = layers(args.shape, args.layers)
    cfg = config_from_hf(raw, name=args.shape)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = random_model(cfg, dtype, args.device)
    plain = timed(args, model, False, 0)
    # The decode step as the profiler times it (the verify below is timed the same way).
    decode_ms = cycle_ms(plain["summary"]) or plain["tpot_ms_p50"]
    e_decode = plain["summary"].get("experts", {}).get("decode", 0.0)
    ctx = args.prompt_len + args.output_len // 2
    floor_ms = step_bytes(model, e_decode, ctx) / args.bandwidth * 1e3
    out = {"shape": args.shape, "layers": cfg.num_layers, "dtype": args.dtype,
           "compile": args.compile,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "decode": {"tok_s": 1e3 / decode_ms, "ms": decode_ms, "floor_ms": floor_ms,
                      "of_floor": floor_ms / decode_ms, "experts_per_layer": e_decode,
                      "bytes": step_bytes(model, e_decode, ctx)},
           "verify": []}
    for n in args.draft_tokens:
        r = timed(args, model, True, n - 1)
        v = segment_ms(r["summary"], ("verify_commit", "verify"))
        out["verify"].append({
            "num_draft_tokens": n, "verify_ms": v,
            "x_decode": v / decode_ms if v else None,
            "experts_per_layer": r["summary"].get("experts", {}).get("verify"),
            "spec_tok_s": 1e3 / r["tpot_ms_p50"] if r["tpot_ms_p50"] else None,
            "tau": r["tau"]})
    return out


def fmt(out: dict) -> str:
    d = out["decode"]
    lines = [f"{out['shape']} ({out['layers']} layers, {out['dtype']}, {out['device']}"
             f"{', compiled' if out['compile'] else ''}), batch 1",
             f"decode {d['tok_s']:.1f} tok/s = {d['ms']:.2f} ms/step; floor {d['floor_ms']:.2f} "
             f"ms ({d['bytes'] / 1e9:.2f} GB at {d['experts_per_layer']:.1f} experts/layer): "
             f"{100 * d['of_floor']:.0f} % of the floor",
             f"{'draft tokens':>12} {'verify ms':>10} {'x decode':>9} {'experts/layer':>14} "
             f"{'spec tok/s (SIMULATED)':>23} {'tau':>5}"]
    for v in out["verify"]:
        vm = f"{v['verify_ms']:.2f}" if v["verify_ms"] else "-"
        x = f"{v['x_decode']:.2f}" if v["x_decode"] else "-"
        e = f"{v['experts_per_layer']:.1f}" if v["experts_per_layer"] else "-"
        lines.append(f"{v['num_draft_tokens']:>12} {vm:>10} {x:>9} {e:>14} "
                     f"{v['spec_tok_s'] or 0:>23.1f} {v['tau'] or 0:>5.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--draft-tokens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 4, 8, 16], help="num_draft_tokens of the verify chains")
    ap.add_argument("--simulate", type=float, default=3.0, help="SIMULATED tau")
    ap.add_argument("--bandwidth", type=float, default=H200_COPY_BANDWIDTH,
                    help="bytes/s the floor divides by (default: the H200's measured copy)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=None)
    ap.add_argument("--activation-reserve", type=parse_bytes, default=4 << 30)
    ap.add_argument("--compile", action="store_true", help="torch.compile the target")
    args = ap.parse_args()
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.rates = args.spec_policy = None
    args.max_num_batched_tokens, args.max_num_seqs = 2048, 8
    torch.manual_seed(0)
    out = run(args)
    print(fmt(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
