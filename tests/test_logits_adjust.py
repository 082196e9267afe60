"""Logits adjustments (presence, frequency and repetition penalties, logit_bias, min_tokens,
min_p): the batched device functions against the per-token reference, at every node of a
draft tree; greedy decoding with them equals a full-recompute reference; speculative greedy
equals plain greedy token for token (random drafts and drafts that are mostly right), with
adjusted and unadjusted sequences side by side."""

from __future__ import annotations

import random

import pytest
import torch
from reference import patch_oracle_drafts

from specscope.config import ModelConfig, SamplingParams, SpecConfig
from specscope.draft.eagle3 import random_draft
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.logits import adjustment, count_emitted, token_state
from specscope.engine.sequence import Sequence
from specscope.models.loader import random_model
from specscope.sampling import (
    adjust_logits_reference,
    apply_min_p,
    path_counts,
    processed_logits,
)
from specscope.spec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")

V = 16
EOS = 3
TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=V,
                   hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False, name="tiny")
GRID = [(1, 1, None), (3, 1, None), (5, 1, None), (2, 2, 4), (3, 3, 8), (4, 2, 7)]

PENALISED = [
    SamplingParams(max_tokens=20, presence_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=20, frequency_penalty=0.8, ignore_eos=True),
    SamplingParams(max_tokens=20, repetition_penalty=1.7, ignore_eos=True),
    SamplingParams(max_tokens=20, logit_bias={5: 4.0, 7: -100, 2: 2.5}, ignore_eos=True),
    SamplingParams(max_tokens=20, min_tokens=6, stop_token_ids=(1, 9)),
    SamplingParams(max_tokens=20, presence_penalty=-0.5, frequency_penalty=0.6,
                   repetition_penalty=1.3, logit_bias={4: 3.0}, min_tokens=4,
                   stop_token_ids=(11,)),
    # Most tokens are stop ids: it stops about as soon as min_tokens allows, so a verify
    # tree spans the depth where the mask lifts.
    SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=tuple(range(2, V))),
    SamplingParams(max_tokens=20, ignore_eos=True),  # no adjustment, beside the others
]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, torch.float32, "cpu", seed=1)


@pytest.fixture(scope="module")
def draft(model):
    d = random_draft(TINY, torch.float32, "cpu", seed=1)
    d.attach_target(model)
    return d


def _stops(p: SamplingParams) -> set[int]:
    return set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})


@torch.inference_mode()
def solo_adjusted_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with `p`'s adjustments by a full forward per token (no cache) and the
    per-token reference adjustment, stopping as the engine does."""
    out: list[int] = []
    while len(out) < p.max_tokens:
        ids = prompt + out
        h, _ = model(torch.tensor(ids)[None], torch.arange(len(ids))[None])
        x = adjust_logits_reference(model.compute_logits(h[0, -1]), prompt, out, p, _stops(p))
        out.append(int(x.argmax()))
        if out[-1] in _stops(p):
            break
    return out


def _engine(model, draft=None, spec=None, **kw):
    cfg = BatchConfig(num_blocks=96, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                      max_model_len=96, **kw)
    return Engine(model, cfg, frozenset({EOS}), draft=draft, spec=spec)


def _run(engine, seqs):
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 2000
    assert engine.pool.all_free()


def _prompts(rng, n):
    return [[rng.randrange(V) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


# -- the batched functions against the reference --------------------------------------------


def test_min_p_keeps_tokens_near_the_top():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = apply_min_p(x, 0.15).isfinite()[0].tolist()
    assert kept == [True, True, True, False, False]  # above 0.15 * 0.5
    torch.testing.assert_close(apply_min_p(x, 0.0), x)
    p = processed_logits(x, SamplingParams(temperature=1.0, min_p=0.5)).isfinite()[0]
    assert p.tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("seed", range(4))
def test_adjustment_at_every_tree_node_equals_the_reference(seed):
    """Each node of a random tree is adjusted with the sequence's tokens plus its own path
    (counts) and its depth (min_tokens): what plain decoding does at that prefix."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqs, params = [], []
    for i, p in enumerate(PENALISED):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]
        seq = Sequence(f"s{i}", prompt, p)
        seq.output_ids = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
        seq.logits_state = token_state(seq, V, frozenset({EOS}), torch.device("cpu"))
        seqs.append(seq)
        params.append(p)
    S, N = len(seqs), 9
    parents = [[-1] + [rng.randrange(i) for i in range(1, N)] for _ in range(S)]
    depth = []
    for par in parents:
        d = [0]
        for i in range(1, N):
            d.append(d[par[i]] + 1)
        depth.append(d)
    tree = DraftTree(torch.randint(0, V, (S, N)), torch.tensor(parents), torch.tensor(depth))
    logits = torch.randn(S, N, V) * 3
    adj = adjustment(seqs, torch.device("cpu"))
    anc = tree.ancestor_mask(N)
    got = adj.apply(logits, path_counts(adj.take(tree.tokens), adj.take(anc), V),
                    adj.take(tree.depth))
    for s, seq in enumerate(seqs):
        for i in range(N):
            path, j = [], i
            while j > 0:  # the node's path below the root, root side first
                path.insert(0, int(tree.tokens[s, j]))
                j = parents[s][j]
            want = adjust_logits_reference(logits[s, i], seq.prompt_ids,
                                           seq.output_ids + path, seq.params,
                                           _stops(seq.params))
            torch.testing.assert_close(got[s, i], want, msg=f"seq {s} node {i}")


def test_counts_follow_emitted_tokens_on_the_device():
    seq = Sequence("s", [1, 2], SamplingParams(frequency_penalty=1.0))
    seq.output_ids = [4, 4]
    seq.logits_state = token_state(seq, V, frozenset(), torch.device("cpu"))
    count_emitted([seq], torch.tensor([[4, 5, -1, -1]]))
    assert seq.logits_state.counts.tolist()[4:6] == [3, 1]
    assert seq.logits_state.counts.sum() == 4
    # Nothing is built for a sequence that adjusts nothing.
    plain = Sequence("p", [1], SamplingParams())
    assert token_state(plain, V, frozenset(), torch.device("cpu")) is None
    assert adjustment([plain], torch.device("cpu")) is None


# -- end to end: greedy ------------------------------------------------------------------


def test_plain_greedy_with_adjustments_equals_the_reference(model):
    rng = random.Random(3)
    prompts = _prompts(rng, len(PENALISED))
    seqs = [Sequence(f"s{i}", p, q) for i, (p, q) in enumerate(zip(prompts, PENALISED,
                                                                   strict=True))]
    _run(_engine(model), seqs)
    for s in seqs:
        assert s.output_ids == solo_adjusted_greedy(model, s.prompt_ids, s.params), s.seq_id
    # The adjustments changed something (each params' own output differs from plain greedy).
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    differs = [s.output_ids[:20] != solo_adjusted_greedy(model, s.prompt_ids, plain)
               for s in seqs[:-1]]
    assert sum(differs) >= 4, differs
    banned = seqs[3]
    assert 7 not in banned.output_ids
    for s in (seqs[4], seqs[5], seqs[6]):  # min_tokens: no stop token before it
        assert not _stops(s.params) & set(s.output_ids[:s.params.min_tokens])
    assert len(seqs[6].output_ids) == 6 and seqs[6].finish_reason == "stop"
    assert set(seqs[6].output_ids[:5]) <= {0, 1}


@pytest.mark.parametrize(("steps", "topk", "ndt"), GRID)
def test_speculative_greedy_with_adjustments_equals_plain(model, draft, steps, topk, ndt):
    rng = random.Random(steps * 5 + topk)
    prompts = _prompts(rng, len(PENALISED))

    def run(engine):
        seqs = [Sequence(f"s{i}", p, q) for i, (p, q) in enumerate(zip(prompts, PENALISED,
                                                                       strict=True))]
        _run(engine, seqs)
        return seqs

    plain = run(_engine(model))
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt)
    speculative = run(_engine(model, draft, spec))
    for a, b in zip(plain, speculative, strict=True):
        assert a.output_ids == b.output_ids, a.seq_id
    assert any(b.spec.accepted for b in speculative)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(4, 1, None), (3, 2, 6), (4, 3, 10)])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_accepting_drafts_with_adjustments(monkeypatch, model, draft, steps, topk, ndt,
                                           noise):
    """Drafts that propose the adjusted greedy continuation: long accepted paths, each node
    verified under its own path's counts and depth; the output is still plain's."""
    rng = random.Random(steps + topk)
    prompts = _prompts(rng, len(PENALISED))
    truth = {f"s{i}": p + solo_adjusted_greedy(model, p, q)
             for i, (p, q) in enumerate(zip(prompts, PENALISED, strict=True))}
    engine = _engine(model, draft, SpecConfig(draft="random", num_steps=steps, topk=topk,
                                              num_draft_tokens=ndt))
    patch_oracle_drafts(monkeypatch, engine, truth, noise, steps, V)
    seqs = [Sequence(f"s{i}", p, q) for i, (p, q) in enumerate(zip(prompts, PENALISED,
                                                                   strict=True))]
    _run(engine, seqs)
    for s in seqs:
        assert s.output_ids == truth[s.seq_id][len(s.prompt_ids):], s.seq_id
    acc = [a for s in seqs for a in s.spec.accepted]
    assert sum(acc) / len(acc) > (steps - 1 if noise == 0 else 0.5)


def test_graph_steps_with_adjustments(model, draft):
    """The CUDA-graph steps run eagerly (their static-shape functions): the plain decode
    graph serves adjusted sequences (their logits are adjusted after it), the speculative
    graph takes only unadjusted ones; output is still plain decoding's."""
    from specscope.config import SpecPolicy

    base = SpecConfig(draft="random", num_steps=3)
    rng = random.Random(21)
    prompts = _prompts(rng, len(PENALISED))

    def run(engine):
        seqs = [Sequence(f"s{i}", p, q) for i, (p, q) in enumerate(zip(prompts, PENALISED,
                                                                       strict=True))]
        _run(engine, seqs)
        return [s.output_ids for s in seqs]

    want = run(_engine(model))
    cfg = BatchConfig(num_blocks=96, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                      max_model_len=96)
    engine = Engine(model, cfg, frozenset({EOS}), draft=draft, spec=base,
                    policy=SpecPolicy.parse("2:3,1,4;8:off", base))
    engine._make_graphs(capture=False)
    ran = {"decode": [], "spec": []}
    for name, key in (("_graph_decode", "decode"), ("_graph_spec", "spec")):
        real = getattr(engine, name)

        def counted(arg, _real=real, _key=key):
            items = arg.scheduled if hasattr(arg, "scheduled") else arg
            ran[_key].append([it.seq.params.adjusts_logits for it in items])
            return _real(arg)
        setattr(engine, name, counted)
    assert run(engine) == want
    assert any(any(flags) for flags in ran["decode"])  # adjusted rows in the decode graph
    assert not any(any(flags) for flags in ran["spec"])


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
    {"repetition_penalty": float("inf")}, {"min_p": 1.5}, {"min_tokens": -1},
    {"min_tokens": 200, "max_tokens": 10}, {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}},
    {"logit_bias": {"x": 1}}, {"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": True},
    {"n": 0},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        SamplingParams(**kwargs)


def test_sampling_params_flags():
    assert not SamplingParams().adjusts_logits and not SamplingParams(min_p=0.2).adjusts_logits
    assert SamplingParams(logit_bias={3: 1}).adjusts_logits
    assert not SamplingParams(logit_bias={3: 1}).counts_tokens
    assert SamplingParams(repetition_penalty=1.1).counts_tokens
    assert SamplingParams(logit_bias={"7": -1, 2: 3}).logit_bias == ((2, 3.0), (7, -1.0))


def test_draft_chain_is_adjusted_along_its_path():
    """A greedy chain's draft token j is the argmax of the draft's logits adjusted after the
    sequence's tokens and draft tokens 1..j-1 (depth j - 1), as the verify will adjust the
    target's there."""
    from types import SimpleNamespace

    from specscope.spec.drafter import draft_chain

    torch.manual_seed(0)
    # The next logits depend on the token fed only, and favour it: unpenalised, a chain
    # would repeat one token, so the path's own counts decide.
    table = torch.randn(V, V) + 2.5 * torch.eye(V)
    # The step's 'normed' output is the logits themselves: the head is the identity.
    stub = SimpleNamespace(to_target=lambda d: d, compute_logits=lambda x: x,
                           config=SimpleNamespace(vocab_size=V))

    def step(tokens, hidden, rope, slots, anc):
        return hidden, table[tokens]

    seqs = []
    for i, p in enumerate(PENALISED):
        seq = Sequence(f"s{i}", [i % V, (3 * i) % V], p)
        seq.output_ids = [(5 * i + 1) % V, 2]
        seq.logits_state = token_state(seq, V, frozenset({EOS}), torch.device("cpu"))
        seqs.append(seq)
    S, k = len(seqs), 5
    root = torch.tensor([s.last_token for s in seqs])
    tree = draft_chain(step, stub, torch.zeros(S, 4), table[root], root,
                       torch.full((S,), 4), k, [s.params for s in seqs], [None] * S,
                       adjust=adjustment(seqs, torch.device("cpu")))
    for r, seq in enumerate(seqs):
        drafted = tree.tokens[r, 1:].tolist()
        for j in range(k):
            prev = seq.last_token if j == 0 else drafted[j - 1]
            want = adjust_logits_reference(table[prev], seq.prompt_ids,
                                           seq.output_ids + drafted[:j], seq.params,
                                           _stops(seq.params)).argmax()
            assert drafted[j] == int(want), (r, j)
