"""Token sampling without host syncs: temperature, top-k, top-p, seeded, greedy fast path.

Sampling from p uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks
i with probability p_i (the same law as torch.multinomial), but it is a pure device op:
no `multinomial` rejection loop, no `.item()`, so a decode step stays capturable and the
engine's single device->host read stays the only one. Filters follow HF/vLLM order:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

import os

import torch

from specscope.config import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator: a given seed always gives the same tokens on a device."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept). [B, V] -> [B, V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches p. [B, V] -> [B, V].

    A token is dropped when the tokens strictly above it already hold mass >= p (they are
    the nucleus without it), so the most likely token always survives.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_above = probs.cumsum(-1) - probs  # [B, V]
    drop_sorted = mass_above >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled, top-k and top-p filtered logits [B, V] (fp32). Not for greedy."""
    x = logits.float() / params.temperature
    x = apply_top_k(x, params.top_k)
    return apply_top_p(x, params.top_p)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row. logits [B, V] -> tokens [B] int64, on the logits' device."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = processed_logits(logits, params).softmax(-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN and argmax favours NaN.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)
