"""fp32 linears on MKL-packed weights for one row count (models/packed.py pack_fp32_rows):
the packed GEMM against F.linear at that count, the reference path at every other, the copy
dropped when speculation stops, subclasses (tensor-parallel linears) left alone, and greedy
speculation still equal to greedy plain decoding on a packed fp32 target."""

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
    assert m.a._mkl is not None and m.a._mkl[0][2] == 6  # the packed copy ran
    torch.testing.assert_close(got6, want6, rtol=1e-5, atol=1e-5)
    assert torch.equal(got1, want1)  # another row count: F.linear itself
    assert pack_fp32_rows(m, None) == 0
    assert m.a.fp32_rows is None and m.a._mkl is None
    plain = Block()
    assert pack_fp32_rows(plain, None) == 0 and type(plain.a) is nn.Linear  # none to drop


def test_a_new_row_count_replaces_the_copy_and_weights_repack():
    lin = nn.Linear(32, 48).requires_grad_(False)
    m = nn.Sequential(lin)
    pack_fp32_rows(m, 4)
    p = m[0]
    x = torch.randn(4, 32)
    with torch.inference_mode():
        p(x)
        first = p._mkl[1]
        pack_fp32_rows(m, 3)
        assert p._mkl is None
        y = p(torch.randn(3, 32))
        assert y.shape == (3, 48) and p._mkl[0][2] == 3
    with torch.no_grad():
        p.weight.mul_(2)  # an in-place update: the next call repacks
    with torch.inference_mode():
        x3 = torch.randn(3, 32)
        torch.testing.assert_close(p(x3), F.linear(x3, p.weight, p.bias), rtol=1e-5, atol=1e-5)
    assert first is not None


def test_autograd_takes_the_reference_path():
    m = nn.Sequential(nn.Linear(16, 16))
    pack_fp32_rows(m, 2)
    x = torch.randn(2, 16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and m[0]._mkl is None


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
