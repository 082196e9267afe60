"""KV storage and the attention op that reads it: the contiguous per-request cache the engine
runs today, and the paged pieces of the batched engine (BlockPool, PagedKV)."""

from specscope.kvcache.attention import attention, causal_mask, write_kv
from specscope.kvcache.block_pool import BlockPool, OutOfBlocks, prefix_hashes
from specscope.kvcache.cache import KVCache
from specscope.kvcache.paged import BatchMeta, PagedKV, attention_reference, slot_mapping

__all__ = ["BatchMeta", "BlockPool", "KVCache", "OutOfBlocks", "PagedKV", "attention",
           "attention_reference", "causal_mask", "prefix_hashes", "slot_mapping", "write_kv"]
