"""fp32 linears on MKL-packed weights for one row count at a time (models/packed.py
pack_fp32_rows): the packed GEMM against F.linear at that count, the reference path at every
other, the copy made when the count is chosen and kept for the last few counts, dropped when
speculation stops, subclasses (tensor-parallel linears) left alone, and greedy speculation
still equal to greedy plain decoding on a packed fp32 target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specscope.models.packed import PackedLinear, mkl_packing_available, pack_fp32_rows

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 96)
        self.b = nn.Linear(96, 64, bias=False)
        self.tp = type("RowParallel", (nn.Linear,), {})(64, 64)  # a subclass: left alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp(self.b(self.a(x)))


def test_rows_served_packed_and_others_by_the_reference():
    m = Block().requires_grad_(False)
    x6, x1 = torch.randn(1, 6, 64), torch.randn(1, 1, 64)
    with torch.inference_mode():
        want6, want1 = m(x6), m(x1)
        assert pack_fp32_rows(m, 6) == 2
        assert isinstance(m.a, PackedLinear) and type(m.tp).__name__ == "RowParallel"
        got6, got1 = m(x6), m(x1)
    assert list(m.a._mkl) == [6]  # the packed copy ran
    torch.testing.assert_close(got6, want6, rtol=1e-5, atol=1e-5)
    assert torch.equal(got1, want1)  # another row count: F.linear itself
    assert pack_fp32_rows(m, None) == 0
    assert m.a.fp32_rows is None and m.a._mkl == {}
    plain = Block()
    assert pack_fp32_rows(plain, None) == 0 and type(plain.a) is nn.Linear  # none to drop


def _count_mkl(monkeypatch, name: str) -> list:
    """Record each call of torch.ops.mkl.`name` (its last argument, the row count)."""
    calls: list = []
    real = getattr(torch.ops.mkl, name)
    monkeypatch.setattr(torch.ops.mkl, name, lambda *a: calls.append(a[-1]) or real(*a),
                        raising=False)
    return calls


def test_a_count_is_packed_when_chosen_and_the_last_few_are_kept(monkeypatch):
    import specscope.models.packed as packed

    m = nn.Sequential(nn.Linear(32, 48).requires_grad_(False))
    reorders = _count_mkl(monkeypatch, "_mkl_reorder_linear_weight")
    pack_fp32_rows(m, 4)
    p = m[0]
    assert reorders == [4]  # packed when chosen: the first GEMM of 4 rows pays no repack
    with torch.inference_mode():
        p(torch.randn(4, 32))
        assert reorders == [4]
        for rows in (3, 4, 5, 6, 7):  # 4 again: still kept, not repacked
            pack_fp32_rows(m, rows)
            x = torch.randn(rows, 32)
            torch.testing.assert_close(p(x), F.linear(x, p.weight, p.bias),
                                       rtol=1e-5, atol=1e-5)
    assert reorders == [4, 3, 5, 6, 7]
    assert list(p._mkl) == [4, 5, 6, 7][-packed.FP32_COPIES:]  # 3, least recent, dropped
    with torch.no_grad():
        p.weight.mul_(2)  # an in-place update: the next call repacks
    with torch.inference_mode():
        x7 = torch.randn(7, 32)
        torch.testing.assert_close(p(x7), F.linear(x7, p.weight, p.bias), rtol=1e-5, atol=1e-5)
    assert reorders[-1] == 7 and len(reorders) == 6


def test_autograd_takes_the_reference_path(monkeypatch):
    m = nn.Sequential(nn.Linear(16, 16))
    pack_fp32_rows(m, 2)
    x = torch.randn(2, 16, requires_grad=True)
    packed_gemms = _count_mkl(monkeypatch, "_mkl_linear")
    m(x).sum().backward()
    assert packed_gemms == []  # F.linear ran, which autograd can differentiate
    torch.testing.assert_close(x.grad, m[0].weight.sum(0).expand(2, 16))
    with torch.no_grad():
        m(x)
    assert packed_gemms == [2]  # the same input without autograd: the packed GEMM


def test_the_memory_share_is_respected(monkeypatch):
    import specscope.models.packed as packed

    monkeypatch.setattr(packed, "available_memory_bytes", lambda: 1000)
    m = nn.Sequential(nn.Linear(64, 64))
    assert pack_fp32_rows(m, 6) == 0
    assert type(m[0]) is nn.Linear  # nothing packed, nothing swapped


def test_greedy_speculation_on_a_packed_fp32_target_equals_plain(tiny_model_dir):
    from specscope import LLM
    from specscope.config import SamplingParams, SpecConfig

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=None)
    params = SamplingParams(max_tokens=20)
    plain = llm.generate("Once upon a time", params)[0].token_ids
    llm.set_spec(SpecConfig(draft="random", num_steps=3))
    lin = llm.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(lin, PackedLinear) and lin.fp32_rows == 4
    assert llm.generate("Once upon a time", params)[0].token_ids == plain
    llm.set_spec(None)
    assert lin.fp32_rows is None
