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
from safetensors.torch import load_file, save_file

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
