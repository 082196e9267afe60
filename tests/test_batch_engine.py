"""The batched engine loop (plain decoding): many sequences per step over the paged KV cache,
token for token what each gives alone, through chunked prefill, staggered arrivals,
preemption and prefix-cache hits, with every block back in the pool at the end."""

from __future__ import annotations

import random

import pytest
import torch
from reference import solo_greedy

from specscope.config import ModelConfig, SamplingParams
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.loader import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=90,
                   hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False, name="tiny")


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, torch.float32, "cpu", seed=0)


@torch.inference_mode()
@torch.inference_mode()
def _run(engine, arrivals):
    """arrivals: (step, Sequence). Steps until all finish; returns the steps' plans' sizes."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        engine.step()
        step += 1
        assert step < 5000
    return step


def _prompts(n, rng, lo=3, hi=30):
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (64, 8), (9, 16)])
def test_batched_greedy_equals_each_sequence_alone(model, num_blocks, budget):
    """(64, 64): plenty; (64, 8): prompts prefilled in chunks of at most 8 tokens beside the
    decodes; (9, 16): a pool too small for everyone, so sequences are preempted and
    recomputed."""
    rng = random.Random(0)
    prompts = _prompts(7, rng)
    lens = [rng.randrange(1, 15) for _ in prompts]
    engine = Engine(model, BatchConfig(num_blocks=num_blocks, block_size=4,
                                        max_num_batched_tokens=budget, max_num_seqs=4,
                                        max_model_len=64))
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, [(2 * i, s) for i, s in enumerate(seqs)])  # staggered arrivals
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
        assert s.finish_reason == "length"
    assert engine.pool.all_free()
    if num_blocks == 9:
        assert any(s.num_preemptions for s in seqs)


def test_a_shared_prefix_is_not_prefilled_again(model):
    rng = random.Random(1)
    system = [rng.randrange(TINY.vocab_size) for _ in range(17)]
    engine = Engine(model, BatchConfig(num_blocks=32, block_size=4, max_model_len=64))
    a = Sequence("a", system + [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    _run(engine, [(0, a)])
    b = Sequence("b", system + [5], SamplingParams(max_tokens=4, ignore_eos=True))
    _run(engine, [(0, b)])
    assert b.num_cached == 16
    assert b.output_ids == solo_greedy(model, b.prompt_ids, 4)
    assert engine.pool.all_free()
    assert engine.pool.stats().prefix_hits >= 4


def test_greedy_and_seeded_sampling_share_a_batch(model):
    """A sampled sequence's tokens come from its own generator: the same seed gives the same
    tokens whether it runs alone or beside others, and the greedy ones stay exact."""
    rng = random.Random(2)
    prompts = _prompts(4, rng)
    sp = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    gp = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(which):
        engine = Engine(model, BatchConfig(num_blocks=32, block_size=4, max_model_len=64))
        seqs = [Sequence(f"s{i}", prompts[i], sp if i % 2 else gp) for i in which]
        _run(engine, [(0, s) for s in seqs])
        assert engine.pool.all_free()
        return {s.seq_id: s.output_ids for s in seqs}

    together = run(range(4))
    alone = run([1])
    assert together["s1"] == alone["s1"]
    assert together["s0"] == solo_greedy(model, prompts[0], 6)
    assert together["s1"] != together["s3"] or prompts[1] == prompts[3]


def test_stops_at_eos_and_stop_ids(model):
    rng = random.Random(3)
    p = _prompts(1, rng)[0]
    ref = solo_greedy(model, p, 8)
    engine = Engine(model, BatchConfig(num_blocks=16, block_size=4, max_model_len=64),
                    eos_token_ids=frozenset({ref[2]}))
    s = Sequence("e", p, SamplingParams(max_tokens=8))
    _run(engine, [(0, s)])
    assert s.output_ids == ref[:ref.index(ref[2]) + 1] and s.finish_reason == "stop"
    t = Sequence("t", p, SamplingParams(max_tokens=8, stop_token_ids=(ref[4],),
                                        ignore_eos=True))
    _run(engine, [(0, t)])
    assert t.output_ids == ref[:ref.index(ref[4]) + 1] and t.finish_reason == "stop"
    assert engine.pool.all_free()
