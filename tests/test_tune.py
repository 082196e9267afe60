"""Tests for specscope.tune: the cost model recovers known costs, the acceptance model predicts
the engine's accept length for configurations it did not run, hot reconfiguration is lossless.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from specscope import LLM, SamplingParams, SpecConfig
from specscope.config import ServerConfig
from specscope.train.ttt import walk_cycles
from specscope.tune.cost import Calibration, CostModel, calibration_from_summary, fit_cost_model

pytestmark = pytest.mark.usefixtures("single_thread")


def test_cost_model_recovers_known_costs_from_synthetic_timings():
    """Timings made from known terms (a tree's per-depth work included), with 1 % noise, on
    the tuner's own calibration set: the fit recovers the terms and predicts shapes it never
    saw; its residuals are small and reported per calibration point."""
    from specscope.tune.tuner import CALIBRATION

    true = CostModel(a_draft=0.16, b_step=0.11, c_tree=0.08, e_tree=0.11, b_row=0.005,
                     a_verify=2.47, b_verify=0.01, c_tree_verify=0.33, d_tree_verify=0.035,
                     other=0.13, plain=2.2)
    rng = random.Random(0)
    cals = [Calibration(s, k, n, true.draft_ms(s, k, n) * (1 + rng.gauss(0, 0.01)),
                        true.verify_ms(s, k, n) * (1 + rng.gauss(0, 0.01)),
                        true.other)
            for s, k, n in CALIBRATION]
    fit = fit_cost_model(cals, plain_ms=2.2)
    for s, k, n in [(7, 1, 8), (10, 8, 64), (2, 2, 4), (5, 3, 21), (5, 4, 26)]:
        assert fit.cycle_ms(s, k, n) == pytest.approx(true.cycle_ms(s, k, n), rel=0.03)
    assert fit.d_tree_verify == pytest.approx(0.035, abs=0.02)
    assert fit.e_tree == pytest.approx(0.11, rel=0.15)
    assert fit.plain_tok_per_s == pytest.approx(1000 / 2.2)
    assert fit.tok_per_s(3.0, 5, 1, 6) == pytest.approx(3000 / fit.cycle_ms(5, 1, 6))
    assert len(fit.residuals["draft"]) == len(CALIBRATION)
    assert fit.worst_residual() < 0.03


def _h200_classes(n: int) -> str:
    """The default model's kernel classes on the H200 (3 query heads per KV head)."""
    from specscope.engine.machine import kernel_class

    return kernel_class(n, 3, 1, (16, 32, 64, 128), 16)


def test_kernel_classes_follow_the_attention_tile_and_the_linear():
    from specscope.engine.machine import kernel_class, verify_kernel_class

    assert _h200_classes(5) == _h200_classes(2) != _h200_classes(6) == _h200_classes(10)
    assert _h200_classes(11).startswith("attention 64 rows x 1, few-row")
    assert _h200_classes(17) == "attention 64 rows x 1, GEMM"
    assert _h200_classes(43) == "attention 128 rows x 2, GEMM"
    assert kernel_class(4, 1, 8, None, 16) == "GEMM"  # 32 rows of a batch of 8
    assert kernel_class(4, 1, 1, None, None) is None
    cfg = SimpleNamespace(num_heads=9, num_kv_heads=3, mla=None)
    assert verify_kernel_class(cfg, torch.device("cpu"), torch.float32, 8) is None


def test_the_cost_model_fits_each_kernel_class_its_own_step():
    """Verify costs that step with the kernel class (a 32-row tile dearer than a 64-row one,
    as on the H200), on the tuner's calibration shapes for that machine: the classed fit
    recovers every step, either sign, and prices configurations it never ran within 3 %;
    the fit linear in n cannot."""
    from specscope.tune.calibration import calibration_shapes
    from specscope.tune.tuner import all_configs

    step = {"attention 16 rows x 1, few-row linear": 0.0,
            "attention 32 rows x 1, few-row linear": 0.31,
            "attention 64 rows x 1, few-row linear": -0.03,
            "attention 64 rows x 1, GEMM": 0.25, "attention 128 rows x 1, GEMM": 0.61,
            "attention 128 rows x 2, GEMM": 0.9}
    true = CostModel(a_draft=0.44, b_step=0.086, c_tree=0.11, e_tree=0.087, b_row=0.008,
                     a_verify=1.34, b_verify=0.008, c_tree_verify=0.32, d_tree_verify=0.063,
                     other=0.28, plain=1.34, kernel_class=_h200_classes, verify_class_ms=step)
    configs = all_configs(10)
    shapes = calibration_shapes(_h200_classes, configs)
    assert {_h200_classes(c[2]) for c in shapes} == set(step)  # every class measured
    assert len(shapes) > 4 + len(step) - 1  # a point to spare on the verify line
    rng = random.Random(1)
    cals = [Calibration(*c, true.draft_ms(*c) * (1 + rng.gauss(0, 0.005)),
                        true.verify_ms(*c) * (1 + rng.gauss(0, 0.005)), true.other)
            for c in shapes]
    fit = fit_cost_model(cals, plain_ms=1.34, kernel_class=_h200_classes)
    # The 32-row step, measured by chains and trees alike, comes back; a class one shape
    # reaches also takes that shape's noise and trades with the per-token term, so its step
    # is judged by the cycles it predicts: within 3 %.
    s32, s64 = (fit.verify_class_ms[f"attention {r} rows x 1, few-row linear"] for r in (32, 64))
    assert s32 == pytest.approx(0.31, abs=0.05) and s64 < s32
    worst = max(abs(fit.cycle_ms(*c) / true.cycle_ms(*c) - 1) for c in configs)
    assert worst < 0.03, worst
    linear = fit_cost_model(cals, plain_ms=1.34)
    assert max(abs(linear.cycle_ms(*c) / true.cycle_ms(*c) - 1) for c in configs) > 0.05
    assert fit.as_dict()["verify_class_ms"]["attention 32 rows x 1, few-row linear"] > 0.25


def test_a_kernel_class_no_calibration_measured_is_refused():
    """A prediction in a class the calibration never reached would be a guess: it raises."""
    cals = [Calibration(*c, 1.0 + c[0], 1.4 + (0.3 if c[2] > 5 else 0.0), 0.2)
            for c in [(1, 1, 2), (4, 1, 5), (8, 1, 9), (2, 4, 8), (3, 4, 8), (5, 2, 10),
                      (6, 8, 10), (7, 1, 8)]]
    fit = fit_cost_model(cals, plain_ms=1.3, kernel_class=_h200_classes)
    assert fit.verify_ms(8, 1, 9) > fit.verify_ms(4, 1, 5)  # measured classes price
    with pytest.raises(ValueError, match="kernel class"):
        fit.verify_ms(6, 8, 32)


def test_without_kernel_classes_the_calibration_is_the_seven_shapes():
    from specscope.tune.calibration import CALIBRATION, calibration_shapes
    from specscope.tune.tuner import all_configs

    assert calibration_shapes(None, all_configs(10)) == CALIBRATION


def test_cost_terms_are_never_fitted_negative():
    """A cost falling with the number of steps is noise: the fit holds that term at 0 and
    refits the rest (exact non-negative least squares), instead of pricing deep trees below
    shallow ones."""
    from specscope.tune.cost import _lstsq

    rows = [[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]]
    assert _lstsq(rows, [2.0, 1.5, 1.0]) == pytest.approx([1.5, 0.0])
    assert _lstsq(rows, [1.0, 1.5, 2.0]) == pytest.approx([1.0, 0.5])  # unconstrained


def test_cost_model_refuses_a_calibration_that_cannot_identify_a_term():
    """Chains alone cannot tell a tree's per-depth work from its per-row work; trees of one
    depth cannot either. The fit says so instead of sharing one effect between terms."""
    cal = [Calibration(s, k, n, 1.0 + s, 2.5 + 0.01 * n, 0.1)
           for s, k, n in [(1, 1, 2), (4, 1, 5), (8, 1, 9)]]
    with pytest.raises(ValueError, match="cannot identify the draft terms"):
        fit_cost_model(cal, plain_ms=2.0)
    same_depth = cal + [Calibration(3, k, n, 2.0, 3.0, 0.1) for k, n in [(2, 6), (4, 12)]]
    with pytest.raises(ValueError, match="cannot identify"):
        fit_cost_model(same_depth, plain_ms=2.0)


def test_calibration_reads_profiler_summaries():
    summary = {"cycles": 10, "phases": {
        "draft_extend": {"mean_ms": 1.0}, "draft_step[1]": {"mean_ms": 2.0},
        "draft_step[2]": {"mean_ms": 2.0},
        "tree_build": {"mean_ms": 0.5}, "verify": {"mean_ms": 30.0}, "accept": {"mean_ms": 0.2},
        "kv_commit": {"mean_ms": 0.3}, "detokenize": {"mean_ms": 0.1},
        "other": {"mean_ms": 0.4}}}
    c = calibration_from_summary(summary, 5, 1, 6)
    assert (c.draft_ms, c.verify_ms, c.other_ms) == pytest.approx((5.5, 30.5, 0.5))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return LLM(str(default_model_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def model_and_prompts(engine):
    from specscope.bench.datasets import load_prompts
    from specscope.doctor.probe import target_probe_data
    from specscope.draft.loader import load_draft
    from specscope.tune.acceptance import measure_acceptance

    prompts = load_prompts("gsm8k", 2) + load_prompts("mt_bench", 1)
    engine.set_spec(None)
    answers = [engine.generate(p, SamplingParams(max_tokens=48))[0].token_ids for p in prompts]
    data = target_probe_data(engine.model, [engine.encode_prompt(p) for p in prompts],
                             48, answers=answers)
    draft = load_draft("default", engine.model_config).model
    draft.attach_target(engine.model)
    return measure_acceptance(draft, data, depth=6), prompts


@pytest.mark.parametrize("cfg", [(5, 1, None), (2, 2, 4), (6, 3, 12), (5, 8, 40)])
def test_acceptance_model_predicts_unrun_configurations(engine, model_and_prompts, cfg):
    """Measured once (6 steps deep, teacher-forced on the engine's own greedy answers, trees
    unrolled), the model replays the engine's cycles of configurations it never ran: in fp32
    the very same accepted counts, cycle by cycle, but for each answer's last cycle (the
    engine drafts past the answer's end, where the model has no tokens: it counts no more
    than the answer holds)."""
    model, prompts = model_and_prompts
    engine.set_spec(SpecConfig(draft="default", num_steps=cfg[0], topk=cfg[1],
                               num_draft_tokens=cfg[2], confidence_stop=0.0))
    try:
        runs = [engine.generate(p, SamplingParams(max_tokens=48))[0].spec["accepted_per_cycle"]
                for p in prompts]
    finally:
        engine.set_spec(None)
    a = model.accepted_depths(*cfg).tolist()
    for b, run in enumerate(runs):
        replay = walk_cycles(a[b:b + 1], [[(model.starts[b], model.ends[b])]])
        assert replay[:-1] == run[:-1], b
        assert len(replay) == len(run) and replay[-1] <= run[-1], b
    measured = 1 + sum(map(sum, runs)) / sum(map(len, runs))
    assert model.tau(*cfg) == pytest.approx(measured, rel=0.03)
    by_rank = model.acceptance_by_rank(4)
    assert len(by_rank) == 6 and 0 < by_rank[0][0] < 1


def test_hot_reconfiguration_keeps_greedy_outputs(engine):
    """Switching speculation on, between configurations and off, with the weights loaded
    once: greedy outputs stay identical to plain decoding."""
    msgs = [{"role": "user", "content": "Name three prime numbers."}]
    params = SamplingParams(max_tokens=32)
    ref = engine.generate(msgs, params)[0].token_ids
    model = engine.model
    for spec in [SpecConfig(draft="default", num_steps=5),
                 SpecConfig(draft="default", num_steps=3, topk=4, num_draft_tokens=10),
                 SpecConfig(draft="default", num_steps=1), None,
                 SpecConfig(draft="default", num_steps=7)]:
        engine.set_spec(spec)
        assert engine.generate(msgs, params)[0].token_ids == ref, spec
        assert engine.model is model
    engine.set_spec(None)


def test_admin_endpoint_switches_speculation_without_reloading(tmp_path, tiny_model_dir):
    """POST /admin/spec changes num_steps / topk / num_draft_tokens or turns speculation
    off and on between requests; outputs stay the plain greedy ones; bad input is a 400."""
    import httpx
    import torch

    from specscope.draft.eagle3 import random_draft
    from specscope.draft.formats import save_draft
    from specscope.models.loader import read_config
    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    cfg = read_config(tiny_model_dir)
    draft = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=1000, seed=1)
    d = save_draft(draft, draft.config, tmp_path / "draft", "sglang")
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
              spec=SpecConfig(draft=str(d), num_steps=4))
    plain = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    body = {"model": "x", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    ref = plain.generate(body["prompt"], SamplingParams(max_tokens=12))[0].text
    weights = llm.model
    admin = ServerConfig(served_model_name="x", api_keys=("k",), enable_admin=True)
    key = {"Authorization": "Bearer k"}
    srv = BackgroundServer(create_app(llm, admin))
    try:
        with httpx.Client(base_url=srv.url, timeout=60, headers=key) as c:
            assert c.get("/admin/spec").json()["num_steps"] == 4
            for change, want in [({"num_steps": 2}, (2, 1, 3)),
                                 ({"topk": 4, "num_draft_tokens": 8}, (2, 4, 8)),
                                 ({"enabled": False}, None), ({"enabled": True}, (2, 4, 8)),
                                 ({"num_steps": 6, "topk": 1}, (6, 1, 7))]:
                r = c.post("/admin/spec", json=change)
                assert r.status_code == 200, r.text
                s = r.json()
                got = (s["num_steps"], s["topk"], s["num_draft_tokens"]) if s["enabled"] \
                    else None
                assert got == want, (change, s)
                out = c.post("/v1/completions", json=body).json()
                assert out["choices"][0]["text"] == ref
            for bad in [{"topk": 0}, {"num_steps": 3, "topk": 1, "num_draft_tokens": 9},
                        {"speed": "max"}, [1], {"num_steps": True}, {"num_steps": 17},
                        {"num_steps": 1000000000}, {"topk": 17}, {"enabled": "no"},
                        {"enabled": 0}, {"num_steps": "3"}, {"enabled": False, "topk": 2}]:
                r = c.post("/admin/spec", json=bad)
                assert r.status_code == 400 and "error" in r.json(), (bad, r.text)
        assert llm.model is weights
    finally:
        srv.stop()
    bare = BackgroundServer(create_app(plain, admin))
    try:
        r = httpx.post(f"{bare.url}/admin/spec", json={"num_steps": 3}, headers=key)
        assert r.status_code == 400 and "--draft" in r.json()["error"]["message"]
    finally:
        bare.stop()


def test_simulated_acceptance_model_matches_its_profile():
    """AcceptanceModel.simulated: chains give the analytic accept length of the rates; a
    sibling rate makes wider trees accept more; rates repeat their last value."""
    from specscope.tune.acceptance import AcceptanceModel

    rates = (0.8, 0.7, 0.6)
    m = AcceptanceModel.simulated(rates, 0.0, depth=6, positions=40_000)
    expect, run = 1.0, 1.0
    for a in (0.8, 0.7, 0.6, 0.6, 0.6):
        run *= a
        expect += run
    assert m.tau(5, 1) == pytest.approx(expect, rel=0.02)
    assert m.tau(5, 4, 20) == pytest.approx(m.tau(5, 1), rel=1e-6)  # no sibling: no gain
    ms = AcceptanceModel.simulated(rates, 0.4, depth=6, positions=40_000)
    assert ms.tau(5, 1) == pytest.approx(expect, rel=0.02)
    assert ms.tau(5, 2, 10) > ms.tau(5, 1) + 0.2
    # With the draft's scores, chains are unchanged: no node is cut by rounding (its own
    # score, summed in another order, must not outrank it).
    import torch

    g = torch.Generator().manual_seed(0)
    scores = -(10.3 + 0.05 * torch.rand(200, 6, 8, generator=g)).sort(-1).values
    with_scores = AcceptanceModel.simulated(rates, 0.0, depth=6, positions=40_000,
                                            scores=scores)
    for c in [(2, 1, 3), (4, 1, 5), (6, 1, 7)]:
        assert with_scores.tau(*c) == pytest.approx(m.tau(*c), abs=1e-9), c


def test_the_draft_stays_loaded_while_speculation_is_off(monkeypatch):
    """set_spec(None) then speculation again (a tuner alternating plain and speculative
    runs, or POST /admin/spec enabled=true) reuses the loaded draft; new taps reload it."""
    import torch

    import specscope.engine.llm as llm_module
    from specscope.config import ModelConfig
    from specscope.models.loader import random_model

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512})
    llm = LLM.from_model(random_model(cfg, torch.float32, "cpu"), max_model_len=512)
    loads = []
    real = llm_module.load_spec_draft
    monkeypatch.setattr(llm_module, "load_spec_draft",
                        lambda *a, **k: loads.append(1) or real(*a, **k))
    for spec in (SpecConfig(draft="random", num_steps=2), None,
                 SpecConfig(draft="random", num_steps=3, topk=2, num_draft_tokens=5), None,
                 SpecConfig(draft="random", num_steps=2)):
        llm.set_spec(spec)
        llm.generate("1 2 3", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(loads) == 1
    llm.set_spec(SpecConfig(draft="random", num_steps=2, draft_layer_ids=(0, 1, 2)))
    assert len(loads) == 2


def test_batched_predictions_equal_one_by_one():
    """AcceptanceModel.taus (thresholds per (steps, topk)) gives every configuration's tau
    exactly as tau() one at a time, for a measured (walked) and a simulated (iid) model."""
    import torch

    from specscope.tune.acceptance import INF_RANK, AcceptanceModel
    from specscope.tune.tuner import all_configs

    g = torch.Generator().manual_seed(0)
    r = torch.randint(1, 5, (3, 120, 10), generator=g)
    r[r == 4] = INF_RANK
    walked = AcceptanceModel(
        ranks=r, starts=[5, 3, 10], ends=[100, 120, 90],
        path_lp=-torch.rand(3, 120, 10, generator=g) * 3,
        top_lp=-(torch.rand(3, 120, 10, 8, generator=g) * 4).sort(-1).values)
    simulated = AcceptanceModel.simulated((0.8, 0.7, 0.6), 0.35, positions=2000)
    cfgs = all_configs(10)
    for m in (walked, simulated):
        batched = m.taus(cfgs)
        assert set(batched) == set(cfgs)
        for c in cfgs[::7]:
            assert batched[c] == pytest.approx(m.tau(*c), abs=1e-9), c


def test_simulated_trees_take_their_shape_from_the_running_draft():
    """A random draft's flat scores fill EAGLE-2's tree breadth first, so a simulated profile
    accepts less in wide, shallow-budget trees than its ranks alone say. The tuner's simulated
    model (scores from the running draft) predicts the engine's tau within 10 % on trees and
    chains; the rank-only bound misses (6, 4, 16) by far more, so this test can fail."""
    import torch

    from specscope.config import ModelConfig
    from specscope.models.loader import random_model
    from specscope.tune.acceptance import AcceptanceModel
    from specscope.tune.tuner import run_config, simulated_acceptance

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048})
    llm = LLM.from_model(random_model(cfg, torch.float32, "cpu"), max_model_len=2048)
    rates = (0.85, 0.8, 0.75, 0.7, 0.7, 0.65)
    base = SpecConfig(draft="random", simulate_acceptance=rates)
    prompts = ["1 2 3 4 5 6 7 8 9 10 11 12", "40 41 42 43 44 45 46 47 48 49"]
    model = simulated_acceptance(llm, "random", base, prompts, depth=6)
    rank_only = AcceptanceModel.simulated(rates, 0.0, depth=6)
    params = SamplingParams(max_tokens=600, ignore_eos=True)
    errs = {}
    for c in [(5, 1, 6), (6, 4, 16), (6, 2, 16), (4, 4, 8), (3, 8, 16)]:
        measured = run_config(llm, c, "random", prompts[:1], params, base)
        errs[c] = model.tau(*c) / measured.accept_length - 1
        assert abs(errs[c]) < 0.10, (c, model.tau(*c), measured.accept_length)
    assert rank_only.tau(6, 4, 16) / (1 + errs[(6, 4, 16)]) > 1.25 * model.tau(6, 4, 16)


def test_pick_breaks_near_ties_by_measurement_and_prediction():
    """Confirmed runs within the tie margin of the fastest are tied, and the tie goes to the
    best of measurement and prediction together: a prediction well ahead wins over a
    measurement slightly ahead, predictions the model cannot tell apart leave it to the
    measurement; a clear measured win stands; plain decoding competes like any
    configuration."""
    from specscope.tune.result import Measured
    from specscope.tune.tuner import pick

    preds = {(4, 1, 5): (3.16, 85.0), (5, 1, 6): (3.38, 77.1), (3, 1, 4): (2.84, 77.7)}
    runs = [Measured(None, 38.8, 1.0, 5.0), Measured((4, 1, 5), 88.7, 3.46, 2.0),
            Measured((3, 1, 4), 85.0, 3.05, 2.0), Measured((5, 1, 6), 91.0, 3.54, 2.0)]
    # 2.5 % behind in the run, 9 % ahead in the model: the model decides
    assert pick(runs, preds, 38.8).config == (4, 1, 5)
    assert pick(runs, preds, 38.8, tie_margin=0.0).config == (5, 1, 6)
    # predicted 0.4 % apart (the H200's (6, 1, 7) against (5, 1, 6), measured 2.8 % apart,
    # and 3 % apart in paired re-runs): the measurement decides
    close = {(6, 1, 7): (3.53, 457.5), (5, 1, 6): (3.38, 455.7)}
    tied = [Measured((6, 1, 7), 492.5, 3.84, 1.0), Measured((5, 1, 6), 506.7, 3.72, 1.0)]
    assert pick(tied, close, 204.4).config == (5, 1, 6)
    runs[3] = Measured((5, 1, 6), 95.0, 3.54, 2.0)  # 7 % ahead: the measurement decides
    assert pick(runs, preds, 38.8).config == (5, 1, 6)
    slow = [Measured(None, 40.0, 1.0, 5.0), Measured((4, 1, 5), 39.5, 1.2, 2.0)]
    # tied with plain, and plain predicted faster: speculation off
    assert pick(slow, {(4, 1, 5): (1.2, 39.0)}, 41.0).config is None


def test_interleaved_confirmation_keeps_the_engine(tiny_model_dir):
    """Confirmation runs alternate configurations prompt by prompt on one engine (no
    rebuild), each measured over every prompt, in the order given."""
    from specscope.tune.tuner import measure_interleaved

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
              spec=SpecConfig(draft="random", num_steps=2))
    engine = llm.engine
    cfgs = [(3, 1, 4), (2, 2, 4), (1, 1, 2)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = measure_interleaved(llm, cfgs, "random", ["1 2 3", "Once upon a time"], params)
    assert [m.config for m in got] == cfgs and llm.engine is engine
    assert all(m.tok_per_s > 0 and m.seconds > 0 and m.accept_length >= 1 for m in got)
    assert llm.spec.num_steps == 1  # left on the last configuration run


def test_confirmation_always_covers_both_families_and_the_served_config():
    """A cost model that under-prices trees ranks trees first: the best predicted chain must
    still be confirmed (on the H200 the pick was 9 % below a chain the tuner never ran), and
    so must the best tree and the configuration being served."""
    from specscope.tune.tuner import confirmation_set

    preds = {(5, 3, 21): (4.0, 780.0), (5, 4, 26): (4.1, 770.0), (3, 4, 13): (3.6, 760.0),
             (5, 1, 6): (3.4, 700.0), (4, 1, 5): (3.2, 690.0), (7, 1, 8): (3.5, 650.0)}
    must, more = confirmation_set(preds, 1)
    assert must == [(5, 3, 21), (5, 1, 6)] and more == [(5, 4, 26)]
    must, more = confirmation_set(preds, 1, served=(7, 1, 8))
    assert must == [(5, 3, 21), (5, 1, 6), (7, 1, 8)] and more == [(5, 4, 26)]
    chains_only = {c: v for c, v in preds.items() if c[1] == 1}
    assert confirmation_set(chains_only, 2) == ([(5, 1, 6)], [(4, 1, 5), (7, 1, 8)])
    assert confirmation_set(preds, 0, served=(9, 9, 99)) == ([(5, 3, 21), (5, 1, 6)], [])


def test_best_at_a_batch_size_turns_speculation_off_where_it_does_not_pay():
    from specscope.tune.batch_policy import best_at
    from specscope.tune.cost import CostModel

    def cost(verify_per_token):
        return CostModel(a_draft=1.0, b_step=0.5, c_tree=0.0, e_tree=0.0, b_row=0.0,
                         a_verify=10.0, b_verify=verify_per_token, c_tree_verify=0.0,
                         d_tree_verify=0.0, other=0.2, plain=10.0)

    taus = {(3, 1, 4): 2.6, (5, 1, 6): 3.2}
    pick, pred = best_at(cost(0.1), 1, taus, 0.03)  # a cheap verify: the longer chain
    assert pick == (5, 1, 6) and pred > 100.0
    pick, pred = best_at(cost(10.0), 16, taus, 0.03)  # verify tokens dear at batch 16
    assert pick is None and pred is not None and pred < 16 * 100.0


def test_a_policy_is_fitted_at_several_batch_sizes():
    """fit_policy runs plain and the calibration shapes as 4 concurrent requests, fits that
    batch size's costs, and gives a policy whose entries are its picks (or off)."""
    import torch

    from specscope.config import ModelConfig, SpecPolicy
    from specscope.models.loader import random_model
    from specscope.tune.batch_policy import fit_policy
    from specscope.tune.tuner import CALIBRATION, spec_for

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512})
    llm = LLM.from_model(random_model(cfg, torch.float32, "cpu"), max_model_len=512)
    base = SpecConfig(draft="random", num_steps=3, simulate_acceptance=(0.8,))
    taus = {(3, 1, 4): 3.0, (5, 1, 6): 3.5, (2, 2, 4): 2.6}
    lines = []
    policy, rows = fit_policy(llm, "random", ["1 2 3", "4 5 6 7"], [1, 4], taus, (3, 1, 4),
                              SamplingParams(max_tokens=12, ignore_eos=True), CALIBRATION,
                              spec_for, base, 4, 0.03, lines.append)
    assert [r.batch for r in rows] == [4] and rows[0].plain_tok_per_s > 0
    assert rows[0].cost.plain > 0 and len(lines) == 1
    assert policy is not None and isinstance(policy, SpecPolicy)
    one, four = policy.for_batch(1), policy.for_batch(3)
    assert (one.num_steps, one.topk, one.num_draft_tokens) == (3, 1, 4)
    if rows[0].pick is None:
        assert four is None
    else:
        assert (four.num_steps, four.topk, four.num_draft_tokens) == rows[0].pick
        assert rows[0].measured_tok_per_s > rows[0].plain_tok_per_s
    # the tuner's shapes run without the confidence stop, which the flag leaves to the base
    assert SpecPolicy.parse(policy.flag(), replace(base, confidence_stop=0.0)) == policy


def test_the_acceptance_model_reads_the_served_configurations_text(tiny_model_dir,
                                                                   monkeypatch):
    """With a served configuration, its run over the prompts gives the text the acceptance
    model is measured on (a speculating engine's text, which in bf16 can part from plain
    decoding's); the configuration is confirmed again among the others (a run minutes
    earlier met another speed of the machine), listed once, from that confirmation."""
    from specscope.tune import tuner
    from specscope.tune.acceptance import AcceptanceModel

    filled: dict = {}
    real_run = tuner.run_config

    def run_spy(llm, cfg, *a, outputs=None, **k):
        got = real_run(llm, cfg, *a, outputs=outputs, **k)
        if outputs is not None:
            filled[cfg], filled["text run", cfg] = outputs, got
        return got

    def acc_spy(llm, draft, prompts, answers, *a, **k):  # a random draft has no real one
        filled["read"] = answers
        return AcceptanceModel.simulated((0.7, 0.6, 0.5), depth=3, positions=500)

    monkeypatch.setattr(tuner, "run_config", run_spy)
    monkeypatch.setattr(tuner, "_acceptance_model", acc_spy)
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    res = tuner.tune(llm, "random", ["1 2 3", "Once upon a time"], max_tokens=8, depth=3,
                     calibration_tokens=8, served=(2, 1, 3), log=lambda _: None)
    assert filled["read"] is filled[(2, 1, 3)] and len(filled["read"]) == 2
    assert [m.config for m in res.measured].count((2, 1, 3)) == 1
    listed = next(m for m in res.measured if m.config == (2, 1, 3))
    assert listed is not filled["text run", (2, 1, 3)]  # the interleaved confirmation's
    assert res.measured[0].config is None and "text_run" in res.timings
    # Each confirmed cycle's terms, modelled and measured, with the host time's spread.
    terms = res.term_errors()
    assert [tuple(r["config"]) for r in terms] == [m.config for m in res.measured[1:]]
    for r, line in zip(terms, res.term_lines(), strict=True):
        assert r["other"]["measured_ms"] > 0 and r["other_p90_ms"] >= r["other_p50_ms"] > 0
        assert line.startswith(f"[terms] {tuple(r['config'])}") and "host p50/p90" in line


def test_plain_decoding_runs_whole_only_where_it_could_win(tiny_model_dir, monkeypatch):
    """With a served configuration (whose text the acceptance model reads), plain decoding
    is priced by one calibration-length run, and run over the whole prompts only where a
    confirmed configuration comes within plain_margin of its prediction: each switch
    between plain and speculative decoding builds a new engine, and a plain run the
    recommendation cannot depend on is time the tuner need not spend."""
    from specscope.tune import tuner
    from specscope.tune.acceptance import AcceptanceModel

    plain_runs: list[tuple[int, int | None]] = []
    real_run = tuner.run_config

    def run_spy(llm, cfg, draft, prompts, params, *a, **k):
        if cfg is None:
            plain_runs.append((len(prompts), params.max_tokens))
        return real_run(llm, cfg, draft, prompts, params, *a, **k)

    monkeypatch.setattr(tuner, "run_config", run_spy)
    monkeypatch.setattr(tuner, "_acceptance_model", lambda *a, **k: AcceptanceModel.simulated(
        (0.7, 0.6, 0.5), depth=3, positions=500))
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    prompts = ["1 2 3", "Once upon a time"]
    lines: list[str] = []
    res = tuner.tune(llm, "random", prompts, max_tokens=8, depth=3, calibration_tokens=6,
                     served=(2, 1, 3), plain_margin=-1.0, log=lines.append)
    assert plain_runs == [(1, 6)] and res.plain_run is not None
    assert all(m.config is not None for m in res.measured) and res.recommended is not None
    assert "plain (not confirmed)" in res.table()
    assert any("plain decoding not confirmed" in x for x in lines)
    plain_runs.clear()
    res = tuner.tune(llm, "random", prompts, max_tokens=8, depth=3, calibration_tokens=6,
                     served=(2, 1, 3), plain_margin=100.0, log=lines.append)
    assert plain_runs == [(1, 6), (2, 8)] and res.measured[0].config is None


def test_a_budget_cuts_the_extra_confirmations_only(tiny_model_dir, monkeypatch):
    """With --budget-seconds spent, the tuner still confirms its must-runs (the top
    prediction, the best chain and tree, the served configuration) and drops the next-best
    ones; each estimated from the served configuration's whole-prompt run."""
    from specscope.tune import tuner
    from specscope.tune.acceptance import AcceptanceModel

    monkeypatch.setattr(tuner, "_acceptance_model", lambda *a, **k: AcceptanceModel.simulated(
        (0.7, 0.6, 0.5), depth=3, positions=500))
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    lines: list[str] = []
    kw = dict(max_tokens=6, depth=3, calibration_tokens=6, served=(2, 1, 3), confirm=2,
              plain_margin=-1.0, log=lines.append)
    res = tuner.tune(llm, "random", ["1 2 3"], budget_seconds=0.0, **kw)
    must, more = tuner.confirmation_set(res.predictions, 2, (2, 1, 3))
    assert [m.config for m in res.measured] == must and len(more) == 2
    assert any(f"confirming {len(must)} of {len(must) + 2}" in x for x in lines)
    res = tuner.tune(llm, "random", ["1 2 3"], budget_seconds=1e6, **kw)
    must, more = tuner.confirmation_set(res.predictions, 2, (2, 1, 3))  # this run's ranking
    assert [m.config for m in res.measured] == must + more


def test_a_trees_extra_host_time_is_its_own_term():
    """The host's time between a cycle's segments is fitted as a constant and a tree's
    extra (on the H200 trees spent 0.25-0.32 ms a cycle there, chains 0.14-0.18), both
    identified by the calibration's chains and trees, with their residuals kept."""
    from specscope.tune.tuner import CALIBRATION

    true = CostModel(a_draft=0.36, b_step=0.08, c_tree=0.1, e_tree=0.05, b_row=0.006,
                     a_verify=1.32, b_verify=0.01, c_tree_verify=0.3, d_tree_verify=0.06,
                     other=0.15, plain=1.43, tree_other=0.1)
    cals = [Calibration(s, k, n, true.draft_ms(s, k, n), true.verify_ms(s, k, n),
                        true.other_ms(s, k, n)) for s, k, n in CALIBRATION]
    fit = fit_cost_model(cals, plain_ms=1.43)
    assert fit.other == pytest.approx(0.15) and fit.tree_other == pytest.approx(0.1)
    assert fit.cycle_ms(4, 5, 21) - fit.cycle_ms(4, 1, 5) == pytest.approx(
        true.cycle_ms(4, 5, 21) - true.cycle_ms(4, 1, 5))
    assert [r["fitted_ms"] for r in fit.residuals["other"]] == pytest.approx(
        [c.other_ms for c in cals], abs=1e-4)
    chains_only = [c for c in cals if c.topk == 1]
    with pytest.raises(ValueError, match="cannot identify"):
        fit_cost_model(chains_only, plain_ms=1.43)


def test_the_calibration_measures_its_shapes_in_turn(tiny_model_dir, monkeypatch):
    """The calibration shapes run their tokens in rounds, every shape once a round, on one
    engine: a drift of the machine's speed then weighs on every shape alike instead of
    landing in the shapes measured during it (where the fit would read it as cost)."""
    from specscope.tune.calibration import CALIBRATION
    from specscope.tune.tuner import _calibrate, all_configs, run_config

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
              spec=SpecConfig(draft="random", num_steps=2))
    plain = run_config(llm, None, "random", ["1 2 3"], SamplingParams(max_tokens=4), None,
                       2).summary
    llm.set_spec(SpecConfig(draft="random", num_steps=2))
    engine, runs = llm.engine, []
    generate = llm.generate

    def recording(prompt, params=None):
        runs.append((llm.spec.num_steps, llm.spec.topk, llm.spec.num_draft_tokens,
                     params.max_tokens))
        return generate(prompt, params)

    monkeypatch.setattr(llm, "generate", recording)
    cost, run_s = _calibrate(llm, "random", ["1 2 3"], None, plain, 12, 2, all_configs(8),
                             rounds=3)
    measured = [r for r in runs if r[3] == 4]  # 12 tokens in 3 parts; warm-ups run 2
    assert [r[:3] for r in measured] == CALIBRATION * 3
    assert len(runs) == len(CALIBRATION) * 4 and llm.engine is engine
    assert len(run_s) == len(CALIBRATION) and cost.a_verify > 0
