"""End-to-end speculative decoding on a tiny fp32 target (DESIGN.md's testing pyramid, 3-4).

- greedy speculative output == greedy plain output, token for token, over a grid of
  (num_steps, topk, num_draft_tokens), with a random draft (rejections everywhere) and with
  a noisy oracle draft (partial acceptance: exercises accept, KV commit and draft extend);
- an oracle draft (the target's own greedy tokens) gives acceptance 1.0, tau = num_steps + 1;
- simulated acceptance keeps the KV cache consistent: every bonus token equals the target's
  full-recompute argmax after the emitted prefix, and tau follows the requested profile.
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from specscope import LLM, SamplingParams
from specscope.config import SpecConfig
from specscope.spec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")

GRID = [  # (num_steps, topk, num_draft_tokens)
    (1, 1, None), (3, 1, None), (5, 1, None), (7, 1, None),
    (2, 2, 3), (3, 2, 6), (4, 3, 10), (3, 4, 12), (5, 2, 8),
]
PROMPT = "The quick brown fox"
N_TOKENS = 40


@pytest.fixture(scope="module")
def plain(tiny_model_dir: pathlib.Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def reference(plain: LLM) -> tuple[list[int], list[int]]:
    params = SamplingParams(max_tokens=N_TOKENS + 16, ignore_eos=True)
    prompt_ids = plain.encode_prompt(PROMPT)
    out = plain.generate(PROMPT, params)[0]
    return prompt_ids, out.token_ids


def _spec_llm(model_dir: pathlib.Path, steps: int, topk: int, ndt: int | None,
              **kw) -> LLM:
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt, **kw)
    return LLM(str(model_dir), dtype="fp32", device="cpu", spec=spec)


def _oracle(monkeypatch, llm: LLM, reference, noise: float, seed: int = 0) -> None:
    """Replace the drafter by one proposing the target's greedy continuation, each token
    corrupted with probability `noise`; trees get wrong siblings at random ranks."""
    prompt_ids, out_ids = reference
    seq = prompt_ids + out_ids
    rng = random.Random(seed)
    V = llm.model_config.vocab_size
    spec = llm.spec

    def truth(i: int) -> int:
        return seq[i] if i < len(seq) else 0

    def wrong(t: int) -> int:
        return (t + 1 + rng.randrange(V - 1)) % V

    def fake_tree(n: int) -> tuple[list[int], list[int], list[int]]:
        k, topk = spec.num_steps, spec.topk
        budget = spec.num_draft_tokens - 1
        tokens, parents, depth = [truth(n)], [-1], [0]
        cur = 0
        for d in range(1, k + 1):
            if budget <= 0:
                break
            siblings = min(topk, budget - (k - d))  # leave room for the deeper levels
            siblings = max(1, siblings)
            correct_rank = rng.randrange(siblings)
            nxt = cur
            for r in range(siblings):
                t = truth(n + d)
                if r != correct_rank or rng.random() < noise:
                    t = wrong(t)
                tokens.append(t)
                parents.append(cur)
                depth.append(d)
                if r == correct_rank:
                    nxt = len(tokens) - 1
                budget -= 1
            cur = nxt
        while len(tokens) < spec.num_draft_tokens:  # pad with wrong leaves under the root
            tokens.append(wrong(truth(n + 1)))
            parents.append(0)
            depth.append(1)
        return tokens, parents, depth

    def fake(seqs, h0, normed0, adjust=None) -> DraftTree:
        rows = [fake_tree(s.num_computed) for s in seqs]
        t = torch.tensor
        return DraftTree(tokens=t([r[0] for r in rows]), parents=t([r[1] for r in rows]),
                         depth=t([r[2] for r in rows]))

    monkeypatch.setattr(llm.engine, "_draft_trees", fake)


@pytest.mark.parametrize(("steps", "topk", "ndt"), GRID)
def test_greedy_spec_equals_plain_random_draft(tiny_model_dir, reference, steps, topk, ndt):
    llm = _spec_llm(tiny_model_dir, steps, topk, ndt)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS]
    assert out.spec is not None and out.spec["cycles"] > 0 and not out.spec["simulated"]


@pytest.mark.parametrize(("steps", "topk", "ndt"), GRID)
def test_greedy_spec_equals_plain_noisy_oracle(monkeypatch, tiny_model_dir, reference, steps,
                                               topk, ndt):
    llm = _spec_llm(tiny_model_dir, steps, topk, ndt)
    _oracle(monkeypatch, llm, reference, noise=0.3, seed=steps * 10 + topk)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS]
    if steps > 1:
        assert out.spec["accept_length"] > 1.2  # really accepted (partial) paths


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(1, 1, None), (4, 1, None), (7, 1, None),
                                                    (3, 2, 6), (4, 3, 10)])
def test_oracle_draft_accepts_everything(monkeypatch, tiny_model_dir, reference, steps, topk,
                                         ndt):
    llm = _spec_llm(tiny_model_dir, steps, topk, ndt)
    _oracle(monkeypatch, llm, reference, noise=0.0)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS]
    st = out.spec
    assert st["accept_length"] == pytest.approx(steps + 1)
    assert st["acceptance_by_position"] == [1.0] * steps


def _full_recompute_argmax(llm: LLM, ids: list[int]) -> list[int]:
    m = llm.model
    x = torch.tensor([ids])
    with torch.inference_mode():
        h, _ = m(x, torch.arange(len(ids))[None])
        return m.compute_logits(h[0]).argmax(-1).tolist()


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(5, 1, None), (3, 2, 6), (4, 3, 10)])
def test_simulated_acceptance_keeps_kv_consistent(tiny_model_dir, steps, topk, ndt):
    llm = _spec_llm(tiny_model_dir, steps, topk, ndt, simulate_acceptance=3.0)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=90, ignore_eos=True))[0]
    st = out.spec
    assert st["simulated"]
    prompt_ids = llm.encode_prompt(PROMPT)
    seq = prompt_ids + out.token_ids
    pred = _full_recompute_argmax(llm, seq)
    # Bonus tokens: the first token, then the last token of each cycle.
    bonus_at = [len(prompt_ids)]
    for a in st["accepted_per_cycle"]:
        bonus_at.append(bonus_at[-1] + a + 1)
    for p in bonus_at:
        if p < len(seq):
            assert seq[p] == pred[p - 1], f"bonus at {p} is not the target's argmax"
    if topk == 1:  # a chain has room for every drawn acceptance; trees may be shallower
        assert 2.3 < st["accept_length"] < 3.7


def test_spec_sampling_is_seeded(tiny_model_dir):
    llm = _spec_llm(tiny_model_dir, 3, 1, None)
    p = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a = llm.generate(PROMPT, p)[0].token_ids
    assert a == llm.generate(PROMPT, p)[0].token_ids
    tree = _spec_llm(tiny_model_dir, 3, 2, 6)
    b = tree.generate(PROMPT, p)[0].token_ids
    assert b == tree.generate(PROMPT, p)[0].token_ids


def test_spec_near_context_end_falls_back_to_plain(tiny_model_dir, plain):
    """A request ending at the context limit completes (the last tokens decode plainly)."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", max_model_len=64,
              spec=SpecConfig(draft="random", num_steps=5))
    n_prompt = len(llm.encode_prompt(PROMPT))
    params = SamplingParams(max_tokens=64 - n_prompt, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    ref = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", max_model_len=64)
    assert out.token_ids == ref.generate(PROMPT, params)[0].token_ids


@pytest.mark.parametrize("kwargs", [
    {"num_steps": 0}, {"topk": 0}, {"num_steps": 3, "topk": 1, "num_draft_tokens": 5},
    {"num_steps": 2, "topk": 2, "num_draft_tokens": 9}, {"simulate_acceptance": 9.0},
    {"simulate_acceptance": (0.5, 1.5)}, {"confidence_stop": 1.0},
    {"confidence_stop": -0.1}, {"confidence_stop": "0.2"},
    {"confidence_stop": 0.2, "topk": 2, "num_draft_tokens": 6},
    {"confidence_stop": 0.2, "simulate_acceptance": 3.0},
])
def test_spec_config_validation(kwargs):
    with pytest.raises(ValueError):
        SpecConfig(draft="random", **kwargs)


def _pick_probs_from(monkeypatch, values: list[float]) -> None:
    """draft_chain's pick probabilities replaced by `values` in turn (one per row and
    step), so chains end at varied depths whatever the random draft's distributions."""
    import specscope.spec.drafter as drafter

    it = iter(values * 1000)
    monkeypatch.setattr(drafter, "pick_probs", lambda logits, d, qs: torch.tensor(
        [next(it) for _ in range(d.shape[0])]))


def test_confidence_stop_is_lossless_and_counts_what_it_drafted(monkeypatch, tiny_model_dir,
                                                                reference):
    """Chains the confidence stop ends after 0 to num_steps tokens: greedy output equal to
    plain decoding's, each cycle's drafted positions recorded (and the accepted never more),
    and acceptance by position counting a position only where it was drafted."""
    from specscope.engine.speculative import acceptance_by_position

    _pick_probs_from(monkeypatch, [0.9, 0.8, 0.05, 0.6, 0.3, 0.95, 0.99, 0.9, 0.9, 0.1])
    llm = _spec_llm(tiny_model_dir, 4, 1, None, confidence_stop=0.2)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS]
    st = out.spec
    drafted, accepted = st["drafted_per_cycle"], st["accepted_per_cycle"]
    assert len(drafted) == len(accepted) == st["cycles"]
    assert set(drafted) > {0, 1} and max(drafted) <= 4
    assert all(a <= d for a, d in zip(accepted, drafted, strict=True))
    cond, _ = acceptance_by_position(accepted, 4, drafted)
    assert st["acceptance_by_position"] == pytest.approx(cond, abs=1e-4)


def test_confidence_stop_with_a_noisy_oracle_and_sampling(monkeypatch, tiny_model_dir,
                                                          reference):
    """A stop that keeps every token changes nothing; one that keeps none makes every cycle
    a one-token verify, still equal to plain decoding; a sampled request under the stop
    repeats with its seed."""
    _pick_probs_from(monkeypatch, [0.5])
    llm = _spec_llm(tiny_model_dir, 3, 1, None, confidence_stop=0.01)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS] and set(out.spec["drafted_per_cycle"]) == {3}
    llm = _spec_llm(tiny_model_dir, 3, 1, None, confidence_stop=0.6)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:N_TOKENS]
    assert set(out.spec["drafted_per_cycle"]) == {0} and out.spec["accept_length"] == 1.0
    _pick_probs_from(monkeypatch, [0.9, 0.9, 0.3])
    llm = _spec_llm(tiny_model_dir, 3, 1, None, confidence_stop=0.5)
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    a = llm.generate(PROMPT, p)[0]
    assert a.token_ids == llm.generate(PROMPT, p)[0].token_ids and len(a.token_ids) == 20
    assert max(a.spec["drafted_per_cycle"]) <= 2


def test_the_machine_chooses_the_confidence_stop():
    """None: on for a trained draft's chain on the CPU, off on CUDA, for trees, a random
    draft and simulated acceptance; an explicit value as given; none under tensor
    parallelism, where an explicit one is refused."""
    from specscope.engine.machine import CPU_CONFIDENCE_STOP, resolve_confidence_stop

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_confidence_stop(SpecConfig(draft="d"), cpu) == CPU_CONFIDENCE_STOP
    assert resolve_confidence_stop(SpecConfig(draft="d"), cuda) == 0.0
    assert resolve_confidence_stop(SpecConfig(draft="d", topk=2), cpu) == 0.0
    assert resolve_confidence_stop(SpecConfig(draft="random"), cpu) == 0.0
    assert resolve_confidence_stop(SpecConfig(draft="d", simulate_acceptance=2.0), cpu) == 0.0
    assert resolve_confidence_stop(SpecConfig(draft="d", confidence_stop=0.3), cuda) == 0.3
    assert resolve_confidence_stop(SpecConfig(draft="d", confidence_stop=0.0), cpu) == 0.0
    assert resolve_confidence_stop(SpecConfig(draft="d"), cpu, 2) == 0.0
    with pytest.raises(ValueError, match="tensor parallelism"):
        resolve_confidence_stop(SpecConfig(draft="d", confidence_stop=0.3), cpu, 2)


def test_spec_needs_a_draft(tiny_model_dir):
    with pytest.raises(ValueError, match="draft"):
        LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=SpecConfig())


def test_phase_timing_splits_the_cycle(tiny_model_dir):
    llm = _spec_llm(tiny_model_dir, 3, 2, 6, simulate_acceptance=2.5)
    prof = llm.enable_profiling(True, interval=None)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    s = llm.profile_summary()[0]
    assert s["cycles"] == out.spec["cycles"] and s["simulated"]
    for phase in ("draft_extend", "draft_step[1]", "draft_step[2]", "tree_build", "verify",
                  "accept", "kv_commit", "detokenize", "other"):
        assert phase in s["phases"], phase
    assert s["request_phases_ms"]["prefill"] > 0
    assert s["accept_length"] == pytest.approx(out.spec["accept_length"])
    llm.set_spec(None)  # hot switch to plain decoding, same weights
    llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    plain = prof.summary("plain")
    assert plain["cycles"] == 4 and "decode" in plain["phases"]


@pytest.mark.parametrize("fmt", ["sglang", "eagle", "speculators"])
def test_cli_generate_with_a_draft_checkpoint(tmp_path, tiny_model_dir, reference, capsys, fmt):
    """`specscope generate --draft DIR` loads each format; greedy output equals plain."""
    import json

    from specscope.cli import main
    from specscope.draft.eagle3 import random_draft
    from specscope.draft.formats import save_draft
    from specscope.models.loader import read_config

    cfg = read_config(tiny_model_dir)
    draft = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=1000, seed=1)
    out_dir = tmp_path / fmt
    ids = None if fmt == "eagle" else "0,1,1"
    if ids:
        draft = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=1000, seed=1,
                             layer_ids=(0, 1, 1))
    save_draft(draft, draft.config, out_dir, fmt)
    argv = ["generate", "--model", str(tiny_model_dir), "--dtype", "fp32", "--device", "cpu",
            "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos", "--json",
            "--draft", str(out_dir), "--speculative-num-steps", "3"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["token_ids"] == reference[1][:12]
    assert res["spec"]["cycles"] > 0 and res["spec"]["simulated"] is False


def test_simulated_siblings_take_the_drawn_kept_rank():
    """Simulated acceptance in a tree: a rejected top child passes to the next-ranked kept
    sibling (rate `sibling`); a drawn rank the tree did not keep ends the cycle."""
    from specscope.spec.simulate import simulated_verdict

    # root 0; depth 1: 1 (rank 1), 2 (rank 2); depth 2: 3, 4 under 1 and 5 under 2
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    tree = DraftTree(tokens=t([10, 11, 12, 13, 14, 15]), parents=t([-1, 0, 0, 1, 1, 2]),
                     depth=t([0, 1, 1, 2, 2, 2]))
    logits = torch.zeros(6, 20)
    rates = torch.tensor([0.5, 0.5])
    # depth 1: top child rejected (0.9 > 0.5), sibling accepted (0.1 < 0.5) -> node 2;
    # depth 2: top child of node 2 accepted -> node 5
    v = simulated_verdict(tree, logits, None, rates, torch.tensor([[0.9, 0.1], [0.2, 0.9]]),
                          2, 2, None, sibling=0.5)
    assert v.path.tolist() == [0, 2, 5] and int(v.num_accepted) == 2
    # depth 2 draws rank 2, but node 2 kept one child: the cycle ends after node 2
    v = simulated_verdict(tree, logits, None, rates, torch.tensor([[0.9, 0.1], [0.9, 0.1]]),
                          2, 2, None, sibling=0.5)
    assert v.path.tolist() == [0, 2, -1] and int(v.num_accepted) == 1
    # without a sibling rate only the top-ranked path counts (the chain behaviour)
    v = simulated_verdict(tree, logits, None, rates, torch.tensor([[0.9, 0.1], [0.2, 0.1]]),
                          2, 2, None, sibling=0.0)
    assert v.path.tolist() == [0, -1, -1] and int(v.num_accepted) == 0
    v = simulated_verdict(tree, logits, None, rates, torch.tensor([0.2, 0.3]), 2, 2, None)
    assert v.path.tolist() == [0, 1, 3] and int(v.num_accepted) == 2
    with pytest.raises(ValueError, match="simulate_sibling"):
        SpecConfig(draft="random", topk=2, num_draft_tokens=4, simulate_acceptance=3.0,
                   simulate_sibling=1.0)


def test_switching_speculation_keeps_requests_in_flight(tiny_model_dir, plain):
    """set_spec while requests run (a server's /admin/spec): into a new engine (plain to
    speculative and back) they carry over with their KV recomputed; between configurations
    of one draft the engine switches in place, keeping their KV. Either way they still give
    their greedy outputs; nothing leaks."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    prompts = [PROMPT, "Once upon a time", "1 2 3 4"]
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, p)]
    rids = [llm.add_request(llm.encode_prompt(x), p) for x in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    switches = iter([SpecConfig(draft="random", num_steps=3),
                     SpecConfig(draft="random", num_steps=2, topk=2, num_draft_tokens=4), None])
    step = 0
    while llm.has_unfinished_requests():
        for d in llm.step():
            got[d.request_id] += d.token_ids
        step += 1
        if step % 4 == 0:
            before = llm.engine
            nxt = next(switches, None)
            llm.set_spec(nxt)
            same_draft = nxt is not None and before.draft is not None
            assert (llm.engine is before) == same_draft
    assert [got[r] for r in rids] == want
    assert llm.engine.pool.all_free()


def test_retarget_keeps_the_engine_and_checks_the_tree(tiny_model_dir):
    """Switching among one draft's configurations keeps the engine and its KV pools; a tree
    past max_num_batched_tokens is refused with the limit named, the engine unchanged."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", max_num_batched_tokens=16,
              max_num_seqs=4, spec=SpecConfig(draft="random", num_steps=3))
    engine, kv = llm.engine, llm.engine.kv
    llm.set_spec(SpecConfig(draft="random", num_steps=4, topk=4, num_draft_tokens=16))
    assert llm.engine is engine and llm.engine.kv is kv
    assert engine.scheduler.spec_tokens == 16 and engine.spec.topk == 4
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.retarget(SpecConfig(draft="random", num_steps=6, topk=8, num_draft_tokens=32))
    assert engine.spec.num_draft_tokens == 16
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_each_configuration_keeps_its_simulated_stream(tiny_model_dir):
    """Across in-place switches each configuration draws on from where it stopped, a new one
    from the seed (as a new engine would); reset_simulation restarts every stream."""
    a = SpecConfig(draft="random", num_steps=3)
    b = SpecConfig(draft="random", num_steps=2, topk=2, num_draft_tokens=4)
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=a)
    ref = torch.rand(9, generator=torch.Generator().manual_seed(a.simulate_seed))
    e = llm.engine
    a1 = torch.rand(3, generator=e.sim_gen)
    llm.set_spec(b)
    b1 = torch.rand(3, generator=e.sim_gen)
    llm.set_spec(a)
    a2 = torch.rand(3, generator=e.sim_gen)
    assert llm.engine is e
    assert torch.equal(a1, ref[:3]) and torch.equal(b1, ref[:3]) and torch.equal(a2, ref[3:6])
    llm.reset_simulation()
    llm.set_spec(b)
    assert torch.equal(torch.rand(3, generator=e.sim_gen), ref[:3])
