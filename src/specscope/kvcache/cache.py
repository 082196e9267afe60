"""A preallocated KV cache: one K and one V buffer per layer, never reallocated mid-request.

Layout per layer: [B, Hkv, S, D]. Slot s of row b holds the key/value of the token whose
position is s: committed tokens are contiguous from 0, so the valid prefix of a row is
[0, length). The engine tracks lengths on the host (it knows how many tokens it fed), so
reading a length never needs a device->host sync.
"""

from __future__ import annotations

import torch


class KVCache:
    """Static K/V buffers for `num_layers` layers, `batch` rows and `capacity` positions."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if capacity < 1 or batch < 1:
            raise ValueError(f"KV cache needs capacity and batch >= 1, got {capacity}, {batch}")
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch = batch
        self.capacity = capacity
        self.num_layers = num_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def fits(self, batch: int, capacity: int, dtype: torch.dtype,
             device: torch.device | str) -> bool:
        """Whether this cache can serve a request of that size (so it can be reused)."""
        k0 = self.k[0]
        return (self.batch == batch and self.capacity >= capacity and k0.dtype == dtype
                and same_device(k0.device, torch.device(device)))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where "cuda" means the current CUDA device (torch says cuda != cuda:0)."""
    def index(d: torch.device) -> int:
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" else 0
    return a.type == b.type and index(a) == index(b)
