"""The Triton grouped expert GEMM (models/moe_triton.py) against the per-expert reference.

Runs the compiled kernels on CUDA when there is a GPU, else Triton's CPU interpreter
(TRITON_INTERPRET=1, as tests/test_triton_attention.py); skipped where triton is not
installed. The dispatch layout is checked on its own too: every pair in its expert's
block, padding rows empty, within the static bound.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import CUDA, DEV  # noqa: F401  (imported first: it skips without triton)

from specscope.config import MoEConfig
from specscope.models import moe_triton
from specscope.models.moe import route
from specscope.models.moe_experts import experts_looped
from specscope.models.moe_triton import block_rows, dispatch, experts_grouped


def _case(N: int, E: int, k: int, H: int, i: int, seed: int, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    logits = torch.randn(N, E, generator=g)
    if skew:  # most tokens to expert 0 and 1: long segments spanning several blocks
        logits[:, :2] += 6
    moe = MoEConfig(num_experts=E, top_k=k, expert_intermediate_size=i, sparse_layers=(True,))
    ids, w = route(logits, moe)
    gate_up = torch.randn(E, 2 * i, H, generator=g) * 0.2
    down = torch.randn(E, H, i, generator=g) * 0.2
    return x, ids, w, gate_up, down


@pytest.mark.parametrize(("N", "E", "k"), [(1, 8, 2), (5, 16, 4), (7, 4, 4), (40, 8, 2)])
def test_dispatch_layout(N, E, k):
    _, ids, _, _, _ = _case(N, E, k, 16, 16, seed=N, skew=N == 40)
    BM = 16
    d = dispatch(ids, E, BM)
    total, bound = d.row_token.shape[0], N * k + min(E, N * k) * (BM - 1)
    assert total % BM == 0 and total < bound + BM
    rows = d.pair_row.reshape(-1)
    assert len(set(rows.tolist())) == N * k  # one row per pair
    tok = torch.arange(N).repeat_interleave(k)
    assert torch.equal(d.row_token[rows].long(), tok)  # each pair's row holds its token
    blk = d.block_expert.long()[rows // BM]
    assert torch.equal(blk, ids.reshape(-1))  # ... in a block of its expert
    used = torch.zeros(total, dtype=torch.bool)
    used[rows] = True
    assert (d.row_token[~used] == N).all()  # every other row is padding
    assert (d.block_expert <= E).all()
    # Within an expert, the pairs keep token order (the stable sort).
    for e in range(E):
        r = rows[ids.reshape(-1) == e]
        assert torch.equal(r, r.sort().values)


@pytest.fixture(params=["sorted", "pairs"])
def path(request, monkeypatch) -> str:
    """Force experts_grouped's path whatever the pair count: the sorted, block-padded GEMMs
    or the few-pairs GEMVs."""
    monkeypatch.setattr(moe_triton, "use_pairs", lambda *a: request.param == "pairs")
    return request.param


@pytest.mark.parametrize(("N", "E", "k", "H", "i"), [
    (1, 8, 2, 32, 16),  # decode: one token
    (1, 32, 8, 200, 72),  # decode at k = 8, widths past one tile and not multiples of it
    (6, 16, 4, 48, 24),  # a verify tree: widths that are not tile multiples
    (33, 4, 2, 32, 40, ),  # prefill-like: several blocks per expert
])
def test_grouped_equals_looped_fp32(N, E, k, H, i, path):
    x, ids, w, gate_up, down = _case(N, E, k, H, i, seed=N + E, skew=N > 30)
    ref = experts_looped(x, ids, w, gate_up, down)
    out = experts_grouped(*(t.to(DEV) for t in (x, ids, w, gate_up, down))).cpu()
    assert out.shape == (N, H) and ref.abs().max() > 0.1
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("which", ["PAIR_GATE_UP_TILE", "PAIR_DOWN_TILE"])
@pytest.mark.parametrize("tile", [(16, 32, 4, 1, False), (32, 64, 4, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_kernels_on_either_unit(monkeypatch, which, tile, dtype):
    """The pair path's gate_up and down on the CUDA cores and on the tensor cores (a
    pair's row alone in a 16-row tile), widths past one tile and not multiples of it."""
    monkeypatch.setattr(moe_triton, which, tile)
    x, ids, w, gate_up, down = _case(3, 16, 4, 200, 72, seed=7)
    ref = experts_looped(x, ids, w, gate_up, down)
    out = moe_triton.experts_pairs(x.to(DEV, dtype), ids.to(DEV), w.to(DEV),
                                   gate_up.to(DEV, dtype), down.to(DEV, dtype)).float().cpu()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 2e-2), rel


def test_grouped_bf16_close_to_fp32_reference(path):
    x, ids, w, gate_up, down = _case(9, 8, 2, 32, 32, seed=5)
    ref = experts_looped(x, ids, w, gate_up, down)
    out = experts_grouped(x.to(DEV, torch.bfloat16), ids.to(DEV), w.to(DEV),
                          gate_up.to(DEV, torch.bfloat16), down.to(DEV, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    rel = (out.float().cpu() - ref).norm() / ref.norm()
    assert rel < 2e-2


def test_block_rows_by_batch():
    assert block_rows(8) == 16 and block_rows(16384) == 64


def test_path_by_pair_count(monkeypatch):
    """Few pairs take the two-launch pair path, more the sorted GEMMs."""
    calls = []
    monkeypatch.setattr(moe_triton, "experts_pairs", lambda *a: calls.append("pairs"))
    monkeypatch.setattr(moe_triton, "dispatch", lambda *a: calls.append("sorted") or 1 / 0)
    experts_grouped(*_case(4, 64, 8, 16, 16, seed=0))  # 32 pairs of 64 experts
    for N, E in ((5, 64), (2, 16)):  # 40 pairs; 16 pairs but more than half the experts
        with pytest.raises(ZeroDivisionError):
            experts_grouped(*_case(N, E, 8, 16, 16, seed=0))
    assert calls == ["pairs", "sorted", "sorted"]


def _looped(x, ids, w, gate_up, down, residual=None):
    """experts_looped with run_experts' residual."""
    out = experts_looped(x, ids, w, gate_up, down)
    return out if residual is None else residual + out


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_moe_model_forward_through_the_kernel(monkeypatch, path, arch):
    """A whole tiny MoE forward with the grouped kernel (as CUDA runs it) against the
    looped path (the CPU's): Qwen2-MoE's shared expert joins the experts' sum, so the
    residual is added after; Qwen3-MoE's block adds it inside the experts' last kernel."""
    from specscope.models import moe as moe_module
    from specscope.models.loader import random_model
    from specscope.models.registry import config_from_hf

    cfg = config_from_hf({
        "architectures": [arch], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "head_dim": 8})
    model = random_model(cfg, torch.float32, DEV, seed=3)
    ids = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(1)).to(DEV)
    pos = torch.arange(13, device=DEV)[None]
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(moe_module, "run_experts", _looped)
    with torch.no_grad():
        ref = model.compute_logits(model(ids, pos)[0])
        monkeypatch.setattr(moe_module, "run_experts", experts_grouped)
        out = model.compute_logits(model(ids, pos)[0])
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [
    torch.float32,
    # The interpreter's fp32 -> bf16 conversion does not round as the GPU's does.
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 rounding"))])
def test_residual_added_as_the_reference_adds_it(path, dtype):
    """experts_grouped(..., residual) is residual + experts_grouped(...) bit for bit: the
    pair path adds it in its down kernel to the rounded sum, in fp32, and rounds again."""
    x, ids, w, gate_up, down = (t.to(DEV) for t in _case(3, 32, 8, 64, 48, seed=4))
    if dtype != torch.float32:
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    r = torch.randn(3, 64, device=DEV).to(dtype)
    out = experts_grouped(x, ids, w, gate_up, down, r)
    assert out.dtype == dtype
    assert torch.equal(out, r + experts_grouped(x, ids, w, gate_up, down))
