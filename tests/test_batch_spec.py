"""The batched speculative cycle: many sequences per step, each drafting its own chain or
tree over the paged draft KV, all verified in one target forward beside plain and prefill
pieces. Greedy output equals each sequence alone, token for token in fp32, through staggered
arrivals, chunked prefill, preemption and prefix-cache hits; every block of both pools is
free at the end."""

from __future__ import annotations

import random

import pytest
import torch
from reference import patch_oracle_drafts, solo_greedy

from specscope.config import ModelConfig, SamplingParams, SpecConfig
from specscope.draft.eagle3 import random_draft
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.loader import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

# A small vocabulary: this random draft's guesses are accepted now and then (0.1 to 0.3
# tokens a cycle), so its own drafting runs through accepts as well as rejections.
V = 16
TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=V,
                   hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False, name="tiny")
GRID = [(1, 1, None), (3, 1, None), (5, 1, None), (2, 2, 4), (3, 3, 8), (4, 2, 7)]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, torch.float32, "cpu", seed=1)


@pytest.fixture(scope="module")
def draft(model):
    d = random_draft(TINY, torch.float32, "cpu", seed=1)
    d.attach_target(model)
    return d


def _engine(model, draft, steps, topk, ndt, num_blocks=64, budget=64, sim=None, stop=None,
            **kw):
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt,
                      simulate_acceptance=sim, confidence_stop=stop)
    cfg = BatchConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                       max_num_seqs=4, max_model_len=96, **kw)
    return Engine(model, cfg, draft=draft, spec=spec)


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


def _workload(rng, n=6, lo=3, hi=24):
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
    lens = [rng.randrange(1, 30) for _ in prompts]
    return prompts, lens


def _assert_all_free(engine):
    assert engine.pool.all_free() and engine.draft_pool.all_free()


@pytest.mark.parametrize(("steps", "topk", "ndt"), GRID)
@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (64, 9), (14, 16)])
def test_batched_speculative_greedy_equals_each_sequence_alone(model, draft, steps, topk, ndt,
                                                               num_blocks, budget):
    """(64, 64): plenty of room; (64, 9): prompts prefilled in chunks beside the trees;
    (14, 16): a pool too small for everyone, so sequences are preempted and recomputed."""
    rng = random.Random(steps * 7 + topk)
    prompts, lens = _workload(rng)
    engine = _engine(model, draft, steps, topk, ndt, num_blocks, budget)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    record = []
    _run(engine, [(3 * i, s) for i, s in enumerate(seqs)], record)
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    _assert_all_free(engine)
    spec_steps = [o for o in record if o.accepted is not None]
    assert spec_steps, "nothing speculated"
    if steps > 1 and budget == 64 and num_blocks == 64:
        assert any(o.accepted > 0 for o in spec_steps)  # a random draft, still accepted
    if num_blocks == 14:
        assert any(s.num_preemptions for s in seqs)


def _oracle(monkeypatch, engine, truth, noise, seed):
    patch_oracle_drafts(monkeypatch, engine, truth, noise, seed, V)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, None), (6, 1, None), (3, 2, 6),
                                                    (4, 3, 10)])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_batched_speculative_with_accepting_drafts(monkeypatch, model, draft, steps, topk, ndt,
                                                   noise):
    """Drafts that are mostly (noise 0.3) or always (0.0) right: long accepted paths per
    sequence, different lengths side by side, all committed and extended correctly."""
    rng = random.Random(steps + 10 * topk)
    prompts, lens = _workload(rng, n=5)
    truth = {f"s{i}": p + solo_greedy(model, p, 40) for i, p in enumerate(prompts)}
    engine = _engine(model, draft, steps, topk, ndt)
    _oracle(monkeypatch, engine, truth, noise, seed=steps)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, [(i, s) for i, s in enumerate(seqs)])
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == truth[s.seq_id][len(p):len(p) + n], s.seq_id
    acc = [a for s in seqs for a in s.spec.accepted]
    if noise == 0.0:
        # every cycle accepts everything, except where max_tokens cuts it short
        assert sum(a == steps for a in acc) >= len(acc) - len(seqs)
    else:
        assert sum(acc) / len(acc) > 0.5
    _assert_all_free(engine)


def test_prefix_cache_hits_skip_the_shared_prompt(model, draft):
    """A second request with the same system prompt takes its blocks from the cache in both
    pools and still gives its solo output."""
    rng = random.Random(5)
    system = [rng.randrange(V) for _ in range(17)]
    prompts = [system + [rng.randrange(V) for _ in range(k)] for k in (3, 6, 2)]
    engine = _engine(model, draft, 3, 2, 5)
    seqs = []
    for i, p in enumerate(prompts):  # one after another: the first fills the cache
        s = Sequence(f"s{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
        seqs.append(s)
        _run(engine, [(0, s)])
        assert s.output_ids == solo_greedy(model, p, 12)
    assert seqs[0].num_cached == 0
    assert all(s.num_cached == 16 for s in seqs[1:])  # 4 full blocks of the shared 17
    _assert_all_free(engine)


@pytest.fixture(scope="module")
def sure_draft(model):
    """A random draft whose picks are often confident (its head scaled up): chains under a
    confidence stop end at different lengths, sequence by sequence."""
    d = random_draft(TINY, torch.float32, "cpu", seed=1)
    with torch.no_grad():
        d.lm_head.weight.mul_(SCALE)
    d.attach_target(model)
    return d


SCALE = 12.0


@pytest.mark.parametrize("stop", [None, 0.3])
def test_mixed_greedy_and_sampled_sequences(model, draft, sure_draft, stop):
    """Greedy sequences beside sampled ones still give their greedy output; a seeded
    sampled sequence gives the same tokens in a batch as alone (its own generator), also
    with a confidence stop, which would end a chain where its neighbours' drafts do."""
    rng = random.Random(9)
    prompts, lens = _workload(rng, n=6)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=100 + i, top_p=0.95) for i, n in enumerate(lens)]

    def run(idx):
        engine = _engine(model, draft if stop is None else sure_draft, 3, 1, None, stop=stop)
        seqs = [Sequence(f"s{i}", prompts[i], params[i]) for i in idx]
        _run(engine, [(0, s) for s in seqs])
        _assert_all_free(engine)
        drafted.update(d for s in seqs for d in s.spec.drafted)
        return {s.seq_id: s.output_ids for s in seqs}

    drafted = set()
    together = run(range(6))
    assert drafted == {3} if stop is None else len(drafted) > 1  # the stop cut chains
    for i in range(6):
        alone = run([i])[f"s{i}"]
        assert together[f"s{i}"] == alone, i
        if params[i].greedy:
            assert alone == solo_greedy(model, prompts[i], lens[i])


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(4, 1, None), (3, 2, 6)])
def test_simulated_acceptance_keeps_kv_consistent(model, draft, steps, topk, ndt):
    """Simulated acceptance accepts draft tokens the target would not emit; the K/V stays
    consistent: every step's last token is the target's argmax after what came before."""
    rng = random.Random(2)
    prompts, lens = _workload(rng, n=4)
    engine = _engine(model, draft, steps, topk, ndt, sim=3.0)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n + 10, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    record = []
    _run(engine, [(0, s) for s in seqs], record)
    seen = {s.seq_id: list(s.prompt_ids) for s in seqs}
    for o in record:
        if not o.new_tokens:
            continue
        before = seen[o.seq.seq_id] + o.new_tokens[:-1]
        if o.accepted is not None and not o.finished:  # (max_tokens may cut the bonus off)
            assert o.new_tokens[-1] == solo_greedy(model, before, 1)[0]
        seen[o.seq.seq_id] = before + o.new_tokens[-1:]
    acc = [a for s in seqs for a in s.spec.accepted]
    assert sum(acc) / len(acc) > 1.0  # simulated tau ~ 3: well above the random draft's
    _assert_all_free(engine)


@pytest.mark.parametrize("policy", ["1:3,1,4;2:off", "1:4,2,7;3:2,1,3;8:off",
                                    "2:off;4:3,3,8"])
def test_speculation_by_batch_size(model, draft, policy):
    """A policy picks each step's configuration from the batch size (off where it does not
    pay): outputs stay each sequence's own greedy output, and the steps follow the table."""
    from specscope.config import SpecPolicy

    base = SpecConfig(draft="random", num_steps=3)
    pol = SpecPolicy.parse(policy, base)
    rng = random.Random(11)
    prompts, lens = _workload(rng, n=5)
    cfg = BatchConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                      max_model_len=96)
    engine = Engine(model, cfg, draft=draft, spec=base, policy=pol)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    pending = [(2 * i, s) for i, s in enumerate(seqs)]
    step, seen = 0, []
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        running = max(len(engine.scheduler.running), 1)
        outs = engine.step()
        want = pol.for_batch(running)
        for o in outs:
            if o.accepted is not None:
                assert want is not None, (running, policy)
                seen.append((running, want.num_draft_tokens))
        step += 1
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n), s.seq_id
    assert seen, "nothing speculated"
    _assert_all_free(engine)


def test_policy_validation():
    from specscope.config import SpecPolicy

    base = SpecConfig(draft="random", num_steps=3)
    for bad in ["", "4:3,1,4;2:off", "x:off", "1:3,1", "1:3,1,9"]:
        with pytest.raises(ValueError):
            SpecPolicy.parse(bad, base)
    pol = SpecPolicy.parse("1:5,1,6;4:3,1,4;16:off", base)
    assert pol.for_batch(1).num_steps == 5 and pol.for_batch(3).num_steps == 3
    assert pol.for_batch(16) is None and pol.for_batch(100) is None
    assert "<= 4: (3, 1, 4)" in pol.describe()


def _static_steps(engine):
    """Run the engine's CUDA-graph steps eagerly (what a graph replays) and count them."""
    engine._make_graphs(capture=False)
    counts = {"spec": 0, "decode": 0}
    for name, key in (("_graph_spec", "spec"), ("_graph_decode", "decode")):
        real = getattr(engine, name)

        def counted(*a, _real=real, _key=key):
            counts[_key] += 1
            return _real(*a)
        setattr(engine, name, counted)
    return counts


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, None), (5, 1, None), (3, 3, 8),
                                                     (4, 2, 7)])
def test_graph_steps_equal_the_eager_step(model, draft, steps, topk, ndt):
    """The CUDA-graph steps' static-shape functions (padded to a bucket, pending pairs padded
    to num_steps + 1, block tables as wide as needed, padding rows in the scratch block),
    run eagerly: greedy output is still each sequence's own, token for token in fp32, and
    both kinds of graph step ran (a policy turns speculation off at 3+ sequences)."""
    from specscope.config import SpecPolicy

    base = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt)
    pol = SpecPolicy.parse(f"2:{steps},{topk},{base.num_draft_tokens};4:off", base)
    rng = random.Random(steps + 10 * topk)
    prompts, lens = _workload(rng, n=5)
    cfg = BatchConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                      max_model_len=96)
    engine = Engine(model, cfg, draft=draft, spec=base, policy=pol)
    counts = _static_steps(engine)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n + 8, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, [(4 * i, s) for i, s in enumerate(seqs)])
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n + 8), s.seq_id
    assert counts["spec"] > 0 and counts["decode"] > 0, counts
    _assert_all_free(engine)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(4, 1, None), (3, 2, 6)])
def test_graph_steps_simulate_as_the_eager_step(model, draft, steps, topk, ndt):
    """Simulated acceptance in the graph steps draws the same uniforms as the eager step:
    the same accepted lengths and tokens, step for step."""
    rng = random.Random(5)
    prompts, lens = _workload(rng, n=3)
    runs = []
    for static in (False, True):
        engine = _engine(model, draft, steps, topk, ndt, sim=3.0)
        counts = _static_steps(engine) if static else None
        seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n + 10, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
        _run(engine, [(0, s) for s in seqs])
        runs.append([(s.output_ids, s.spec.accepted) for s in seqs])
        _assert_all_free(engine)
    assert counts["spec"] > 0
    assert runs[0] == runs[1]


def test_plain_decode_graphs_per_key_window(model, monkeypatch):
    """Plain decode graphs are captured per key window (engine/cuda_graph.py key_windows):
    sequences whose contexts cross the short window's bound move to the long window's graph
    and their greedy output is still their own, token for token."""
    from specscope.engine import cuda_graph

    monkeypatch.setattr(cuda_graph, "LONG_KEY_BOUND", 24)
    rng = random.Random(7)
    prompts, lens = _workload(rng, n=3)
    cfg = BatchConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                      max_model_len=96)
    engine = Engine(model, cfg)
    _static_steps(engine)
    assert engine.graphs.windows == (24, 96)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n + 16, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))]
    _run(engine, [(2 * i, s) for i, s in enumerate(seqs)])
    for s, p, n in zip(seqs, prompts, lens, strict=True):
        assert s.output_ids == solo_greedy(model, p, n + 16), s.seq_id
    assert {w for _, w in engine.graphs.graphs} == {24, 96}
    assert engine.pool.all_free()
