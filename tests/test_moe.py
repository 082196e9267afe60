"""The MoE router and expert execution (models/moe.py) against direct references.

Routing is checked token by token against a plain-Python selection (sorted by score, then
expert id) on random and deliberately tied logits, for every MoEConfig routing field:
softmax / sigmoid, grouped top-k (group score = the sum of a group's two best), the
correction bias (selection only), renormalisation and scaling.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specscope.config import ModelConfig, MoEConfig
from specscope.models.moe import SparseMoe, route
from specscope.models.moe_experts import expert_counts, experts_dense, experts_looped

pytestmark = pytest.mark.usefixtures("single_thread")


def moe_cfg(**kw) -> MoEConfig:
    base = dict(num_experts=16, top_k=4, expert_intermediate_size=8, sparse_layers=(True,))
    return MoEConfig(**{**base, **kw})


ROUTINGS = {
    "mixtral": dict(num_experts=8, top_k=2),
    "qwen2_moe": dict(norm_topk_prob=False),
    "qwen3_moe": dict(norm_topk_prob=True),
    "deepseek_v3": dict(scoring="sigmoid", n_group=4, topk_group=2, correction_bias=True,
                        routed_scaling_factor=2.5),
    "grouped_softmax": dict(n_group=8, topk_group=3, norm_topk_prob=False),
    "sigmoid_plain": dict(scoring="sigmoid", top_k=3),
}


def reference_route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
                    ) -> tuple[list[list[int]], list[list[float]]]:
    """Token by token in Python: the scores (torch, the same fp32 op), then the groups and
    the experts ranked by (-score, id) explicitly."""
    scores = logits.float().softmax(-1) if moe.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    E, G = moe.num_experts, moe.n_group
    per = E // G
    all_ids, all_w = [], []
    for n in range(logits.shape[0]):
        c = choice[n].tolist()
        eligible = list(range(E))
        if G > 1:
            score = []
            for g in range(G):
                top2 = sorted(c[g * per:(g + 1) * per], reverse=True)[:2]
                score.append(float(torch.tensor(top2, dtype=torch.float32).sum()))
            groups = sorted(range(G), key=lambda g: (-score[g], g))[:moe.topk_group]
            eligible = [e for e in range(E) if e // per in groups]
        ids = sorted(eligible, key=lambda e: (-c[e], e))[:moe.top_k]
        w = [float(scores[n, e]) for e in ids]
        if moe.norm_topk_prob:
            w = [x / sum(w) for x in w]
        all_ids.append(ids)
        all_w.append([x * moe.routed_scaling_factor for x in w])
    return all_ids, all_w


def check_route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> None:
    ids, w = route(logits, moe, bias)
    ref_ids, ref_w = reference_route(logits, moe, bias)
    assert ids.shape == (logits.shape[0], moe.top_k) and ids.dtype == torch.long
    assert w.dtype == torch.float32
    assert ids.tolist() == ref_ids
    assert torch.allclose(w, torch.tensor(ref_w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_matches_per_token_reference(name):
    moe = moe_cfg(**ROUTINGS[name])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, moe.num_experts, generator=g) * 2
    bias = torch.randn(moe.num_experts, generator=g) * 0.3 if moe.correction_bias else None
    check_route(logits, moe, bias)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_ties_go_to_the_lower_id(name):
    """Logits from {0, 1, 2}: most tokens have tied experts (and tied groups); the lower
    expert (group) id must win, exactly as the reference's explicit (-score, id) order."""
    moe = moe_cfg(**ROUTINGS[name])
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (64, moe.num_experts), generator=g).float()
    bias = (torch.randint(0, 2, (moe.num_experts,), generator=g).float() * 0.5
            if moe.correction_bias else None)
    check_route(logits, moe, bias)
    # All-equal logits: experts 0..k-1 (the first groups), whatever the device's topk does.
    ids, _ = route(torch.zeros(3, moe.num_experts),
                   dataclasses.replace(moe, n_group=1, topk_group=1))
    assert ids.tolist() == [list(range(moe.top_k))] * 3


def test_grouped_topk_restricts_to_the_best_groups():
    """Group score is the sum of the two best: a group with one huge expert loses to a
    group with two good ones, and experts outside the kept groups are never picked even
    when individually better."""
    moe = moe_cfg(num_experts=8, top_k=2, n_group=4, topk_group=1, scoring="sigmoid",
                  norm_topk_prob=False)
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 6.0  # group 0: one great expert, one bad: 0.998 + 0.018
    logits[0, 2:4] = 2.0  # group 1: two good: 0.881 + 0.881
    ids, w = route(logits, moe)
    assert ids.tolist() == [[2, 3]]
    assert torch.allclose(w, torch.sigmoid(torch.tensor([[2.0, 2.0]])))
    check_route(logits, moe, None)


def test_correction_bias_selects_but_does_not_weight():
    moe = moe_cfg(num_experts=4, top_k=1, scoring="sigmoid", correction_bias=True,
                  norm_topk_prob=False)
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    ids, w = route(logits, moe, bias)
    assert ids.tolist() == [[2]]  # sigmoid(0) + 1 beats sigmoid(1)
    assert torch.allclose(w, torch.tensor([[0.5]]))  # the weight is the score alone


def test_renormalisation_and_scaling():
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    ids, w = route(logits, moe_cfg(norm_topk_prob=True, routed_scaling_factor=3.0))
    assert torch.allclose(w.sum(-1), torch.full((5,), 3.0))
    _, raw = route(logits, moe_cfg(norm_topk_prob=False))
    assert (raw.sum(-1) < 1).all()


def test_expert_counts_skip_dead_tokens():
    ids = torch.tensor([[0, 1], [1, 2], [3, 1]])
    assert expert_counts(ids, 5).tolist() == [1, 3, 1, 1, 0]
    live = torch.tensor([True, False, True])
    assert expert_counts(ids, 5, live).tolist() == [1, 2, 0, 1, 0]


def random_experts(E: int, H: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * i, H, generator=g) * 0.3, torch.randn(E, H, i, generator=g) * 0.3


@pytest.mark.parametrize("N", [1, 7, 40])
def test_looped_equals_dense(N):
    E, H, i, k = 8, 16, 12, 3
    gate_up, down = random_experts(E, H, i, seed=N)
    g = torch.Generator().manual_seed(N + 100)
    x = torch.randn(N, H, generator=g)
    ids, w = route(torch.randn(N, E, generator=g), moe_cfg(num_experts=E, top_k=k))
    a = experts_looped(x, ids, w, gate_up, down)
    b = experts_dense(x, ids, w, gate_up, down)
    assert a.shape == (N, H) and a.abs().max() > 0.1
    assert (a - b).abs().max() <= 1e-5


def tiny_model_cfg(moe: MoEConfig) -> ModelConfig:
    return ModelConfig(architecture="Qwen2MoeForCausalLM", family="qwen2_moe", vocab_size=32,
                       hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=32, tie_word_embeddings=False, moe=moe)


def test_sparse_moe_block_by_hand():
    """The block: routed experts weighted and summed, plus the gated shared expert, and
    `active` = the distinct experts used."""
    moe = moe_cfg(num_experts=6, top_k=2, num_shared_experts=1, shared_intermediate_size=10,
                  shared_expert_gate=True, norm_topk_prob=False)
    block = SparseMoe(tiny_model_cfg(moe))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        out = block(x)
        flat = x.reshape(-1, 16)
        ids, w = route(flat @ block.gate.weight.T, moe)
        want = torch.zeros_like(flat)
        for n in range(6):
            for j in range(2):
                e = int(ids[n, j])
                want[n] += w[n, j] * _mlp(flat[n], block.experts.gate_up_proj[e],
                                          block.experts.down_proj[e])
        s = block.shared_expert
        want += torch.sigmoid(flat @ block.shared_expert_gate.weight.T) * s(flat)
    assert out.shape == x.shape
    assert (out.reshape(-1, 16) - want).abs().max() <= 1e-5
    assert int(block.active) == len(set(ids.reshape(-1).tolist()))


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (gate_up @ x).chunk(2)
    return down @ (torch.nn.functional.silu(gate) * up)
