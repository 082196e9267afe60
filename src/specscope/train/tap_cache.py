"""An optional on-disk cache of what the target computes for each training example.

By default the trainer runs the target online every step (no dumps). With a cache, the first
epoch writes each example's taps and final hidden state (bf16) and later epochs read them
back instead of running the target. One safetensors file per example, written under a
temporary name and renamed, so a killed run never leaves a file that loads half-written.
The directory is keyed by the run's fingerprint: other data or layer ids never hit it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specscope.models.registry import TargetModel
from specscope.train.data import Example, collate
from specscope.train.ttt import TTTBatch

log = logging.getLogger("specscope.train")


class TapCache:
    def __init__(self, root: str | Path, fingerprint: str) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def estimate_bytes(num_tokens: int, num_taps: int, hidden: int) -> int:
        """Bytes the cache will take: (taps + final hidden) x hidden x bf16 per token."""
        return num_tokens * (num_taps + 1) * hidden * 2

    def _path(self, index: int) -> Path:
        return self.dir / f"{index:08d}.safetensors"

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(taps [T, n * Ht], hidden [T, Ht]) of example `index`, or None if not cached."""
        p = self._path(index)
        if not p.exists():
            return None
        t = load_file(str(p))
        return t["taps"], t["hidden"]

    def put(self, index: int, taps: torch.Tensor, hidden: torch.Tensor) -> None:
        p = self._path(index)
        tmp = p.with_name(f".tmp-{p.name}-{os.getpid()}")
        save_file({"taps": taps.to(torch.bfloat16).contiguous().cpu(),
                   "hidden": hidden.to(torch.bfloat16).contiguous().cpu()}, str(tmp))
        os.replace(tmp, p)


def target_batch(target: TargetModel, examples: list[Example], draft_ids: torch.Tensor,
                 device: torch.device, indices: list[int] | None = None,
                 cache: TapCache | None = None) -> TTTBatch:
    """Run the target over a padded batch (or read it from the tap cache): taps, its
    distribution over the draft vocabulary and its greedy token at every position."""
    ids, mask = collate(examples)
    if torch.device(device).type == "cuda":  # pinned, asynchronous: the host need not wait
        ids = ids.pin_memory().to(device, non_blocking=True)
        mask = mask.pin_memory().to(device, non_blocking=True)
    else:
        ids, mask = ids.to(device), mask.to(device)
    B, T = ids.shape
    cached = [cache.get(i) for i in indices] if cache is not None and indices else [None] * B
    if any(c is None for c in cached):
        pos = torch.arange(T, device=device).expand(B, T)
        hidden, taps = target(ids, pos, return_taps=True)  # [B, T, Ht], [B, T, n * Ht]
        if cache is not None and indices:
            for b, (i, c) in enumerate(zip(indices, cached, strict=True)):
                if c is None:
                    n = len(examples[b].ids)
                    cache.put(i, taps[b, :n], hidden[b, :n])
    else:
        w = target.lm_head.weight
        taps = torch.zeros(B, T, cached[0][0].shape[-1], dtype=w.dtype, device=device)
        hidden = torch.zeros(B, T, w.shape[1], dtype=w.dtype, device=device)
        for b, (tp, hd) in enumerate(cached):
            taps[b, :tp.shape[0]] = tp.to(device)
            hidden[b, :hd.shape[0]] = hd.to(device)
    logits = target.compute_logits(hidden)  # [B, T, V] fp32
    top = logits.argmax(-1)
    logp = F.log_softmax(logits[..., draft_ids], dim=-1)  # [B, T, Vd]
    return TTTBatch(input_ids=ids, label_mask=mask, taps=taps, target_logp=logp,
                    target_top=top)
