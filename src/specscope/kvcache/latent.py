"""Attention over MLA's latent cache (DeepSeek-V3, Kimi-K2; docs/mla.md).

In the absorbed form MLA is multi-query attention over one shared "head" per token: the key
is the token's cache entry, its compressed latent (kv_lora_rank channels) then its rope key,
and the value is the latent alone, the entry's first kv_lora_rank channels (a view:
PagedKV's latent layout stores it once). Every query head attends to the same entries, so
the H query heads fold into the query axis exactly as GQA's groups do (G = H, one KV head).

This runs the torch reference (`attention_reference`) on every device. On CUDA too: the
Triton kernels take equal key and value widths (and power-of-two ones), which MLA's 576 / 512
are not, so MLA does not yet have a fast paged kernel; a GPU session measures this path.
"""

from __future__ import annotations

import torch

from specscope.kvcache.paged import BatchMeta, attention_reference


def latent_attend(q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor,
                  values: torch.Tensor, meta: BatchMeta, scale: float) -> torch.Tensor:
    """One layer's absorbed MLA step over a flattened batch: write each token's entry at
    meta.slots, then attend over the paged latent cache.

    q [N, H, Dk] (the absorbed queries: q_nope through kv_b_proj's key half, then q_rope);
    entry [N, Dk] (latent then rope key); cache one layer's blocks [num_blocks, block_size,
    1, Dk]; values its view [..., :Dv]. Returns [N, H, Dv], still in the latent space (the
    caller maps it through kv_b_proj's value half)."""
    _write_entry(entry, cache, meta.slots)
    N, H, _ = q.shape
    return attention_reference(q, cache, values, meta, scale).view(N, H, values.shape[-1])


# Outside torch.compile's graphs, like paged.py's K/V write: traced, an in-place write into
# the cache (a graph input) is functionalised into a copy of the layer's whole cache.
@torch.compiler.disable
def _write_entry(entry: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    flat = cache.view(-1, cache.shape[-1])  # [slots, Dk] (one KV head)
    flat.index_copy_(0, slots, entry.to(flat.dtype))
