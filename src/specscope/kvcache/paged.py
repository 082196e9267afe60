"""Paged K/V storage: one model's keys and values in fixed-size blocks, every write and every
commit of an accepted tree path in one place.

Layout per layer: k and v [num_blocks, block_size, Hkv, D] ("NHD", FlashInfer's paged layout,
so a paged kernel reads it in place). A token's slot is block * block_size + offset; a
sequence's block table lists its blocks in position order, so the token at position p of a
sequence lives in slot table[p // block_size] * block_size + p % block_size.

MLA's layout (DeepSeek-V3, Kimi-K2; docs/mla.md): one tensor per layer [num_blocks,
block_size, 1, kv_lora_rank + rope_dim], each token's compressed latent then its rope key;
the values are a view of its first kv_lora_rank channels, so nothing is stored twice and
every write, commit and gather below moves the one tensor.

The attention here is the torch reference (CPU, tests): it gathers each sequence's K/V into a
contiguous copy, which a fast path must never do every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from specscope.native import cpu_kernels_for

if TYPE_CHECKING:
    from specscope.kvcache.budget import KVLayout

# Key bounds above this are "long": there the paged-attention kernel cuts a batch-1 decode's
# keys into two waves of chunks, not one (kvcache/triton_attention.py _num_splits), and the
# engine captures plain decode graphs for a bound of this many keys beside the model's
# length (engine/cuda_graph.py key_windows), so short contexts keep the one-wave kernel.
LONG_KEY_BOUND = 8192


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, tensors: int = 2) -> int:
    """One token's cache over all layers: K and V (tensors 2), or MLA's one latent tensor."""
    el = torch.empty((), dtype=dtype).element_size()
    return tensors * num_layers * num_kv_heads * head_dim * el


def upload(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or list of equal-length lists) on the device. On CUDA through pinned
    memory and an asynchronous copy: a plain torch.tensor(..., device=cuda) from pageable
    memory synchronises the stream, and a step builds several of these per forward."""
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def padded_rows(tables: list[list[int]]) -> tuple[list[int], int]:
    """Block tables as one flat host list, each row zero padded to the widest, and that
    width."""
    width = max(len(t) for t in tables)
    return [b for t in tables for b in t + [0] * (width - len(t))], width


def block_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables [len(tables), widest] int64 on the device, zero padded."""
    flat, width = padded_rows(tables)
    return upload(flat, torch.long, device).view(len(tables), width)


def with_pieces(meta: BatchMeta, pieces: list[tuple[int, int, int]], num_heads: int,
                num_kv_heads: int, device: torch.device, plans: dict | None = None,
                long_tiles: bool = False) -> BatchMeta:
    """meta with its pieces, host-known (tokens, block-table row, keys seen) in flattened
    order: the reference's spans always (a short host list; MLA's latent attention runs the
    reference on every device), and on CUDA the fast backend's query tiles.

    plans: a cache of tile plans by the pieces' lengths, for steps of static shapes: a
    CUDA-graph capture cannot upload a plan, so its warm-up run builds them here and the
    capture finds them. long_tiles: long prefill runs take the fast backend's long tiles
    (triton_attention.long_tiles_fit says where they run)."""
    spans, a = [], 0
    for n, row, keys in pieces:
        spans.append((a, a + n, row, keys))
        a += n
    meta.spans, meta.span_masks, meta.span_blocks = spans, None, None
    if device.type == "cuda" and _fast_backend() is not None:
        from specscope.kvcache.triton_attention import build_tiles

        lens = tuple(n for n, _, _ in pieces)
        tiles = None if plans is None else plans.get(lens)
        if tiles is None:
            tiles = build_tiles(list(lens), num_heads, num_kv_heads, device, long_tiles)
            if plans is not None:
                plans[lens] = tiles
        meta.tiles = tiles
    return meta


def slot_mapping(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Slots [N] of N tokens: token i is at `positions[i]` of sequence `seq_index[i]`, whose
    blocks are row seq_index[i] of block_tables [B, max_blocks] (int64)."""
    blocks = block_tables[seq_index, positions // block_size]
    return blocks * block_size + positions % block_size


class PagedKV:
    """K/V blocks for `num_layers` layers.

    latent_values: MLA's layout (the module docstring): one tensor per layer of head_dim
    channels, `v[layer]` the view of its first latent_values channels. None: K and V."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, *,
                 latent_values: int | None = None) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        if latent_values is None:
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self._stores = self.k + self.v
        else:
            if not 0 < latent_values <= head_dim:
                raise ValueError(f"latent_values {latent_values} must be in 1..{head_dim}")
            self.v = [k[..., :latent_values] for k in self.k]
            self._stores = list(self.k)  # the views own nothing: never write or move them
        self.latent_values = latent_values
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # The block CUDA-graph padding rows write (the engine sets it): its tokens are not
        # counted in per-token statistics (models/llama.py ForwardContext.live_slots).
        self.scratch_block: int | None = None

    @classmethod
    def from_layout(cls, layout: KVLayout, num_blocks: int, block_size: int,
                    device: torch.device | str) -> PagedKV:
        """The paged cache of a model's KVLayout (budget.py)."""
        return cls(layout.num_layers, num_blocks, block_size, layout.num_kv_heads,
                   layout.head_dim, layout.dtype, device, latent_values=layout.latent_values)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stores)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None,
              slots: torch.Tensor) -> None:
        """k, v [N, Hkv, D] into slots [N] (int64, on the device: no host sync). In MLA's
        layout k is the whole entry (latent and rope key) and v must be None."""
        kf = self.k[layer].view(-1, *self.k[layer].shape[2:])  # [slots, Hkv, D]
        kf.index_copy_(0, slots, k.to(kf.dtype))
        if self.latent_values is None:
            vf = self.v[layer].view(-1, *self.v[layer].shape[2:])
            vf.index_copy_(0, slots, v.to(vf.dtype))
        elif v is not None:
            raise ValueError("MLA's cache stores one entry per token: pass v=None")

    def commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V from slots src [M] to dst [M] in every layer: the accepted path of a
        verified tree, from the slots its nodes were verified in to the positions they now
        hold. Copied through a gather first, so overlapping src and dst are safe (once per
        stored tensor: moving a view as well would copy already-moved slots again)."""
        for t in self._stores:
            f = t.view(-1, *t.shape[2:])  # [slots, Hkv, D]
            f.index_copy_(0, dst, f.index_select(0, src))

    def gather(self, layer: int, block_table: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` tokens of K/V, contiguous [length, Hkv, D]
        (reference path and tests)."""
        nb = -(-length // self.block_size)
        k = self.k[layer][block_table[:nb]].flatten(0, 1)[:length]
        v = self.v[layer][block_table[:nb]].flatten(0, 1)[:length]
        return k, v


@dataclass
class BatchMeta:
    """What attention needs about a flattened ragged batch of N tokens from B sequences
    (built by the engine from a step's plan; prefill chunks, decode tokens, draft steps and
    verify trees side by side), in a compact form a paged kernel reads as is.

    slots [N]: where each token's K/V are written; seq_index [N]: its row of
    block_tables [B, max_blocks] (int64). Token i sees the keys of its own sequence at
    cache positions
        window_start[i] <= p < visible[i]                 (its prefix, causal)
        p = tree_start[i] + t with tree_mask[i, t]         (its tree ancestors and itself)
    tree_mask [N, T] bool, T = 0 when the batch has no tree. max_len: a host-known bound on
    every position any token sees (so no step reads it back from the device)."""

    slots: torch.Tensor
    seq_index: torch.Tensor
    block_tables: torch.Tensor
    visible: torch.Tensor
    window_start: torch.Tensor
    tree_start: torch.Tensor
    tree_mask: torch.Tensor
    max_len: int
    # The fast backend's query tiles (triton_attention.TilePlan), built once per forward on
    # the host from the pieces' lengths; None: the backend plans them on the device.
    tiles: Any = None
    # Host-known pieces (first token, end token, block-table row, keys seen): runs of
    # consecutive tokens of one sequence, so the reference attends piece by piece over one
    # gather of that sequence's K/V; None: token by token (tests).
    spans: list[tuple[int, int, int, int]] | None = None
    # The reference's per-span masks (None: the span sees every key) and block selections,
    # the same for every layer: built at the first.
    span_masks: list[torch.Tensor | None] | None = None
    span_blocks: list[torch.Tensor | int] | None = None
    # The native CPU attention's arguments from these fields (int64, contiguous), the same
    # for every layer: built at the first (native/cpu.py).
    native_args: Any = None

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def causal(cls, block_tables: torch.Tensor, seq_index: torch.Tensor,
               positions: torch.Tensor, block_size: int, sliding_window: int | None = None,
               max_len: int | None = None) -> BatchMeta:
        """Every token sees its sequence's positions up to its own (prefill and decode),
        the last `sliding_window` of them with a window (Mistral semantics). max_len
        defaults to max(positions) + 1, a host read (the engine passes it)."""
        if max_len is None:
            max_len = int(positions.max()) + 1 if positions.numel() else 1
        visible = positions + 1
        return cls(slot_mapping(block_tables, seq_index, positions, block_size), seq_index,
                   block_tables, visible, _window_start(positions, sliding_window), visible,
                   torch.zeros(positions.shape[0], 0, dtype=torch.bool,
                               device=positions.device), max_len)

    @classmethod
    def cat(cls, metas: list[BatchMeta]) -> BatchMeta:
        """Pieces of one forward side by side (they share one block_tables tensor)."""
        if len(metas) == 1:
            return metas[0]
        spans, base = [], 0
        for m in metas:
            spans = None if m.spans is None or spans is None else \
                spans + [(a + base, b + base, r, L) for a, b, r, L in m.spans]
            base += m.num_tokens
        T = max(m.tree_mask.shape[1] for m in metas)
        masks = [torch.nn.functional.pad(m.tree_mask, (0, T - m.tree_mask.shape[1]))
                 for m in metas]
        return cls(*(torch.cat([getattr(m, f) for m in metas])
                     for f in ("slots", "seq_index")), metas[0].block_tables,
                   *(torch.cat([getattr(m, f) for m in metas])
                     for f in ("visible", "window_start", "tree_start")),
                   torch.cat(masks), max(m.max_len for m in metas), spans=spans)

    def dense_mask(self, rows: slice = slice(None), keys: int | None = None) -> torch.Tensor:
        """[n, keys] bool: which of the first `keys` (default max_len) positions of its
        sequence each token of `rows` sees (the reference's mask)."""
        L = self.max_len if keys is None else keys
        key = torch.arange(L, device=self.slots.device)[None, :]  # [1, L]
        vis, ws = self.visible[rows, None], self.window_start[rows, None]
        seen = (key < vis) & (key >= ws)
        T = self.tree_mask.shape[1]
        if T == 0:
            return seen
        rel = key - self.tree_start[rows, None]  # [n, L]
        in_tree = (rel >= 0) & (rel < T)
        return seen | (in_tree & self.tree_mask[rows].gather(1, rel.clamp(0, T - 1)))


def _window_start(positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    if sliding_window is None:
        return torch.zeros_like(positions)
    return (positions - sliding_window + 1).clamp_min(0)


def tree_meta(block_tables: torch.Tensor, prefix_len: torch.Tensor, ancestors: torch.Tensor,
              block_size: int, *, rows: torch.Tensor | None = None,
              query_slots: torch.Tensor | None = None, rope: torch.Tensor | None = None,
              sliding_window: int | None = None, max_len: int | None = None) -> BatchMeta:
    """The BatchMeta of S trees, Q query tokens each, flattened tree by tree (S * Q tokens):
    verify trees (Q = T = N nodes) or one draft step of tree expansion (Q beams over the
    T tree slots written so far).

    Tree s hangs after a committed prefix of prefix_len[s] tokens of block_tables row
    rows[s] (default s). Its query q writes its K/V at cache position prefix_len[s] +
    query_slots[q] (default q; a verify's accepted path is moved into place later by the
    commit) and sees the whole prefix plus the tree slots t with ancestors[s, q, t]
    (DraftTree.ancestor_mask for a verify: [s, i, j] = j is i or an ancestor). rope [S, Q]:
    the queries' rope positions, needed only to apply a sliding window to the prefix.
    max_len defaults to max(prefix_len) + T, a host read (the engine passes it)."""
    S, Q, T = ancestors.shape
    dev = prefix_len.device
    rows = torch.arange(S, device=dev) if rows is None else rows
    query_slots = torch.arange(Q, device=dev) if query_slots is None else query_slots
    seq = rows.repeat_interleave(Q)  # [S * Q]
    start = prefix_len.repeat_interleave(Q)  # [S * Q]
    cache_pos = start + query_slots.repeat(S)
    if max_len is None:
        max_len = int(prefix_len.max()) + T if S else 1
    win = (torch.zeros_like(start) if rope is None or sliding_window is None
           else _window_start(rope.reshape(-1), sliding_window))
    return BatchMeta(slot_mapping(block_tables, seq, cache_pos, block_size), seq,
                     block_tables, start, win, start, ancestors.reshape(S * Q, T), max_len)


def chain_meta(block_tables: torch.Tensor, prefix_len: torch.Tensor, nodes: int,
               block_size: int, *, rows: torch.Tensor | None = None,
               sliding_window: int | None = None, max_len: int | None = None) -> BatchMeta:
    """tree_meta of S chains of `nodes` nodes (each node's ancestors are the nodes before
    it) in the causal form: node q of chain s sits at position prefix_len[s] + q and sees
    every position up to its own, the keys a chain's ancestor mask gives it, with no mask
    to read. The attention then takes its causal path: on the H200 an 8-node verify right
    after a decoder layer's linears took 14.7 us this way against 28.0 us through the mask
    (benchmarks/paged_attention.py --between; alone, 12.4 against 14.8)."""
    S = prefix_len.shape[0]
    dev = prefix_len.device
    rows = torch.arange(S, device=dev) if rows is None else rows
    positions = (prefix_len[:, None] + torch.arange(nodes, device=dev)).reshape(-1)
    if max_len is None:
        max_len = int(prefix_len.max()) + nodes if S else 1
    return BatchMeta.causal(block_tables, rows.repeat_interleave(nodes), positions,
                            block_size, sliding_window, max_len=max_len)


def chain_meta_host(block_tables: torch.Tensor, tables: list[list[int]], rows: list[int],
                    prefix_len: list[int], nodes: int, block_size: int,
                    sliding_window: int | None, max_len: int
                    ) -> tuple[BatchMeta, torch.Tensor]:
    """chain_meta from host lists, with the chains' positions [S * nodes]: chain s is at
    row rows[s] of block_tables (its blocks tables[s], a host list) after prefix_len[s]
    positions. The same fields as chain_meta's, computed on the host and uploaded at once
    (a verify's few nodes: a dozen small device ops otherwise)."""
    pos = [n + j for n in prefix_len for j in range(nodes)]
    seq = [r for r in rows for _ in range(nodes)]
    owner = [t for t in tables for _ in range(nodes)]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, p in zip(owner, pos, strict=True)]
    visible = [p + 1 for p in pos]
    start = [0] * len(pos) if sliding_window is None else \
        [max(p - sliding_window + 1, 0) for p in pos]
    N, dev = len(pos), block_tables.device
    f = upload(slots + seq + visible + start + pos, torch.long, dev).view(5, N)
    meta = BatchMeta(f[0], f[1], block_tables, f[2], f[3], f[2],
                     torch.zeros(N, 0, dtype=torch.bool, device=dev), max_len)
    return meta, f[4]


def accepted_path_slots(block_tables: torch.Tensor, prefix_len: torch.Tensor,
                        path: torch.Tensor, block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) slots [B * (D + 1)] that move each sequence's accepted tree path into
    place with one PagedKV.commit: node path[b, k], verified at position prefix_len[b] +
    path[b, k], goes to position prefix_len[b] + k. path [B, D + 1] (verify_greedy_batch's,
    -1 past the accepted nodes): those rows copy a slot onto itself, so the shapes stay
    static and nothing is read back to the host."""
    B, D1 = path.shape
    k = torch.arange(D1, device=path.device)[None].expand(B, D1)
    node = torch.where(path >= 0, path, k)
    seq = torch.arange(B, device=path.device)[:, None].expand(B, D1).reshape(-1)
    src = slot_mapping(block_tables, seq, (prefix_len[:, None] + node).reshape(-1), block_size)
    dst = slot_mapping(block_tables, seq, (prefix_len[:, None] + k).reshape(-1), block_size)
    return src, dst


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: BatchMeta, scale: float) -> torch.Tensor:
    """One layer's attention step for a flattened batch: write this step's K/V at
    meta.slots, then attend over the paged cache (the Triton kernels on CUDA, else the
    torch reference).

    q [N, H, D], k/v [N, Hkv, D] (token-major, any strides); k_cache/v_cache one layer's
    blocks [num_blocks, block_size, Hkv, D]. Returns [N, H * D]."""
    fast = _fast_backend() if q.is_cuda else None
    if fast is not None:
        return _fast_attend(fast, q, k, v, k_cache, v_cache, meta, scale)
    _write(k, v, k_cache, v_cache, meta.slots)
    return attention_reference(q, k_cache, v_cache, meta, scale)


# Both run outside torch.compile's graphs. The write: traced, an in-place write into the
# cache (a graph input) is functionalised into a copy of the whole layer's cache per step.
# The kernels: their launch wrapper plans tiles and splits on the host, which dynamo does
# not trace. CUDA graphs still capture both.
@torch.compiler.disable
def _write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: torch.Tensor) -> None:
    """k, v [N, Hkv, D] into the cache's slots (cast to its dtype where they differ)."""
    kf, vf = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    kf.index_copy_(0, slots, k if k.dtype == kf.dtype else k.to(kf.dtype))
    vf.index_copy_(0, slots, v if v.dtype == vf.dtype else v.to(vf.dtype))


@torch.compiler.disable
def _fast_attend(fast, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                 scale: float) -> torch.Tensor:
    _write(k, v, k_cache, v_cache, meta.slots)
    return fast(q, k_cache, v_cache, meta, scale, tiles=meta.tiles)


def paged_attend_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                     scale: float, num_heads: int, num_kv_heads: int,
                     norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                     eps: float = 0.0) -> torch.Tensor | None:
    """paged_attend from the fused q/k/v projection's rows qkv [N, (H + 2 Hkv) D]: per-head
    norms (`norms`: q_norm and k_norm weights), rotary by cos/sin [N, D] and the KV write
    in one kernel (kvcache/rope_write_triton.py), then the attention kernel. Returns
    [N, H * D], or None where this path does not apply (not CUDA, no Triton, a head dim
    whose half is not a power of two, a cache in another dtype): the caller then runs
    the reference (project, paged_attend)."""
    D = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    if not qkv.is_cuda:
        return _native_attend_qkv(qkv, cos, sin, k_cache, v_cache, meta, scale, num_heads,
                                  num_kv_heads, norms, eps, D)
    fast, fused = _fast_backend(), _rope_write_backend()
    if fast is None or fused is None or D & (D - 1) or D < 4 or k_cache.dtype != qkv.dtype:
        return None
    q = _rope_write(fused, qkv.contiguous(), cos.contiguous(), sin.contiguous(), meta.slots,
                    k_cache, v_cache, num_heads, num_kv_heads, norms, eps)
    return fast(q, k_cache, v_cache, meta, scale, tiles=meta.tiles)


def _native_attend_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                       scale: float, num_heads: int, num_kv_heads: int,
                       norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float, D: int
                       ) -> torch.Tensor | None:
    """paged_attend_qkv on the CPU: the native kernel (specscope/native) where it applies,
    else None (the caller runs the reference)."""
    native = cpu_kernels_for(qkv)
    if native is None or not native.attend_applies(qkv, k_cache, v_cache, cos, D, norms):
        return None
    return native.attend_qkv(qkv, cos, sin, k_cache, v_cache, meta, scale, num_heads,
                             num_kv_heads, norms, eps)


@torch.compiler.disable
def _rope_write(fused, *args) -> torch.Tensor:
    return fused(*args)


@cache
def _rope_write_backend():
    try:
        from specscope.kvcache.rope_write_triton import rope_write
    except ImportError:
        return None
    return rope_write


def fast_backend_available() -> bool:
    return _fast_backend() is not None


def long_tiles_available(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fast backend runs prefill chunks in its long tiles here
    (triton_attention.long_tiles_fit); False off CUDA or without it."""
    if device.type != "cuda" or _fast_backend() is None:
        return False
    from specscope.kvcache.triton_attention import long_tiles_fit

    return long_tiles_fit(head_dim, dtype, device)


@cache
def _fast_backend():
    """The Triton paged-attention kernels (kvcache/triton_attention.py) when Triton is
    installed (CUDA); None otherwise, and the torch reference runs."""
    try:
        from specscope.kvcache.triton_attention import paged_attention
    except ImportError as e:  # asked for on CUDA only: say once what is missing
        logging.getLogger("specscope").warning(
            "paged attention on CUDA runs the slow torch reference: %s; install the kernels' "
            "dependency with pip install 'specscope[cuda]'", e)
        return None
    return paged_attention


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: BatchMeta, scale: float) -> torch.Tensor:
    """Attention of a flattened ragged batch over one layer's paged K/V, the torch reference
    (and the CPU's path).

    q [N, H, D]: N query tokens of B sequences; k_cache [num_blocks, block_size, Hkv, D],
    v_cache [..., Dv] (Dv may differ from D: MLA's values are the latent part of its keys).
    Gathers each sequence's K/V into a contiguous copy (what a fast backend must not do):
    once per piece with meta.spans, one SDPA each with the GQA heads folded into the query
    axis; else per token. On the CPU a piece whose blocks are consecutive reads them as a
    view, and one that sees all its keys (a decode token) needs no mask. Returns
    [N, H * Dv]."""
    if meta.spans is None:
        return _attention_per_token(q, k_cache, v_cache, meta, scale)
    N, H, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[-1]
    G, bs = H // Hkv, k_cache.shape[1]
    if meta.span_masks is None:
        _prepare_spans(meta, G, bs)
    whole = len(meta.spans) == 1 and meta.spans[0][1] - meta.spans[0][0] == N
    cuda = q.is_cuda
    out = None if whole else torch.empty(N, H * Dv, dtype=q.dtype, device=q.device)
    flat = None
    for (a, b, _, L), m, blocks in zip(meta.spans, meta.span_masks, meta.span_blocks,
                                       strict=True):
        n = b - a
        if isinstance(blocks, int):  # consecutive blocks from `blocks`: a view
            if flat is None:
                flat = k_cache.view(-1, Hkv, k_cache.shape[-1]), v_cache.view(-1, Hkv, Dv)
            k, v = (c.narrow(0, blocks * bs, L).transpose(0, 1) for c in flat)  # [Hkv, L, D]
        else:
            k, v = (c.index_select(0, blocks).flatten(0, 1)[:L].transpose(0, 1)
                    for c in (k_cache, v_cache))
        qs = q if whole else q[a:b]
        one = n == 1 and not cuda
        # Rows g * n + t of each KV head's group (one token: the heads as they lie).
        qf = qs.reshape(Hkv, G, D) if one else qs.transpose(0, 1).reshape(Hkv, G * n, D)
        if cuda:  # 4-D, as SDPA's fused CUDA kernels take it (3-D falls back to the math path)
            o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=m,
                                               scale=scale)
        else:
            o = _cpu_attention(qf, k, v, m, scale)
        o = o.reshape(1, H * Dv) if one else \
            o.reshape(H, n, Dv).transpose(0, 1).reshape(n, H * Dv)
        if whole:  # one piece is the whole batch (batch-1 steps): its rows are the output
            return o
        out[a:b] = o
    return out


def _cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention on the CPU as two batched products with the scores in fp32: q [Hkv,
    R, D] over k, v [Hkv, L, D] (any strides), mask [1, R, L] or None -> [Hkv, R, Dv] in q's
    dtype. SDPA's CPU kernels, which compute in fp32 too, took 1.1-1.7x as long for the
    default model's decode and verify rows, bf16 or fp32, on AVX-512 and AVX2 alike
    (benchmarks/cpu_kernels.py --attention; docs/cpu.md)."""
    scores = torch.bmm(q.float(), k.float().transpose(1, 2)).mul_(scale)  # [Hkv, R, L]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.bmm(scores.softmax(-1), v.float()).to(q.dtype)


def _prepare_spans(meta: BatchMeta, G: int, bs: int) -> None:
    """meta's per-span masks and block selections, once per forward. The shortcuts (no
    mask, a view of consecutive blocks) read the mask and the block table, host reads that
    cost nothing on the CPU and would synchronise a GPU: there every span keeps its mask
    and gathers."""
    cpu = meta.block_tables.device.type == "cpu"
    masks, blocks = [], []
    for a, b, r, L in meta.spans:
        m = meta.dense_mask(slice(a, b), L)
        masks.append(None if cpu and bool(m.all()) else
                     m[None].expand(G, b - a, L).reshape(1, G * (b - a), L))
        row = meta.block_tables[r, :-(-L // bs)]
        first = int(row[0]) if cpu and row.numel() else -1
        consecutive = first >= 0 and bool((row == torch.arange(first, first + row.numel()))
                                          .all())
        blocks.append(first if consecutive else row)
    meta.span_masks, meta.span_blocks = masks, blocks


def _attention_per_token(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: BatchMeta, scale: float) -> torch.Tensor:
    N, H, D = q.shape
    bs = k_cache.shape[1]
    L = meta.max_len
    nb = -(-L // bs)
    k = k_cache[meta.block_tables[:, :nb]].flatten(1, 2)[:, :L]  # [B, L, Hkv, D]
    v = v_cache[meta.block_tables[:, :nb]].flatten(1, 2)[:, :L]
    k, v = k[meta.seq_index], v[meta.seq_index]  # [N, L, Hkv, D]
    G = H // k.shape[2]
    qg = q.reshape(N, k.shape[2], G, D)
    s = torch.einsum("nhgd,nlhd->nhgl", qg, k).float() * scale
    s = s.masked_fill(~meta.dense_mask()[:, None, None, :], float("-inf"))
    p = s.softmax(-1).to(q.dtype)
    out = torch.einsum("nhgl,nlhd->nhgd", p, v)  # [N, Hkv, G, Dv]
    return out.reshape(N, -1)
