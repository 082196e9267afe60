"""The native CPU decoder's whole forward (native/decoder.c, every layer in one call) of the
default model on its GGUF's 4-bit codes, timed alone: N tokens of one sequence at the end of a
context of L keys (a decode step at N = 1, a chain-of-5 verify at N = 6), the token counts
alternated in one process.

    python benchmarks/cpu_forward.py --keys 400 --tokens 1,6
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_forward.py

The KV cache holds random bf16 (or fp32) values, so the figure is the forward's cost at that
context, not a generation's. Compare two trees by running this script in each (the native
library is built per source). Prints each token count's median and minimum ms, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specscope.engine.llm import LLM
from specscope.kvcache.paged import BatchMeta, PagedKV
from specscope.models.llama import forward_context
from specscope.native.decoder import native_decoder


def case(model, kv: PagedKV, tables: torch.Tensor, L: int, N: int, bs: int):
    """A closure running the native decoder over N tokens at positions [L, L + N)."""
    pos = torch.arange(L, L + N)
    meta = BatchMeta.causal(tables, torch.zeros(N, dtype=torch.long), pos, bs, max_len=L + N)
    h0 = model.model.embed_tokens(torch.randint(0, 1000, (N,)))
    ctx = forward_context(model._rope, pos[None], kv, None, None, None,
                          model.config.num_heads // model.config.num_kv_heads,
                          None, meta)
    nd = native_decoder(model, h0, kv, ctx)
    if nd is None:
        raise SystemExit("the native decoder does not run here (no C compiler?)")
    cos, sin, _ = ctx.rope_tokens
    c, s = cos[:, 0].contiguous(), sin[:, 0].contiguous()

    def run() -> None:
        nd.run(h0.clone(), c, s, kv, meta, ())
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=400)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 6])
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args()
    model = LLM(spec=None).model
    cfg, bs = model.config, 16
    nb = (args.keys + max(args.tokens)) // bs + 2
    kv = PagedKV(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim,
                 model.model.embed_tokens.weight.dtype, "cpu")
    for t in kv.k + kv.v:
        t.normal_()
    tables = torch.arange(nb)[None]
    with torch.inference_mode():
        runs = {n: case(model, kv, tables, args.keys, n, bs) for n in args.tokens}
        times: dict[int, list[float]] = {n: [] for n in runs}
        for _ in range(args.rounds):
            for n, f in runs.items():
                t = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t)
    out = {}
    for n, v in times.items():
        out[n] = {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
        print(f"{args.keys} keys, {n:2} tokens: median {out[n]['median_ms']:.3f} ms, "
              f"min {out[n]['min_ms']:.3f} ms")
    print(json.dumps({"benchmark": "cpu_forward", "keys": args.keys, "tokens": out}))


if __name__ == "__main__":
    main()
