"""The default model's linears on the CPU in each weight format torch has a kernel for, at
1 and 6 rows (a decode step, a chain-of-5 verify): whether a format's cost stays flat in the
rows, i.e. whether its kernel streams each weight once for a few-token forward.

    python benchmarks/cpu_kernels.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_kernels.py
    python benchmarks/cpu_kernels.py --attention    # the attention instead (below)
    python benchmarks/cpu_kernels.py --native-attention [OLD.so NEW.so]   # the native one
        (and a batched decode step's: 8 sequences, streamed and held in cache)
    python benchmarks/cpu_kernels.py --native-quant [OLD.so NEW.so]   # the GGUF products, A/B
    python benchmarks/cpu_kernels.py --native-quant --tiles 8,16   # 8- against 16-row tiles

Formats: the native GGUF kernels (`models/quant.py` GgufLinear, Q4_1 and Q8_0 codes with
8-bit activations made from bf16 or fp32 ones: what `--quantization int4-gguf` runs), dense
fp32 and bf16 (F.linear), int8 weights with a scale per output row (`_weight_int8pack_mm`,
bf16 and fp32 activations) and torch's 4-bit weights in groups of 32
(`_weight_int4pack_mm_for_cpu`, bf16 activations). `--rows 1,6,8,16` times more row counts;
`--formats Q4_1,Q8_0` only the named ones. Random weights of SmolLM2-135M's
shapes; microseconds per call, the mean of 200 after 10 untimed. A table, then a JSON line.

--attention: one layer's attention of the default model (3 KV heads, 3 query heads each,
head dim 64) for 1 and 6 query tokens (a decode token, a chain-of-5 verify under a tree
mask) over 64 to 2,048 keys laid out as the paged cache holds them ([keys, KV heads, D],
read as a transposed view), in bf16 and fp32: torch's SDPA against the engine's CPU path
(kvcache/paged.py _cpu_attention: two batched products, scores in fp32), with each one's
largest difference from a float64 reference.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}


def bench(fn: Callable[[], object], reps: int = 200) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def formats(n: int, k: int) -> dict[str, tuple[torch.dtype, Callable]]:
    """Each format's activation dtype and its product x W^T (x made in that dtype)."""
    w = torch.randn(n, k) * 0.02
    wb = w.bfloat16()
    s = w.abs().amax(1) / 127
    w8 = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    p4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k),
                                                                 dtype=torch.int32), 1)
    sz = torch.stack([torch.rand(k // 32, n), torch.rand(k // 32, n)], -1).bfloat16()
    f32, b16, sb = torch.float32, torch.bfloat16, s.bfloat16()
    out = gguf_formats(w)
    return out | {"fp32": (f32, lambda x: F.linear(x, w)),
            "bf16": (b16, lambda x: F.linear(x, wb)),
            "int8 (bf16 x)": (b16, lambda x: torch._weight_int8pack_mm(x, w8, sb)),
            "int8 (fp32 x)": (f32, lambda x: torch._weight_int8pack_mm(x, w8, s)),
            "int4 (bf16 x)": (b16, lambda x: torch._weight_int4pack_mm_for_cpu(x, p4, 32,
                                                                               sz))}


def gguf_formats(w: torch.Tensor) -> dict[str, tuple[torch.dtype, Callable]]:
    """The native GGUF kernels (models/quant.py GgufLinear: Q4_1 and Q8_0 codes, 8-bit
    activations) of w's shape, with bf16 and fp32 activations; none where they do not build."""
    import numpy as np

    from specscope import native
    from specscope.models.quant import GgufLinear, q8_0_codes

    if native.cpu_kernels() is None:
        return {}
    n, k = w.shape
    rng = np.random.default_rng(0)
    d = np.abs(rng.normal(0.002, 0.001, (n, k // 32))).astype(np.float32)
    q4 = GgufLinear.from_codes(rng.integers(0, 16, (n, k)).astype(np.uint8), d, -8 * d, 4, None)
    q, dq = q8_0_codes(w)
    q8 = GgufLinear.from_codes(q, dq, None, 8, None)
    return {f"{name} ({tag} x)": (dt, lin) for name, lin in (("Q4_1", q4), ("Q8_0", q8))
            for tag, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}


def attention_case(dtype: torch.dtype, n: int, L: int) -> dict:
    """SDPA against the engine's CPU attention for n query tokens over L keys."""
    from specscope.kvcache.paged import _cpu_attention

    q = torch.randn(3, 3 * n, 64, dtype=dtype)
    k, v = (torch.randn(L, 3, 64, dtype=dtype).transpose(0, 1) for _ in range(2))
    m = None
    if n > 1:  # the tree's own keys under a random ancestor pattern, each sees itself
        m = torch.ones(1, 3 * n, L, dtype=torch.bool)
        m[..., -n:] = torch.rand(1, 3 * n, n) > 0.5
        m[..., -1] = True
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m,
                                         scale=0.125)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125)

    def ours() -> torch.Tensor:
        return _cpu_attention(q, k, v, m, 0.125)
    return {"dtype": str(dtype).split(".")[-1], "tokens": n, "keys": L,
            "sdpa_us": bench(sdpa), "engine_us": bench(ours),
            "sdpa_err": float((sdpa().double() - ref).abs().max()),
            "engine_err": float((ours().double() - ref).abs().max())}


def attention_rows() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 6):
            for L in (64, 256, 512, 1024, 2048):
                r = attention_case(dtype, n, L)
                rows.append(r)
                print(f"{r['dtype']:8} {n} tokens {L:5} keys: SDPA {r['sdpa_us']:7.1f} us, "
                      f"engine {r['engine_us']:7.1f} us ({r['sdpa_us'] / r['engine_us']:.2f}x"
                      f"); max error {r['sdpa_err']:.1e} / {r['engine_err']:.1e}", flush=True)
    return rows


def libraries(libs: list[str]) -> list:
    """Each given native library file (builds of other sources from the cache directory),
    or this build's library when none is given."""
    import ctypes

    from specscope import native
    from specscope.native.cpu import CpuKernels

    return [CpuKernels(ctypes.CDLL(p), p) for p in libs] or [native.cpu_kernels()]


def alternate(kernels: list, call: Callable, rounds: int, label: str,
              **row: object) -> dict:
    """call(kernels[i]) timed for each library in turn, `rounds` rounds of 20 calls: the
    row (each library's median microseconds "us", whether their first outputs are equal),
    printed after `label`."""
    import statistics

    times: list[list[float]] = [[] for _ in kernels]
    outs = [call(k) for k in kernels]
    for _ in range(rounds):
        for i, k in enumerate(kernels):
            times[i].append(bench(lambda k=k: call(k), reps=20))
    row |= {"us": [statistics.median(t) for t in times],
            "equal": all(torch.equal(outs[0], o) for o in outs[1:])}
    print(label + "  ".join(f"{u:8.1f} us" for u in row["us"])
          + ("  (outputs equal)" if row["equal"] else "  (OUTPUTS DIFFER)"), flush=True)
    return row


def native_attention_rows(libs: list[str], rounds: int = 30) -> list[dict]:
    """The native layer attention (`native/cpu.py` attend_qkv: rotary, the KV write, the
    attention) of the default model's shape, bf16, 1 and 6 tokens of one sequence at 300,
    700 and 1,500 keys: this build's library, or each library file in `libs` (builds of other
    sources from the cache directory) called alternately in one process, `rounds` rounds
    of 20 calls, medians; the libraries' outputs are compared with torch.equal."""
    from specscope.kvcache.paged import BatchMeta

    kernels = libraries(libs)
    H, Hkv, D, bs, blocks, dt = 9, 3, 64, 16, 96, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(blocks, bs, Hkv, D, generator=g).to(dt) for _ in range(2))
    table = torch.randperm(blocks, generator=g)[None]
    rows = []
    for L in (300, 700, 1500):
        for n in (1, 6):
            meta = BatchMeta.causal(table, torch.zeros(n, dtype=torch.long),
                                    torch.arange(L - n, L), bs, max_len=L)
            qkv = torch.randn(n, (H + 2 * Hkv) * D, generator=g).to(dt)
            cos, sin = (torch.randn(n, D, generator=g).to(dt) for _ in range(2))
            rows.append(alternate(kernels, lambda k, a=(qkv, cos, sin, kc, vc, meta):
                                  k.attend_qkv(*a, 0.125, H, Hkv, None, 0.0), rounds,
                                  f"{L:4} keys {n} tokens: ", keys=L, tokens=n))
    return rows + batched_attention_rows(kernels, max(rounds // 6, 3))


def batched_attention_rows(kernels: list, rounds: int) -> list[dict]:
    """A batched decode step's attention: 8 sequences of one token at 256 keys each, over 30
    layers' caches (each its own, 47 MB in all, so they stream from memory as a step's do),
    and the same with one layer's cache read 30 times (held in L2/L3): what the memory
    costs beyond the arithmetic. Microseconds for the 30 calls."""
    from specscope.kvcache.paged import BatchMeta

    H, Hkv, D, bs, dt, S, L = 9, 3, 64, 16, torch.bfloat16, 8, 256
    g = torch.Generator().manual_seed(1)
    blocks = S * (L // bs + 1)
    caches = [tuple(torch.randn(blocks, bs, Hkv, D, generator=g).to(dt) for _ in range(2))
              for _ in range(30)]
    table = torch.randperm(blocks, generator=g).view(S, -1)
    meta = BatchMeta.causal(table, torch.arange(S), torch.full((S,), L - 1), bs, max_len=L)
    qkv = torch.randn(S, (H + 2 * Hkv) * D, generator=g).to(dt)
    cos, sin = (torch.randn(S, D, generator=g).to(dt) for _ in range(2))
    rows = []
    for where, layers in (("streamed", caches), ("in cache", [caches[0]] * 30)):
        def step(k, layers: list = layers) -> torch.Tensor:
            for kc, vc in layers:
                out = k.attend_qkv(qkv, cos, sin, kc, vc, meta, 0.125, H, Hkv, None, 0.0)
            return out
        rows.append(alternate(kernels, step, rounds, f"8 seqs x {L} keys, 30 layers {where}: ",
                              keys=L, seqs=S, where=where))
    return rows


def native_quant_rows(libs: list[str], tiles: list, rounds: int = 30) -> list[dict]:
    """The native GGUF products (`native/quant_kernels.c`) of the default model's shapes
    (its Q4_1 linears, its tied Q8_0 head), bf16 activations, 1, 6 and 8 rows, random codes,
    then the greedy pick over the head's and the draft's vocabularies (`argmax_rows`):
    this build's library, or each library file in `libs`, each in every weight layout of
    `tiles` (rows a tile; None: the one models/quant.py picks), called alternately in one
    process, `rounds` rounds of 20 calls, medians; outputs compared with torch.equal."""
    import numpy as np

    from specscope.models.quant import GgufLinear

    variants = [(k, t) for k in libraries(libs) for t in tiles]
    rng = np.random.default_rng(0)
    shapes = {"qkv Q4_1": (960, 576, 4), "gate_up Q4_1": (3072, 576, 4),
              "down Q4_1": (576, 1536, 4), "head Q8_0": (49152, 576, 8)}
    rows = []
    for name, (N, K, bits) in shapes.items():
        q = (rng.integers(0, 16, (N, K)) if bits == 4 else rng.integers(-127, 128, (N, K)))
        d = rng.random((N, K // 32), dtype=np.float32) * 0.01
        m = -8 * d if bits == 4 else None
        lins = {t: GgufLinear.from_codes(q, d, m, bits, None, t) for t in tiles}
        for M in (1, 6, 8):
            x = torch.randn(M, K).to(torch.bfloat16)
            rows.append(alternate(variants, lambda v, x=x, lins=lins, N=N, bits=bits:
                                  v[0].quant_linear(x, lins[v[1]].codes, lins[v[1]].scales,
                                                    lins[v[1]].offsets, N, bits),
                                  rounds, f"{name:13} {M} rows: ", shape=name, rows=M))
    kernels = [k for k, _ in variants[::len(tiles)]]
    for V, what in ((49152, "the head's"), (12288, "the draft's")):
        for M in (1, 6):  # the greedy pick after the product (argmax_rows)
            x = torch.randn(M, V).to(torch.bfloat16)
            rows.append(alternate(kernels, lambda k, x=x: k.argmax_rows(x), rounds,
                                  f"argmax {what} {V} {M} rows: ", shape=f"argmax {V}",
                                  rows=M))
    return rows


def native_streamed_rows(libs: list[str], tiles: list, rounds: int = 15) -> list[dict]:
    """The default model's 120 Q4_1 products (30 layers of qkv, o, gate_up, down: 66 MB of
    codes and scales, random, each weight its own, so they stream from memory as a decode
    step's do) at 1, 6 and 8 bf16 rows: each library in `libs` (or this build's) in each
    layout of `tiles`, in turn, `rounds` rounds of all 120, medians in ms. A weight held in
    cache (native_quant_rows) shows the kernels' arithmetic; this shows what a step pays."""
    import statistics

    import numpy as np

    from specscope.models.quant import GgufLinear

    variants = [(k, t) for k in libraries(libs) for t in tiles]
    rng = np.random.default_rng(0)
    lins: dict = {t: [] for t in tiles}
    for _ in range(30):
        for N, K in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
            d = rng.random((N, K // 32), dtype=np.float32) * 0.01
            q = rng.integers(0, 16, (N, K))
            for t in tiles:
                lins[t].append(GgufLinear.from_codes(q, d, -8 * d, 4, None, t))
    rows = []
    for M in (1, 6, 8):
        xs = {K: torch.randn(M, K).to(torch.bfloat16) for K in (576, 1536)}

        def run(k, layers: list, xs: dict = xs) -> None:
            for lin in layers:
                k.quant_linear(xs[lin.in_features], lin.codes, lin.scales, lin.offsets,
                               lin.out_features, 4)

        times: list[list[float]] = [[] for _ in variants]
        for _ in range(rounds):
            for i, (k, t) in enumerate(variants):
                start = time.perf_counter()
                run(k, lins[t])
                times[i].append((time.perf_counter() - start) * 1e3)
        ms = [statistics.median(t) for t in times]
        print(f"120 products streamed, {M} rows: " + "  ".join(f"{m:7.3f} ms" for m in ms),
              flush=True)
        rows.append({"rows": M, "ms": ms})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--native-attention", nargs="*", metavar="LIB", default=None,
                    help="time the native layer attention instead: this build's, or each "
                         "given library file alternately (A/B of two builds)")
    ap.add_argument("--native-quant", nargs="*", metavar="LIB", default=None,
                    help="time the native GGUF products instead: this build's, or each given "
                         "library file alternately (A/B of two builds)")
    ap.add_argument("--tiles", default=None,
                    help="with --native-quant: the weight layouts to alternate, rows a tile "
                         "(e.g. 8,16; 16 runs in 512-bit vectors where the build has AVX-512 "
                         "VNNI); default the layout the loader picks. Give 8 to time libraries "
                         "built before 16-row tiles")
    ap.add_argument("--rows", default="1,6",
                    help="activation rows a product (comma-separated; the first is the unit "
                         "of the ratios)")
    ap.add_argument("--formats", default=None,
                    help="only formats whose name starts with one of these (comma-separated)")
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    wanted = tuple(args.formats.split(",")) if args.formats else ("",)
    print(json.dumps({"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads()}))
    if args.native_attention is not None:
        with torch.inference_mode():
            rows = native_attention_rows(args.native_attention)
        print(json.dumps({"benchmark": "native_attention", "rows": rows}))
        return
    if args.native_quant is not None:
        with torch.inference_mode():
            tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else [None]
            rows = native_quant_rows(args.native_quant, tiles)
            streamed = native_streamed_rows(args.native_quant, tiles)
        print(json.dumps({"benchmark": "native_quant", "tiles": tiles, "rows": rows,
                          "streamed": streamed}))
        return
    if args.attention:
        with torch.inference_mode():
            rows = attention_rows()
        print(json.dumps({"bench": "cpu_kernels", "attention": rows}))
        return
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            for fmt, (dtype, fn) in formats(n, k).items():
                if not fmt.startswith(wanted):
                    continue
                xs = {m: torch.randn(m, k, dtype=dtype) for m in args.rows}
                us = {m: bench(lambda x=xs[m], fn=fn: fn(x)) for m in xs}
                rows.append({"linear": name, "format": fmt,
                             **{f"us_{m}": round(v, 2) for m, v in us.items()}})
                print(f"{name:13} {fmt:16} " + "   ".join(
                    f"{m} rows {v:8.1f} us ({v / us[args.rows[0]]:.1f}x)"
                    for m, v in us.items()), flush=True)
    print(json.dumps({"bench": "cpu_kernels", "rows": rows}))


if __name__ == "__main__":
    main()
