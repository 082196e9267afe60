"""Serving benchmark of the batched engine: aggregate output tok/s and median TPOT at several
concurrencies, plain and speculative, plus long-context decode and time to first token.

GPU (the issue's setting): a random-weight Llama-3.1-8B-shape target in bf16, 128-token
prompts, 256 output tokens, concurrency 1, 4, 16, 64; speculation uses an EAGLE-3-shaped
random draft with SIMULATED acceptance (default tau 3.9, a chain of 7), labelled so.

    python benchmarks/serving.py --device cuda
    python benchmarks/serving.py --device cuda --long-context 16384

CPU: the default model (SmolLM2-135M GGUF) as `specscope generate` runs it (dtype and
quantization auto: the GGUF's 4-bit codes on the native kernels where they build;
`--dtype fp32 --quantization none` for dense weights); `--sequential` also runs the same
requests one after another and reports how much faster they finish batched (`--repeat N`:
N rounds of both, alternated, the ratio of their medians).

    python benchmarks/serving.py --device cpu --concurrency 8 --output-len 64 --sequential

Requests all arrive at once (the engine's own scheduler packs them); every step's single
device->host read makes the host timestamps real. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, layers  # noqa: E402  (benchmarks/ is not a package)

from specscope.config import SamplingParams, SpecConfig, SpecPolicy  # noqa: E402
from specscope.draft.eagle3 import random_draft  # noqa: E402
from specscope.engine.engine import BatchConfig, Engine  # noqa: E402
from specscope.engine.sequence import Sequence  # noqa: E402
from specscope.kvcache.budget import (  # noqa: E402
    KVLayout,
    activation_bytes,
    kv_budget,
    parse_bytes,
)
from specscope.models.registry import config_from_hf  # noqa: E402


def build_model(args):
    if args.device == "cpu" and args.shape == "default":
        from specscope.engine.machine import resolve_dtype, resolve_quantization
        from specscope.models.loader import load_model

        cpu = torch.device("cpu")
        quant, _ = resolve_quantization(args.quantization, None, cpu, args.dtype)
        dtype = resolve_dtype(args.dtype, cpu)
        args.dtype, args.quantization = {torch.bfloat16: "bf16"}.get(dtype, "fp32"), quant
        return load_model(None, dtype, cpu, None, quant).model
    from specscope.models.loader import random_model

    cfg = config_from_hf(layers(args.shape, args.layers), name=args.shape)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return random_model(cfg, dtype, args.device)


def build_engine(args, model, spec: bool, max_len: int, steps: int = 7) -> Engine:
    dev = torch.device(args.device)
    dtype = model.dtype
    mc = model.config
    layouts = [model.kv_layout(dtype)]
    draft = spec_cfg = policy = None
    if spec:
        spec_cfg = SpecConfig(draft="random", num_steps=steps, topk=1,
                              simulate_acceptance=args.rates or args.simulate)
        draft = random_draft(mc, dtype, dev)
        draft.attach_target(model)
        dc = draft.config
        layouts.append(KVLayout(dc.num_layers, dc.num_kv_heads, dc.head_dim, dtype))
        if args.spec_policy:
            policy = SpecPolicy.parse(args.spec_policy, spec_cfg)
    # The engine's own bound where it is larger (a speculating MoE model's verify logits).
    reserve = max(args.activation_reserve, activation_bytes(
        mc, args, dtype, args.max_num_batched_tokens if spec else 0))
    budget = kv_budget(layouts, 16, dev, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_cache_memory=args.kv_cache_memory, activation_bytes=reserve)
    print(budget.describe(max_len), file=sys.stderr)
    cfg = BatchConfig(num_blocks=budget.num_blocks, block_size=16,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                       compile=args.compile)
    return Engine(model, cfg, draft=draft, spec=spec_cfg, policy=policy)


def run_batch(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once; returns wall time, output tok/s, TPOT and TTFT medians."""
    t0 = time.perf_counter()
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=output_len, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    first, last = {}, {}
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_tokens:
                first.setdefault(o.seq.seq_id, now)
                last[o.seq.seq_id] = now
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs)
    tpot = [(last[s.seq_id] - first[s.seq_id]) / (len(s.output_ids) - 1)
            for s in seqs if len(s.output_ids) > 1]
    acc = [a for s in seqs if s.spec for a in s.spec.accepted]
    assert engine.pool.all_free()
    return {"wall_s": wall, "output_tok_s": tokens / wall,
            "tpot_ms_p50": 1000 * statistics.median(tpot) if tpot else None,
            "ttft_ms_p50": 1000 * statistics.median(first[s.seq_id] - t0 for s in seqs),
            "tau": 1 + sum(acc) / len(acc) if acc else None}


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def sequential_rounds(engine: Engine, ps: list[list[int]], args, r: dict, spec: bool) -> None:
    """The same requests one after another, against all at once: `--repeat` rounds of the
    two, alternated (the batched run already in r is the first round's), each round's
    ratio, and the ratio of the medians into r: on a machine whose speed drifts between
    runs, a single pair's ratio moves with the drift."""
    batched, sequential, ratios = [r["wall_s"]], [], []
    for i in range(args.repeat):
        if i:
            if spec:
                engine.reset_simulation()
            batched.append(run_batch(engine, ps, args.output_len)["wall_s"])
        t0 = time.perf_counter()
        for p in ps:
            run_batch(engine, [p], args.output_len)
        sequential.append(time.perf_counter() - t0)
        ratios.append(sequential[-1] / batched[-1])
    r["sequential_wall_s"] = statistics.median(sequential)
    r["batched_speedup"] = r["sequential_wall_s"] / statistics.median(batched)
    if args.repeat > 1:
        r["batched_wall_s_rounds"], r["sequential_wall_s_rounds"] = batched, sequential
        r["batched_speedup_rounds"] = ratios


def concurrency_table(args, model) -> list[dict]:
    rows = []
    max_len = args.prompt_len + args.output_len + 64
    runs = [(m, s) for m in args.modes for s in (args.spec_steps if m == "spec" else [0])]
    for mode, steps in runs:
        engine = build_engine(args, model, mode == "spec", max_len, steps)
        for c in args.concurrency:
            ps = prompts_for(c, args.prompt_len, model.config.vocab_size, c)
            # A whole warm-up run on other prompts (no prefix-cache hit later): every kernel
            # variant the timed run meets is compiled (Triton specialises on split-K, which
            # starts past 256 keys), every graph captured, the allocator primed.
            run_batch(engine, prompts_for(c, args.prompt_len, model.config.vocab_size, c + 99),
                      args.output_len)
            if mode == "spec":
                engine.reset_simulation()
            r = run_batch(engine, ps, args.output_len)
            name = mode + (" SIMULATED " + ("policy" if args.spec_policy else f"k={steps}")
                           if mode == "spec" else "")
            r.update(mode=name + (" compiled" if args.compile else ""), concurrency=c,
                     policy=args.spec_policy if mode == "spec" else None)
            if args.sequential:
                sequential_rounds(engine, ps, args, r, mode == "spec")
            rows.append(r)
            print(json.dumps(r), file=sys.stderr)
        del engine
        gc.collect()  # the engine and its captured graphs hold each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its pools from what is free
    return rows


def fit_policy(args, model) -> str:
    """The tuner's speculation-by-batch-size policy for this target and the random draft at
    the SIMULATED profile args.rates (the tuner's acceptance model is that profile), as a
    --spec-policy flag; the tuner's own LLM is freed before the table's engines start."""
    from specscope import LLM
    from specscope.tune.tuner import tune

    t = time.perf_counter()
    llm = LLM.from_model(model, name=args.shape, max_model_len=args.prompt_len +
                         args.output_len + 64)
    prompts = [" ".join(str(100 + 37 * i + j) for j in range(48)) for i in range(3)]
    base = SpecConfig(draft="random", simulate_acceptance=args.rates)
    res = tune(llm, "random", prompts, max_tokens=96, base=base, warmup_tokens=96,
               batch_sizes=args.fit_policy, log=lambda x: print(x, file=sys.stderr))
    # No policy: speculation lost to plain decoding at every batch size.
    flag = (res.policy.flag() if res.policy is not None
            else ";".join(f"{b}:off" for b in args.fit_policy))
    print(f"tuner ({time.perf_counter() - t:.0f} s): {flag}; {res.recommendation()}",
          file=sys.stderr)
    del llm, res
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return flag


def long_context(args, model) -> dict:
    """Batch 1: TTFT of a long prompt, then decode tok/s at that context."""
    engine = build_engine(args, model, False, args.long_context + 256)
    p = prompts_for(2, args.long_context, model.config.vocab_size, 7)
    # Warm-up on another prompt of the same length (the measured one must miss the prefix
    # cache): every KV window the measured request reaches has its graphs, and the kernels
    # for this context are compiled, as in a server that has served long prompts before.
    run_batch(engine, p[1:], 129)
    r = run_batch(engine, p[:1], 129)
    decode = 128 / (r["wall_s"] - r["ttft_ms_p50"] / 1000)
    return {"context": args.long_context, "ttft_ms": r["ttft_ms_p50"],
            "decode_tok_s": decode, "tpot_ms": r["tpot_ms_p50"]}


def fmt(rows: list[dict]) -> str:
    lines = [f"{'mode':<28} {'conc':>5} {'out tok/s':>10} {'TPOT p50 ms':>12} "
             f"{'TTFT p50 ms':>12} {'tau':>5} {'vs 1-by-1':>9}"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        sp = f"{r['batched_speedup']:.2f}x" if "batched_speedup" in r else "-"
        tpot = f"{r['tpot_ms_p50']:.2f}" if r["tpot_ms_p50"] else "-"
        lines.append(f"{r['mode']:<28} {r['concurrency']:>5} {r['output_tok_s']:>10.1f} "
                     f"{tpot:>12} {r['ttft_ms_p50']:>12.1f} {tau:>5} {sp:>9}"
                     + ("  (rounds " + ", ".join(f"{x:.2f}x" for x in
                                                 r["batched_speedup_rounds"]) + ")"
                        if "batched_speedup_rounds" in r else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="default: llama-3.1-8b on CUDA, the "
                    "embedded default model on the CPU; one of " + ", ".join(SHAPES))
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the shape's layer width, cut it to this many decoder layers "
                    "(a DeepSeek-V3 / Kimi-K2 subset that fits one GPU)")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA; on the CPU auto "
                    "(bf16 where the CPU has native bf16, else fp32), as `specscope generate`")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int4-gguf"],
                    help="the CPU default model's weights: auto (the GGUF's 4-bit codes on the "
                    "native kernels where they build, as `specscope generate`) or none (dense)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["plain", "spec"])
    ap.add_argument("--spec-steps", type=lambda s: [int(x) for x in s.split(",")],
                    default=[7], help="chain lengths of the spec mode, e.g. 3,5,7")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target")
    ap.add_argument("--simulate", type=float, default=3.9, help="SIMULATED tau")
    ap.add_argument("--spec-policy", default=None,
                    help="speculation by batch size for the spec mode, e.g. "
                         "'4:7,1,8;16:3,1,4;512:off'")
    ap.add_argument("--fit-policy", type=lambda s: [int(x) for x in s.split(",")],
                    default=None, help="batch sizes to fit the tuner's policy at (e.g. "
                    "4,16,64); the spec mode then serves it")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=None)
    ap.add_argument("--activation-reserve", type=parse_bytes, default=4 << 30)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --sequential: rounds of batched and one-after-another runs, "
                         "alternated; the ratio is of their medians")
    ap.add_argument("--long-context", type=int, default=0)
    args = ap.parse_args()
    args.rates = None
    cpu = args.device == "cpu"
    args.shape = args.shape or ("default" if cpu else "llama-3.1-8b")
    args.dtype = args.dtype or ("auto" if cpu else "bf16")
    torch.manual_seed(0)
    model = build_model(args)
    out = {"device": torch.cuda.get_device_name() if not cpu else "cpu",
           "shape": args.shape, "dtype": args.dtype, "prompt_len": args.prompt_len,
           "quantization": args.quantization if cpu else "none",
           "output_len": args.output_len}
    if args.long_context:
        out["long_context"] = long_context(args, model)
        print(json.dumps(out["long_context"]))
    else:
        if args.fit_policy:
            # The tuner models a per-position profile: the one whose chain of 7 gives tau
            # 3.9 (a constant rate), which the table's speculation then uses too.
            args.rates = SpecConfig(draft="random", num_steps=7,
                                    simulate_acceptance=args.simulate).acceptance_rates()
            out["simulated_rates"] = args.rates
            args.spec_policy = out["tuned_policy"] = fit_policy(args, model)
        out["rows"] = concurrency_table(args, model)
        print(fmt(out["rows"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
