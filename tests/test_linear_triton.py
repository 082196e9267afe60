"""The few-row Triton linear (models/linear_triton.py) against F.linear, and the model's
Linear dispatching to it only where it applies (models/linear.py).

In Triton's CPU interpreter the kernel runs in fp32 (its bf16 dots are not the GPU's): the
indexing, the masks of ragged N and K, the bias, 1..16 rows. On CUDA also bf16, compiled,
against cuBLAS. Every case checks that a row's result does not depend on how many rows
share the call (the kernel pads rows to 16: a verify computes each row as a decode step
does). Skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import CUDA, DEV  # noqa: F401  (imported first: it skips without triton)

from specscope.models import linear_triton as lt
from specscope.models.linear import Linear, linear

CASES = [(1, 48, 64, False), (5, 40, 96, True), (16, 64, 1024, False), (3, 33, 80, True),
         (8, 130, 2048, False)]


@pytest.mark.parametrize(("m", "n", "k", "bias"), CASES)
@pytest.mark.parametrize("tile", [None, (16, 32, 4, 2)])
def test_kernel_equals_f_linear_fp32(m, n, k, bias, tile):
    torch.manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, device=DEV), torch.randn(n, k, device=DEV)
    b = torch.randn(n, device=DEV) if bias else None
    out = lt.linear(x, w, b, tile=tile)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)
    # Each row alone gives the same bits as within the call.
    assert torch.equal(lt.linear(x[-1:], w, b, tile=tile), out[-1:])


def test_leading_dims_and_strided_rows():
    torch.manual_seed(1)
    x = torch.randn(1, 6, 2 * 64, device=DEV)[..., ::2]  # [1, 6, 64], a stride-2 last dim
    w = torch.randn(32, 64, device=DEV)
    out = lt.linear(x, w, tile=(16, 32, 4, 2))
    assert out.shape == (1, 6, 32)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not CUDA, reason="the bf16 kernel is the GPU's")
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096), (4096, 14336), (32000, 4096),
                                      (1000, 576)])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_kernel_bf16_on_cuda_matches_cublas(n, k, m):
    torch.manual_seed(n + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    out, ref = lt.linear(x, w).float(), F.linear(x, w).float()
    # Both sum in fp32 and round once: apart by at most a bf16 step of the output.
    assert ((out - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()
    assert torch.equal(lt.linear(x[:1], w), lt.linear(x, w)[:1])


def test_applies_only_to_few_16_bit_rows_on_cuda():
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not lt.applies(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # the CPU
    if CUDA:
        wc = w.cuda()
        assert lt.applies(torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda"), wc)
        assert not lt.applies(torch.zeros(17, 64, dtype=torch.bfloat16, device="cuda"), wc)
        assert not lt.applies(torch.zeros(1, 64, device="cuda"), wc.float())
        assert not lt.applies(torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"), wc.t())


def test_model_linear_is_f_linear_off_the_fast_path():
    """On the CPU (and under autograd anywhere) the model's Linear is nn.Linear exactly."""
    torch.manual_seed(2)
    layer = Linear(64, 32, bias=True)
    ref = torch.nn.Linear(64, 32, bias=True)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), ref(x))
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))
    assert set(layer.state_dict()) == {"weight", "bias"}


def _silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, -1)
    return (F.silu(g.float()).to(gu.dtype).float() * u.float()).to(gu.dtype)


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 48, 64, False), (5, 40, 96, True),
                                                  (16, 64, 1024, True), (3, 33, 80, False)])
@pytest.mark.parametrize("fold", ["gated", "residual"])
def test_folded_epilogues_equal_their_reference(m, n, k, bias, fold):
    """SwiGLU's silu(gate) * up and the residual add folded into the product compute what
    the separate kernels compute after it (fp32: to rounding), and a row's result still
    does not depend on the rows beside it."""
    torch.manual_seed(m + n + k)
    gated = fold == "gated"
    x = torch.randn(m, k, device=DEV)
    w = torch.randn(2 * n if gated else n, k, device=DEV) * k ** -0.5
    b = torch.randn(w.shape[0], device=DEV) if bias else None
    r = None if gated else torch.randn(m, n, device=DEV)
    ref = _silu_mul_ref(F.linear(x, w, b)) if gated else F.linear(x, w, b) + r
    out = lt.linear(x, w, b, tile=(32, 32, 4, 2), gated=gated, residual=r)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
    one = lt.linear(x[-1:], w, b, tile=(32, 32, 4, 2), gated=gated,
                    residual=None if r is None else r[-1:])
    assert torch.equal(one, out[-1:])


@pytest.mark.skipif(not CUDA, reason="the bf16 kernel is the GPU's")
@pytest.mark.parametrize("m", [1, 8])
def test_folded_epilogues_in_bf16_on_cuda(m):
    """bf16, the engine's case: the folded SwiGLU and residual add round as the separate
    kernels do, bit for bit."""
    from specscope.models.fused_triton import silu_mul
    torch.manual_seed(m)
    k, i = 4096, 14336
    bf = torch.bfloat16
    x = torch.randn(m, k, device=DEV, dtype=bf)
    wgu = (torch.randn(2 * i, k, device=DEV) * k ** -0.5).to(bf)
    assert torch.equal(lt.linear(x, wgu, gated=True), silu_mul(lt.linear(x, wgu)))
    act = torch.randn(m, i, device=DEV, dtype=bf)
    wd = (torch.randn(k, i, device=DEV) * i ** -0.5).to(bf)
    assert torch.equal(lt.linear(act, wd, residual=x), lt.linear(act, wd) + x)


def test_dependent_launch_options(monkeypatch):
    """PDL's launch options: never off CUDA or in the interpreter, never for a launch of
    more than MAX_ROWS tokens, never with SPECSCOPE_PDL=0; the linear's L2 prefetch is a
    power of two of whole 128-byte lines, at most K."""
    from specscope.models import dependent_launch as dl

    assert dl.options(torch.empty(4, 8), 1) == {"PDL": False}
    monkeypatch.setenv(dl.PREFETCH_ENV, "512")
    assert [dl.prefetch_columns(k) for k in (32, 64, 96, 256, 4096)] == [0, 64, 64, 256, 512]
    monkeypatch.setenv(dl.PREFETCH_ENV, "0")
    assert dl.prefetch_columns(4096) == 0
    if torch.cuda.is_available() and dl.enabled(torch.empty(1, device="cuda")):
        x = torch.empty(1, device="cuda")
        assert dl.options(x, dl.MAX_ROWS) == {"PDL": True, "launch_pdl": True}
        assert dl.options(x, dl.MAX_ROWS + 1) == {"PDL": False}
        monkeypatch.setenv(dl.ENV, "0")
        assert dl.options(x, 1) == {"PDL": False}


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 48, 64, False), (5, 200, 96, True),
                                                  (16, 130, 64, False), (3, 33, 80, True)])
@pytest.mark.parametrize("tile", [None, (16, 32, 4, 2)])
def test_linear_argmax_equals_the_products_argmax(m, n, k, bias, tile):
    """The head's argmax folded into the product picks what argmax over `linear`'s output
    picks, the first column on ties (some placed across programs here), mapped through a
    vocabulary map, and a row's pick does not depend on the rows beside it."""
    torch.manual_seed(m + n)
    x = torch.randn(m, k, device=DEV)
    w = torch.randn(n, k, device=DEV)
    w[n - 1] = w[0]  # a tie between the first and the last program's columns
    w[17] = w[3]  # and inside the first program
    x[0] = w[0] * 4  # row 0's best is column 0 and its copy at n - 1
    b = torch.randn(n, device=DEV) if bias else None
    if b is not None:
        b[n - 1] = b[0]
    ref = lt.linear(x, w, b, tile=tile).float().argmax(-1)
    out = lt.linear_argmax(x, w, b, tile=tile)
    assert out.dtype == torch.long and torch.equal(out, ref)
    assert int(out[0]) == 0
    d2t = torch.randint(0, 1000, (n,), device=DEV)
    assert torch.equal(lt.linear_argmax(x, w, b, d2t, tile=tile), ref + d2t[ref])
    assert torch.equal(lt.linear_argmax(x[-1:], w, b, tile=tile), out[-1:])
    lead = lt.linear_argmax(x.view(1, m, k), w, b, tile=tile)
    assert lead.shape == (1, m) and torch.equal(lead[0], out)


def test_model_linear_argmax_off_the_fast_path():
    """Off CUDA, linear_argmax is the reference: the product's argmax, then the map."""
    from specscope.models.linear import linear_argmax

    torch.manual_seed(3)
    x, w = torch.randn(4, 64), torch.randn(40, 64)
    d2t = torch.arange(40) * 2
    ids = F.linear(x, w).argmax(-1)
    assert torch.equal(linear_argmax(x, w), ids)
    assert torch.equal(linear_argmax(x, w, token_map=d2t), ids + d2t[ids])


@pytest.mark.skipif(not CUDA, reason="the bf16 kernel is the GPU's")
@pytest.mark.parametrize(("n", "k"), [(32000, 4096), (128256, 4096), (49152, 576)])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_linear_argmax_bf16_on_cuda(n, k, m):
    """bf16 heads of real shapes: the fused pick equals argmax over the kernel's logits."""
    torch.manual_seed(n + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    assert torch.equal(lt.linear_argmax(x, w), lt.linear(x, w).float().argmax(-1))
