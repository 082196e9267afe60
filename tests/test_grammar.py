"""Structured output (engine/grammar.py): the grammar state and its masks, and constrained
generation end to end: JSON that parses and fits its schema, greedy and sampled, plain and
speculative; greedy constrained speculation equals greedy constrained plain decoding token
for token (chains and trees, random drafts on the tiny model, the shipped draft on the
default model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from specscope.config import SamplingParams, SpecConfig, StructuredOutputs  # noqa: E402
from specscope.engine.grammar import (  # noqa: E402
    DraftConstraint,
    GrammarCompiler,
    constrain_rows,
    constrain_trees,
    unpack,
)
from specscope.engine.llm import LLM  # noqa: E402
from specscope.engine.tokenizer import IdTokenizer, Tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

# Finite choices only, so a random model finishes the object in a few tokens.
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["city", "n", "ok"], "additionalProperties": False}
GRID = [(1, 1, None), (3, 1, None), (2, 2, 4), (3, 3, 8)]


def fits(text: str) -> bool:
    """text is a JSON object that SCHEMA accepts."""
    obj = json.loads(text)
    return (set(obj) == {"city", "n", "ok"} and obj["city"] in ("Paris", "London", "Rome")
            and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
            and isinstance(obj["ok"], bool))


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size)


def _allowed(g, V) -> set[int]:
    bits = np.empty(g.words, np.int32)
    g.fill_mask(bits)
    return set(torch.nonzero(unpack(torch.from_numpy(bits), V)).flatten().tolist())


def _ids(tok, text):
    return tok.hf.encode(text, add_special_tokens=False)


# -- the grammar state ---------------------------------------------------------------------


def test_mask_advance_and_termination(tok, compiler):
    V = tok.vocab_size
    g = compiler.compile(StructuredOutputs(json_object=True))
    first = _allowed(g, V)
    assert first and all(tok.decode([t]).startswith("{") for t in first)
    ids = _ids(tok, '{"a": 1}')
    for t in ids[:-1]:
        assert t in _allowed(g, V)
        assert not g.advance(t)
    assert not g.accepting
    assert g.advance(ids[-1]) and g.done  # the object is closed: the request ends
    assert _allowed(g, V) <= tok.eos_token_ids


def test_paths_roll_back_and_ungrammatical_paths_are_unmasked(tok, compiler):
    V = tok.vocab_size
    g = compiler.compile(StructuredOutputs(json=SCHEMA))
    before = _allowed(g, V)
    good, bad = _ids(tok, '{"city": "'), _ids(tok, "hello")
    bits = np.empty((3, g.words), np.int32)
    assert g.masks_after([[], good, bad], bits) == [True, True, False]
    assert _allowed(g, V) == before  # rolled back to the committed state
    rows = unpack(torch.from_numpy(bits), V)
    assert set(torch.nonzero(rows[0]).flatten().tolist()) == before
    assert all(tok.decode([t])[:1] in "PLR" for t in torch.nonzero(rows[1]).flatten().tolist())
    assert bool(rows[2].all())  # never accepted (the target's mask refuses it): left free


def test_tree_masks_follow_each_nodes_path(tok, compiler):
    g = compiler.compile(StructuredOutputs(json=SCHEMA))
    a, b = _ids(tok, '{"'), _ids(tok, "{")
    assert len(a) == len(b) == 1
    # root -> '{"' -> 'city', and root -> '{' (two branches)
    city = _ids(tok, 'city')[0]
    tokens, parents = [0, a[0], city, b[0]], [-1, 0, 1, 0]
    bits = np.empty((4, g.words), np.int32)
    g.tree_masks(tokens, parents, bits)
    ref = np.empty((4, g.words), np.int32)
    g.masks_after([[], a, a + [city], b], ref)
    assert (bits == ref).all()


def test_constrain_rows_touches_only_constrained_rows(compiler, tok):
    V = tok.vocab_size
    g = compiler.compile(StructuredOutputs(choice=("yes", "no")))
    logits = torch.randn(3, V)
    assert constrain_rows(logits, [None, None, None]) is logits  # no work without grammars
    out = constrain_rows(logits, [None, g, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    ok = torch.isfinite(out[1])
    assert set(torch.nonzero(ok).flatten().tolist()) == _allowed(g, V)
    assert torch.equal(out[1][ok], logits[1][ok])


def test_constrain_trees_and_draft_constraint(compiler, tok):
    V = tok.vocab_size
    g = compiler.compile(StructuredOutputs(json=SCHEMA))
    a = _ids(tok, '{"')[0]
    tokens = torch.tensor([[0, a, 5], [0, 1, 2]])
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    logits = torch.zeros(2, 3, V)
    out = constrain_trees(logits, tokens, parents, [g, None])
    assert torch.equal(out[1], logits[1])
    ref = np.empty((3, g.words), np.int32)
    g.tree_masks([0, a, 5], [-1, 0, 1], ref)
    assert torch.equal(torch.isfinite(out[0]), unpack(torch.from_numpy(ref), V))
    # A draft vocabulary of the even target ids: masks gathered through it; a beam with no
    # allowed draft token stays unmasked.
    draft_ids = torch.arange(0, V, 2)
    dc = DraftConstraint([None, g], draft_ids)
    lg = torch.zeros(2, 2, draft_ids.numel())
    paths = torch.tensor([[[1], [2]], [[a], [_ids(tok, "hello")[0]]]])
    got = dc(lg, paths)
    assert torch.equal(got[0], lg[0])
    want = unpack(torch.from_numpy(ref[1:2]), V)[0, draft_ids]
    assert not want.any() or torch.equal(torch.isfinite(got[1, 0]), want)
    assert torch.isfinite(got[1, 1]).all()


def test_bad_schemas_and_grammars_name_the_problem(compiler):
    with pytest.raises(ValueError, match="JSON schema"):
        compiler.check(StructuredOutputs(json={"type": "objectx"}))
    with pytest.raises(ValueError, match="not valid JSON"):
        compiler.check(StructuredOutputs(json="{nope"))
    with pytest.raises(ValueError, match="grammar"):
        compiler.check(StructuredOutputs(grammar="start: missing_rule"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json_object=True, regex="a+")
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(IdTokenizer(), 16).compile(StructuredOutputs(json_object=True))


def test_missing_library_says_which_extra(monkeypatch, tok):
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *a, **kw):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(ValueError, match=r"specscope\[structured\]"):
        GrammarCompiler(tok, tok.vocab_size).compile(StructuredOutputs(json_object=True))


# -- constrained generation ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=None)


PROMPTS = ["Give me JSON", "hello", "The weather in"]


@pytest.mark.parametrize(("steps", "topk", "ndt"), GRID)
def test_greedy_constrained_speculation_equals_plain(tiny, steps, topk, ndt):
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA))
    tiny.set_spec(None)
    plain = tiny.generate(PROMPTS, params)
    tiny.set_spec(SpecConfig(draft="random", num_steps=steps, topk=topk,
                             num_draft_tokens=ndt))
    try:
        spec = tiny.generate(PROMPTS, params)
    finally:
        tiny.set_spec(None)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
        assert p.finish_reason == "stop" and fits(p.text)
    assert sum(sum(s.spec["accepted_per_cycle"]) for s in spec) > 0  # forced tokens accept


@pytest.mark.parametrize("spec", [None, SpecConfig(draft="random", num_steps=3),
                                  SpecConfig(draft="random", num_steps=2, topk=2,
                                             num_draft_tokens=4)])
def test_sampled_constrained_output_fits_the_schema(tiny, spec):
    tiny.set_spec(spec)
    try:
        outs = tiny.generate(PROMPTS, SamplingParams(
            max_tokens=40, temperature=1.0, seed=3,
            structured_outputs=StructuredOutputs(json=SCHEMA)))
    finally:
        tiny.set_spec(None)
    for o in outs:
        assert o.finish_reason == "stop" and fits(o.text), o.text


def test_constrained_and_free_requests_share_a_batch(tiny):
    free = SamplingParams(max_tokens=12)
    alone = tiny.generate(PROMPTS, free)
    tiny.set_spec(SpecConfig(draft="random", num_steps=3))
    try:
        rids = [tiny.add_request(tiny.encode_prompt(p), free) for p in PROMPTS]
        rids.append(tiny.add_request(tiny.encode_prompt("x"), SamplingParams(
            max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA))))
        done = {}
        while len(done) < len(rids):
            done.update({d.request_id: d.output for d in tiny.step() if d.finished})
    finally:
        tiny.set_spec(None)
    assert [done[r].token_ids for r in rids[:-1]] == [a.token_ids for a in alone]
    assert fits(done[rids[-1]].text)


@pytest.mark.slow
def test_default_model_json_object_plain_and_speculative():
    """The shipped draft accepts real tokens: chain and tree equal plain decoding, and the
    greedy and sampled objects parse as JSON."""
    messages = [[{"role": "user", "content": "Describe a person as a JSON object with "
                  "name, age and city."}]]
    params = SamplingParams(max_tokens=48, structured_outputs=StructuredOutputs(
        json_object=True))
    llm = LLM(dtype="fp32", device="cpu", spec=None)
    plain = llm.chat(messages, params)[0]
    assert plain.finish_reason == "stop" and isinstance(json.loads(plain.text), dict)
    for spec in (SpecConfig(draft="default", num_steps=3),
                 SpecConfig(draft="default", num_steps=3, topk=2, num_draft_tokens=6)):
        llm.set_spec(spec)
        out = llm.chat(messages, params)[0]
        assert out.token_ids == plain.token_ids
        assert out.spec["accept_length"] > 1.5
    sampled = llm.chat(messages, SamplingParams(
        max_tokens=48, temperature=0.8, seed=1,
        structured_outputs=StructuredOutputs(json_object=True)))[0]
    if sampled.finish_reason == "stop":
        assert isinstance(json.loads(sampled.text), dict)
    else:  # cut by max_tokens: still a prefix the grammar allowed
        assert sampled.text.startswith("{")


def _spy(engine, counts):
    engine._make_graphs(capture=False)  # the graph steps' static functions, run eagerly
    for name in ("_graph_spec", "_graph_decode"):
        real = getattr(engine, name)

        def counted(*a, _real=real, _name=name):
            counts[_name] += 1
            return _real(*a)
        setattr(engine, name, counted)


def test_graph_steps_mask_plain_decode_and_leave_constrained_speculation_eager(tiny):
    """A plain decode graph step keeps constrained sequences (the mask applies to its output
    logits); the pure speculative graph step never takes them (its masks need host reads
    between draft steps)."""
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA))
    ref = tiny.generate(PROMPTS, params)
    try:
        for spec in (None, SpecConfig(draft="random", num_steps=3)):
            tiny.set_spec(spec)
            counts = {"_graph_spec": 0, "_graph_decode": 0}
            _spy(tiny.engine, counts)
            out = tiny.generate(PROMPTS, params)
            assert [o.token_ids for o in out] == [r.token_ids for r in ref]
            assert counts["_graph_spec"] == 0
            if spec is None:
                assert counts["_graph_decode"] > 0
        tiny.generate(PROMPTS, SamplingParams(max_tokens=12))  # free: the graph step runs
        assert counts["_graph_spec"] > 0
    finally:
        tiny.set_spec(None)
