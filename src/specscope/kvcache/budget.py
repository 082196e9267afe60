"""How many KV blocks the engine gets: from a fraction of the GPU's memory (vLLM's
`--gpu-memory-utilization`, SGLang's `--mem-fraction-static`) or a byte budget
(`--kv-cache-memory`, the way to size it on a CPU).

On CUDA the pools take what is left of `utilization * total memory` once the weights (all
memory torch holds when sizing) and the activations of the largest step (measured by the
caller with a forward of max_num_batched_tokens tokens, `activation_bytes`) are counted,
as vLLM sizes its cache. The target's and the draft's pools hold the same number of blocks
(every sequence needs both), so a block costs both models' K/V for block_size tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specscope.kvcache.paged import kv_bytes_per_token

GiB = 1 << 30
DEFAULT_CPU_KV_BYTES = 2 * GiB  # when no --kv-cache-memory is given on the CPU


@dataclass(frozen=True)
class KVLayout:
    """One model's K/V shape per token: layers, KV heads, head dim, dtype.

    latent_values: MLA's layout (DeepSeek-V3, Kimi-K2): one tensor per layer, 1 "head" of
    head_dim = kv_lora_rank + rope_dim channels (the compressed latent, then the shared rope
    key), the values its first latent_values (= kv_lora_rank) channels; stored once, so a
    token costs num_layers * head_dim elements, not 2 * heads * head_dim. None: K and V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    latent_values: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.dtype, 1 if self.latent_values is not None else 2)


@dataclass(frozen=True)
class KVBudget:
    """The pools' size and what it buys."""

    num_blocks: int
    block_size: int
    bytes: int  # what the blocks take, both pools
    source: str  # how the budget was set, for the start-up log

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        """The start-up line: how many tokens and full-length sequences fit."""
        full = self.num_tokens / max_model_len
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({self.bytes / GiB:.2f} GiB, {self.source}); "
                f"{full:.1f} sequences of the full context ({max_model_len} tokens) fit")


def bytes_per_block(layouts: list[KVLayout], block_size: int) -> int:
    return block_size * sum(lay.bytes_per_token for lay in layouts)


def kv_budget(layouts: list[KVLayout], block_size: int, device: torch.device, *,
              gpu_memory_utilization: float | None = None,
              kv_cache_memory: int | None = None, activation_bytes: int = 0,
              max_tokens: int | None = None) -> KVBudget:
    """The blocks a budget holds. kv_cache_memory (bytes) wins when given; otherwise on CUDA
    the utilization fraction (default 0.9) of the device's memory minus what torch holds
    now (the weights) and the activations; on the CPU DEFAULT_CPU_KV_BYTES, or less when
    max_tokens (every sequence at full context) needs less."""
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    if kv_cache_memory is not None and kv_cache_memory <= 0:
        raise ValueError(f"--kv-cache-memory must be a positive number of bytes, got "
                         f"{kv_cache_memory}")
    per_block = bytes_per_block(layouts, block_size)
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, f"--kv-cache-memory {kv_cache_memory / GiB:.2f} GiB"
    elif device.type == "cuda":
        util = 0.9 if gpu_memory_utilization is None else gpu_memory_utilization
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        budget = int(util * total) - held - activation_bytes
        source = (f"{util:g} of {total / GiB:.1f} GiB, less {held / GiB:.2f} GiB held and "
                  f"{activation_bytes / GiB:.2f} GiB of activations")
        if budget > free:  # another process holds part of the device
            budget, source = free - activation_bytes, source + f", capped by {free / GiB:.1f} free"
    else:
        budget, source = DEFAULT_CPU_KV_BYTES, "the CPU default; set --kv-cache-memory"
        if max_tokens is not None:
            need = -(-max_tokens // block_size) * per_block
            if need < budget:
                budget, source = need, "every sequence at full context (CPU default)"
    n = budget // per_block
    if n < 1:
        raise ValueError(f"the KV budget ({max(budget, 0) / GiB:.3f} GiB: {source}) holds no "
                         f"block of {block_size} tokens ({per_block} bytes); raise "
                         f"--gpu-memory-utilization or --kv-cache-memory")
    return KVBudget(int(n), block_size, int(n) * per_block, source)


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1e9' or a plain number of bytes -> bytes (for
    --kv-cache-memory)."""
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):].strip()
    try:
        value = float(num) * (units[unit] if unit else 1)
    except (ValueError, KeyError):
        raise ValueError(f"cannot read {text!r} as a size: give bytes, or a number with "
                         f"K/M/G/T (powers of 10) or KiB/MiB/GiB/TiB") from None
    if value <= 0:
        raise ValueError(f"a KV budget must be positive, got {text!r}")
    return int(value)


def activation_bytes(model: Any, engine: Any, dtype: torch.dtype, verify_rows: int = 0) -> int:
    """A bound on one step's activation memory on top of the weights and the KV pools (what
    the pools must leave free): a step of max_num_batched_tokens tokens holds a few
    hidden-sized and two intermediate-sized buffers per token, the sampled rows' fp32 logits
    and probabilities, and the allocator's slack. model: a ModelConfig; engine: an
    EngineConfig. verify_rows: the most tree nodes one verify carries (speculating engines:
    the token budget, Scheduler.max_trees), whose logits a verify computes for every node
    (the lm_head's output, its fp32 copy and probabilities: 3.3 GB for 3,648 nodes of
    Qwen3's 152k vocabulary)."""
    el = torch.empty((), dtype=dtype).element_size()
    tokens, seqs = engine.max_num_batched_tokens, engine.max_num_seqs
    per_token = el * (8 * model.hidden_size + 3 * model.intermediate_size)
    logits = 4 * 3 * model.vocab_size * max(seqs, 64)  # logits, probs, a race buffer
    verify = (el + 8) * model.vocab_size * verify_rows
    return tokens * per_token + max(logits, verify) + 512 * (1 << 20)
