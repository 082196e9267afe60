"""The target over a paged KV cache: a flattened ragged batch (prefill chunks and decode
tokens of several sequences side by side, their blocks scattered over the pool) gives every
token the logits a full forward over its own sequence gives."""

from __future__ import annotations

import pytest
import torch

from specscope.config import ModelConfig
from specscope.kvcache.paged import BatchMeta, PagedKV
from specscope.models.loader import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=90,
                   hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=128, tie_word_embeddings=False, name="tiny")


def _kv(bs: int) -> PagedKV:
    return PagedKV(TINY.num_layers, 16, bs, TINY.num_kv_heads, TINY.head_dim, torch.float32,
                   "cpu")


def _verify_after_prefixes(model, kv, tables, prefixes, trees, bs, max_depth):
    """Write the prefixes' K/V (as earlier steps would have), then verify one tree per
    sequence in one forward. Returns the nodes' logits [S * N, V] and the prefix lengths."""
    from specscope.kvcache.paged import tree_meta

    ids = torch.cat(prefixes)[None]
    seq = torch.cat([torch.full((len(p),), b) for b, p in enumerate(prefixes)])
    pos = torch.cat([torch.arange(len(p)) for p in prefixes])
    model(ids, pos[None], kv, batch=BatchMeta.causal(tables, seq, pos, bs))
    n = torch.tensor([len(p) for p in prefixes])
    meta = tree_meta(tables, n, torch.stack([t.ancestor_mask(max_depth) for t in trees]), bs)
    rope = torch.cat([len(p) + t.depth for p, t in zip(prefixes, trees, strict=True)])
    hidden, _ = model(torch.cat([t.tokens for t in trees])[None], rope[None], kv, batch=meta)
    return model.compute_logits(hidden[0]), n


def _step(model, kv, tables, pieces, bs, window=None):
    """pieces: (seq, tokens, first position). Returns logits per piece."""
    ids = torch.cat([t for _, t, _ in pieces])[None]
    pos = torch.cat([torch.arange(p, p + len(t)) for _, t, p in pieces])
    seq = torch.cat([torch.full((len(t),), b) for b, t, _ in pieces])
    meta = BatchMeta.causal(tables, seq, pos, bs, window)
    hidden, _ = model(ids, pos[None], kv, batch=meta)
    logits = model.compute_logits(hidden[0])
    return logits.split([len(t) for _, t, _ in pieces])


@pytest.mark.parametrize("window", [None, 5])
def test_a_ragged_batch_over_paged_kv_equals_full_forwards(window):
    import dataclasses

    cfg = dataclasses.replace(TINY, sliding_window=window)
    model = random_model(cfg, torch.float32, "cpu", seed=0)
    bs = 4
    kv = PagedKV(cfg.num_layers, 16, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (9, 14, 5)]
    tables = torch.tensor([[7, 2, 12, 0], [3, 15, 9, 1], [10, 5, 4, 8]])
    refs = []
    for s in seqs:
        h, _ = model(s[None], torch.arange(len(s))[None])
        refs.append(model.compute_logits(h[0]))
    # step 1: seq 0 prefills 6, seq 1 its first chunk of 10, seq 2 all 4 but its last token
    out = _step(model, kv, tables, [(0, seqs[0][:6], 0), (1, seqs[1][:10], 0),
                                    (2, seqs[2][:4], 0)], bs, window)
    for got, (b, n) in zip(out, [(0, 6), (1, 10), (2, 4)], strict=True):
        torch.testing.assert_close(got, refs[b][:n], atol=1e-5, rtol=1e-5)
    # step 2: seq 0 the rest of its prompt, seq 1 the rest, seq 2 one decode token
    out = _step(model, kv, tables, [(0, seqs[0][6:], 6), (1, seqs[1][10:], 10),
                                    (2, seqs[2][4:], 4)], bs, window)
    for got, (b, a) in zip(out, [(0, 6), (1, 10), (2, 4)], strict=True):
        torch.testing.assert_close(got, refs[b][a:], atol=1e-5, rtol=1e-5)


def test_a_paged_cache_without_its_batch_is_refused():
    model = random_model(TINY, torch.float32, "cpu", seed=0)
    kv = PagedKV(TINY.num_layers, 4, 4, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs the batch's BatchMeta"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], kv)


def test_verify_trees_over_paged_kv_equal_the_contiguous_tree_forward():
    """Two sequences' draft trees verified side by side over the paged cache give each node
    the logits of the single-request tree forward (a contiguous cache, the ancestor mask)."""
    from specscope.kvcache import KVCache
    from specscope.spec.tree import DraftTree

    model = random_model(TINY, torch.float32, "cpu", seed=0)
    bs = 4
    kv = _kv(bs)
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (7, 10)]
    tables = torch.tensor([[4, 11, 2, 9, 0], [6, 1, 13, 3, 8]])
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    trees = [DraftTree(tokens=torch.randint(0, TINY.vocab_size, (6,), generator=g),
                       parents=parents, depth=depth) for _ in prefixes]
    logits, _ = _verify_after_prefixes(model, kv, tables, prefixes, trees, bs, 2)
    got = logits.split(6)
    for p, t, out in zip(prefixes, trees, got, strict=True):
        cache = KVCache(TINY.num_layers, 1, TINY.num_kv_heads, 32, TINY.head_dim,
                        torch.float32, "cpu")
        model(p[None], torch.arange(len(p))[None], cache, kv_len=len(p))
        L = len(p) + 6
        mask = torch.zeros(1, 6, L, dtype=torch.bool)
        mask[0, :, :len(p)] = True
        mask[0, :, len(p):] = t.ancestor_mask(2)
        h, _ = model(t.tokens[None], (len(p) + t.depth)[None], cache, kv_len=L,
                     slots=(len(p) + torch.arange(6))[None], attn_mask=mask)
        torch.testing.assert_close(out, model.compute_logits(h[0]), atol=1e-5, rtol=1e-5)


def test_verify_accept_commit_then_decode_over_paged_kv():
    """One batched speculative step's K/V bookkeeping end to end: verify two trees (whose
    tokens follow the target's greedy choices on some branches), accept per sequence
    (verify_greedy_batch), move the accepted paths into place (one commit), then decode the
    bonus tokens: the logits equal a full forward over prefix + accepted + bonus."""
    from specscope.kvcache.paged import accepted_path_slots
    from specscope.spec.tree import DraftTree
    from specscope.spec.verify import emitted_tokens_batch, verify_greedy_batch

    model = random_model(TINY, torch.float32, "cpu", seed=3)
    bs, N = 4, 6
    kv = _kv(bs)
    g = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (5, 9)]
    tables = torch.tensor([[9, 3, 14, 1, 7], [0, 12, 5, 10, 2]])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    depth = torch.tensor([0, 1, 1, 2, 2, 3])

    def full_logits(ids):
        h, _ = model(ids[None], torch.arange(len(ids))[None])
        return model.compute_logits(h[0])

    trees = []
    for b, p in enumerate(prefixes):  # node 1 and its child follow the target; node 2 not
        root = torch.randint(0, TINY.vocab_size, (1,), generator=g)
        t1 = full_logits(torch.cat([p, root]))[-1].argmax()
        t3 = full_logits(torch.cat([p, root, t1[None]]))[-1].argmax()
        other = torch.randint(0, TINY.vocab_size, (3,), generator=g)
        tok = torch.stack([root[0], t1, (t1 + 1) % TINY.vocab_size, t3, other[0],
                           other[1] if b == 0 else (t3 + 1) % TINY.vocab_size])
        trees.append(DraftTree(tokens=tok, parents=parents, depth=depth))
    flat, n = _verify_after_prefixes(model, kv, tables, prefixes, trees, bs, 3)
    logits = flat.view(2, N, -1)
    tok = torch.stack([t.tokens for t in trees])
    path, a, bonus = verify_greedy_batch(tok, parents.expand(2, N), depth.expand(2, N),
                                         logits, 3)
    assert a.tolist()[0] >= 2 and a.tolist()[1] >= 2  # both accepted nodes 1 and 3
    kv.commit(*accepted_path_slots(tables, n, path, bs))
    emitted = emitted_tokens_batch(tok, path, a, bonus)
    # decode each sequence's bonus token at its new length
    new_pos = n + a + 1
    dec = BatchMeta.causal(tables, torch.arange(2), new_pos, bs)
    h, _ = model(bonus[None], new_pos[None], kv, batch=dec)
    got = model.compute_logits(h[0])
    for b, p in enumerate(prefixes):
        acc = emitted[b, :int(a[b])]
        ref = full_logits(torch.cat([p, trees[b].tokens[:1], acc, bonus[b:b + 1]]))[-1]
        torch.testing.assert_close(got[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_a_chain_verify_in_causal_form_sees_what_its_ancestor_mask_gives(window):
    """chain_meta (no tree mask: the attention's causal path) against tree_meta with a
    chain's ancestor mask: the same cache slots written and the same attention output,
    with and without a sliding window, for chains hung after different prefixes."""
    from specscope.kvcache.paged import attention_reference, chain_meta, tree_meta

    torch.manual_seed(0)
    bs, nodes, H, Hkv, D = 4, 5, 4, 2, 8
    n = torch.tensor([3, 9, 14])
    tables = torch.randperm(3 * 6).view(3, 6)
    rows = torch.tensor([2, 0, 1])
    chain = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool)).expand(3, nodes, nodes)
    rope = n[:, None] + torch.arange(nodes)
    tree = tree_meta(tables, n, chain, bs, rows=rows, rope=rope, sliding_window=window,
                     max_len=24)
    causal = chain_meta(tables, n, nodes, bs, rows=rows, sliding_window=window, max_len=24)
    assert causal.tree_mask.shape[1] == 0
    assert torch.equal(causal.slots, tree.slots)
    k, v = (torch.randn(18, bs, Hkv, D, dtype=torch.float64) for _ in range(2))
    q = torch.randn(3 * nodes, H, D, dtype=torch.float64)
    torch.testing.assert_close(attention_reference(q, k, v, causal, D ** -0.5),
                               attention_reference(q, k, v, tree, D ** -0.5))


@pytest.mark.parametrize("window", [None, 6])
def test_a_chains_metadata_from_host_lists_equals_chain_meta(window):
    """chain_meta_host (the engine's CPU and eager verify: host lists, one upload) gives
    chain_meta's fields and positions, for chains on rows out of order after different
    prefixes, with and without a sliding window."""
    from specscope.kvcache.paged import chain_meta, chain_meta_host

    bs, nodes = 4, 5
    n = [3, 9, 14]
    tables = torch.randperm(3 * 6, generator=torch.Generator().manual_seed(1)).view(3, 6)
    rows = [2, 0, 1]
    want = chain_meta(tables, torch.tensor(n), nodes, bs, rows=torch.tensor(rows),
                      sliding_window=window, max_len=24)
    got, pos = chain_meta_host(tables, [tables[r].tolist() for r in rows], rows, n, nodes, bs,
                               window, 24)
    for f in ("slots", "seq_index", "visible", "window_start", "tree_start", "tree_mask"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert got.block_tables is tables and got.max_len == want.max_len == 24
    assert torch.equal(pos, (torch.tensor(n)[:, None] + torch.arange(nodes)).reshape(-1))
