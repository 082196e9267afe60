"""Paged attention in Triton: the fast path of `attention_reference` (paged.py), reading the
paged K/V cache in place through the block table.

One call serves every kind of token a forward carries: long causal prefill chunks, decode
tokens (one per sequence, long contexts) and verify/draft trees (a few to 64 tokens per
sequence under a tree_mask), with exactly the reference's per-token visibility
(window_start <= p < visible, plus tree_start + t where tree_mask[i, t]; p < max_len).

Design (why each piece is there):
- Query tiles. A tile is a run of consecutive tokens of one sequence; its rows are
  (token, query head) pairs of the G = H / Hkv heads that share one KV head, so every K/V
  block a tile reads is loaded once for all its tokens and heads, not once per token/head,
  and decode tokens still give the matrix units G rows. Tiles come in groups of one size
  (16, 32, 64 or 128 rows; 256 for long prefill runs where the caller says the GPU holds
  them, `long_tiles_fit`), one launch per group, so decode tokens are not padded to a
  prefill tile's rows.
- Key loop. A tile walks the key range its rows can see, [min window_start, max(visible,
  last tree position + 1)) clipped to [0, max_len), BLOCK_N keys a step; each key's physical
  block comes from its sequence's block-table row, so any block_size (a power of two) and any
  block order work. The steps every row sees whole run with no mask; only the steps at the
  window's edge, the causal diagonal and the tree apply the exact per-row mask (and only
  those read tree_mask).
- Split-K (flash-decoding). When a group has too few (tile, KV head) programs to fill the
  GPU (batch-1 decode at 16k), each tile's key range is cut into chunks, one program each,
  writing partial (max, sum, acc) rows that a second launch merges, one program per row;
  a chunk past the tile's keys does nothing, and a range that fits one chunk (a short
  context under a long bound) is written by its program directly, the merge's programs
  then returning at once. The split count
  is fixed by the host (at most one wave of programs: a 17th split of 8 KV heads on 132 SMs
  would run as a second wave), the chunk length by each program from its tile's actual key
  range: a CUDA graph is captured for the model's length limit, and chunks cut for that
  limit would leave most programs idle at a shorter context.
- On Hopper the kernel launches dependently (models/dependent_launch.py).
- Online softmax in fp32 (exp2 with the log2(e)-folded scale); rows that see nothing yield
  zeros, never NaN.

No host syncs: grids come from host-known ints only (N, H, Hkv, max_len and the tile count),
so a call is CUDA-graph capturable for fixed shapes and a fixed TilePlan.

Tile contract (TilePlan): groups of tiles, each tile an int32 pair (first token, end token)
[num_tiles, 2] on q's device, half-open; the tokens of one tile are consecutive in the
flattened batch and share one seq_index; a tile holds at most its group's tokens_per_tile
tokens; empty tiles (first == end) are skipped; every token lies in exactly one tile of one
group. `build_tiles` builds a plan on the host from the pieces' lengths (what the engine
knows); `plan_tiles` builds one on the device from meta.seq_index with no host sync (used
when no plan is given). Build a plan once per forward and pass it to every layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from specscope.kvcache.paged import LONG_KEY_BOUND, BatchMeta, upload
from specscope.models import dependent_launch
from specscope.models.dependent_launch import release, wait

LOG2E = 1.4426950408889634
# Rows of a tile (tokens x G heads), smallest first: decode-sized, tree-sized, prefill-sized.
# Up to 32 rows the dots run as register MMAs with 128-key steps (memory-bound work: decode,
# small trees, measured ~2x faster there than 64-row tiles); 64 and 128 rows suit prefill.
TILE_ROWS = (16, 32, 64, 128)
# Runs of more than this many rows (prefill chunks) may take tiles of this size instead,
# twice as many rows reusing each K/V step: on the H200 a 16k causal prefill at D = 128 took
# 6.15 ms a layer against 7.20 with 128-row tiles (benchmarks/paged_attention.py). Their
# K/V pipeline needs ~160 KB of shared memory (long_tiles_fit).
LONG_TILE_ROWS = 256
# The shortest key chunk worth a program of its own when splitting a long key range.
MIN_SPLIT_KEYS = 256
# Partial chunks a merge program loads at once (one row of head dims each). The merge is a
# launch of its own: folded into the split launch's last program (an acquire-release
# ticket) it was slower wherever the range was really split, its serial merge on one SM and
# every program's fence on the critical path (docs/gpu-floor.md).
MERGE_STEP = 32
# Triton's CPU interpreter multiplies bf16 dot operands as their raw uint16 bits (3.9): under
# it, bf16 operands are widened to fp32 first (the same products, so tests stay meaningful).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileGroup:
    """Tiles of one size: tiles [num_tiles, 2] int32 (first token, end token) on the device,
    each at most tokens_per_tile tokens of one sequence."""

    tiles: torch.Tensor
    tokens_per_tile: int

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


@dataclass(frozen=True)
class TilePlan:
    """How a flattened batch's tokens are cut into query tiles: one launch per group."""

    groups: tuple[TileGroup, ...]


def tokens_per_tile(piece_len: int, group_size: int, long_tiles: bool = False) -> int:
    """Tokens per tile for a run of `piece_len` tokens of one sequence with G = group_size
    query heads per KV head: the smallest tile of TILE_ROWS rows that holds the whole run,
    else the largest (a long prefill chunk is cut into several tiles); with long_tiles, a
    run of more than LONG_TILE_ROWS rows is cut into tiles of that many."""
    rows = piece_len * group_size
    if long_tiles and rows > LONG_TILE_ROWS:
        return max(1, LONG_TILE_ROWS // group_size)
    fit = next((r for r in TILE_ROWS if rows <= r), TILE_ROWS[-1])
    return max(1, fit // group_size)


def long_tiles_fit(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether LONG_TILE_ROWS tiles run here: a head dim of 128 in 2-byte elements (the
    shape they were measured on) on a GPU whose blocks may take ~200 KB of shared memory
    (Hopper and later; an A100 or a consumer GPU keeps 128-row tiles)."""
    dev = torch.device(device)
    if dev.type != "cuda" or head_dim != 128 or torch.empty((), dtype=dtype).element_size() != 2:
        return False
    return _smem_optin(dev) >= LONG_TILE_SMEM


def build_tiles(piece_lengths: Sequence[int], num_heads: int, num_kv_heads: int,
                device: torch.device | str, long_tiles: bool = False) -> TilePlan:
    """A TilePlan from the host-known lengths of a batch's pieces, in flattened order (each
    piece a run of consecutive tokens of one sequence: a prefill chunk, a decode token, a
    tree). Pieces are grouped by tile size; one small host->device copy per group.
    long_tiles: long runs take LONG_TILE_ROWS tiles (where long_tiles_fit)."""
    G = num_heads // num_kv_heads
    by_size: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for n in piece_lengths:
        tpt = tokens_per_tile(n, G, long_tiles)
        tiles = by_size.setdefault(tpt, [])
        tiles += [(a, min(a + tpt, start + n)) for a in range(start, start + n, tpt)]
        start += n
    return TilePlan(tuple(
        TileGroup(upload(t, torch.int32, torch.device(device)), tpt)
        for tpt, t in sorted(by_size.items())))


def plan_tiles(meta: BatchMeta, num_heads: int, num_kv_heads: int) -> TilePlan:
    """A one-group TilePlan built on the device from meta.seq_index, with no host sync: a
    tile starts where the sequence changes and every tokens_per_tile tokens after.

    Its tile count is a host bound, min(N, ceil(N / tokens_per_tile) + B) for B block-table
    rows, which holds when each row's tokens are contiguous (every batch the engine builds);
    tiles past the real count are empty. Pass a build_tiles plan for any other layout."""
    N, B = meta.num_tokens, meta.block_tables.shape[0]
    tpt = tokens_per_tile(-(-N // max(B, 1)), num_heads // num_kv_heads)
    max_tiles = max(1, min(N, -(-N // tpt) + B))
    seq = meta.seq_index
    idx = torch.arange(N, device=seq.device)
    new_run = torch.ones(N, dtype=torch.bool, device=seq.device)
    new_run[1:] = seq[1:] != seq[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), 0).values
    first = new_run | ((idx - run_start) % tpt == 0)  # [N]: a tile starts here
    tile_id = first.cumsum(0) - 1
    tile_id = torch.where(first & (tile_id < max_tiles), tile_id, max_tiles + 1)
    starts = torch.full((max_tiles + 2,), N, dtype=torch.int64, device=seq.device)
    starts.scatter_(0, tile_id, idx)  # non-starts all land in the spare last slot
    starts = starts[:max_tiles + 1]
    tiles = torch.stack([starts[:-1], starts[1:]], 1).to(torch.int32)  # [max_tiles, 2]
    return TilePlan((TileGroup(tiles, tpt),))


@triton.jit
def _tile_rows(tiles_ptr, tile, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of a tile: row r is token first + r // G, query head r % G of the KV head."""
    first = tl.load(tiles_ptr + 2 * tile)
    end = tl.load(tiles_ptr + 2 * tile + 1)
    r = tl.arange(0, BLOCK_M)
    tok = first + r // G
    return first, end, tok, r % G, (tok < end) & (r < BLOCK_M // G * G), r


@triton.jit
def _key_range(tok, row_ok, vis_ptr, ws_ptr, ts_ptr, tm_ptr, stride_tm, T, max_len, W,
               BS: tl.constexpr, HAS_TREE: tl.constexpr, T_PAD: tl.constexpr):
    """Per-row bounds and the tile's key range [lo, hi): the union of what its rows see,
    clipped to max_len and to the block table's width."""
    vis = tl.load(vis_ptr + tok, mask=row_ok, other=0)
    ws = tl.maximum(tl.load(ws_ptr + tok, mask=row_ok, other=0), 0)
    lo = tl.min(tl.where(row_ok & (vis > ws), ws, max_len), 0)
    hi = tl.max(tl.where(row_ok, vis, 0), 0)
    ts = tl.load(ts_ptr + tok, mask=row_ok, other=0)
    if HAS_TREE:
        t = tl.arange(0, T_PAD)
        bits = tl.load(tm_ptr + tok[:, None].to(tl.int64) * stride_tm + t[None, :],
                       mask=row_ok[:, None] & (t[None, :] < T), other=0)
        seen = bits != 0  # [BLOCK_M, T_PAD]
        last = tl.max(tl.where(seen, t[None, :] + 1, 0), 1)
        first = tl.min(tl.where(seen, t[None, :], T_PAD), 1)
        has = row_ok & (last > 0)
        lo = tl.minimum(lo, tl.min(tl.where(has, ts + first, max_len), 0))
        hi = tl.maximum(hi, tl.max(tl.where(has, ts + last, 0), 0))
    hi = tl.minimum(tl.minimum(hi, max_len), W * BS)
    lo = tl.minimum(tl.maximum(lo, 0), hi)
    return vis, ws, ts, lo, hi


@triton.jit
def _row_mask(pos, kv_ok, tok, row_ok, vis, ws, ts, tm_ptr, stride_tm, T,
              HAS_TREE: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: which of the keys at pos each row sees."""
    seen = (pos[None, :] >= ws[:, None]) & (pos[None, :] < vis[:, None])
    if HAS_TREE:
        rel = pos[None, :] - ts[:, None]
        in_tree = (rel >= 0) & (rel < T) & row_ok[:, None]
        bit = tl.load(tm_ptr + tok[:, None].to(tl.int64) * stride_tm + rel, mask=in_tree,
                      other=0)
        seen = seen | (bit != 0)
    return seen & kv_ok[None, :]


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_masked(acc, m_i, l_i, q, start, n_first, restart, n_steps, lo, k_end, k_ptr,
                   v_ptr, bt_row, kvh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   tok, row_ok, vis, ws, ts, tm_ptr, stride_tm, T, qk_scale,
                   D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Online softmax over n_steps masked key steps of BLOCK_N keys: n_first from start,
    the rest from restart, so one loop (one copy of its code) covers both masked runs."""
    for i in range(0, n_steps):
        kb = tl.where(i < n_first, start + i * BLOCK_N, restart + (i - n_first) * BLOCK_N)
        kb = tl.multiple_of(kb, BLOCK_N)  # both runs start on whole key steps
        acc, m_i, l_i = _key_step(acc, m_i, l_i, q, kb, lo, k_end, k_ptr, v_ptr, bt_row,
                                  kvh, stride_kb, stride_kt, stride_kh, stride_vb,
                                  stride_vt, stride_vh, tok, row_ok, vis, ws, ts,
                                  tm_ptr, stride_tm, T, qk_scale, D, DP, BS, BLOCK_N,
                                  True, HAS_TREE, PRECISION, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _attend_open(acc, m_i, l_i, q, start, stop, k_ptr, v_ptr, bt_row, kvh,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                 D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over keys [start, stop) that every row sees: no mask arithmetic,
    no predicated loads, a loop over the key position itself (a select in its place, as
    the masked loop has, cost the long prefill tiles a quarter of their speed)."""
    for kb in range(start, stop, BLOCK_N):
        acc, m_i, l_i = _key_step(acc, m_i, l_i, q, kb, 0, 0, k_ptr, v_ptr, bt_row, kvh,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                  stride_vh, 0, 0, 0, 0, 0, k_ptr, 0, 0, qk_scale, D, DP,
                                  BS, BLOCK_N, False, False, PRECISION, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _key_step(acc, m_i, l_i, q, kb, lo, k_end, k_ptr, v_ptr, bt_row, kvh,
              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
              tok, row_ok, vis, ws, ts, tm_ptr, stride_tm, T, qk_scale,
              D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    """One step of BLOCK_N keys from kb, each key's physical block read from the
    block-table row. DP: D padded to a power of two (Triton's ranges), the padding columns
    loaded as zeros."""
    d = tl.arange(0, DP)
    d_ok = d < D
    pos = kb + tl.arange(0, BLOCK_N)
    kv_ok = (pos >= lo) & (pos < k_end)  # read only by MASKED steps
    if MASKED:
        blk = tl.load(bt_row + pos // BS, mask=kv_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // BS).to(tl.int64)  # [BLOCK_N] physical blocks
    k_off = blk * stride_kb + (pos % BS) * stride_kt + kvh * stride_kh
    v_off = blk * stride_vb + (pos % BS) * stride_vt + kvh * stride_vh
    k = _load_rows(k_ptr, k_off, d, d_ok, kv_ok, MASKED, D, DP)  # [BLOCK_N, DP]
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        seen = _row_mask(pos, kv_ok, tok, row_ok, vis, ws, ts, tm_ptr, stride_tm, T,
                         HAS_TREE)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, v_off, d, d_ok, kv_ok, MASKED, D, DP)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _load_rows(ptr, off, d, d_ok, kv_ok, MASKED: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr):
    """K or V rows [BLOCK_N, DP] at row offsets off: predicated by key (MASKED) and by
    column where D is padded, else a plain load."""
    if MASKED:
        return tl.load(ptr + off[:, None] + d[None, :], mask=kv_ok[:, None] & d_ok[None, :],
                       other=0.0)
    if DP != D:
        return tl.load(ptr + off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    return tl.load(ptr + off[:, None] + d[None, :])


# Ints that change from step to step (the key bound, the block-table width, the tree width)
# are not specialised on (Triton would compile a variant per divisibility pattern).
@triton.jit(do_not_specialize=["max_len", "T", "W", "stride_bt", "stride_tm"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, n_work_ptr,
                 tiles_ptr, seq_ptr, bt_ptr, vis_ptr, ws_ptr, ts_ptr, tm_ptr,
                 max_len, qk_scale, T, W,
                 stride_qn, stride_qh, stride_kb, stride_kt, stride_kh,
                 stride_vb, stride_vt, stride_vh, stride_on, stride_bt, stride_tm,
                 G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T_PAD: tl.constexpr,
                 HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, META_EARLY: tl.constexpr,
                 PDL: tl.constexpr):
    """One (tile, KV head, key chunk) program: flash attention of the tile's rows over the
    chunk of its key range in three runs of key steps: masked up to the first step every
    row sees whole, unmasked while all rows see every key, masked again to the end (the
    causal diagonal, the tree); the two masked runs go first, in one loop. Tiles run last
    first: in a prefill chunk the later tiles have the longer key ranges, so the tail of
    the launch is short. META_EARLY: the batch's layout (tiles, visible lengths, windows,
    tree starts and masks, sequence rows) is read before the dependent launch's wait, its
    round trips overlapping the kernel before; only where no kernel right before this one
    writes it (the caller's own tile plan and tree mask, built before the forward's first
    layer)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh, split = tl.program_id(1), tl.program_id(2)
    if not META_EARLY:
        wait(PDL)
    first, end, tok, g, row_ok, r = _tile_rows(tiles_ptr, tile, G, BLOCK_M)
    vis, ws, ts, lo, hi = _key_range(tok, row_ok, vis_ptr, ws_ptr, ts_ptr, tm_ptr, stride_tm,
                                     T, max_len, W, BS, HAS_TREE, T_PAD)
    seq = tl.load(seq_ptr + first, mask=first < end, other=0)
    if META_EARLY:  # the batch's layout read while the kernel before finishes
        wait(PDL)
    release(PDL)
    k_begin = (lo // BLOCK_N * BLOCK_N).to(tl.int32)
    k_end = hi.to(tl.int32)
    n_work = 1  # the chunks that hold keys (programs past them have nothing to do)
    if SPLIT:  # this program's chunk of the tile's own key range, whole key steps
        per = tl.cdiv(k_end - k_begin, tl.num_programs(2))
        chunk = tl.maximum(tl.cdiv(per, BLOCK_N) * BLOCK_N, MIN_CHUNK)
        n_work = tl.maximum(tl.cdiv(k_end - k_begin, chunk), 1)
        k_begin = k_begin + split * chunk
        k_end = tl.minimum(k_end, k_begin + chunk)
    # [a, b): whole key steps that every row of the tile sees.
    ws_max = tl.max(tl.where(row_ok, ws, 0), 0)
    vis_min = tl.min(tl.where(row_ok, vis, max_len), 0)
    a = tl.minimum(tl.maximum((ws_max + BLOCK_N - 1) // BLOCK_N * BLOCK_N, k_begin), k_end)
    b = tl.minimum(tl.maximum(vis_min // BLOCK_N * BLOCK_N, a), k_end)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    d = tl.arange(0, DP)
    row_d = row_ok[:, None] & (d < D)[None, :]
    head = kvh * G + g
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qn + head[:, None] * stride_qh
                + d[None, :], mask=row_d, other=0.0)  # [BLOCK_M, DP]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    # The masked steps ([k_begin, a) and [b, k_end)) in one loop, then the unmasked ones:
    # two loop bodies in the kernel, not three. A kernel's code (and its spills) is
    # fetched again after the linears between two attention calls evict it, and on the
    # H200 the larger tree-mask kernel paid that at every call.
    n_lead = tl.cdiv(a - k_begin, BLOCK_N)
    acc, m_i, l_i = _attend_masked(acc, m_i, l_i, q, k_begin, n_lead, b,
                                   n_lead + tl.cdiv(k_end - b, BLOCK_N), lo, k_end, k_ptr,
                                   v_ptr, bt_row, kvh, stride_kb, stride_kt, stride_kh,
                                   stride_vb, stride_vt, stride_vh, tok, row_ok, vis, ws, ts,
                                   tm_ptr, stride_tm, T, qk_scale, D, DP, BS, BLOCK_N,
                                   HAS_TREE, PRECISION, UPCAST)
    acc, m_i, l_i = _attend_open(acc, m_i, l_i, q, a, b, k_ptr, v_ptr, bt_row, kvh,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                 stride_vh, qk_scale, D, DP, BS, BLOCK_N, PRECISION, UPCAST)
    if n_work == 1:  # the whole range in one program (split 0): the rows are final
        if split == 0:
            _store_rows(out_ptr, acc, l_i, tok, head, row_d, d, stride_on, D)
    elif split < n_work:
        part = (split * tl.num_programs(0) * tl.num_programs(1)
                + tile * tl.num_programs(1) + kvh) * BLOCK_M + r
        tl.store(part_acc_ptr + part[:, None].to(tl.int64) * D + d[None, :], acc,
                 mask=row_d)
        tl.store(part_ml_ptr + 2 * part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=row_ok)
    if SPLIT and split == 0:  # how many chunks the merge reads (1: none, rows written)
        tl.store(n_work_ptr + tile * tl.num_programs(1) + kvh, n_work)


@triton.jit
def _store_rows(out_ptr, acc, l_i, tok, head, row_d, d, stride_on, D: tl.constexpr):
    """A tile's normalised output rows, in the output's dtype (rows that saw no key: 0)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_on + head[:, None] * D
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_d)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(out_ptr, part_acc_ptr, part_ml_ptr, n_work_ptr, tiles_ptr, splits,
                  stride_on, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  BLOCK_M: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
    """Merge one tile row's per-chunk partial (max, sum, acc) into its output row: one
    program per row that tokens can fill (a decode tile's G heads), STEP chunks a load, so
    the merge is a few wide loads, not a serial walk over the chunks (latency-bound at
    batch-1 decode). The loads' addresses do not wait for the chunk count: chunks past it
    are read and dropped, so a merge of up to STEP chunks is one round trip to memory.
    Rows the split launch wrote whole (a chunk count of 1) are left as they are."""
    tile, kvh, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(tiles_ptr + 2 * tile)  # (the split launch right before wrote no tile)
    end = tl.load(tiles_ptr + 2 * tile + 1)
    wait(PDL)
    release(PDL)
    n_work = tl.load(n_work_ptr + tile * tl.num_programs(1) + kvh)
    d = tl.arange(0, DP)
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros([DP], tl.float32)
    stride_s = tl.num_programs(0) * tl.num_programs(1) * BLOCK_M  # one chunk's rows
    for s0 in range(0, splits, STEP):
        s = s0 + tl.arange(0, STEP)
        s_in = s < splits
        part = s * stride_s + (tile * tl.num_programs(1) + kvh) * BLOCK_M + r
        m_s = tl.load(part_ml_ptr + 2 * part, mask=s_in, other=float("-inf"))  # [STEP]
        l_s = tl.load(part_ml_ptr + 2 * part + 1, mask=s_in, other=0.0)
        a_s = tl.load(part_acc_ptr + part[:, None].to(tl.int64) * D + d[None, :],
                      mask=s_in[:, None] & (d < D)[None, :], other=0.0)  # [STEP, DP]
        s_ok = s < n_work  # chunks past the tile's keys wrote nothing: drop what was read
        m_s = tl.where(s_ok, m_s, float("-inf"))
        l_s = tl.where(s_ok, l_s, 0.0)
        a_s = tl.where(s_ok[:, None], a_s, 0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m_s - m_safe)
        l_run = l_run * alpha + tl.sum(l_s * w, 0)
        acc = acc * alpha + tl.sum(a_s * w[:, None], 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tok = first + r // G
    ok = (tok < end) & (r < BLOCK_M // G * G) & (n_work > 1)
    tl.store(out_ptr + tok.to(tl.int64) * stride_on + (kvh * G + r % G) * D + d,
             out.to(out_ptr.dtype.element_ty), mask=d < tl.where(ok, D, 0))


@cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors to fill (a host-side property, cached: no sync). Off CUDA (the
    interpreter) a small stand-in, so long-context tests exercise the split path."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def _smem_optin(device: torch.device) -> int:
    """Shared memory one block may opt in to on this GPU (bytes; host-side, cached)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


# A long tile's pipeline (64-key steps, 3 stages, D = 128, bf16): Q 64 KB + K/V 96 KB.
LONG_TILE_SMEM = 200_000


def _kernel_config(block_m: int, D: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a tile of block_m rows: long key steps for the
    memory-bound small tiles, short ones and a deeper pipeline for the big ones (the best
    of a sweep on an H200, bf16, D = 128; benchmarks/paged_attention.py --sweep). At D <= 64
    the 32- and 64-row tiles take 64-key steps: on the H200 the default model's verify of
    6-9 tokens (32 rows) took 25.6 us a layer with 128-key steps and 12.8 with these, and of
    16 tokens (64 rows) 16.7 against 14.5 (--shape smollm2-135m --sweep)."""
    if block_m == LONG_TILE_ROWS:  # only where long_tiles_fit (the sweep's best, 8 warps)
        return _fit_stages(64, 8, 3, block_m, D, elem_size, LONG_TILE_SMEM)
    if D <= 64 and block_m in (32, 64):
        return _fit_stages(64, 4, 3 if block_m == 32 else 2, block_m, D, elem_size)
    if block_m <= 32:
        return _fit_stages(128 if D <= 128 else 64, 4, 3, block_m, D, elem_size)
    if D <= 128:
        return _fit_stages(32, 4, 4, block_m, D, elem_size)
    return _fit_stages(32, 8 if block_m > 64 else 4, 2, block_m, D, elem_size)


def _fit_stages(block_n: int, warps: int, stages: int, block_m: int, D: int, elem_size: int,
                limit: float = 160e3) -> tuple[int, int, int]:
    """Keep K and V tiles of every pipeline stage plus Q in shared memory well inside
    Hopper's 228 KB (`limit` bytes): fewer stages down to 2, then shorter key steps (fp32,
    large D)."""
    while stages * 2 * block_n * D * elem_size + block_m * D * elem_size > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            return block_n, warps, 1
    return block_n, warps, stages


def _num_splits(programs: int, max_len: int, device: torch.device,
                num_splits: int | None) -> int:
    """Chunks each tile's key range is cut into when too few (tile, KV head) programs would
    run to fill the GPU: as many as keep the launch to one program per SM (one wave), two
    waves past LONG_KEY_BOUND keys, never chunks shorter than MIN_SPLIT_KEYS of the longest
    range max_len allows. On the H200 a batch-1 decode at 16k keys took 33.9 us a layer in
    16 chunks (one wave of 8 KV heads) and 29.5 in 32; at 160 keys under a 4k bound the
    second wave cost 2 us (benchmarks/results/paged_attention_h200_decode_splits.log)."""
    if num_splits is None:
        waves = 2 if max_len > LONG_KEY_BOUND else 1
        sms = _sm_count(device)
        num_splits = min(waves * sms // max(programs, 1), -(-max_len // MIN_SPLIT_KEYS))
    return max(1, num_splits)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: BatchMeta, scale: float, *, tiles: TilePlan | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Attention of a flattened ragged batch over one layer's paged K/V, read in place:
    `attention_reference`'s semantics exactly.

    q [N, H, D] (last dim contiguous); k_cache, v_cache [num_blocks, block_size, Hkv, D];
    tiles: a TilePlan for meta's tokens (see the module docstring), else built on the device
    by plan_tiles; num_splits: force the key-range split count (tests, tuning), else chosen
    from the SM count. Returns [N, H * D] in q's dtype. No host syncs."""
    N, H, D = q.shape
    out = torch.empty(N, H * D, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    # The layout may be read before the wait unless this call just wrote part of it.
    early = tiles is not None
    if tiles is None:
        tiles = plan_tiles(meta, H, k_cache.shape[2])
    T = meta.tree_mask.shape[1]
    tm = meta.tree_mask.view(torch.uint8) if T else meta.visible  # a dummy pointer when T = 0
    if T and tm.stride(1) != 1:
        tm, early = tm.contiguous(), False
    for group in tiles.groups:
        if group.num_tiles:
            _launch_group(q, k_cache, v_cache, out, meta, tm, T, scale, group, num_splits,
                          early)
    return out


def _launch_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, meta: BatchMeta, tm: torch.Tensor, T: int, scale: float,
                  group: TileGroup, num_splits: int | None, early: bool) -> None:
    """One group's attention launch (early: the kernel's META_EARLY)."""
    N, H, D = q.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hkv
    block_m = max(16, triton.next_power_of_2(group.tokens_per_tile * G))
    DP = max(16, triton.next_power_of_2(D))  # the kernels' head range (D itself when a power of 2)
    block_n, warps, stages = _kernel_config(block_m, DP, k_cache.element_size())
    splits = _num_splits(group.num_tiles * Hkv, meta.max_len, q.device, num_splits)
    rows = splits * group.num_tiles * Hkv * block_m
    part_acc, part_ml = _partials(rows if splits > 1 else 0, D, q.device)
    n_work = torch.empty(group.num_tiles * Hkv if splits > 1 else 1, dtype=torch.int32,
                         device=q.device)
    bt = meta.block_tables
    precision = "ieee" if q.dtype == torch.float32 else None
    _attn_kernel[(group.num_tiles, Hkv, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, n_work, group.tiles, meta.seq_index, bt,
        meta.visible, meta.window_start, meta.tree_start, tm,
        meta.max_len, scale * LOG2E, T, bt.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), bt.stride(0),
        tm.stride(0) if T else 0,
        G=G, D=D, DP=DP, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        T_PAD=max(16, triton.next_power_of_2(max(T, 1))), HAS_TREE=T > 0, SPLIT=splits > 1,
        MIN_CHUNK=-(-MIN_SPLIT_KEYS // block_n) * block_n,
        PRECISION=precision, UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
        META_EARLY=early, num_warps=warps, num_stages=stages, **dependent_launch.options(q, N))
    if splits > 1:
        merge_rows = min(block_m, triton.next_power_of_2(group.tokens_per_tile * G))
        _merge_kernel[(group.num_tiles, Hkv, merge_rows)](
            out, part_acc, part_ml, n_work, group.tiles, splits, out.stride(0), G=G, D=D,
            DP=DP, BLOCK_M=block_m, STEP=min(MERGE_STEP, triton.next_power_of_2(splits)),
            num_warps=4, **dependent_launch.options(q, N))


def _partials(rows: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for split key ranges' partial rows: acc [rows * D] and (max, sum) [rows * 2],
    fp32 (a 1-element stand-in each when rows is 0)."""
    return (torch.empty(max(rows * D, 1), dtype=torch.float32, device=device),
            torch.empty(max(rows * 2, 1), dtype=torch.float32, device=device))


__all__ = ["TileGroup", "TilePlan", "build_tiles", "paged_attention", "plan_tiles",
           "tokens_per_tile"]
