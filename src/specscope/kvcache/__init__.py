"""Preallocated KV storage and the attention op that reads it."""

from specscope.kvcache.attention import attention, causal_mask, write_kv
from specscope.kvcache.cache import KVCache

__all__ = ["KVCache", "attention", "causal_mask", "write_kv"]
