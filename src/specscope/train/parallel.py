"""Data-parallel train-draft: one process per GPU, launched by torchrun.

Each process (a rank) holds the target and a replica of the draft on its own device. A
training step takes `world` consecutive batches of the shared batch order, one per rank; the
draft's gradients are averaged in one flat all-reduce before clipping, so every replica takes
the same optimizer step and the replicas stay equal (checked at every checkpoint and at the
end). Regeneration and self-prompting are sharded the same way: rank r answers conversations
r, r + world, …, into its own resumable file, and every rank then reads all the files back in
the original order, so each sees the same data.

Rank 0 alone logs, evaluates, writes checkpoints and exports. With no torchrun environment
(WORLD_SIZE unset or 1) nothing here does anything, and train-draft runs as one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Rank 0 evaluates and exports while the others wait, and sharded regeneration can leave
# ranks minutes apart; the default collective timeout (10 min for NCCL) is too short for that.
TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the launch."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (set by torchrun; launch "
                         f"train-draft with `torchrun --nproc-per-node N -m specscope.cli "
                         f"train-draft ...`)") from None


def ranks_from_env() -> Ranks:
    """Ranks from torchrun's WORLD_SIZE, RANK and LOCAL_RANK (one process when unset)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"bad torchrun environment: WORLD_SIZE={world}, RANK={rank}, "
                         f"LOCAL_RANK={local}")
    return Ranks(rank, world, local)


def start(ranks: Ranks, device: torch.device) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on the CPU); returns this rank's device."""
    if not ranks.active:
        return device
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {ranks.local_rank} but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible; use "
                             f"--nproc-per-node <= the number of GPUs")
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT,
                                device_id=device if device.type == "cuda" else None)
    return device


def stop(ranks: Ranks) -> None:
    if ranks.active and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ranks: Ranks) -> None:
    if ranks.active:
        dist.barrier()


def shard(n: int, ranks: Ranks) -> list[int]:
    """The indices of n items this rank handles: rank, rank + world, …"""
    return list(range(ranks.rank, n, ranks.world))


def average_gradients(params: list[torch.nn.Parameter], ranks: Ranks) -> None:
    """Replace each parameter's gradient by its mean over the ranks (one flat all-reduce).
    A parameter without a gradient counts as zeros, so every rank sends the same layout."""
    if not ranks.active:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= ranks.world
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
        offset += n


def all_sum(t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """t summed over the ranks, in place (t itself when there is one process)."""
    if ranks.active:
        dist.all_reduce(t)
    return t


def any_rank(flag: bool, ranks: Ranks, device: torch.device) -> bool:
    """True when flag is true on any rank (every rank gets the same answer)."""
    if not ranks.active:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_in_sync(params: list[torch.nn.Parameter], ranks: Ranks) -> None:
    """Raise if any rank's replica differs from rank 0's (they must be bit-identical)."""
    if not ranks.active:
        return
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([1.0 if torch.equal(flat, ref) else 0.0], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if same.item() < 1.0:
        raise RuntimeError("data-parallel train-draft: the draft replicas diverged across "
                           "ranks (a bug: please report it with the command line)")
