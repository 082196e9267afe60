"""CUDA-graph capture of the batched engine's steady steps, one graph per batch-size bucket:
the plain decode step (with a draft: the draft's extend by the previous token's pair, then
the decode) and the pure speculative step as two segments, draft and verify-and-commit.

At small batches a step is hundreds of small kernels; launching them one by one from Python
costs more than running them. These steps are free of host syncs, and their shapes are
static once the batch is padded to a bucket (1, 2, 4, 8, ...), so each is captured once per
bucket (and speculative configuration) and replayed. Inputs are static buffers the engine
fills by one host->device copy per step; outputs are overwritten by the next replay, so the
engine reads (or copies) them first. Padding rows write and read only a scratch block no
sequence owns. With capture=False the same static-shape functions run eagerly (CPU tests:
what a graph would replay, checked against the ragged eager step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specscope.engine.draft_runner import draft_slots
from specscope.kvcache.paged import LONG_KEY_BOUND, BatchMeta, upload, with_pieces
from specscope.profiler.profiler import BATCH_BUCKETS


def bucket_for(n: int) -> int | None:
    """The smallest batch-size bucket holding n sequences (None past the largest); the
    profiler splits its summaries by the same buckets."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


class Capturer:
    """Captures functions of static buffers as CUDA graphs sharing one memory pool (or, with
    capture=False, runs them eagerly every time)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device, self.capture = device, capture
        self.pool = None
        # Attention tile plans by piece lengths: the warm-up run builds them (a capture
        # cannot upload), the capture and later replays reuse them.
        self.plans: dict = {}

    def graph(self, fn: Callable[[], object]) -> tuple[Callable[[], None], list]:
        """(replay, [outputs]) of fn, not yet run for this step: call replay. Capturing, a
        warm-up runs fn once first (compiling kernels, building plans, making this step's
        own writes, which the replay repeats: every captured step rewrites what it reads
        before it commits, so running it twice is running it once)."""
        if not self.capture:
            box = [None]

            def rerun() -> None:
                box[0] = fn()
            return rerun, box
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn()
        self.pool = g.pool()
        return g.replay, [out]


def _rows(tables: list[list[int]], b: int, fill: int, least: int) -> tuple[list[int], int]:
    """Block tables of n <= b sequences as b rows (padding rows all `fill`), as wide as the
    widest (at least `least` columns): columns past it keep whatever an earlier step left,
    which no real row reads (a sequence only sees positions it holds blocks for) and no
    padding row reads or writes (its positions stay below `least` blocks)."""
    w = max([len(t) for t in tables] + [least])
    flat = []
    for t in tables:
        flat += t + [fill] * (w - len(t))
    return flat + [fill] * (w * (b - len(tables))), w


def key_windows(max_len: int) -> tuple[int, ...]:
    """The key bounds plain decode graphs are captured for, shortest first: a step takes the
    smallest holding its longest context. The attention kernel cuts a long bound's keys into
    more chunks (kvcache/triton_attention.py _num_splits), which a short context under that
    bound's graph would pay for without using them."""
    return (LONG_KEY_BOUND, max_len) if max_len > LONG_KEY_BOUND else (max_len,)


class BatchGraphs:
    """The plain decode step (one token per sequence over the paged KV) captured per
    batch-size bucket and key window (key_windows). With a draft (`extend`), the step first
    extends the draft by each sequence's one pending pair (the previous position's taps, the
    token being decoded), so the draft stays current for a later speculative step, and it
    returns the decode's taps.
    """

    def __init__(self, model, kv, block_size: int, max_blocks: int, max_len: int,
                 scratch_block: int, device: torch.device, max_batch: int,
                 extend: Callable | None = None, tap_width: int = 0,
                 draft_scratch: int = 0, capture: bool = True) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.scratch, self.device = scratch_block, device
        self.extend, self.draft_scratch = extend, draft_scratch
        self.max_batch = bucket_for(max_batch) or BATCH_BUCKETS[-1]
        B = self.max_batch
        self.ids = torch.zeros(B, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, dtype=torch.long, device=device)
        self.tables = torch.full((B, max_blocks), scratch_block, dtype=torch.long,
                                 device=device)
        self.dtables = torch.full((B, max_blocks), draft_scratch, dtype=torch.long,
                                  device=device)
        self.taps = torch.zeros(B, tap_width, dtype=model.dtype, device=device)
        self.cap = Capturer(device, capture)
        self.graphs: dict[tuple[int, int], tuple[Callable, list]] = {}
        self.windows = key_windows(max_len)

    def run(self, ids: list[int], pos: list[int], tables: list[list[int]],
            dtables: list[list[int]] | None = None, taps: list[torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n, V], taps [n, n_taps] or None) of one decode token per sequence: ids,
        positions and block tables of n sequences (host lists, one host->device copy), and
        with a draft its block tables and each sequence's pending taps [1, n_taps]."""
        n = len(ids)
        b = bucket_for(n)
        pad = b - n
        t, wt = _rows(tables, b, self.scratch, 1)
        flat = ids + [0] * pad + pos + [0] * pad + t
        if self.extend is not None:
            d, wd = _rows(dtables, b, self.draft_scratch, 1)
            flat += d
        dev = upload(flat, torch.long, self.device)
        self.ids[:b].copy_(dev[:b])
        self.pos[:b].copy_(dev[b:2 * b])
        self.tables[:b, :wt].copy_(dev[2 * b:2 * b + b * wt].view(b, wt))
        if self.extend is not None:
            self.dtables[:b, :wd].copy_(dev[2 * b + b * wt:].view(b, wd))
            self.taps[:n].copy_(torch.cat(taps))
        window = next(w for w in self.windows if w > max(pos))
        entry = self.graphs.get((b, window))
        if entry is None:
            entry = self.graphs[b, window] = self.cap.graph(lambda: self._forward(b, window))
        entry[0]()
        logits, out_taps = entry[1][0]
        return logits[:n], None if out_taps is None else out_taps[:n]

    def _forward(self, b: int, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step of bucket b over keys [0, window) (every position below window)."""
        if self.extend is not None:
            ones = torch.ones(b, dtype=torch.long, device=self.device)
            self.extend(self.ids[:b, None], (self.pos[:b] - 1).clamp_min(0)[:, None], ones,
                        self.taps[:b], self.dtables[:b], window, self.cap.plans,
                        heads=False)
        meta = BatchMeta.causal(self.tables[:b], torch.arange(b, device=self.device),
                                self.pos[:b], self.block_size,
                                self.model.config.sliding_window, max_len=window)
        meta = with_pieces(meta, [(1, s, window) for s in range(b)],
                           *self.model.local_heads, self.device, self.cap.plans)
        hidden, taps = self.model(self.ids[None, :b], self.pos[None, :b], self.kv, batch=meta,
                                  return_taps=self.extend is not None)
        return self.model.compute_logits(hidden[0]), None if taps is None else taps[0]


@dataclass
class _SpecEntry:
    """One (configuration, bucket)'s static inputs and its two captured segments."""

    ids: torch.Tensor  # [b, W] the tokens after the pending pairs' positions
    pos: torch.Tensor  # [b, W] the pairs' draft positions
    count: torch.Tensor  # [b] pending pairs per row
    n: torch.Tensor  # [b] committed target length (the root's position)
    root: torch.Tensor  # [b]
    dtables: torch.Tensor  # [b, blocks] draft pool
    tables: torch.Tensor  # [b, blocks] target pool
    taps: torch.Tensor  # [b * W, n_taps]
    u: torch.Tensor | None  # [b, k, C] simulated acceptance's uniforms
    pad_blocks: int  # blocks a padding row's positions reach (its table's all-scratch part)
    segments: list = field(default_factory=list)  # [(replay, outputs)] draft, verify


class SpecGraphs:
    """The pure speculative step (every scheduled sequence speculating, greedy, with at most
    num_steps + 1 pending draft pairs) as two CUDA graphs per (configuration, bucket): the
    draft segment (engine._draft_static: the extend at a fixed width, then the draft steps)
    and the verify segment (engine._verify_static: the target's tree forward, the verdicts,
    the commit, the path's taps). The engine times each as one profiler phase."""

    def __init__(self, draft_fn: Callable, verify_fn: Callable, block_size: int,
                 max_blocks: int, max_len: int,
                 scratch: int, draft_scratch: int, tap_width: int, dtype: torch.dtype,
                 device: torch.device, max_batch: int, capture: bool = True) -> None:
        self.draft_fn, self.verify_fn = draft_fn, verify_fn
        self.block_size, self.max_blocks, self.max_len = block_size, max_blocks, max_len
        self.scratch, self.draft_scratch = scratch, draft_scratch
        self.tap_width, self.dtype, self.device = tap_width, dtype, device
        self.max_batch = bucket_for(max_batch) or BATCH_BUCKETS[-1]
        self.cap = Capturer(device, capture)
        self.entries: dict[tuple, _SpecEntry] = {}
        self.current: _SpecEntry | None = None

    def entry(self, spec, n: int, simulated: bool) -> _SpecEntry:
        """The static buffers of configuration `spec` at n sequences' bucket (made once)."""
        b = bucket_for(n)
        key = (spec, b)
        e = self.entries.get(key)
        if e is None:
            W, dev, long = spec.num_steps + 1, self.device, torch.long
            cols = spec.topk if spec.simulate_sibling > 0 and spec.topk > 1 else 1
            e = self.entries[key] = _SpecEntry(
                torch.zeros(b, W, dtype=long, device=dev),
                torch.zeros(b, W, dtype=long, device=dev),
                torch.ones(b, dtype=long, device=dev), torch.zeros(b, dtype=long, device=dev),
                torch.zeros(b, dtype=long, device=dev),
                torch.full((b, self.max_blocks), self.draft_scratch, dtype=long, device=dev),
                torch.full((b, self.max_blocks), self.scratch, dtype=long, device=dev),
                torch.zeros(b * W, self.tap_width, dtype=self.dtype, device=dev),
                torch.ones(b, spec.num_steps, cols, device=dev) if simulated else None,
                -(-max(W, spec.num_draft_tokens, draft_slots(spec)) // self.block_size))
        self.current = e
        return e

    def load(self, e: _SpecEntry, seqs: list, taps: list[torch.Tensor],
             u: torch.Tensor | None) -> None:
        """Fill e's inputs for these sequences (one host->device copy of every int; the
        pending taps in one gather)."""
        b, W = e.ids.shape
        S, L = len(seqs), self.max_len
        ids, pos, count, n, root, dest = [], [], [], [], [], []
        for s, (seq, t) in enumerate(zip(seqs, taps, strict=True)):
            dc, P = seq.draft_computed, t.shape[0]
            ids += seq.tokens(dc + 1, dc + 1 + P) + [0] * (W - P)
            pos += [min(dc + i, L - 1) for i in range(W)]
            count.append(P)
            n.append(seq.num_computed)
            root.append(seq.last_token)
            dest += range(s * W, s * W + P)
        pad = b - S
        # Padding rows: one pair at position 0 of an all-scratch table; their trees too
        # stay within the first pad_blocks blocks, all scratch.
        ids += [0] * (W * pad)
        pos += list(range(W)) * pad
        count += [1] * pad
        n += [0] * pad
        root += [0] * pad
        dt, wd = _rows([q.block_tables[1] for q in seqs], b, self.draft_scratch, e.pad_blocks)
        tt, wt = _rows([q.block_tables[0] for q in seqs], b, self.scratch, e.pad_blocks)
        flat = upload(ids + pos + count + n + root + dt + tt + dest, torch.long, self.device)
        o = 0
        for buf, size in ((e.ids, b * W), (e.pos, b * W), (e.count, b), (e.n, b),
                          (e.root, b)):
            buf.view(-1).copy_(flat[o:o + size])
            o += size
        e.dtables[:, :wd].copy_(flat[o:o + b * wd].view(b, wd))
        o += b * wd
        e.tables[:, :wt].copy_(flat[o:o + b * wt].view(b, wt))
        o += b * wt
        e.taps.index_copy_(0, flat[o:], torch.cat(taps))
        if u is not None:
            e.u[:S].copy_(u)

    def draft(self) -> None:
        """Replay the current entry's draft segment (capturing it the first time)."""
        e = self.current
        if not e.segments:
            e.segments.append(self.cap.graph(lambda: self.draft_fn(
                e.ids, e.pos, e.count, e.taps, e.dtables, e.n, e.root, self.cap.plans)))
        e.segments[0][0]()

    def verify(self):
        """Replay the current entry's verify segment; its verdicts (engine._Verdicts of the
        b rows, overwritten by the next replay)."""
        e = self.current
        if len(e.segments) == 1:
            tree = e.segments[0][1]
            e.segments.append(self.cap.graph(lambda: self.verify_fn(
                tree[0], e.n, e.tables, e.u, self.cap.plans)))
        e.segments[1][0]()
        return e.segments[1][1][0]
