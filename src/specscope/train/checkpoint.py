"""Trainer checkpoints that are whole or absent: never half-written and then loaded.

A checkpoint is a directory `step-NNNNNNNN/` holding `state.pt` and a `COMPLETE` marker. It is
written under a temporary name (`.tmp-...`), fsynced, marked, and only then renamed into
place, so a run killed at any instant leaves either the previous checkpoints or the new one.
Loading ignores directories without the marker and temporary leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Atomically write `state` as root/step-NNNNNNNN; keep the newest `keep` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    _fsync_file(tmp / "state.pt")
    (tmp / COMPLETE).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
    _fsync_file(tmp / COMPLETE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Whole checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / COMPLETE).exists()
             and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def remove_partial(root: Path) -> None:
    """Delete leftovers of interrupted writes (temporary or unmarked directories)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-") or not (p / COMPLETE).exists()):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    if not (path / COMPLETE).exists():
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker); it was "
                         f"interrupted while being written")
    return torch.load(path / "state.pt", map_location=map_location, weights_only=False)
