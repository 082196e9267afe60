"""The tuner against an exhaustive grid, both measured in process on the same prompts.

    python benchmarks/tune.py [--dataset mt_bench --num-prompts 3 --max-tokens 96]

GPU, the default model and its shipped draft (real acceptance):

    python benchmarks/tune.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --num-prompts 8 --max-tokens 128

GPU, simulated acceptance (a random-weight Llama-3.1-8B-shape target and a random EAGLE-3
draft; the draft and verify run for real, acceptance follows the given per-position profile
and sibling rate, and the tuner's acceptance model is that same profile):

    python benchmarks/tune.py --device cuda --shape llama-3.1-8b \
        --rates 0.8,0.76,0.73,0.71,0.69,0.68,0.67,0.66,0.65,0.64 --sibling 0.35

The grid: plain decoding, chains of 1..8 steps, and trees topk {2, 4, 8} x steps {2, 3, 4, 6}
x num_draft_tokens {8, 16, 32} (those the shape allows). Reported: the best grid
configuration and its tok/s; the tuner's pick and its tok/s measured the same way; the
measurement time of each (wall seconds of all runs, weights loaded once, no reloads).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

from specscope import LLM, SamplingParams, SpecConfig
from specscope.bench.datasets import load_prompts
from specscope.cli_draft import served_config
from specscope.engine.machine import freeze_heap
from specscope.tune.result import TuneResult
from specscope.tune.tuner import _calibrate, max_nodes, run_config, tune


def grid() -> list:
    cfgs = [None] + [(s, 1, s + 1) for s in range(1, 9)]
    for k in (2, 4, 8):
        for s in (2, 3, 4, 6):
            for n in (8, 16, 32):
                if n <= max_nodes(s, k):
                    cfgs.append((s, k, n))
    return cfgs


def build(args: argparse.Namespace) -> tuple[LLM, list]:
    """The target and the prompts: the default model on the CPU, or on CUDA a random-weight
    model of a real shape (no tokenizer: prompts are token ids)."""
    if args.model is not None or (args.device == "cpu" and not args.random_target):
        dtype = args.dtype if args.device == "cpu" else "auto"
        return LLM(args.model, dtype=dtype, device=args.device), load_prompts(
            args.dataset, args.num_prompts)
    import torch

    from specscope.config import ModelConfig
    from specscope.models.loader import random_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from shapes import SHAPES  # benchmarks/ is not a package

    cfg = ModelConfig.from_hf(SHAPES[args.shape], name=args.shape)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    llm = LLM.from_model(random_model(cfg, dtype, args.device), name=args.shape,
                         max_model_len=4096)
    prompts = [" ".join(str(100 + 37 * i + j) for j in range(48))
               for i in range(args.num_prompts)]
    return llm, prompts


def log_line(lines: list[str], text: str) -> None:
    lines.append(text)
    print(text, flush=True)


class GcClock:
    """Python's garbage collections and their time, per generation, between two takes: a
    collection pauses the host in the middle of a cycle, and a launch-bound model's cycle
    waits for the host."""

    def __init__(self) -> None:
        self.count, self.ms, self._t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms[info["generation"]] += 1e3 * (time.perf_counter() - self._t)

    def take(self, what: str, lines: list[str]) -> None:
        pairs = enumerate(zip(self.count, self.ms, strict=True))
        log_line(lines, f"[gc] {what}: " + ", ".join(f"gen{g} {n} ({ms:.1f} ms)"
                                                     for g, (n, ms) in pairs))
        self.count, self.ms = [0, 0, 0], [0.0, 0.0, 0.0]


def recalibrate(llm: LLM, args: argparse.Namespace, prompts: list, base: SpecConfig | None,
                warm: int, res: TuneResult, lines: list[str]) -> None:
    """After the tuner (untimed): its calibration again, at its own length and at the
    confirmation's, each model's cycle for the confirmed configurations beside the cycle the
    confirmation measured. If the second calibration agrees with the first, the gap to the
    confirmation is the workload (the length, the prompts); if it agrees with the
    confirmation, the machine moved between the two."""
    plain = res.plain_run
    confirmed = [m for m in res.measured if m.config is not None]
    for tokens in dict.fromkeys((args.calibration_tokens, args.max_tokens)):
        cost, _ = _calibrate(llm, args.draft, prompts[:1], base, plain.summary, tokens, warm,
                             list(res.predictions), args.calibration_rounds)
        log_line(lines, f"[recalibrated, {tokens} tokens] cycle ms, tuner's model / this "
                        "model / confirmation measured: " + ", ".join(
            f"{m.config} {res.cost.cycle_ms(*m.config):.3f} / {cost.cycle_ms(*m.config):.3f} "
            f"/ {1e3 * (m.accept_length or 1) / m.tok_per_s:.3f}" for m in confirmed))


def noise_runs(llm: LLM, args: argparse.Namespace, prompts: list, base: SpecConfig | None,
               warm: int, lines: list[str]) -> None:
    """Plain and (3, 1, 4) measured alternately, each run as a grid run is (untimed)."""
    params = SamplingParams(max_tokens=args.max_tokens)
    runs: dict[str, list[float]] = {"plain": [], "(3, 1, 4)": []}
    for _ in range(args.noise_runs):
        for name, cfg in (("plain", None), ("(3, 1, 4)", (3, 1, 4))):
            runs[name].append(run_config(llm, cfg, args.draft, prompts, params, base,
                                         warm).tok_per_s)
    for name, v in runs.items():
        med = sorted(v)[len(v) // 2]
        log_line(lines, f"[noise] {name}: " + ", ".join(f"{x:.1f}" for x in v) +
                 f" tok/s; median {med:.1f}, spread {min(v) / med - 1:+.1%} .. "
                 f"{max(v) / med - 1:+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--model", default=None,
                    help="a real target (e.g. the default model's GGUF) on any device; "
                         "default: the embedded model on the CPU, a random --shape on CUDA")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", help="CPU only (CUDA: bf16)")
    ap.add_argument("--shape", default="llama-3.1-8b", help="CUDA: the random target's shape")
    ap.add_argument("--rates", default=None,
                    help="simulated acceptance: per-position rates of the top-ranked child "
                         "(implies --draft random)")
    ap.add_argument("--sibling", type=float, default=0.0,
                    help="simulated acceptance: rate of each next-ranked sibling")
    ap.add_argument("--random-target", action="store_true",
                    help="a random-weight target of --shape also on the CPU (tests)")
    ap.add_argument("--pair-repeats", type=int, default=3,
                    help="re-measure the grid's best and the tuner's pick alternately this "
                         "many times (untimed), against the max-of-grid selection bias")
    ap.add_argument("--served", default="5,1",
                    help="the tuner's --served (as `specscope tune`'s default); 'none': none")
    ap.add_argument("--quick", action="store_true", help="a 4-configuration grid (smoke test)")
    ap.add_argument("--warm-all", action="store_true",
                    help="the untimed process warm-up runs every grid and calibration "
                         "configuration once (one prompt): kernels JIT-compiled per shape "
                         "(Triton's, on CUDA) are then compiled for both sides, as in a "
                         "process that has run them before, instead of charged to whichever "
                         "side meets a shape first (the tuner, which runs first)")
    ap.add_argument("--calibration-tokens", type=int, default=48,
                    help="tokens of each calibration run (the tuner's calibration_tokens)")
    ap.add_argument("--calibration-rounds", type=int, default=2,
                    help="each shape's calibration tokens run in this many parts, the "
                         "shapes in turn (the tuner's calibration_rounds)")
    ap.add_argument("--noise-runs", type=int, default=0,
                    help="before the tuner (untimed): plain and (3, 1, 4) measured "
                         "alternately this many times each, their spread printed: the "
                         "run-to-run noise within this process that prediction errors are "
                         "judged against")
    ap.add_argument("--recalibrate", action="store_true",
                    help="after the tuner (untimed): its calibration again at its own length "
                         "and at --max-tokens, each model's cycles beside the confirmation's")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the garbage collector's heap unfrozen (as before "
                         "engine.machine.freeze_heap): full collections then fall inside runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm, prompts = build(args)
    if not args.no_gc_freeze:
        freeze_heap()  # as `specscope tune` does once its engine is built
    base = None
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(","))
        args.draft = "random"
        base = SpecConfig(draft="random", simulate_acceptance=rates,
                          simulate_sibling=args.sibling)
        # The tuner builds the profile's acceptance model itself (timed): ranks from the
        # profile, the tree's shape from the random draft's scores.
    # On CUDA the warm-up runs a whole request so every KV window's graphs exist before the
    # clock runs; the same for the grid and the tuner.
    warm = args.max_tokens if args.device != "cpu" else 8
    lines: list[str] = []
    clock = GcClock()
    # Process warm-up, timed for neither side: the first requests of a process pay lazy
    # initialisation (kernels, allocator, the draft's first load) that whichever side ran
    # first would otherwise be charged for.
    t = time.perf_counter()
    run_config(llm, None, args.draft, prompts[:1], SamplingParams(max_tokens=warm), base, warm)
    run_config(llm, (3, 1, 4), args.draft, prompts[:1], SamplingParams(max_tokens=warm), base,
               warm)
    if args.warm_all:
        from specscope.tune.tuner import all_configs, tuner_calibration_shapes

        # The shapes the tuner's calibration runs, the kernel classes' extra ones included.
        for cfg in dict.fromkeys([*grid(), *tuner_calibration_shapes(llm, all_configs())]):
            if cfg is not None:
                run_config(llm, cfg, args.draft, prompts[:1],
                           SamplingParams(max_tokens=warm), base, warm)
    log_line(lines, f"process warm-up (untimed for both sides): {time.perf_counter() - t:.1f} s")
    clock.take("process warm-up", lines)
    if args.noise_runs:
        noise_runs(llm, args, prompts, base, warm, lines)
        clock.take("noise runs", lines)
    t = time.perf_counter()
    res = tune(llm, args.draft, prompts, max_tokens=args.max_tokens,
               log=lambda x: log_line(lines, x), base=base,
               warmup_tokens=warm, calibration_tokens=args.calibration_tokens,
               calibration_rounds=args.calibration_rounds,
               served=None if args.served == "none" else served_config(args.served))
    tune_s = time.perf_counter() - t
    clock.take("tuner", lines)
    for line, rows in res.cost.residuals.items():  # the fit's residuals, point by point
        log_line(lines, f"[fit] {line}: " + ", ".join(
            f"{tuple(r['config'])} {r['measured_ms']:.3f}/{r['fitted_ms']:.3f} ms" for r in rows))
    for line in [res.table(), *res.term_lines(), res.recommendation()]:
        log_line(lines, line)
    if args.recalibrate:
        recalibrate(llm, args, prompts, base, warm, res, lines)
        clock.take("recalibration", lines)
    params = SamplingParams(max_tokens=args.max_tokens)
    t = time.perf_counter()
    rows = []
    for cfg in grid() if not args.quick else [None, (3, 1, 4), (2, 2, 4), (3, 4, 12)]:
        m = run_config(llm, cfg, args.draft, prompts, params, base, warm)
        rows.append(m)
        pred = res.predictions.get(cfg) if cfg else None
        log_line(lines, f"grid {str(cfg or 'plain'):<14} {m.tok_per_s:7.2f} tok/s  tau "
                        f"{m.accept_length or 1:.2f}" +
                 (f"  (predicted {pred[1]:.1f} tok/s, tau {pred[0]:.2f})" if pred else ""))
    grid_s = time.perf_counter() - t
    clock.take("grid", lines)
    best = max(rows, key=lambda m: m.tok_per_s)
    pick = next((m for m in rows if m.config == res.recommended), None)
    if pick is None:  # the tuner's pick is not in the grid: measure it like the grid
        pick = run_config(llm, res.recommended, args.draft, prompts, params, base, warm)
    # The grid's best is the maximum of 36 noisy measurements, biased high by the selection
    # itself. Re-measure it and the tuner's pick in alternation (time counted for neither
    # side) and compare medians as well. With simulated acceptance every grid run used the
    # same seed, so its best is partly a lucky draw (one draw per configuration, about 55
    # cycles at 2 x 96: a standard error of about 0.2 in tau); each repeat then draws anew
    # (seed r + 1, the same for both sides), comparing configurations rather than draws.
    paired: dict[str, list[float]] = {"best": [], "pick": []}
    if args.pair_repeats and pick.config != best.config:
        for r in range(args.pair_repeats):
            rbase = dataclasses.replace(base, simulate_seed=r + 1) if base else None
            for name, cfg in (("best", best.config), ("pick", pick.config)):
                m = run_config(llm, cfg, args.draft, prompts, params, rbase, warm)
                paired[name].append(m.tok_per_s)
        log_line(lines, f"paired re-measurement (best, pick): {paired['best']} "
                        f"{paired['pick']}")
    med = {k: sorted(v)[len(v) // 2] for k, v in paired.items() if v}
    # Each repeat runs the pair back to back, so the ratio within a pair cancels a drift of
    # the machine's speed that the two sides' medians keep.
    ratios = sorted(p / b for b, p in zip(paired["best"], paired["pick"], strict=True))
    summary = {
        "grid_configs": len(rows), "grid_seconds": round(grid_s, 1),
        "grid_best": str(best.config or "plain"), "grid_best_tok_per_s": round(best.tok_per_s, 2),
        "tuner_pick": str(res.recommended or "plain"),
        "tuner_pick_tok_per_s": round(pick.tok_per_s, 2),
        "pick_vs_best": round(pick.tok_per_s / best.tok_per_s - 1, 4),
        "paired_median_pick_vs_best": round(med["pick"] / med["best"] - 1, 4) if med else 0.0,
        "paired_ratio_median_pick_vs_best":
            round(ratios[len(ratios) // 2] - 1, 4) if ratios else 0.0,
        "paired_repeats": args.pair_repeats if med else 0,
        "paired_fresh_draws": bool(med and base is not None),
        "tuner_seconds": round(tune_s, 1), "tuner_time_share": round(tune_s / grid_s, 3),
        "weight_reloads": 0, "device": str(llm.device), "model": llm.model_name,
        "simulated": {"rates": args.rates, "sibling": args.sibling} if args.rates else None,
    }
    lines.append(json.dumps(summary, indent=1))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
