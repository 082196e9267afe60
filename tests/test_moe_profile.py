"""MoE cost in the profile: the distinct experts each step activates (read with the step's
one device->host read, CUDA-graph padding left out), in the summaries, the text table, the
report and the trace; and the tuner's cost model pricing a verify by its experts."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specscope import LLM
from specscope.config import SamplingParams, SpecConfig
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.loader import random_model
from specscope.models.moe import SparseMoe
from specscope.models.registry import config_from_hf
from specscope.profiler.profiler import format_summary
from specscope.profiler.report import render_report
from specscope.profiler.trace import chrome_trace
from specscope.tune.cost import (
    Calibration,
    ExpertModel,
    calibration_from_summary,
    fit_cost_model,
    fit_expert_model,
    verify_columns,
)

pytestmark = pytest.mark.usefixtures("single_thread")

E, K, V = 16, 2, 64
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": V, "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_experts": E,
             "num_experts_per_tok": K, "moe_intermediate_size": 16, "norm_topk_prob": True,
             "max_position_embeddings": 128, "mlp_only_layers": [1]}


@pytest.fixture(scope="module")
def model():
    m = random_model(config_from_hf(QWEN3_MOE), torch.float32, "cpu", seed=5)
    with torch.no_grad():  # a spread-out router, so tokens pick different experts
        for block in m.moe_blocks():
            block.gate.weight.normal_(0, 1.0)
    return m


class ExpertSpy:
    """Each MoE block's picks in the last forward, from a hook: the count the engine must
    report, computed independently of SparseMoe.active."""

    def __init__(self, model) -> None:
        self.ids: list[torch.Tensor] = []
        self.handles = [b.gate.register_forward_hook(self._hook) for b in model.moe_blocks()]

    def _hook(self, module, args, out) -> None:
        self.ids.append(out[0])

    def mean_distinct(self, rows: int | None = None) -> float:
        layers = [len(set(ids[:rows].reshape(-1).tolist())) for ids in self.ids]
        return sum(layers) / len(layers)


def _seqs(n: int, seed: int, tokens: int = 12) -> list[Sequence]:
    rng = random.Random(seed)
    return [Sequence(f"s{i}", [rng.randrange(V) for _ in range(rng.randrange(3, 12))],
                     SamplingParams(max_tokens=tokens, ignore_eos=True)) for i in range(n)]


def test_each_step_reports_its_distinct_experts(model):
    """Plain and speculative steps: last_stats.experts_active equals the count over the
    target forward's tokens (a spy on the router), and a lone decode token activates
    exactly top_k experts per layer."""
    from specscope.draft.eagle3 import random_draft

    draft = random_draft(model.config, torch.float32, "cpu", seed=2)
    draft.attach_target(model)
    for spec in (None, SpecConfig(draft="random", num_steps=3, topk=2, num_draft_tokens=6)):
        engine = Engine(model, BatchConfig(num_blocks=64, block_size=4, max_num_seqs=2,
                                           max_model_len=64),
                        draft=None if spec is None else draft, spec=spec)
        for s in _seqs(2, seed=1):
            engine.add(s)
        kinds = set()
        while engine.has_work:
            spy = ExpertSpy(model)
            engine.step()
            for h in spy.handles:
                h.remove()
            st = engine.last_stats
            target = spy.ids[-len(model.moe_blocks()):]  # the draft runs no experts
            spy.ids = target
            assert st.experts_active == pytest.approx(spy.mean_distinct()), st
            if st.decode_tokens == 1 and st.num_seqs == 1:
                assert st.experts_active == K
            kinds.add("verify" if st.num_speculating else "decode" if st.decode_tokens
                      else "prefill")
        assert ("verify" in kinds) == (spec is not None) and "prefill" in kinds


def test_graph_padding_rows_are_not_counted(model):
    """The CUDA-graph decode step (run eagerly) pads 3 sequences to a bucket of 4: its
    expert counts equal the eager step's over the same tokens, step for step; counting the
    padding row too would differ."""
    def run(static: bool, count_padding: bool = False) -> list[float]:
        engine = Engine(model, BatchConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                           max_model_len=64))
        if static:
            engine._make_graphs(capture=False)
        if count_padding:
            engine.kv.scratch_block = None
        for s in _seqs(3, seed=3, tokens=10):
            engine.add(s)
        out = []
        while engine.has_work:
            engine.step()
            st = engine.last_stats
            if st.decode_tokens == 3 and not st.prefill_tokens:
                out.append(st.experts_active)
        return out

    eager = run(False)
    assert len(eager) > 3
    assert run(True) == eager
    assert run(True, count_padding=True) != eager  # the test can tell


def test_profile_shows_experts_beside_verify(model):
    llm = LLM.from_model(model, spec=SpecConfig(draft="random", num_steps=3), max_num_seqs=2,
                         kv_cache_memory=8 << 20)
    prof = llm.enable_profiling(True, interval=None)
    llm.generate(["1 2 3 4", "5 6 7"], SamplingParams(max_tokens=12, ignore_eos=True))
    s = prof.summary(prof.config)
    verify = s["experts"]["verify"]
    assert K <= verify <= E
    assert s["modes"]["phases"]["experts"]["verify"] == verify
    assert all("experts" in b for b in s["by_batch"].values())
    text = format_summary(s)
    assert "experts/layer" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("verify "))
    assert f"{verify:.1f}" in row.split()[-1]
    html = render_report([s], prof.all_records())
    assert "experts / layer" in html and "experts / MoE layer" in html
    args = [e["args"] for e in chrome_trace(prof.all_records())["traceEvents"]
            if e.get("name") == "cycle"]
    assert args and all(a["experts_active"] is not None for a in args)
    llm.enable_profiling(False)
    # A dense target has no expert column at all.
    dense = dict(s, experts={}, modes={k: dict(m, experts={}) for k, m in s["modes"].items()},
                 by_batch={b: dict(m, experts={}) for b, m in s["by_batch"].items()})
    assert "experts" not in format_summary(dense)


# -- the cost model -----------------------------------------------------------------------


def test_expert_model_is_the_uniform_expectation():
    """With E_eff = E the curve is the expected distinct count of uniform, independent
    top-k picks (checked by sampling), capped at E and k t."""
    m = ExpertModel(E, K, float(E))
    g = torch.Generator().manual_seed(0)
    for t in (1, 3, 8, 20):
        draws = [len(set(torch.cat([torch.randperm(E, generator=g)[:K] for _ in range(t)])
                         .tolist())) for _ in range(3000)]
        assert m.distinct(t) == pytest.approx(sum(draws) / len(draws), rel=0.02)
    assert m.distinct(1) == K and m.distinct(1000) == E and m.distinct(0) == 0


def test_expert_model_fit_recovers_skewed_routing():
    truth = ExpertModel(128, 8, 40.0)
    pts = [(t, truth.distinct(t)) for t in (2, 5, 9, 16, 32)]
    fit = fit_expert_model(pts, 128, 8)
    assert fit.effective == pytest.approx(40.0, rel=0.01)
    assert fit_expert_model([], 128, 8).effective == 128


CAL = [(1, 1, 2), (4, 1, 5), (8, 1, 9), (2, 4, 8), (3, 8, 16), (5, 2, 10), (6, 8, 32)]


def _cals(truth: ExpertModel, b_expert: float, b_verify: float = 0.01) -> list[Calibration]:
    out = []
    for s, k, n in CAL:
        x = truth.distinct(n)
        v = sum(c * w for c, w in zip(verify_columns(s, k, n), (2.0, b_verify, 0.3, 0.05),
                                      strict=True)) + b_expert * x
        out.append(Calibration(s, k, n, 1.0 + 0.4 * (s - 1), v, 0.1, experts=x))
    return out


def test_cost_model_fits_the_expert_term_and_prices_draft_tokens_by_it():
    truth = ExpertModel(128, 8, 60.0)
    cost = fit_cost_model(_cals(truth, b_expert=0.05), plain_ms=2.5, moe=(128, 8))
    assert cost.b_expert == pytest.approx(0.05, rel=1e-3)
    assert cost.experts.effective == pytest.approx(60.0, rel=0.01)
    assert cost.experts_for(9) == pytest.approx(truth.distinct(9), rel=1e-3)
    assert "effective_experts" in cost.as_dict()
    # Without the experts measured (a dense target) the line has no expert term.
    unmeasured = [dataclasses.replace(c, experts=None) for c in _cals(truth, 0.0)]
    dense = fit_cost_model(unmeasured, 2.5, (128, 8))
    assert dense.experts is None and dense.b_expert == 0.0

    # Chains of 1..10 steps with acceptance 0.8 a position: priced by their experts, longer
    # chains cost more, so the MoE model picks a shorter chain than a model whose verify
    # does not grow with the tokens.
    def best_chain(c) -> int:
        taus = {s: sum(0.8 ** i for i in range(s + 1)) for s in range(1, 11)}
        return max(taus, key=lambda s: c.tok_per_s(taus[s], s, 1, s + 1))

    moe = fit_cost_model(_cals(truth, b_expert=0.2, b_verify=0.0), 2.5, (128, 8))
    per_token = fit_cost_model([dataclasses.replace(c, experts=None)
                                 for c in _cals(truth, 0.0, 0.0)], 2.5)
    assert best_chain(moe) < best_chain(per_token)


def test_a_saturated_expert_count_leaves_the_expert_term_out():
    """At batch 64 every calibration's verify activates all the experts the router reaches
    (seen on the H200 with Qwen3-30B-A3B's shape, whose batch policy fit then raised: rank
    10 of 11), so X(B n) is a constant the verify's constant already holds. The fit leaves
    the term out instead of raising and prices every configuration as the truth does; at
    batch 1 the same shapes still fit it."""
    from specscope.engine.machine import kernel_class
    from specscope.tune.calibration import calibration_shapes
    from specscope.tune.tuner import all_configs

    def classes(n: int) -> str:  # Qwen3-30B-A3B: 8 query heads a KV head, GEMMs at batch 64
        return kernel_class(n, 8, 64, (16, 32, 64, 128), 16)

    truth = ExpertModel(128, 8, 10.0)
    configs = all_configs(10)
    step = {c: 0.1 * i for i, c in enumerate(sorted({classes(c[2]) for c in configs}))}
    cals = []
    for s, k, n in calibration_shapes(classes, configs, moe=True):
        x = truth.distinct(64 * n)
        v = sum(c * w for c, w in zip(verify_columns(s, k, n), (2.0, 0.05, 0.3, 0.05),
                                      strict=True)) + 0.2 * x + step[classes(n)]
        cals.append(Calibration(s, k, n, 1.0 + 0.4 * (s - 1), v, 0.1, experts=x))
    assert max(c.experts for c in cals) - min(c.experts for c in cals) < 1e-6  # saturated
    cost = fit_cost_model(cals, plain_ms=2.5, moe=(128, 8), batch=64, kernel_class=classes)
    assert cost.b_expert == 0.0 and cost.experts is not None
    for c in cals:
        assert cost.verify_ms(c.num_steps, c.topk, c.num_draft_tokens) == pytest.approx(
            c.verify_ms, rel=1e-6)
    spread = fit_cost_model(_cals(truth, b_expert=0.05), plain_ms=2.5, moe=(128, 8))
    assert spread.b_expert == pytest.approx(0.05, rel=0.02)  # batch 1: not saturated


def test_calibration_reads_the_steady_verify_experts():
    phases = {"verify_commit": {"mean_ms": 3.0}, "draft": {"mean_ms": 1.0}}
    s = {"phases": phases, "experts": {"verify": 9.0},
         "modes": {"segments": {"phases": phases, "experts": {"verify": 7.5}}}}
    assert calibration_from_summary(s, 3, 1, 4).experts == 7.5
    assert calibration_from_summary({"phases": phases, "modes": {}}, 3, 1, 4).experts is None
    assert isinstance(SparseMoe.takes_context, bool)


def test_the_tuner_fits_expert_costs_on_a_moe_target(model):
    """The tuner's own calibration (batch 1) and a batch-size fit (batch 2) on a MoE
    target: the calibrations carry their measured experts, and the cost models have an
    expert model fitted to them."""
    from specscope.tune.batch_policy import fit_batch
    from specscope.tune.tuner import CALIBRATION, _calibrate, all_configs, run_config, spec_for

    llm = LLM.from_model(model, max_num_seqs=2, kv_cache_memory=8 << 20)
    base = SpecConfig(draft="random", num_steps=3, simulate_acceptance=(0.8,))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = run_config(llm, None, "random", ["1 2 3"], params, base, 4).summary
    assert plain["experts"]["decode"] == K  # one token a step: exactly top_k per layer
    cost, _ = _calibrate(llm, "random", ["1 2 3"], base, plain, 10, 4, all_configs(3))
    assert cost.experts is not None and K <= cost.experts.effective <= 16 * E
    assert cost.b_expert >= 0 and cost.experts_for(1) == K
    assert cost.experts_for(8) > cost.experts_for(2)
    batch2, _ = fit_batch(llm, "random", ["1 2 3", "4 5 6 7"], 2, params, CALIBRATION,
                          spec_for, base, 4)
    assert batch2.batch == 2 and batch2.experts is not None
    assert batch2.experts_for(4) == pytest.approx(batch2.experts.distinct(8))


def test_a_deepseek_target_reports_its_experts():
    """DeepSeek-V3 (sigmoid scores, grouped top-k, correction bias, shared expert, a dense
    first layer) over MLA's latent cache: each step's count is the router's."""
    from specscope.models.loader import allocate

    cfg = config_from_hf(dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=V, hidden_size=32,
        intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=10, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        max_position_embeddings=128), "tiny-deepseek")
    m = allocate(cfg, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.3)
    assert len(m.moe_blocks()) == 2
    engine = Engine(m.eval(), BatchConfig(num_blocks=64, block_size=4, max_num_seqs=2,
                                          max_model_len=64))
    for s in _seqs(2, seed=4, tokens=6):
        engine.add(s)
    seen = []
    while engine.has_work:
        spy = ExpertSpy(m)
        engine.step()
        for h in spy.handles:
            h.remove()
        seen.append(engine.last_stats.experts_active)
        assert seen[-1] == pytest.approx(spy.mean_distinct())
    assert all(K <= x <= E for x in seen)
