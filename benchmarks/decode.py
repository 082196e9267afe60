"""Plain-decoding throughput at batch 1: specscope vs HF transformers `generate`, one run.

CPU (default): the default model (SmolLM2-135M-Instruct GGUF) through `specscope.LLM` in each
requested configuration, and through HF transformers (GGUF loaded by transformers itself)
on the same prompt and token count.

    python benchmarks/decode.py --tokens 128 --configs fp32 bf16 int4-gguf --hf fp32 bf16

GPU: a random-weight model of a real shape (default Llama-3.1-8B) built on the device.

    python benchmarks/decode.py --device cuda --shape llama-3.1-8b --tokens 256 --hf none

Each row: decode tok/s (tokens after the first over the time after the first, i.e.
excluding prefill), end-to-end tok/s, and achieved bandwidth = bytes streamed per decode
step (weights + KV read) / decode step time. A table, then one JSON line, are printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

PROMPT = "The history of the printing press begins"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of unique weights (tied embedding/lm_head counted once: lm_head reads it all)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_step(cfg, ctx_mean: float, elem: int) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx_mean * elem


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_specscope(config: str, args: argparse.Namespace) -> dict:
    from specscope import LLM, SamplingParams

    base, _, extra = config.partition("+")  # e.g. "int4-gguf+compile"
    quant = "int4-gguf" if base == "int4-gguf" else "none"
    dtype = "bf16" if base == "int4-gguf" else base
    llm = LLM(args.model, dtype=dtype, device="cpu", quantization=quant,
              cache_dir=args.cache_dir, compile=extra == "compile")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    t0 = time.perf_counter()
    # Warm-up with the full token count: a compiled step compiles here, for every KV window.
    llm.generate(PROMPT, params)
    warmup_s = time.perf_counter() - t0
    runs = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = llm.generate(PROMPT, params)[0]
        total = time.perf_counter() - t0
        runs.append((out.metrics.decode_tokens_per_s, args.tokens / total, out))
    decode_tps = statistics.median(r[0] for r in runs)
    e2e_tps = statistics.median(r[1] for r in runs)
    out = runs[0][2]
    cfg = llm.model_config
    step_bytes = model_bytes(llm.model) + kv_bytes_per_step(
        cfg, out.metrics.prompt_tokens + args.tokens / 2, llm.dtype.itemsize)
    return {"engine": "specscope", "config": config, "decode_tok_s": decode_tps,
            "e2e_tok_s": e2e_tps, "gb_s": step_bytes * decode_tps / 1e9,
            "weights_mb": model_bytes(llm.model) / 1e6, "warmup_s": warmup_s,
            "text": out.text[:80]}


def bench_hf(dtype_name: str, args: argparse.Namespace) -> dict:
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specscope.models.gguf import default_model_gguf

    path = default_model_gguf() if args.model is None else args.model
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    d, f = os.path.dirname(str(path)), os.path.basename(str(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    stamps: list[float] = []

    def stamp(input_ids, scores, **kw) -> torch.Tensor:  # a StoppingCriteria: never stops
        stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kw = {"do_sample": False, "pad_token_id": tok.eos_token_id, "stopping_criteria": [stamp]}

    def gen(n: int) -> tuple[float, float, torch.Tensor]:
        stamps.clear()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        total = time.perf_counter() - t0
        # stamps[i] is taken right after token i is chosen: decode rate excludes prefill
        return total, (len(stamps) - 1) / (stamps[-1] - stamps[0]), out

    gen(8)  # warm-up
    runs = [gen(args.tokens) for _ in range(args.repeat)]
    total = statistics.median(r[0] for r in runs)
    decode_tps = statistics.median(r[1] for r in runs)
    out = runs[0][2]
    return {"engine": "hf-transformers", "config": dtype_name, "decode_tok_s": decode_tps,
            "e2e_tok_s": args.tokens / total, "gb_s": model_bytes(model) * decode_tps / 1e9,
            "weights_mb": model_bytes(model) / 1e6,
            "text": tok.decode(out[0, ids.shape[1]:])[:80]}


def bench_gpu(args: argparse.Namespace) -> list[dict]:
    """Random-weight real-shape model; the engine's decode loop without a tokenizer."""
    from specscope.models.loader import random_model
    from specscope.models.registry import config_from_hf

    device = torch.device(args.device)
    dtype = torch.bfloat16
    cfg = config_from_hf(SHAPES[args.shape], name=args.shape)
    model = random_model(cfg, dtype, device)
    modes = [m for m in args.gpu_modes if device.type == "cuda" or "graphs" not in m]
    return [_bench_gpu_runner(model, cfg, device, dtype, mode, args) for mode in modes]


def _bench_gpu_runner(model, cfg, device, dtype, mode: str, args) -> dict:
    """Batch-1 decode on the engine loop (LLM.stream: one request, every step's read)."""
    from specscope import LLM
    from specscope.config import SamplingParams

    llm = LLM.from_model(model, name=args.shape, max_model_len=4096,
                         cuda_graphs="graphs" in mode, compile="compile" in mode,
                         gpu_memory_utilization=0.5 if device.type == "cuda" else None)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,)).tolist()

    def run() -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        t1 = None
        for _ in llm.stream(None, params, prompt_ids=prompt):
            if t1 is None:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    t0 = time.perf_counter()
    run()  # warm-up: captures the batch-1 graph / compiles
    warmup_s = time.perf_counter() - t0
    runs = [run() for _ in range(args.repeat)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    decode_tps = (args.tokens - 1) / decode
    wbytes = model_bytes(model)
    step_bytes = wbytes + kv_bytes_per_step(cfg, len(prompt) + args.tokens / 2, 2)
    bw = step_bytes * decode_tps / 1e9
    return {"engine": "specscope", "config": f"{args.shape} bf16 {mode}", "decode_tok_s":
            decode_tps, "e2e_tok_s": args.tokens / (prefill + decode), "gb_s": bw,
            "weights_mb": wbytes / 1e6, "step_ms": 1e3 / decode_tps, "warmup_s": warmup_s,
            "floor_ms": step_bytes / (args.peak_gbs * 1e9) * 1e3, "text": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=["fp32", "bf16", "int4-gguf"])
    ap.add_argument("--hf", nargs="*", default=["fp32", "bf16"],
                    help="HF transformers dtypes to compare (none to skip)")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--peak-gbs", type=float, default=4270.0,
                    help="measured copy bandwidth of the GPU, for the floor column")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-modes", nargs="*",
                    default=["eager", "cuda-graphs", "cuda-graphs+compile"],
                    help="random-model modes: eager, compile, cuda-graphs, cuda-graphs+compile")
    ap.add_argument("--random", action="store_true",
                    help="random-weight --shape model on --device (default on CUDA)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows: list[dict] = []
    if args.device.startswith("cuda") or args.random:
        rows += bench_gpu(args)
    else:
        for c in args.configs:
            rows.append(bench_specscope(c, args))
            gc.collect()  # one model in memory at a time
        for d in [h for h in args.hf if h != "none"]:
            rows.append(bench_hf(d, args))
            gc.collect()
    base = next((r["e2e_tok_s"] for r in rows
                 if r["engine"] == "hf-transformers" and r["config"] == "fp32"), None)
    hdr = f"{'engine':<16} {'config':<26} {'decode tok/s':>12} {'e2e tok/s':>10} " \
          f"{'GB/s':>7} {'weights MB':>10} {'vs HF fp32':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ratio = f"{r['e2e_tok_s'] / base:.2f}x" if base else "-"
        r["vs_hf_fp32_e2e"] = r["e2e_tok_s"] / base if base else None
        print(f"{r['engine']:<16} {r['config']:<26} {r['decode_tok_s']:>12.1f} "
              f"{r['e2e_tok_s']:>10.1f} {r['gb_s']:>7.1f} {r['weights_mb']:>10.0f} {ratio:>10}")
    for r in rows:
        if "floor_ms" in r:
            print(f"  {r['config']}: {r['step_ms']:.2f} ms/token vs bandwidth floor "
                  f"{r['floor_ms']:.2f} ms ({r['floor_ms'] / r['step_ms']:.0%} of peak)")
        if r.get("text"):
            print(f"  {r['engine']}/{r['config']}: {r['text']!r}")
    meta = {"device": args.device, "tokens": args.tokens, "repeat": args.repeat,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    print(json.dumps({"benchmark": "decode", **meta, "rows": rows}))


if __name__ == "__main__":
    main()
