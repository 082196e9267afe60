"""The fused Triton routing kernel (models/moe_route_triton.py) against route().

route() (models/moe.py, itself checked against a plain-Python selection in test_moe.py) is
the reference: the kernel must give the same ids exactly, in the same order, and the same
weights to 1e-6 relative, for every routing variant, on random logits and on crafted ties
(which must go to the lower expert / group id). Runs the compiled kernel on CUDA when
there is a GPU, else Triton's CPU interpreter (TRITON_INTERPRET=1, as
tests/test_moe_triton.py); skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import CUDA, DEV  # noqa: F401  (imported first: it skips without triton)

from specscope.config import MoEConfig
from specscope.models import moe as moe_module
from specscope.models.moe import Router, route
from specscope.models.moe_experts import expert_counts, live_mask
from specscope.models.moe_route_triton import route_fused, router_fits, router_fused


def moe_cfg(**kw) -> MoEConfig:
    base = dict(num_experts=16, top_k=4, expert_intermediate_size=8, sparse_layers=(True,))
    return MoEConfig(**{**base, **kw})


ROUTINGS = {
    "mixtral": dict(num_experts=8, top_k=2),
    "qwen2_moe": dict(num_experts=60, top_k=4, norm_topk_prob=False),  # E not a power of 2
    "qwen3_moe": dict(num_experts=128, top_k=8),
    "deepseek_v3": dict(num_experts=256, top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                        correction_bias=True, routed_scaling_factor=2.5),
    "kimi_k2": dict(num_experts=384, top_k=8, scoring="sigmoid", correction_bias=True,
                    routed_scaling_factor=2.827),  # one group of a non power of 2
    "groups_of_one": dict(num_experts=8, top_k=3, n_group=8, topk_group=4, scoring="sigmoid",
                          norm_topk_prob=False, routed_scaling_factor=1.5),
    "softmax_bias_odd_groups": dict(num_experts=36, top_k=4, n_group=3, topk_group=2,
                                    correction_bias=True),  # 3 groups of 12: both padded
    "every_group_kept": dict(num_experts=16, top_k=4, n_group=4, topk_group=4),
    # Fewer eligible experts (1 group of 2) than top_k: the rest from the dropped groups.
    "too_few_eligible": dict(num_experts=8, top_k=3, n_group=4, topk_group=1,
                             scoring="sigmoid", correction_bias=True),
}


def _bias(moe: MoEConfig, g: torch.Generator) -> torch.Tensor | None:
    # About a score gap in size, so the bias really changes the choice.
    return torch.randn(moe.num_experts, generator=g) * 0.1 if moe.correction_bias else None


def check(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """route_fused on DEV equals route() on the CPU; returns the ids."""
    ref_ids, ref_w = route(logits, moe, bias)
    ids, w = route_fused(logits.to(DEV), moe, None if bias is None else bias.to(DEV))
    assert ids.dtype == torch.long and w.dtype == torch.float32
    assert ids.shape == w.shape == (logits.shape[0], moe.top_k)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-6, atol=0)
    return ref_ids


@pytest.mark.parametrize("N", [1, 7, 64])
@pytest.mark.parametrize("name", ROUTINGS)
def test_random_logits(name, N):
    moe = moe_cfg(**ROUTINGS[name])
    g = torch.Generator().manual_seed(N)
    check(torch.randn(N, moe.num_experts, generator=g), moe, _bias(moe, g))


@pytest.mark.parametrize("name", ROUTINGS)
def test_ties_go_to_the_lower_id(name):
    """Equal logits everywhere (every expert and every group tied): the lowest ids, in
    order. Then logits from {0, 1, 2} (most tokens tied within and across groups), and
    groups that are permutations of one another (every group score tied)."""
    moe = moe_cfg(**ROUTINGS[name])
    E, k = moe.num_experts, moe.top_k
    bias = torch.zeros(E) if moe.correction_bias else None
    ids = check(torch.zeros(7, E), moe, bias)
    assert torch.equal(ids, torch.arange(k).expand(7, k))
    g = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 3, (64, E), generator=g).float()
    bias = None if bias is None else torch.randint(0, 2, (E,), generator=g) * 0.25
    check(levels, moe, bias)
    if moe.n_group > 1:
        per = E // moe.n_group
        one = torch.randn(per, generator=g)
        perms = [one[torch.randperm(per, generator=g)] for _ in range(moe.n_group)]
        ids = check(torch.cat(perms)[None], moe, None)
        if moe.topk_group * per >= k:  # else some come from the dropped groups by design
            assert (ids // per < moe.topk_group).all()


def test_strided_and_bf16_inputs():
    """Logits that are a column slice of a wider tensor (row stride != E) and a bf16 bias
    (a model cast to bf16): route's .float() reading of both."""
    moe = moe_cfg(**ROUTINGS["deepseek_v3"])
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, moe.num_experts + 5, generator=g)
    bias = (torch.randn(moe.num_experts, generator=g) * 0.1).bfloat16()
    ref_ids, ref_w = route(wide[:, :moe.num_experts], moe, bias)
    ids, w = route_fused(wide.to(DEV)[:, :moe.num_experts], moe, bias.to(DEV))
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-6, atol=0)


def test_no_tokens():
    ids, w = route_fused(torch.zeros(0, 16, device=DEV), moe_cfg())
    assert ids.shape == w.shape == (0, 4)


def test_router_takes_the_kernels_on_cuda_only(monkeypatch):
    """Router.forward routes through router_fused (up to 16 tokens) or F.linear and
    route_fused (more) where x is on CUDA, route() elsewhere; the backend is the cached
    import of models/moe_route_triton."""
    from specscope.models import moe_route_triton as mrt

    assert moe_module._route_backend() is mrt
    calls = []

    class Spy:
        router_fits = staticmethod(mrt.router_fits)

        @staticmethod
        def router_fused(*a):
            calls.append("router")
            return mrt.router_fused(*a)

        @staticmethod
        def route_fused(*a):
            calls.append("route")
            return mrt.route_fused(*a)

    monkeypatch.setattr(moe_module, "_route_backend", lambda: Spy)
    moe = moe_cfg(**ROUTINGS["deepseek_v3"])
    router = Router(32, moe).to(DEV)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.1)
        for n in (5, 17):
            x = torch.randn(n, 32, device=DEV)
            ids, w = router(x)
            logits = torch.nn.functional.linear(x, router.weight)
            ref_ids, ref_w = route(logits.cpu(), moe, router.e_score_correction_bias.cpu())
            assert torch.equal(ids.cpu(), ref_ids)
            torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=0)
    assert calls == (["router", "route"] if CUDA else [])


@pytest.mark.parametrize("N", [1, 3, 16])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "kimi_k2"])
@pytest.mark.parametrize("H", [48, 1024])
def test_router_fused_equals_linear_then_route(N, name, H):
    """The one-launch router (partial logits by its programs, 2 to 4 hidden chunks a tile
    of experts at H = 1024; the sum and the routing by the last to finish) gives route()'s
    ids on F.linear's fp32 logits, its weights to 1e-5, and expert_counts' count over the
    real tokens; called again (the ticket back at zero) it does the same on new tokens,
    with CUDA-graph padding rows this time."""
    moe = moe_cfg(**ROUTINGS[name])
    E = moe.num_experts
    g = torch.Generator().manual_seed(N + E)
    weight = torch.randn(E, H, generator=g) * H ** -0.5  # logits of order 1, as trained
    bias = _bias(moe, g)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEV)
    active = torch.full((), -1, dtype=torch.long, device=DEV)
    for live in (None, (torch.randint(0, 80, (N,), generator=g), 64, 80)):
        x = torch.randn(N, H, generator=g)
        ids, w = router_fused(x.to(DEV), weight.to(DEV), moe, ticket,
                              None if bias is None else bias.to(DEV), active,
                              None if live is None else (live[0].to(DEV), 64, 80))
        ref_ids, ref_w = route(torch.nn.functional.linear(x, weight), moe, bias)
        assert torch.equal(ids.cpu(), ref_ids)
        torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-7)
        ref = (expert_counts(ref_ids, E, live_mask(live)) > 0).sum()
        assert int(active) == int(ref)
        assert int(ticket) == 0


def test_router_fits_few_tokens_of_one_dtype():
    w = torch.zeros(8, 32, device=DEV)
    assert router_fits(torch.zeros(16, 32, device=DEV), w)
    assert not router_fits(torch.zeros(17, 32, device=DEV), w)
    assert not router_fits(torch.zeros(0, 32, device=DEV), w)
    assert not router_fits(torch.zeros(2, 32, device=DEV, dtype=torch.float16), w)
    assert not router_fits(torch.zeros(2, 48, device=DEV), w)  # not the router's width
    assert not router_fits(torch.zeros(2, 16, device=DEV), w[:, ::2])  # strided weight


@pytest.mark.parametrize("N", [1, 6, 40])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("padding", [False, True])
def test_active_count_equals_expert_counts(N, name, padding):
    """route_fused's distinct-expert count equals expert_counts' over the real tokens: in
    the routing launch (one program holds every token) and in its own launch (40 tokens
    of 128 or 256 experts: more than one program), with CUDA-graph padding rows (slots in
    the scratch range) left out."""
    moe = moe_cfg(**ROUTINGS[name])
    g = torch.Generator().manual_seed(N)
    logits = torch.randn(N, moe.num_experts, generator=g)
    logits[::2, :3] += 4  # half the tokens share their top experts
    bias = _bias(moe, g)
    live = None
    if padding:
        slots = torch.randint(0, 80, (N,), generator=g)
        slots[0] = 70  # at least one padding row ...
        slots[-1] = 3 if N > 1 else 70  # ... and one real one where there are two
        live = (slots, 64, 80)
    active = torch.full((), -1, dtype=torch.long, device=DEV)
    ids, _ = route_fused(logits.to(DEV), moe, None if bias is None else bias.to(DEV), active,
                         None if live is None else (live[0].to(DEV), 64, 80))
    ref = (expert_counts(ids.cpu(), moe.num_experts, live_mask(live)) > 0).sum()
    assert int(active) == int(ref)
    if padding and N == 1:
        assert int(active) == 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    """Static shapes, no host read: the launch captures into a CUDA graph and its replay
    on new logits equals route()."""
    moe = moe_cfg(**ROUTINGS["deepseek_v3"])
    logits = torch.randn(8, moe.num_experts, device=DEV)
    bias = torch.randn(moe.num_experts, device=DEV) * 0.1
    route_fused(logits, moe, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = route_fused(logits, moe, bias)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    ref_ids, ref_w = route(logits, moe, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)
