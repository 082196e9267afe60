"""The Triton paged-attention kernel (specscope.kvcache.triton_attention) timed on CUDA, one
layer of Llama-3.1-8B attention (H=32, Hkv=8, D=128, bf16, block size 16) by default.

    python benchmarks/paged_attention.py            # the table, then one JSON line
    python benchmarks/paged_attention.py --sweep    # also try other kernel configs per case
    python benchmarks/paged_attention.py --shape smollm2-135m --sweep   # the default model

`--shape smollm2-135m`: the default model's attention (H=9, Hkv=3, D=64), batch-1 decode and
verifies of 5, 6, 9 and 16 tokens after a 200-token prefix (16-, 32-, 32- and 64-row tiles at
3 query heads per KV head), swept over configs and over a tile set without the 32-row tile.

Cases: batch-1 decode at contexts 1k/4k/16k, batch-64 decode at 1k, a 16k-token causal
prefill, a 64-sequence x 8-node verify (after a 1k prefix), batch-1 verifies of 8 nodes as a
tree and as a chain in the engine's causal form. `--between linear` also times each call
right after a decoder layer's linears, as the engine runs it (between_op).

Each call's time is the mean over many calls between two CUDA events, eager (launch
overhead in) and replayed from a CUDA graph (the engine's decode path); block tables are
shuffled, and calls rotate among several disjoint sets of blocks so small cases are not
served from the 60 MB L2. Achieved KV bandwidth = bytes of K/V a call must read (each
visible key of each sequence once) / time; TFLOP/s counts 4 * D * H FLOPs per (query,
visible key). Each case is first checked against attention_reference (float64) at a small
size of the same shape.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specscope.kvcache import triton_attention as ta
from specscope.kvcache.paged import BatchMeta, attention_reference, chain_meta, tree_meta

H, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
ROTATE_BYTES = 512 << 20  # K/V touched across the rotation: several times the L2


@dataclass
class Case:
    """One workload: (kind, sequences, context or prefix, tokens per sequence)."""

    name: str
    kind: str  # "decode" | "prefill" | "verify" (a random tree) | "chain" (a chain verify
    # in the engine's causal form, paged.chain_meta)
    batch: int
    ctx: int
    per_seq: int = 1
    # The key bound the call is given (meta.max_len): the context itself, or, as in the
    # engine's CUDA-graph steps, the model's length limit (a graph is captured once for any
    # context, so its split plan is made for the limit).
    bound: int | None = None


CASES = [Case("decode b1 1k", "decode", 1, 1024), Case("decode b1 4k", "decode", 1, 4096),
         Case("decode b1 16k", "decode", 1, 16384),
         # serving.py --long-context 16384's decode: its graphs' bound is the prompt + 256
         Case("decode b1 16k /16640", "decode", 1, 16448, 1, 16640),
         Case("decode b64 1k", "decode", 64, 1024),
         Case("prefill 16k", "prefill", 1, 16384, 16384),
         Case("verify 64x8 @1k", "verify", 64, 1024, 8),
         Case("decode b1 160 /4k", "decode", 1, 160, 1, 4096),
         Case("verify b1 8 @160 /4k", "verify", 1, 160, 8, 4096),
         Case("verify b1 8 @1k /4k", "verify", 1, 1024, 8, 4096),
         Case("verify chain b1 8 @160 /4k", "chain", 1, 160, 8, 4096)]
SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
SMALL_CASES = [Case("decode b1 200 /2k", "decode", 1, 200, 1, 2048)] + [
    Case(f"verify b1 {n} @200 /2k", "verify", 1, 200, n, 2048) for n in (5, 6, 9, 16)]


def small(case: Case) -> Case:
    """The same shape of work at a size the reference handles quickly."""
    return Case(case.name, case.kind, min(case.batch, 4), min(case.ctx, 300),
                min(case.per_seq, 300), case.bound)


def build(case: Case, bt: torch.Tensor, dev: torch.device
          ) -> tuple[BatchMeta, list[int], int, int]:
    """(meta, piece lengths, keys read, (query, key) pairs) for a case over block tables bt."""
    B, L, n = case.batch, case.ctx, case.per_seq
    if case.kind == "decode":
        meta = BatchMeta.causal(bt, torch.arange(B, device=dev),
                                torch.full((B,), L - 1, device=dev), BS,
                                max_len=case.bound or L)
        return meta, [1] * B, B * L, B * L
    if case.kind == "prefill":
        meta = BatchMeta.causal(bt, torch.zeros(L, dtype=torch.long, device=dev),
                                torch.arange(L, device=dev), BS, max_len=L)
        return meta, [L], L, L * (L + 1) // 2
    if case.kind == "chain":
        meta = chain_meta(bt, torch.full((B,), L, device=dev), n, BS,
                          max_len=case.bound or L + n)
        return meta, [n] * B, B * (L + n), B * n * L + B * n * (n + 1) // 2
    g = torch.Generator().manual_seed(0)
    anc = torch.zeros(B, n, n, dtype=torch.bool)
    for s in range(B):
        parent = [-1] + [int(torch.randint(0, j, (), generator=g)) for j in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                anc[s, i, j], j = True, parent[j]
    meta = tree_meta(bt, torch.full((B,), L, device=dev), anc.to(dev), BS,
                     max_len=case.bound or L + n)
    return meta, [n] * B, B * (L + n), B * n * L + int(anc.sum())


def tables(rows: int, width: int, sets: int, dev: torch.device) -> list[torch.Tensor]:
    """`sets` block tables [rows, width] over disjoint, shuffled blocks of one pool."""
    perm = torch.randperm(rows * width * sets, device=dev)
    return [perm[i * rows * width:(i + 1) * rows * width].view(rows, width)
            for i in range(sets)]


def between_op(kind: str, dev: torch.device) -> Callable[[], object] | None:
    """Work the engine runs between two attention calls, to time a call in that context
    (`--between`): "copy" 512 MB (the L2 and the TLB hold nothing of the call's), "linear"
    one 8B decoder layer's four products streamed by the few-row linear at one row (the
    engine's decode step), "linear-2stage" the same in two pipeline stages (less shared
    memory), "linear-small" one product of the same tile on a 4 MB weight (the kernel,
    little traffic), "small" one tiny kernel (a launch, no traffic)."""
    if kind == "none":
        return None
    if kind == "copy":
        src = torch.empty(256 << 20, dtype=DTYPE, device=dev)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    if kind == "small":
        t = torch.zeros(1024, device=dev)
        return lambda: t.add_(1)
    from specscope.models.linear_triton import config, linear

    shapes = ((4096, 512),) if kind == "linear-small" else (
        (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    ws = [torch.randn(n, k, device=dev, dtype=DTYPE) * 0.01 for n, k in shapes]
    xs = [torch.randn(1, w.shape[1], device=dev, dtype=DTYPE) for w in ws]
    # linear-2stage: the same products with two pipeline stages (less shared memory)
    tiles = [(*config(*w.shape)[:3], 2) if kind == "linear-2stage" else None for w in ws]
    return lambda: [linear(x, w, tile=t) for x, w, t in zip(xs, ws, tiles, strict=True)]


def time_calls(fn: Callable[[int], object], sets: int, graph: bool,
               between: Callable[[], object] | None = None) -> float:
    """Mean milliseconds per call of fn(i) over calls rotating among `sets` inputs; with
    `between` (graph only), each call follows that work, whose own time (timed alone) is
    taken off."""
    if between is not None:
        both = time_calls(lambda i: (between(), fn(i)), sets, True)
        return both - time_calls(lambda i: between(), sets, True)
    reps = max(sets, 32 // sets * sets)
    for i in range(sets):
        fn(i)  # compile and warm up
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(i % sets)
        run = g.replay
    else:
        def run() -> None:
            for i in range(reps):
                fn(i % sets)
    run()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def check(case: Case, dev: torch.device) -> float:
    """Relative error against the float64 reference at a small size of the case."""
    c = small(case)
    W = math.ceil(max(c.bound or 0, c.ctx + c.per_seq) / BS)
    bt = tables(c.batch, W, 1, dev)[0]
    meta, pieces, _, _ = build(c, bt, dev)
    k, v = (torch.randn(c.batch * W, BS, HKV, D, device=dev, dtype=DTYPE) for _ in range(2))
    q = torch.randn(meta.num_tokens, H, D, device=dev, dtype=DTYPE)
    out = ta.paged_attention(q, k, v, meta, D ** -0.5,
                             tiles=ta.build_tiles(pieces, H, HKV, dev))
    ref = attention_reference(q.double(), k.double(), v.double(), meta, D ** -0.5)
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_case(case: Case, dev: torch.device, num_splits: int | None = None,
             long_tiles: bool | None = None, between: tuple[str, ...] = ()
             ) -> dict[str, float | str]:
    """long_tiles: prefill runs in the kernel's long tiles (default: where the engine uses
    them, triton_attention.long_tiles_fit). between: also each call's graph time after
    that work (between_op), as "<kind>_us"."""
    if long_tiles is None:
        long_tiles = ta.long_tiles_fit(D, DTYPE, dev)
    W = math.ceil(max(case.bound or 0, case.ctx + case.per_seq) / BS)
    block_bytes = 2 * BS * HKV * D * torch.empty((), dtype=DTYPE).element_size()
    sets = max(1, min(16, ROTATE_BYTES // (case.batch * W * block_bytes)))
    bts = tables(case.batch, W, sets, dev)
    k, v = (torch.randn(sets * case.batch * W, BS, HKV, D, device=dev, dtype=DTYPE)
            for _ in range(2))
    metas = [build(case, bt, dev) for bt in bts]
    _, pieces, keys, pairs = metas[0]
    plan = ta.build_tiles(pieces, H, HKV, dev, long_tiles)
    q = torch.randn(metas[0][0].num_tokens, H, D, device=dev, dtype=DTYPE)
    fn = lambda i: ta.paged_attention(q, k, v, metas[i][0], D ** -0.5, tiles=plan,  # noqa: E731
                                      num_splits=num_splits)
    eager, graph = time_calls(fn, sets, False), time_calls(fn, sets, True)
    kv_bytes = keys * block_bytes / BS
    ctx = {f"{b}_us": 1e3 * time_calls(fn, sets, True, between_op(b, dev)) for b in between}
    return {**ctx, "case": case.name, "err": check(case, dev), "eager_us": eager * 1e3,
            "graph_us": graph * 1e3, "kv_GBps": kv_bytes / (graph * 1e-3) / 1e9,
            "tflops": 4 * D * H * pairs / (graph * 1e-3) / 1e12, "rotation_sets": sets}


def variants(case: Case) -> list[dict[str, object]]:
    """What --sweep tries per case: forced (BLOCK_N, num_warps, num_stages) configs, the
    prefill tile's rows, split counts (each new config costs a compile: a short list)."""
    if case.kind == "decode" and case.batch == 1:
        # (128-key steps in three stages take 196 KB of shared memory: Hopper's opt-in;
        # the 64- and 32-key configs leave room for two or three programs an SM, so more
        # chunks than SMs still run in one wave.)
        configs = [None, (64, 4, 3), (64, 4, 2), (32, 4, 4), (128, 4, 3), (128, 8, 2)]
        return [{"splits": s} | ({"config": c} if c else {})
                for c in configs for s in (16, 33, 48, 64)]
    if case.kind == "decode":
        return [{"config": c} for c in [(128, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3)]]
    if case.kind in ("verify", "chain"):
        return [{"config": c} for c in [(32, 4, 4), (64, 4, 2), (128, 4, 3), (64, 4, 3),
                                        (128, 8, 2), (64, 2, 3), (128, 8, 3), (64, 8, 3)]] + [
            {"tile_rows": r} for r in [(16, 64, 128), (32, 64, 128)]]
    return [{"long": False, "config": c} for c in [
        (32, 4, 4), (64, 8, 3), (64, 8, 2), (128, 8, 2), (64, 4, 3), (128, 4, 2), (32, 8, 4),
        (64, 8, 4)]] + [
        {"long": False, "rows": 64, "config": c} for c in [(64, 4, 3), (128, 4, 2), (32, 4, 4)]
    ] + [{"long": True, "config": c} for c in [(64, 8, 3), (64, 8, 2), (128, 8, 2), (32, 8, 3)]]


def sweep(case: Case, dev: torch.device, between: tuple[str, ...] = ()
          ) -> list[tuple[str, float]]:
    """Graph-replayed microseconds per variant (a forced kernel config, tile size or split
    count), patched into the module for the run; with `between`, each variant's time after
    the first kind of work (as the engine runs it) instead, alone printed beside it."""
    base_cfg, base_rows = ta._kernel_config, ta.TILE_ROWS
    out = []
    for var in variants(case):
        if "config" in var:
            ta._kernel_config = lambda *_, c=var["config"]: c
        if "rows" in var:
            ta.TILE_ROWS = (*base_rows[:-1], var["rows"])
        if "tile_rows" in var:
            ta.TILE_ROWS = var["tile_rows"]
        try:
            r = run_case(case, dev, var.get("splits"), var.get("long"), between[:1])
            key = f"{between[0]}_us" if between else "graph_us"
            out.append((str(var), r[key]))
            after = f", {r[key]:.1f} us after {between[0]}" if between else ""
            print(f"  {case.name} {var}: {r['graph_us']:.1f} us{after}", flush=True)
        except Exception as e:  # an out-of-resources config: skip it
            print(f"  {case.name} {var}: {type(e).__name__}")
        finally:
            ta._kernel_config, ta.TILE_ROWS = base_cfg, base_rows
    return out


def compiled_kernels() -> dict[object, object]:
    """Every compiled variant of the attention kernel so far, by its cache key (Triton's
    JITFunction.device_caches; empty where this Triton keeps them elsewhere)."""
    out = {}
    for caches in getattr(ta._attn_kernel, "device_caches", {}).values():
        out.update(caches[0] if isinstance(caches, tuple) else caches)
    return out


def code_size(kernels: list[object]) -> str:
    """Machine code bytes, registers and spills of compiled kernels: a kernel's code is
    fetched again when other kernels between two calls evict it from the SM's caches."""
    return ", ".join(f"{len(k.asm.get('cubin', b''))} B cubin, {k.n_regs} regs, "
                     f"{k.n_spills} spills" for k in kernels) or "none compiled"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="also time variants() of each case")
    p.add_argument("--cases", nargs="*", help="names of cases to run (default all)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                   help="whose attention: heads, KV heads and head dim")
    p.add_argument("--between", default="",
                   help="comma-separated: also time each call after copy, linear or small "
                        "work (between_op), that work's own time taken off")
    p.add_argument("--code-size", action="store_true",
                   help="also print each case's compiled attention kernels' code size")
    args = p.parse_args()
    between = tuple(b for b in args.between.split(",") if b)
    global H, HKV, D
    H, HKV, D = SHAPES[args.shape]
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/paged_attention.py needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    known = CASES if args.shape == "llama-3.1-8b" else SMALL_CASES
    cases = [c for c in known if not args.cases or c.name in args.cases]
    print(f"{'case':18} {'rel err':>9} {'eager us':>9} {'graph us':>9} {'KV GB/s':>8} "
          f"{'TFLOP/s':>8}" + "".join(f" {'after ' + b:>12}" for b in between))
    rows = []
    for c in cases:  # printed as they come: a partial table survives a time limit
        before = set(compiled_kernels())
        r = run_case(c, dev, between=between)
        rows.append(r)
        print(f"{r['case']:18} {r['err']:9.2e} {r['eager_us']:9.1f} {r['graph_us']:9.1f} "
              f"{r['kv_GBps']:8.0f} {r['tflops']:8.1f}"
              + "".join(f" {r[b + '_us']:12.1f}" for b in between), flush=True)
        if args.code_size:
            new = [k for key, k in compiled_kernels().items() if key not in before]
            print(f"  {c.name}: {code_size(new)}", flush=True)
    sweeps = {}
    for c in cases if args.sweep else []:
        sweeps[c.name] = sweep(c, dev, between)
        print(c.name, " | ".join(f"{v} {t:.1f}" for v, t in sorted(sweeps[c.name],
                                                                  key=lambda x: x[1])))
    print(json.dumps({"bench": "paged_attention", "device": torch.cuda.get_device_name(),
                      "shape": {"H": H, "Hkv": HKV, "D": D, "block_size": BS,
                                "dtype": str(DTYPE)}, "rows": rows,
                      "sweep": sweeps}))


if __name__ == "__main__":
    main()
