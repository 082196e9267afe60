"""The native CPU decoder's whole forward (native/decoder.c, every layer in one call) of the
default model on its GGUF's 4-bit codes, timed alone: N tokens of one sequence at the end of a
context of L keys (a decode step at N = 1, a chain-of-5 verify at N = 6), or S sequences of
one token each at that context (a batched decode step), the cases alternated in one process.

    python benchmarks/cpu_forward.py --keys 400 --tokens 1,6
    python benchmarks/cpu_forward.py --keys 300 --tokens 1,6 --seqs 8 --libs OLD.so NEW.so
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_forward.py

The KV cache holds random bf16 (or fp32) values, so the figure is the forward's cost at that
context, not a generation's. `--libs` runs each case on a decoder over each given native
library file (builds of two trees from the cache directory: `python -c "from specscope.native
import cpu_kernels; print(cpu_kernels().path)"` in each), alternated, and checks their outputs
are equal; without it, this tree's library. Prints each case's median and minimum ms, then
one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from specscope.engine.llm import LLM
from specscope.kvcache.paged import BatchMeta, PagedKV
from specscope.models.llama import forward_context
from specscope.native.decoder import native_decoder


def case(model, kv: PagedKV, tables: torch.Tensor, L: int, N: int, seqs: int, bs: int,
         libs: list[str]) -> list:
    """Closures running the native decoder (one a library in `libs`, else this tree's) over
    N tokens of one sequence at positions [L, L + N), or over one token at position L of
    each of `seqs` sequences (N = 1). Each returns the forward's output rows."""
    from specscope.native.cpu import CpuKernels
    from specscope.native.decoder import NativeDecoder

    pos = torch.full((seqs,), L) if seqs > 1 else torch.arange(L, L + N)
    rows = torch.arange(seqs) if seqs > 1 else torch.zeros(N, dtype=torch.long)
    meta = BatchMeta.causal(tables, rows, pos, bs, max_len=L + N)
    h0 = model.model.embed_tokens(torch.randint(0, 1000, (pos.shape[0],)))
    ctx = forward_context(model._rope, pos[None], kv, None, None, None,
                          model.config.num_heads // model.config.num_kv_heads,
                          None, meta)
    nd = native_decoder(model, h0, kv, ctx)
    if nd is None:
        raise SystemExit("the native decoder does not run here (no C compiler?)")
    cfg = model.config
    decoders = [NativeDecoder(CpuKernels(ctypes.CDLL(p), p), model.model.layers,
                              cfg.hidden_size, cfg.rms_norm_eps) for p in libs] or [nd]
    cos, sin, _ = ctx.rope_tokens
    c, s = cos[:, 0].contiguous(), sin[:, 0].contiguous()

    def runner(d):
        def run() -> torch.Tensor:
            h = h0.clone()
            d.run(h, c, s, kv, meta, ())
            return h
        return run
    return [runner(d) for d in decoders]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=400)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 6])
    ap.add_argument("--seqs", type=int, default=0,
                    help="also time this many sequences of one token each (a batched step)")
    ap.add_argument("--libs", nargs="*", default=[], metavar="LIB",
                    help="native library files to alternate (A/B of two builds)")
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args()
    model = LLM(spec=None).model
    cfg, bs = model.config, 16
    per = (args.keys + max(args.tokens)) // bs + 2
    S = max(args.seqs, 1)
    kv = PagedKV(cfg.num_layers, S * per, bs, cfg.num_kv_heads, cfg.head_dim,
                 model.model.embed_tokens.weight.dtype, "cpu")
    for t in kv.k + kv.v:
        t.normal_()
    tables = torch.randperm(S * per).view(S, per)  # each sequence's blocks scattered
    cases = [(f"{n:2} tokens", n, 1) for n in args.tokens]
    if args.seqs > 1:
        cases.append((f"{args.seqs} seqs x 1 token", 1, args.seqs))
    out = {}
    with torch.inference_mode():
        runs = {name: case(model, kv, tables, args.keys, n, s, bs, args.libs)
                for name, n, s in cases}
        equal = {name: all(torch.equal(fs[0](), f()) for f in fs[1:])
                 for name, fs in runs.items()}
        times = {name: [[] for _ in fs] for name, fs in runs.items()}
        for _ in range(args.rounds):
            for name, fs in runs.items():
                for i, f in enumerate(fs):
                    t = time.perf_counter()
                    f()
                    times[name][i].append(time.perf_counter() - t)
    for name, per_lib in times.items():
        out[name] = {"median_ms": [statistics.median(v) * 1e3 for v in per_lib],
                     "min_ms": [min(v) * 1e3 for v in per_lib], "equal": equal[name]}
        print(f"{args.keys} keys, {name}: median "
              + " / ".join(f"{m:.3f}" for m in out[name]["median_ms"]) + " ms, min "
              + " / ".join(f"{m:.3f}" for m in out[name]["min_ms"]) + " ms"
              + ("" if len(per_lib) == 1 else
                 ("  (outputs equal)" if equal[name] else "  (OUTPUTS DIFFER)")))
    print(json.dumps({"benchmark": "cpu_forward", "keys": args.keys, "libs": args.libs,
                      "cases": out}))


if __name__ == "__main__":
    main()
