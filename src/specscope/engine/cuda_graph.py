"""CUDA-graph capture of the decode step: one graph per KV window, replayed every token.

At batch 1 a decode step is hundreds of small kernels; launching them one by one from
Python costs more than running them. The step is already free of host syncs and has static
shapes within a KV window (runner.py), so it can be captured once per window and replayed.
Inputs are static buffers the caller fills by device copies; the output logits buffer is
overwritten by the next replay, so consume it (sample) before the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specscope.kvcache import KVCache

# (token [B, 1], position [B, 1], kv_len) -> logits [B, V]; eager or torch.compile'd.
StepFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DecodeGraphs:
    def __init__(self, step_fn: StepFn, device: torch.device, batch: int = 1) -> None:
        self.step_fn = step_fn
        self.device = device
        # [B, 1]: B = 1 for the engine; batched generation (train/regenerate.py) uses more.
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graphs: dict = {}  # kv_len or ("greedy", kv_len) -> (graph, output)
        self.pool = None
        self.cache: KVCache | None = None

    def reset(self) -> None:
        """Forget all graphs (they hold the addresses of a cache that is being replaced).
        Their memory pool goes with them: a new capture must not name a pool no graph holds."""
        self.graphs.clear()
        self.pool = None
        self.cache = None

    def _capture(self, cache: KVCache, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        def step() -> torch.Tensor:
            return self.step_fn(self.token, self.position, kv_len)  # [1, V]

        # Warm up on a side stream (lazy inits, autotuning) as capture requires. The warm-up
        # writes this step's own K/V at this step's own slot, which the replay rewrites
        # identically, so it leaves the cache as the eager step would.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        return graph, out

    def run_greedy(self, cache: KVCache, token: torch.Tensor | None,
                   position: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """A whole greedy plain cycle in one replay: step, argmax, and feeding the token and
        position to the next replay, all inside the graph; the host launches one replay and
        reads [1, token]. token/position: the request's first inputs (None afterwards: the
        graph fed itself). -> [2] int64 static buffer."""
        if cache is not self.cache:
            self.reset()
            self.cache = cache
        if token is not None:
            self.token.copy_(token)
            self.position.copy_(position)
        key = ("greedy", kv_len)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture_greedy(kv_len)
        graph, out = entry
        graph.replay()
        return out

    def _capture_greedy(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up the step alone (writes this step's K/V at its own slot, as the replay will);
        # the token/position updates are only captured, never run twice.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step_fn(self.token, self.position, kv_len).argmax(-1)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            tok = self.step_fn(self.token, self.position, kv_len).argmax(-1)  # [1]
            out = torch.cat([torch.ones_like(tok), tok])  # [2]: count, token
            self.token.copy_(tok.view(1, 1))
            self.position.add_(1)
        self.pool = graph.pool()
        return graph, out

    def run(self, cache: KVCache, token: torch.Tensor, position: torch.Tensor,
            kv_len: int) -> torch.Tensor:
        """Replay the step for this KV window (capturing it first if new). -> logits [1, V]."""
        if cache is not self.cache:
            self.reset()
            self.cache = cache
        self.token.copy_(token)
        self.position.copy_(position)
        entry = self.graphs.get(kv_len)
        if entry is None:
            entry = self.graphs[kv_len] = self._capture(cache, kv_len)
        graph, out = entry
        graph.replay()
        return out
