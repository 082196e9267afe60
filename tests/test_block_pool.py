"""The block pool (allocation, reference counts, prefix cache with LRU eviction) and the
paged K/V storage (writes, the commit of an accepted path, the reference attention)."""

from __future__ import annotations

import pytest
import torch

from specscope.kvcache.block_pool import BlockPool, OutOfBlocks, block_hash, prefix_hashes
from specscope.kvcache.paged import (
    BatchMeta,
    PagedKV,
    accepted_path_slots,
    attention_reference,
    kv_bytes_per_token,
    slot_mapping,
)


def test_allocate_release_and_reference_counts():
    pool = BlockPool(6, 4, enable_prefix_caching=False)
    a = pool.allocate(4)
    assert sorted(a) == [0, 1, 2, 3] and pool.num_available == 2
    with pytest.raises(OutOfBlocks, match="3 KV blocks needed, 2 available of 6"):
        pool.allocate(3)
    assert pool.num_available == 2  # a refused allocation takes nothing
    pool.share(a[:2])
    pool.release(a)
    assert pool.stats().in_use == 2 and [pool.ref_count(b) for b in a[:2]] == [1, 1]
    pool.release(a[:2])
    assert pool.all_free() and pool.num_available == 6
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])
    with pytest.raises(ValueError, match="only held blocks can be shared"):
        pool.share([a[0]])


def test_a_shared_prefix_is_served_from_the_cache():
    bs = 4
    pool = BlockPool(8, bs)
    system = list(range(100, 108))  # two full blocks of a shared system prompt
    first = system + [1, 2, 3]
    hs = prefix_hashes(first, bs)
    assert len(hs) == 2
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hs, strict=False):
        assert pool.register(b, h) == b
    pool.release(blocks)  # finished: the two full blocks stay cached, the tail is free
    st = pool.stats()
    assert (st.in_use, st.cached, st.free) == (0, 2, 6)
    second = system + [9, 9, 9, 9, 5]
    got = pool.lookup(prefix_hashes(second, bs))
    assert got == blocks[:2]  # the system prompt's blocks, not recomputed
    assert pool.stats().cached == 0 and pool.ref_count(got[0]) == 1
    # a block's key covers its whole prefix: block 2 alone equal is not a hit
    other = [7] * 4 + system[4:]
    assert pool.lookup(prefix_hashes(other, bs)) == []
    assert block_hash(block_hash(b"\0" * 16, [7] * 4), system[4:]) != \
        prefix_hashes(system, bs)[1]
    st = pool.stats()
    assert (st.prefix_queries, st.prefix_hits) == (4, 2)  # 3 looked at, the miss included
    pool.release(got)
    assert pool.all_free()


def test_cached_blocks_are_evicted_least_recently_released_first():
    bs = 2
    pool = BlockPool(4, bs)
    seqs = [[i, i + 1] for i in (10, 20, 30, 40)]
    held = []
    for s in seqs:
        (b,) = pool.allocate(1)
        pool.register(b, prefix_hashes(s, bs)[0])
        held.append(b)
    for b in held:  # released in order: 10's block is the least recent
        pool.release([b])
    assert pool.stats().cached == 4 and pool.stats().free == 0
    new = pool.allocate(2)  # evicts the blocks of 10 and 20
    assert sorted(new) == sorted(held[:2])
    assert pool.lookup(prefix_hashes(seqs[0], bs)) == []
    assert pool.lookup(prefix_hashes(seqs[1], bs)) == []
    assert pool.lookup(prefix_hashes(seqs[2], bs)) == [held[2]]
    pool.release(new + [held[2]])
    assert pool.all_free()


def test_the_first_registration_of_a_prefix_keeps_it():
    pool = BlockPool(4, 2)
    h = prefix_hashes([1, 2], 2)[0]
    a, b = pool.allocate(2)
    assert pool.register(a, h) == a
    assert pool.register(b, h) == a  # a second sequence prefilled the same prefix at once
    pool.release([a, b])
    assert pool.stats().cached == 1 and pool.stats().free == 3
    pool.reset_prefix_cache()
    assert pool.stats().cached == 0 and pool.lookup([h]) == []


def test_prefix_caching_off():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    h = prefix_hashes([1, 2], 2)[0]
    assert pool.register(a, h) == a
    pool.release([a])
    assert pool.stats().cached == 0 and pool.lookup([h]) == []


def test_kv_bytes_per_token():
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token
    assert kv_bytes_per_token(32, 8, 128, torch.bfloat16) == 131072


def _paged(num_blocks=12, bs=4, Hkv=2, D=8, layers=2):
    return PagedKV(layers, num_blocks, bs, Hkv, D, torch.float32, "cpu")


def test_writes_land_where_the_block_table_says():
    kv = _paged()
    tables = torch.tensor([[5, 2, 9], [0, 7, 11]])
    pos = torch.tensor([0, 1, 4, 9, 0, 6])
    seq = torch.tensor([0, 0, 0, 0, 1, 1])
    slots = slot_mapping(tables, seq, pos, 4)
    assert slots.tolist() == [20, 21, 8, 37, 0, 30]
    k = torch.randn(6, 2, 8)
    kv.write(1, k, -k, slots)
    got_k, got_v = kv.gather(1, tables[0], 10)
    torch.testing.assert_close(got_k[[0, 1, 4, 9]], k[:4])
    torch.testing.assert_close(got_v[[0, 1, 4, 9]], -k[:4])
    assert kv.k[0].abs().sum() == 0  # other layers untouched


def test_commit_moves_an_accepted_path_in_every_layer():
    kv = _paged()
    src_k = [torch.randn(4, 2, 8) for _ in range(2)]
    slots = torch.tensor([12, 13, 14, 15])
    for layer in range(2):
        kv.write(layer, src_k[layer], src_k[layer] * 2, slots)
    # tree nodes at slots 12..15; the path (nodes 0, 2, 3) goes to slots 12, 13, 14
    kv.commit(torch.tensor([12, 14, 15]), torch.tensor([12, 13, 14]))
    for layer in range(2):
        k = kv.k[layer].view(-1, 2, 8)
        torch.testing.assert_close(k[12:15], src_k[layer][[0, 2, 3]])
        torch.testing.assert_close(kv.v[layer].view(-1, 2, 8)[12:15],
                                   src_k[layer][[0, 2, 3]] * 2)


def test_reference_attention_equals_dense_causal_attention():
    """Two sequences of different lengths prefilled side by side in one flattened batch,
    their blocks scattered over the pool: each query's output equals causal SDPA over its own
    sequence's contiguous K/V (GQA: 4 heads over 2 KV heads)."""
    torch.manual_seed(0)
    bs, Hkv, H, D = 4, 2, 4, 8
    kv = _paged(num_blocks=10, bs=bs, Hkv=Hkv, D=D, layers=1)
    lens = [7, 10]
    tables = torch.tensor([[3, 8, 0], [9, 1, 5]])
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    N = len(seq)
    q, k, v = torch.randn(N, H, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    kv.write(0, k, v, slot_mapping(tables, seq, pos, bs))
    meta = BatchMeta.causal(tables, seq, pos, bs)
    out = attention_reference(q, kv.k[0], kv.v[0], meta, D ** -0.5)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        qq = q[sl].transpose(0, 1)[None]  # [1, H, n, D]
        kk = k[sl].transpose(0, 1)[None].repeat_interleave(H // Hkv, 1)
        vv = v[sl].transpose(0, 1)[None].repeat_interleave(H // Hkv, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        torch.testing.assert_close(out[sl], ref[0].transpose(0, 1).reshape(n, H * D),
                                   atol=1e-5, rtol=1e-5)
        start += n


def test_accepted_paths_of_several_sequences_move_in_one_commit():
    """Two sequences verified trees of 5 nodes after prefixes of 6 and 3 tokens; their
    accepted paths (nodes 0, 2, 4 and just the root) move to consecutive positions in one
    commit, and nothing else in their blocks changes."""
    bs = 4
    kv = _paged(num_blocks=8, bs=bs, layers=1)
    tables = torch.tensor([[5, 1, 7], [2, 6, 0]])
    prefix = torch.tensor([6, 3])
    k = torch.randn(2, 11, 2, 8)  # positions 0..10 of each sequence
    for b in range(2):
        pos = torch.arange(11)
        kv.write(0, k[b], k[b], slot_mapping(tables, torch.full((11,), b), pos, bs))
    path = torch.tensor([[0, 2, 4, -1], [0, -1, -1, -1]])
    src, dst = accepted_path_slots(tables, prefix, path, bs)
    kv.commit(src, dst)
    got0, _ = kv.gather(0, tables[0], 11)
    torch.testing.assert_close(got0[:6], k[0, :6])  # the prefix is untouched
    torch.testing.assert_close(got0[6:9], k[0, [6, 8, 10]])  # nodes 0, 2, 4 in place
    torch.testing.assert_close(got0[9:], k[0, 9:])  # the rest copied onto itself
    got1, _ = kv.gather(0, tables[1], 11)
    torch.testing.assert_close(got1, k[1])  # only the root accepted: nothing moves
