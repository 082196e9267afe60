"""The tensor-parallel group: this rank's place in it and every collective a sharded module
runs (torch.distributed underneath: gloo on the CPU, NCCL on GPUs; no layer of our own).

Each collective goes through `TPGroup`, so that the profiler can time it: while profiling
(`timer` set to the engine's Profiler) every all-reduce and all-gather is bracketed by two
marks (CUDA events on the stream on GPUs, perf_counter on the CPU, where gloo's collectives
are synchronous) and attributed to the phase open when it started. Inside a CUDA-graph
capture nothing is recorded: a replayed segment is timed as a whole.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (still there, deprecated); older ones have only it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveTimer(Protocol):
    """What a profiler offers the group (profiler/profiler.py implements it)."""

    def collective_start(self) -> object: ...

    def collective_end(self, start: object, op: str, nbytes: int) -> None: ...


class TPGroup:
    """rank of size ranks; `group` is the torch.distributed process group of the data plane
    (None: the default group)."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} outside a group of {size}")
        self.rank, self.size, self.group = rank, size, group
        self.device = device or torch.device("cpu")
        self.timer: CollectiveTimer | None = None

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size}, device={self.device})"

    def _start(self) -> object | None:
        t = self.timer
        if t is None or (self.device.type == "cuda" and
                         torch.cuda.is_current_stream_capturing()):
            return None
        return t.collective_start()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x (identical bits on every rank)."""
        start = self._start()
        dist.all_reduce(x, group=self.group)
        if start is not None:
            self.timer.collective_end(start, "all_reduce", x.numel() * x.element_size())
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim, in rank order: x [..., C] ->
        [..., size * C]. One gather into a single tensor over dim 0, then a permute."""
        start = self._start()
        x = x.contiguous()
        flat = x.reshape(-1, x.shape[-1])  # [M, C]
        out = flat.new_empty((self.size * flat.shape[0], flat.shape[1]))  # ranks along dim 0
        _all_gather_single(out, flat, group=self.group)
        if start is not None:
            self.timer.collective_end(start, "all_gather", out.numel() * out.element_size())
        out = out.view(self.size, *flat.shape).transpose(0, 1)  # [M, size, C]
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks that fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
