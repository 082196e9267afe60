"""The block pool: fixed-size KV blocks of one model, handed to sequences and shared between
them through the prefix cache.

Host-side bookkeeping only (the K/V tensors are `PagedKV`'s). A block is in one of three
states:

    in use     reference count >= 1: one or more sequences' block tables hold it
    cached     reference count 0, but full and hashed: its K/V are still valid, and a later
               sequence whose prefix hashes the same takes it back instead of recomputing it
    free       reference count 0, no hash

Allocation takes free blocks first, then evicts cached ones, least recently released first
(vLLM's and SGLang's LRU). A full block's hash covers its tokens and, through its parent's
hash, every token before it, so equal hashes mean equal prefixes: a block is only ever
shared between sequences whose whole prefix up to and including it is the same. Hashes are
128-bit BLAKE2b digests, so a collision (which would serve one prompt another's KV) is out
of reach, unlike Python's 64-bit hash of a tuple.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = b"\0" * 16  # the parent hash of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The prefix-cache key of a full block: its tokens, its parent's key (so the whole
    prefix) and `extra` (anything else the K/V depend on, e.g. a LoRA or image id)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """The keys of every full block of a token sequence, in order."""
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


class OutOfBlocks(RuntimeError):
    """The pool cannot supply the blocks asked for (the scheduler preempts, then retries)."""


@dataclass
class PoolStats:
    num_blocks: int
    in_use: int
    cached: int
    free: int
    prefix_queries: int  # blocks looked up in the prefix cache
    prefix_hits: int  # of which found

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots. Block ids are 0 .. num_blocks - 1.

    enable_prefix_caching: full blocks are registered under their hash when a sequence
    fills them (`register`) and kept, after release, until evicted."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
                 ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._queries = self._hits = 0

    # -- allocation ---------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (reference count 1 each), or OutOfBlocks with nothing taken."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise OutOfBlocks(f"{n} KV blocks needed, {self.num_available} available of "
                              f"{self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently released cached block
                b, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block (a sequence finished, was preempted or shrank).
        A block nobody holds becomes cached if it has a hash, free otherwise. Released in
        reverse, so a sequence's tail is evicted before its shared head."""
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} released more often than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each block (a fork, e.g. n > 1 samples of one prompt)."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is not in use; only held blocks can be shared")
            self._ref[b] += 1

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # -- the prefix cache ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (prefix_hashes of a prompt),
        each taken (one more reference; a cached block leaves the LRU). The statistics count
        every block looked at, the first miss included."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        for h in hashes:
            self._queries += 1
            b = self._block_of.get(h)
            if b is None:
                break
            self._hits += 1
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
            out.append(b)
        return out

    def register(self, block: int, h: bytes) -> int:
        """Record that `block` (held, full) holds the prefix with key `h`. If another block
        already holds it (two sequences prefilled the same prefix at once), the existing one
        stays the cache's and `block` stays private. Returns the block the cache keeps."""
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not in use; only held blocks are registered")
        if not self.enable_prefix_caching:
            return block
        kept = self._block_of.get(h)
        if kept is not None:
            return kept
        if block in self._hash_of:
            raise ValueError(f"block {block} is already registered under another prefix")
        self._block_of[h] = block
        self._hash_of[block] = h
        return block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (cached blocks become free); blocks in use are untouched."""
        for b in list(self._cached):
            self._free.append(b)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def stats(self) -> PoolStats:
        in_use = sum(1 for r in self._ref if r > 0)
        return PoolStats(self.num_blocks, in_use, len(self._cached), len(self._free),
                         self._queries, self._hits)

    def all_free(self) -> bool:
        """No block is held by any sequence (the leak check every engine test ends with)."""
        return not any(self._ref)
