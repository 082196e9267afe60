"""MLA's latent KV cache in the batched engine (DeepSeek-V3 / Kimi-K2 shapes, tiny): its bytes
per token, the commit on the one-tensor layout, greedy decoding over the paged cache (the
absorbed form) token for token the full recompute (the expanded form) through chunked
prefill, preemption and prefix-cache hits, and greedy speculative decoding with a random
EAGLE-3 draft equal to plain decoding."""

from __future__ import annotations

import random

import pytest
import torch
from reference import solo_greedy

from specscope.config import SamplingParams, SpecConfig
from specscope.draft.eagle3 import random_draft
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.kvcache.budget import kv_budget
from specscope.kvcache.paged import PagedKV
from specscope.models.loader import allocate
from specscope.models.registry import config_from_hf

pytestmark = pytest.mark.usefixtures("single_thread")

# A small vocabulary, so the random draft's guesses are accepted now and then.
V = 16
RAW = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=V, hidden_size=32,
           intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
           v_head_dim=12, qk_nope_head_dim=10, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
           max_position_embeddings=128, routed_scaling_factor=2.5,
           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0})
CFG = config_from_hf(RAW, "tiny-deepseek")


def randomized(cfg, seed: int, std: float = 0.3):
    """Weights with a wide spread (logits far from ties, so greedy is well defined), norms
    near 1, a nonzero correction bias."""
    model = allocate(cfg, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise * std)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return randomized(CFG, seed=0)


@pytest.fixture(scope="module")
def draft(model):
    d = random_draft(CFG, torch.float32, "cpu", seed=1)
    d.attach_target(model)
    return d


def test_cache_bytes_per_token_are_the_latent_and_rope_key():
    m = CFG.mla
    layout = allocate(CFG, torch.bfloat16, "meta").kv_layout(torch.bfloat16)
    per_token = CFG.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2  # bf16
    assert layout.bytes_per_token == per_token == 3 * 24 * 2
    # per-head K and V would be 2 x heads x (nope + rope) per layer: 6x more here, 85x at
    # DeepSeek-V3's 128 heads of 192 against its 512 + 64 (docs/mla.md)
    assert 6 * per_token == 2 * CFG.num_layers * CFG.num_heads * CFG.head_dim * 2
    kv = PagedKV.from_layout(layout, 5, 4, "cpu")
    assert kv.nbytes == 5 * 4 * per_token
    assert kv.v[0].shape == (5, 4, 1, m.kv_lora_rank)
    assert kv.v[0].data_ptr() == kv.k[0].data_ptr()  # values: a view of the entries
    budget = kv_budget([layout], 4, torch.device("cpu"), kv_cache_memory=10_000)
    assert budget.num_blocks == 10_000 // (4 * per_token)


def test_commit_moves_latent_entries_once():
    """An accepted tree path moved into place on the one-tensor layout: overlapping source
    and destination slots (node 2 -> slot 1 while node 1's slot is read) come out right,
    values included (a view would be moved twice if it were committed as a tensor)."""
    kv = PagedKV(2, 2, 4, 1, 6, torch.float32, "cpu", latent_values=4)
    for t in kv.k:
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    before = [t.clone().view(-1, 6) for t in kv.k]
    src, dst = torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2])
    kv.commit(src, dst)
    for t, b in zip(kv.k, before, strict=True):
        flat = t.view(-1, 6)
        assert torch.equal(flat[:3], b[src]) and torch.equal(flat[3:], b[3:])
    assert torch.equal(kv.v[1].reshape(-1, 4)[:3], before[1][src, :4])


def _run(engine, arrivals, record=None):
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        outs = engine.step()
        if record is not None:
            record.extend(outs)
        step += 1
        assert step < 3000
    return step


def _workload(rng, n=5, lo=3, hi=20, out_hi=14):
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
    return prompts, [rng.randrange(1, out_hi) for _ in prompts]


def _seqs(prompts, lens):
    return [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]


@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (64, 7), (9, 16)])
def test_batched_greedy_equals_full_recompute(model, num_blocks, budget):
    """(64, 64): plenty; (64, 7): prefill in chunks of at most 7 tokens beside the decodes;
    (9, 16): too few blocks, so sequences are preempted and recomputed."""
    rng = random.Random(0)
    prompts, lens = _workload(rng, n=6)
    engine = Engine(model, BatchConfig(num_blocks=num_blocks, block_size=4,
                                       max_num_batched_tokens=budget, max_num_seqs=4,
                                       max_model_len=64))
    seqs = _seqs(prompts, lens)
    _run(engine, [(2 * i, s) for i, s in enumerate(seqs)])
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    assert engine.pool.all_free()
    if num_blocks == 9:
        assert any(s.num_preemptions for s in seqs)


def test_prefix_cache_hits_on_the_latent_cache(model):
    rng = random.Random(1)
    system = [rng.randrange(V) for _ in range(17)]
    engine = Engine(model, BatchConfig(num_blocks=32, block_size=4, max_model_len=64))
    for i, tail in enumerate(([1, 2], [5], [3, 3, 3])):
        s = Sequence(f"s{i}", system + tail, SamplingParams(max_tokens=5, ignore_eos=True))
        _run(engine, [(0, s)])
        assert s.output_ids == solo_greedy(model, system + tail, 5)
        assert s.num_cached == (0 if i == 0 else 16)  # 4 full blocks of the shared 17
    assert engine.pool.all_free()


def _spec_engine(model, draft, steps, topk, ndt, num_blocks=64, budget=64):
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt)
    cfg = BatchConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                      max_num_seqs=4, max_model_len=96)
    return Engine(model, cfg, draft=draft, spec=spec)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(1, 1, None), (3, 1, None), (3, 3, 8),
                                                    (4, 2, 7)])
@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (12, 9)])
def test_speculative_greedy_equals_plain(model, draft, steps, topk, ndt, num_blocks, budget):
    """Chains and trees verified over the latent cache, accepted paths committed into
    place; (12, 9): chunked prefill beside the trees and preemption."""
    rng = random.Random(steps * 7 + topk)
    prompts, lens = _workload(rng, out_hi=24)
    engine = _spec_engine(model, draft, steps, topk, ndt, num_blocks, budget)
    seqs, record = _seqs(prompts, lens), []
    _run(engine, [(i, s) for i, s in enumerate(seqs)], record)
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    assert engine.pool.all_free() and engine.draft_pool.all_free()
    assert any(o.accepted is not None for o in record), "nothing speculated"
    if num_blocks == 14:
        assert any(s.num_preemptions for s in seqs)


def test_speculative_prefix_hits_and_graph_steps(model, draft):
    """A shared prompt's blocks come from both pools' caches; the CUDA-graph steps'
    static-shape functions (run eagerly) give the same tokens on the latent cache."""
    rng = random.Random(5)
    system = [rng.randrange(V) for _ in range(17)]
    engine = _spec_engine(model, draft, 3, 2, 5)
    engine._make_graphs(capture=False)
    counts = {"_graph_spec": 0, "_graph_decode": 0}
    for name in counts:
        real = getattr(engine, name)

        def counted(*a, _real=real, _name=name):
            counts[_name] += 1
            return _real(*a)
        setattr(engine, name, counted)
    for i, k in enumerate((3, 6)):
        p = system + [rng.randrange(V) for _ in range(k)]
        s = Sequence(f"s{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
        _run(engine, [(0, s)])
        assert s.output_ids == solo_greedy(model, p, 12)
        assert s.num_cached == (0 if i == 0 else 16)
    assert counts["_graph_spec"] > 0, counts
    assert engine.pool.all_free() and engine.draft_pool.all_free()
