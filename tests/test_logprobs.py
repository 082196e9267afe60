"""Log-probabilities, n choices and aborts through the Python API (LLM): logprobs are the
target's raw log_softmax at each emitted token (checked against full forwards), equal with
and without speculation; penalties do not change them; they come back in the step's one
device->host read. n choices share the prompt's cached blocks, are indexed 0..n-1 and, when
seeded, each is deterministic (choice i = the single request with seed + i)."""

from __future__ import annotations

import pytest
import torch

from specscope import LLM, SamplingParams
from specscope.config import ModelConfig, SpecConfig
from specscope.models.loader import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

V = 16
TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=V,
                   hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False, name="tiny")
PROMPTS = ["<1><2><3><4><5><6><7><8><9><10><11><12><13><14><15><1><2><3>", "<4><4><9>"]
SPECS = [SpecConfig(draft="random", num_steps=3),
         SpecConfig(draft="random", num_steps=3, topk=2, num_draft_tokens=6)]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, torch.float32, "cpu", seed=4)


def _llm(model, spec=None) -> LLM:
    return LLM.from_model(model, spec=spec, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=64)


@torch.inference_mode()
def _reference(model, prompt: list[int], out: list[int], k: int) -> list[tuple]:
    """(logprob, rank, top-k ids) of each output token by a full forward of its prefix."""
    rows = []
    for i, t in enumerate(out):
        ids = prompt + out[:i]
        h, _ = model(torch.tensor(ids)[None], torch.arange(len(ids))[None])
        lp = torch.log_softmax(model.compute_logits(h[0, -1]).double(), -1)
        rows.append((float(lp[t]), int((lp >= lp[t]).sum()), lp.topk(k).indices.tolist()))
    return rows


def _check(model, out, k: int) -> None:
    ref = _reference(model, out.prompt_token_ids, out.token_ids, k)
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids)
    for t, entry, (want, rank, top) in zip(out.token_ids, lps, ref, strict=True):
        assert abs(entry[t].logprob - want) < 1e-4 and entry[t].rank == rank
        # The chosen token first, then the top k by rank (the chosen one once).
        others = [i for i in entry if i != t]
        assert others == [i for i in top if i != t]
        assert entry[t].decoded_token == f"<{t}>"
    cum = out.outputs[0].cumulative_logprob
    assert abs(cum - sum(r[0] for r in ref)) < 1e-3


@pytest.mark.parametrize("spec", [None, *SPECS], ids=["plain", "chain", "tree"])
def test_logprobs_are_the_targets_raw_distribution(model, spec):
    llm = _llm(model, spec)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        _check(model, out, 3)
    if spec is not None:
        assert sum(sum(o.spec["accepted_per_cycle"]) for o in outs) > 0


def test_logprobs_equal_with_and_without_speculation(model):
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5,
                            presence_penalty=0.8, repetition_penalty=1.3)
    plain = _llm(model).generate(PROMPTS, params)
    for spec in SPECS:
        spec_out = _llm(model, spec).generate(PROMPTS, params)
        for a, b in zip(plain, spec_out, strict=True):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert list(x) == list(y)
                for t in x:
                    assert abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank
    # Penalties choose other tokens, never other values: still the raw distribution.
    for out in plain:
        _check(model, out, 5)


def test_logprobs_stream_with_their_tokens(model):
    llm = _llm(model, SPECS[0])
    deltas = list(llm.stream(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True,
                                                        logprobs=0)))
    streamed = [e for d in deltas for e in d.logprobs]
    out = deltas[-1].output
    assert streamed == out.outputs[0].logprobs and len(streamed) == 10
    assert all(len(e) == 1 for e in streamed)  # logprobs=0: the chosen token only
    assert deltas[-1].finish_reason == "length"


def test_one_device_to_host_read_per_step(model, monkeypatch):
    """Logprobs and penalties add no read: each step calls tolist once (its `_read`)."""
    llm = _llm(model, SPECS[1])
    for p in PROMPTS:
        llm.add_request(llm.encode_prompt(p), SamplingParams(
            max_tokens=8, ignore_eos=True, logprobs=2, frequency_penalty=0.5, min_tokens=3,
            logit_bias={3: 2.0}))
    reads = []
    real = torch.Tensor.tolist

    def counting(t):
        reads.append(t.shape)
        return real(t)

    def no_item(t):
        raise AssertionError("a host read outside _read")

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    assert len(reads) == steps


def test_n_choices_share_the_prompt_and_are_seeded(model):
    llm = _llm(model, SPECS[0])
    ids = llm.encode_prompt(PROMPTS[0])
    before = llm.engine.pool.stats().prefix_hits
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=11, n=3,
                            logprobs=1)
    out = llm.generate(PROMPTS[0], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent draws
    assert out.metrics.completion_tokens == 24 and out.metrics.prompt_tokens == len(ids)
    # Choices 1 and 2 took the prompt's 4 full blocks (16 of its 18 tokens) from the cache.
    assert llm.engine.pool.stats().prefix_hits - before == 2 * 4
    again = llm.generate(PROMPTS[0], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    for i, c in enumerate(out.outputs):
        single = llm.generate(PROMPTS[0], SamplingParams(
            max_tokens=8, ignore_eos=True, temperature=1.0, seed=11 + i))[0]
        assert single.token_ids == c.token_ids
        assert len(c.logprobs) == 8


def test_abort_gives_finish_reason_abort(model):
    llm = _llm(model)
    rid = llm.add_request(llm.encode_prompt(PROMPTS[1]),
                          SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    llm.step()
    llm.step()
    out = llm.abort_request(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert not llm.has_unfinished_requests() and llm.engine.pool.all_free()
    assert llm.abort_request(rid) is None


@torch.inference_mode()
def _prompt_reference(model, prompt: list[int], k: int) -> list[tuple]:
    h, _ = model(torch.tensor(prompt)[None], torch.arange(len(prompt))[None])
    lp = torch.log_softmax(model.compute_logits(h[0]).double(), -1)  # [P, V]
    return [(float(lp[i, t]), int((lp[i] >= lp[i, t]).sum()), lp[i].topk(k).indices.tolist())
            for i, t in enumerate(prompt[1:])]


@pytest.mark.parametrize("budget", [64, 5])  # the prompt in one chunk, or in chunks of 5
def test_prompt_logprobs(model, budget):
    """Each prompt token's raw log-probability under the prompt before it (the first has
    none), computed at prefill, chunked or not, even when the prompt is cached: a request
    asking for them computes its prompt in full."""
    llm = LLM.from_model(model, spec=SPECS[0], block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=budget)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))  # the prompt is cached now
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, prompt_logprobs=2, n=2,
                                                  logprobs=1))[0]
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for t, entry, (want, rank, top) in zip(ids[1:], plp[1:], _prompt_reference(model, ids, 2),
                                           strict=True):
        assert next(iter(entry)) == t
        assert abs(entry[t].logprob - want) < 1e-4 and entry[t].rank == rank
        assert [i for i in entry if i != t] == [i for i in top if i != t]
    assert len(out.outputs) == 2 and all(len(c.logprobs) == 3 for c in out.outputs)
    deltas = list(llm.stream(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=0)))
    assert deltas[0].prompt_logprobs is not None
    assert [list(e) for e in deltas[0].prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_n_choices_without_prefix_caching(model):
    llm = LLM.from_model(model, block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True, n=3))
    assert [len(o.outputs) for o in out] == [3, 3]
    for o in out:  # greedy: every choice the same
        assert len({tuple(c.token_ids) for c in o.outputs}) == 1
    assert llm.engine.pool.all_free()
