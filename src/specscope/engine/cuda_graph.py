"""CUDA-graph capture of the batched engine's plain decode step: one graph per batch-size
bucket, replayed every step.

At small batches a decode step is hundreds of small kernels; launching them one by one from
Python costs more than running them. The step is free of host syncs, and its shapes are
static once the batch is padded to a bucket (1, 2, 4, 8, ...), so it is captured once per
bucket and replayed. Inputs are static buffers the engine fills by host->device copies; the
output logits buffer is overwritten by the next replay, so sample from it before the next
step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specscope.profiler.profiler import BATCH_BUCKETS


def bucket_for(n: int) -> int | None:
    """The smallest batch-size bucket holding n sequences (None past the largest); the
    profiler splits its summaries by the same buckets."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


class BatchGraphs:
    """The batched engine's plain decode step (one token per sequence over the paged KV)
    captured as one CUDA graph per batch-size bucket and replayed.

    Inputs live in static buffers sized for the largest bucket; a step of n < bucket
    sequences pads the rest with rows that write and read only `scratch_block` (a block no
    sequence owns), so the padding never touches real K/V. The logits buffer is overwritten
    by the next replay: sample from it first."""

    def __init__(self, model, kv, block_size: int, max_blocks: int, max_len: int,
                 scratch_block: int, device: torch.device, max_batch: int,
                 plan_tiles: Callable | None = None) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.max_len, self.scratch, self.device = max_len, scratch_block, device
        self.max_batch = bucket_for(max_batch) or BATCH_BUCKETS[-1]
        B = self.max_batch
        self.ids = torch.zeros(B, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, dtype=torch.long, device=device)
        self.tables = torch.full((B, max_blocks), scratch_block, dtype=torch.long,
                                 device=device)
        self.plan_tiles = plan_tiles
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self.pool = None

    def run(self, ids: list[int], pos: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits [n, V] of one decode token per sequence (ids, positions and block tables
        of n sequences, host lists: one host->device copy each)."""
        n = len(ids)
        b = bucket_for(n)
        pad = b - n
        from specscope.kvcache.paged import upload

        self.ids[:b].copy_(upload(ids + [0] * pad, torch.long, self.device))
        self.pos[:b].copy_(upload(pos + [0] * pad, torch.long, self.device))
        W = self.tables.shape[1]
        rows = [t + [self.scratch] * (W - len(t)) for t in tables] + [[self.scratch] * W] * pad
        self.tables[:b].copy_(upload(rows, torch.long, self.device))
        entry = self.graphs.get(b)
        if entry is None:
            entry = self.graphs[b] = self._capture(b)
        entry[0].replay()
        return entry[1][:n]

    def _forward(self, b: int, tiles: object) -> torch.Tensor:
        from specscope.kvcache.paged import BatchMeta

        meta = BatchMeta.causal(self.tables[:b], torch.arange(b, device=self.device),
                                self.pos[:b], self.block_size,
                                self.model.config.sliding_window, max_len=self.max_len)
        meta.tiles = tiles
        hidden, _ = self.model(self.ids[None, :b], self.pos[None, :b], self.kv, batch=meta)
        return self.model.compute_logits(hidden[0])  # [b, V]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
        # The tile plan is built before capture (a host->device copy cannot be captured)
        # and kept alive with the graph that reads it.
        tiles = self.plan_tiles([1] * b) if self.plan_tiles is not None else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles kernels; rewrites this step's K/V
            self._forward(b, tiles)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b, tiles)
        self.pool = graph.pool()
        return graph, out, tiles
