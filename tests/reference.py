"""Reference computations the engine tests compare against (not a test module)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def solo_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by a full forward per token, no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        h, _ = model(torch.tensor(ids)[None], torch.arange(len(ids))[None])
        ids.append(int(model.compute_logits(h[0, -1]).argmax()))
    return ids[len(prompt):]
