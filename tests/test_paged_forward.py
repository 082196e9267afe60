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
