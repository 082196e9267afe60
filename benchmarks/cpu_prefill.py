"""The default model's prefill on the CPU, to the first token: a prompt's chunks attend on the
native kernel (native/cpu_kernels.c sc_attend_qkv: each token over the keys it sees) or on the
torch reference (kvcache/paged.py attention_reference: the chunk's square of scores, masked),
alternated in one process on the same engine.

    python benchmarks/cpu_prefill.py --lengths 128,1024,3000 --batch 1,8
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_prefill.py

The model runs as `specscope generate` runs it (dtype and quantization auto: the GGUF's 4-bit
codes on the native kernels). A case is B prompts of L random tokens (distinct each round, so
no prefix-cache hit) added at once and stepped until each has its first token; prompts past
2,048 tokens prefill in chunks. The reference path is taken by setting the native attention's
scratch bound (native/cpu.py ATTENTION_MAX_SCRATCH) to 0, which sends every prefill chunk
there. Medians over the rounds in ms, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serving import build_engine, build_model, prompts_for  # noqa: E402

import specscope.native.cpu as native_cpu  # noqa: E402
from specscope.config import SamplingParams  # noqa: E402
from specscope.engine.sequence import Sequence  # noqa: E402


def first_token_ms(engine, prompts: list[list[int]]) -> float:
    """Wall ms from adding the prompts to the step that gives the last of them its first
    token (max_tokens 1: prefill only)."""
    seqs = [Sequence(f"p{i}-{time.perf_counter_ns()}", p,
                     SamplingParams(max_tokens=1, ignore_eos=True))
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
    assert all(len(s.output_ids) == 1 for s in seqs)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,1024,3000")
    ap.add_argument("--batch", default="1,8", help="prompts added at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int4-gguf"])
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    ns = argparse.Namespace(
        device="cpu", shape="default", dtype=args.dtype, quantization=args.quantization,
        layers=None, activation_reserve=4 << 30, max_num_batched_tokens=2048,
        gpu_memory_utilization=None, kv_cache_memory=None, max_num_seqs=256, compile=False,
        rates=None, simulate=None, spec_policy=None)
    model = build_model(ns)
    engine = build_engine(ns, model, False, max(lengths) + 64)
    vocab = model.config.vocab_size
    bound = native_cpu.ATTENTION_MAX_SCRATCH
    paths = {"native": bound, "reference": 0}
    rows = []
    print(f"{'prompts':>8} {'tokens':>7} " + " ".join(f"{p:>12}" for p in paths) + "  ratio")
    for B in batches:
        for L in lengths:
            first_token_ms(engine, prompts_for(B, L, vocab, seed=7))  # warm-up
            times: dict[str, list[float]] = {p: [] for p in paths}
            for r in range(args.rounds):
                for name, scratch in paths.items():
                    native_cpu.ATTENTION_MAX_SCRATCH = scratch
                    seed = 1000 * r + 10 * L + B + (name == "reference")
                    times[name].append(first_token_ms(engine, prompts_for(B, L, vocab, seed)))
            native_cpu.ATTENTION_MAX_SCRATCH = bound
            ms = {p: statistics.median(t) for p, t in times.items()}
            rows.append({"prompts": B, "tokens": L, "ms": ms, "rounds": times})
            print(f"{B:>8} {L:>7} " + " ".join(f"{ms[p]:>9.1f} ms" for p in paths)
                  + f"  {ms['reference'] / ms['native']:.2f}x", flush=True)
    print(json.dumps({"benchmark": "cpu_prefill", "dtype": ns.dtype,
                      "quantization": ns.quantization, "rows": rows}))


if __name__ == "__main__":
    main()
