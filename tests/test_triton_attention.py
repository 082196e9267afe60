"""The Triton paged-attention backend against the torch reference (attention_reference).

Runs the compiled kernels on CUDA when there is a GPU, else Triton's CPU interpreter
(TRITON_INTERPRET=1, set below before triton_attention decorates its kernels). Skipped where
triton is not installed (CI). Every check compares with the reference evaluated in float64
on the same inputs, by relative norm, on fresh random data and shuffled block tables.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import CUDA, DEV  # noqa: F401  (imported first: it skips without triton)

from specscope.kvcache import triton_attention
from specscope.kvcache.paged import BatchMeta, attention_reference, tree_meta
from specscope.kvcache.triton_attention import (
    TilePlan,
    _num_splits,
    build_tiles,
    paged_attention,
    plan_tiles,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def _cache(num_blocks: int, bs: int, hkv: int, d: int, dtype: torch.dtype, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V blocks [num_blocks, bs, Hkv, D] (never zeros: they hide bad indexing)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    return k.to(DEV, dtype), v.to(DEV, dtype)


def _tables(rows: int, width: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Shuffled block tables [rows, width] int64: no sequence's blocks are contiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:rows * width].view(rows, width).to(DEV)


def _ancestors(S: int, T: int, seed: int) -> torch.Tensor:
    """[S, T, T] ancestor masks of random trees (node j's parent is a random earlier node),
    as DraftTree.ancestor_mask: [s, i, j] = j is i or an ancestor of i."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(S, T, T, dtype=torch.bool)
    for s in range(S):
        parent = [-1] + [int(torch.randint(0, j, (), generator=g)) for j in range(1, T)]
        for i in range(T):
            j = i
            while j >= 0:
                out[s, i, j], j = True, parent[j]
    return out.to(DEV)


def _mixed_meta(bt: torch.Tensor, bs: int, window: int | None = None
                ) -> tuple[BatchMeta, list[int]]:
    """A 37-token prefill chunk at positions 20..56 (row 0), decode tokens with contexts 5,
    64 and 130 (rows 1-3) and two 6-node verify trees after prefixes of 50 and 9 (rows 4,
    5), side by side; and its pieces' lengths."""
    t = lambda *x: torch.tensor(x, device=DEV)  # noqa: E731
    prefill = BatchMeta.causal(bt, t(*[0] * 37), torch.arange(20, 57, device=DEV), bs,
                               window, max_len=57)
    decode = BatchMeta.causal(bt, t(1, 2, 3), t(4, 63, 129), bs, window, max_len=130)
    anc = _ancestors(2, 6, seed=bs)
    prefix = t(50, 9)
    rope = prefix[:, None] + anc.sum(-1) - 1  # each node's depth after its prefix
    trees = tree_meta(bt, prefix, anc, bs, rows=t(4, 5), rope=rope, sliding_window=window,
                      max_len=56)
    return BatchMeta.cat([prefill, decode, trees]), [37, 1, 1, 1, 6, 6]


def _check(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: BatchMeta,
           scale: float, **kw: object) -> float:
    """paged_attention's relative error against the float64 reference (asserted)."""
    ref = attention_reference(q.double(), kc.double(), vc.double(), meta, scale)
    out = paged_attention(q, kc, vc, meta, scale, **kw)
    assert out.shape == (q.shape[0], q.shape[1] * q.shape[2]) and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[q.dtype], err
    return err


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch(group: int, bs: int, d: int) -> None:
    hkv = 2
    W = -(-130 // bs) + 1
    kc, vc = _cache(6 * W + 3, bs, hkv, d, torch.float32, seed=group * 100 + bs + d)
    bt = _tables(6, W, 6 * W + 3, seed=d)
    meta, pieces = _mixed_meta(bt, bs)
    q = torch.randn(meta.num_tokens, group * hkv, d, device=DEV)
    _check(q, kc, vc, meta, d ** -0.5)  # tiles built on the device
    _check(q, kc, vc, meta, d ** -0.5, tiles=build_tiles(pieces, group * hkv, hkv, DEV))


@pytest.mark.parametrize("d", [24, 48])
def test_head_dims_not_a_power_of_two(d: int) -> None:
    """Head dims such as 48, 80, 192 (DeepSeek's 128 + 64) or 576 (MLA's absorbed latent plus
    rope key) run in a power-of-two range with the padding columns masked; split key ranges
    and their merge too."""
    bs, hkv = 16, 2
    W = -(-130 // bs) + 1
    kc, vc = _cache(6 * W + 3, bs, hkv, d, torch.float32, seed=d)
    meta, pieces = _mixed_meta(_tables(6, W, 6 * W + 3, seed=d), bs)
    q = torch.randn(meta.num_tokens, 2 * hkv, d, device=DEV)
    _check(q, kc, vc, meta, d ** -0.5, tiles=build_tiles(pieces, 2 * hkv, hkv, DEV))
    _check(q, kc, vc, meta, d ** -0.5, num_splits=3)


@pytest.mark.slow
@pytest.mark.parametrize("bs", [4, 16])
def test_sliding_window(bs: int) -> None:
    W = -(-130 // bs) + 1
    kc, vc = _cache(6 * W, bs, 2, 32, torch.float32, seed=bs)
    meta, pieces = _mixed_meta(_tables(6, W, 6 * W, seed=bs), bs, window=16)
    q = torch.randn(meta.num_tokens, 4, 32, device=DEV)
    _check(q, kc, vc, meta, 0.2, tiles=build_tiles(pieces, 4, 2, DEV))
    _check(q, kc, vc, meta, 0.2, num_splits=3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    W = 10
    kc, vc = _cache(64, 16, 2, 64, dtype, seed=7)
    meta, pieces = _mixed_meta(_tables(6, W, 64, seed=7), 16)
    q = torch.randn(meta.num_tokens, 8, 64, device=DEV).to(dtype)
    _check(q, kc, vc, meta, 0.125, tiles=build_tiles(pieces, 8, 2, DEV))
    _check(q, kc, vc, meta, 0.125, num_splits=2)


@pytest.mark.parametrize("bs", [32, 64])
def test_block_sizes_and_wide_groups(bs: int) -> None:
    """Blocks larger than a key step (bs 64 > BLOCK_N at some sizes) and G = 8."""
    W = -(-130 // bs) + 1
    kc, vc = _cache(6 * W, bs, 1, 32, torch.float32, seed=bs)
    meta, pieces = _mixed_meta(_tables(6, W, 6 * W, seed=bs + 1), bs)
    q = torch.randn(meta.num_tokens, 8, 32, device=DEV)
    _check(q, kc, vc, meta, 0.2, tiles=build_tiles(pieces, 8, 1, DEV))


@pytest.mark.slow
def test_long_context_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """700 keys: a decode token and a 40-token chunk ending there, with the key range split
    into chunks (the auto choice, and forced counts) and merged by the merge launch (2
    chunks a load, so the merge takes several loads)."""
    monkeypatch.setattr(triton_attention, "MERGE_STEP", 2)
    # Scratch starts as NaN: a merge that reads a chunk's partial before it is written (or
    # one never written) shows, rather than finding an earlier call's rows in reused memory.
    monkeypatch.setattr(triton_attention, "_partials", lambda rows, D, dev: (
        torch.full((max(rows * D, 1),), float("nan"), device=dev),
        torch.full((max(rows * 2, 1),), float("nan"), device=dev)))
    bs, W = 16, 45
    kc, vc = _cache(2 * W, bs, 2, 32, torch.float32, seed=3)
    bt = _tables(2, W, 2 * W, seed=3)
    dev_ = torch.tensor
    decode = BatchMeta.causal(bt, dev_([0], device=DEV), dev_([699], device=DEV), bs,
                              max_len=700)
    chunk = BatchMeta.causal(bt, torch.ones(40, dtype=torch.long, device=DEV),
                             torch.arange(660, 700, device=DEV), bs, max_len=700)
    meta = BatchMeta.cat([decode, chunk])
    q = torch.randn(41, 4, 32, device=DEV)
    plan = build_tiles([1, 40], 4, 2, DEV)
    assert all(_num_splits(g.num_tiles * 2, 700, DEV, None) > 1 for g in plan.groups)
    for splits in (None, 1, 3, 8):
        _check(q, kc, vc, meta, 0.2, tiles=plan, num_splits=splits)
    # A key bound far past the context (a CUDA graph's, captured for the length limit): the
    # programs cut their chunks from the tiles' own ranges, which must still cover every key.
    W2 = 4096 // bs
    kc, vc = _cache(2 * W2, bs, 2, 32, torch.float32, seed=4)
    bt = _tables(2, W2, 2 * W2, seed=4)
    bound = BatchMeta.cat([
        BatchMeta.causal(bt, dev_([0], device=DEV), dev_([699], device=DEV), bs,
                         max_len=4096),
        BatchMeta.causal(bt, torch.ones(40, dtype=torch.long, device=DEV),
                         torch.arange(660, 700, device=DEV), bs, max_len=4096)])
    # One wave of programs (the interpreter's stand-in has 4 SMs), chunks of >= 256 keys.
    assert _num_splits(2, 4096, DEV, None) == min(triton_attention._sm_count(DEV) // 2, 16)
    for splits in (None, 5, 16):
        _check(q, kc, vc, bound, 0.2, tiles=plan, num_splits=splits)


def test_tree_edges() -> None:
    """A tree with no prefix (its root sees only itself), a decode token at position 0, a
    non-contiguous q (the model's [1, H, N, D] transposed), and tree_mask padding (cat)."""
    bs = 4
    kc, vc = _cache(16, bs, 2, 16, torch.float32, seed=11)
    bt = _tables(2, 8, 16, seed=11)
    tree = tree_meta(bt, torch.tensor([0], device=DEV), _ancestors(1, 5, seed=1), bs,
                     max_len=5)
    first = BatchMeta.causal(bt, torch.tensor([1], device=DEV),
                             torch.tensor([0], device=DEV), bs, max_len=1)
    meta = BatchMeta.cat([first, tree])
    q = torch.randn(1, 4, meta.num_tokens, 16, device=DEV)[0].transpose(0, 1)  # [N, H, D]
    assert not q.is_contiguous()
    _check(q, kc, vc, meta, 0.25)
    _check(q, kc, vc, meta, 0.25, tiles=build_tiles([1, 5], 4, 2, DEV))


def test_empty_batch() -> None:
    kc, vc = _cache(4, 4, 1, 16, torch.float32, seed=0)
    bt = _tables(1, 4, 4, seed=0)
    empty = torch.zeros(0, dtype=torch.long, device=DEV)
    meta = BatchMeta.causal(bt, empty, empty, 4, max_len=1)
    out = paged_attention(torch.randn(0, 2, 16, device=DEV), kc, vc, meta, 1.0)
    assert out.shape == (0, 32)


def _covers(plan: TilePlan, seq: list[int]) -> None:
    """Every token in exactly one tile; a tile's tokens share a sequence and fit its size."""
    seen = [0] * len(seq)
    for group in plan.groups:
        for a, b in group.tiles.tolist():
            assert b - a <= group.tokens_per_tile and len(set(seq[a:b])) <= 1
            for i in range(a, b):
                seen[i] += 1
    assert seen == [1] * len(seq)


@pytest.mark.parametrize("pieces", [[37, 1, 1, 1, 6, 6], [1] * 9, [300], [5, 200, 1, 64]])
def test_tile_plans(pieces: list[int]) -> None:
    """build_tiles (host) and plan_tiles (device, no sync) both satisfy the tile contract."""
    seq = [r for r, n in enumerate(pieces) for _ in range(n)]
    bt = torch.zeros(len(pieces), 1, dtype=torch.long, device=DEV)
    meta = BatchMeta.causal(bt, torch.tensor(seq, device=DEV),
                            torch.zeros(len(seq), dtype=torch.long, device=DEV), 16, max_len=1)
    for heads, kv_heads in ((4, 4), (8, 2), (32, 4)):
        _covers(build_tiles(pieces, heads, kv_heads, DEV), seq)
        _covers(build_tiles(pieces, heads, kv_heads, DEV, long_tiles=True), seq)
        _covers(plan_tiles(meta, heads, kv_heads), seq)


def test_long_tiles_take_only_long_runs() -> None:
    """With long tiles, only runs of more than LONG_TILE_ROWS rows (prefill chunks) take
    them; decode tokens and trees (at most 64 tokens x 4 heads) keep their tiles."""
    from specscope.kvcache.triton_attention import LONG_TILE_ROWS, tokens_per_tile

    G = 4
    for n in (1, 6, 33, 64):
        assert tokens_per_tile(n, G, True) == tokens_per_tile(n, G)
    assert tokens_per_tile(65, G, True) == LONG_TILE_ROWS // G
    assert tokens_per_tile(2048, G, True) == LONG_TILE_ROWS // G
    assert tokens_per_tile(2048, G) == 128 // G
    sizes = {g.tokens_per_tile for g in build_tiles([300, 1, 8], 32, 8, DEV, True).groups}
    assert sizes == {LONG_TILE_ROWS // G, 16 // G, 32 // G}


def test_prefill_in_long_tiles_matches_the_reference() -> None:
    """A 300-token prefill chunk after a 40-token prefix, with a decode token beside it,
    run in long tiles (D = 128, bf16, the shape they serve) equals the reference."""
    bs, hkv, group, d = 16, 2, 4, 128
    W = -(-340 // bs) + 1
    kc, vc = _cache(2 * W, bs, hkv, d, torch.bfloat16, seed=41)
    bt = _tables(2, W, 2 * W, seed=41)
    seq = torch.tensor([0] * 300 + [1], device=DEV)
    pos = torch.cat([torch.arange(40, 340), torch.tensor([77])]).to(DEV)
    meta = BatchMeta.causal(bt, seq, pos, bs, max_len=340)
    q = torch.randn(301, group * hkv, d, device=DEV, dtype=torch.bfloat16)
    _check(q, kc, vc, meta, d ** -0.5,
           tiles=build_tiles([300, 1], group * hkv, hkv, DEV, long_tiles=True))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture() -> None:
    """Fixed shapes and a fixed plan: the call captures into a CUDA graph (no host sync) and
    its replay on new inputs matches the reference."""
    bs, W = 16, 45
    kc, vc = _cache(2 * W, bs, 2, 64, torch.bfloat16, seed=5)
    bt = _tables(2, W, 2 * W, seed=5)
    meta = BatchMeta.causal(bt, torch.tensor([0, 1], device=DEV),
                            torch.tensor([699, 300], device=DEV), bs, max_len=700)
    plan = build_tiles([1, 1], 8, 2, DEV)
    q = torch.randn(2, 8, 64, device=DEV, dtype=torch.bfloat16)
    paged_attention(q, kc, vc, meta, 0.125, tiles=plan)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kc, vc, meta, 0.125, tiles=plan)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = attention_reference(q.double(), kc.double(), vc.double(), meta, 0.125)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]
