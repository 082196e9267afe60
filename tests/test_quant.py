"""int4-gguf: a GGUF's Q4_0/Q4_1/Q8_0 codes run natively against 8-bit activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import threads

from specscope import native
from specscope.models.quant import GgufLinear, gguf_codes, quantize_activations


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF blocks with random codes and realistic fp16 scale/min."""
    nb = cols // 32
    d = rng.uniform(0.001, 0.05, (rows, nb)).astype(np.float16)
    parts = [d.view(np.uint8).reshape(rows, nb, 2)]
    if qtype == "Q8_0":
        parts.append(rng.integers(-127, 128, (rows, nb, 32)).astype(np.int8).view(np.uint8))
    else:
        if qtype == "Q4_1":
            m = rng.uniform(-0.3, 0.0, (rows, nb)).astype(np.float16)
            parts.append(m.view(np.uint8).reshape(rows, nb, 2))
        parts.append(rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _dense(raw: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols))


QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_codes_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(0)
    rows, cols = 24, 96
    raw = _random_blocks(qtype, rows, cols, rng)
    q, d, m = gguf_codes(raw, qtype, rows, cols)
    assert (q.min(), q.max()) >= ((0, 0) if qtype != "Q8_0" else (-127, 0))
    ours = q.astype(np.float32).reshape(rows, -1, 32) * d[..., None]
    if m is not None:
        ours = ours + m[..., None]
    np.testing.assert_allclose(ours.reshape(rows, cols), _dense(raw, qtype, rows, cols),
                               rtol=0, atol=1e-6)


def _linear(qtype: str, rows: int, cols: int, seed: int, bias: bool = False,
            tile: int | None = None):
    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    q, d, m = gguf_codes(raw, qtype, rows, cols)
    b = torch.randn(rows) if bias else None
    return GgufLinear.from_codes(q, d, m, 8 if qtype == "Q8_0" else 4, b, tile), \
        _dense(raw, qtype, rows, cols), b


def _activation_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x's 8-bit blocks dequantised, times the dense weights: what the kernels approximate
    only by the order of their fp32 sums."""
    a, e, _ = quantize_activations(x)
    return (a * e[..., None]).reshape(x.shape) @ w.T


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_linear_computes_the_quantised_product(qtype, dtype):
    """Rows not a multiple of the 8-row tile (padding), a bias, 3-d input; native and the
    torch reference both equal the dequantised product of the 8-bit activations, and are
    within 8-bit activation error of the exact product."""
    lin, w, b = _linear(qtype, 60, 128, 1, bias=True)
    x = torch.randn(5, 3, 128).to(dtype)
    ref = _activation_reference(x.reshape(15, 128).float(), w) + b
    y = lin(x).float()
    assert y.shape == (5, 3, 60)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(y.reshape(15, 60), ref, **tol)
    torch.testing.assert_close(lin.reference(x.reshape(15, 128)).float() + b, ref, **tol)
    exact = x.reshape(15, 128).float() @ w.T + b
    assert ((y.reshape(15, 60) - exact).norm() / exact.norm()).item() < 2e-2
    torch.testing.assert_close(lin.weight, w, atol=1e-6, rtol=0)


@pytest.mark.skipif(native.cpu_kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("K", [64, 576])
@pytest.mark.parametrize("N", [72, 76])
@pytest.mark.parametrize("tile", [8, 16])
def test_native_quant_paths_are_bit_equal_and_rows_independent(qtype, K, N, tile):
    """The vector path (AVX2 / VNNI / 16-row tiles in 512-bit vectors, whichever this build
    has for the tile; N = 76 ends in a partial tile) equals the C scalar loop bit for bit,
    and a row's result does not depend on the rows beside it (decode = verify) nor on the
    threads."""
    lin, _, _ = _linear(qtype, N, K, 2, tile=tile)
    kernels = native.cpu_kernels()
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(16, K) * torch.linspace(0.01, 10, K)).to(dtype)
        x[3, :32] = 0  # an all-zero block: scale 0
        args = (lin.codes, lin.scales, lin.offsets, N, lin.bits)
        fast = kernels.quant_linear(x, *args)
        assert torch.equal(fast, kernels.quant_linear(x, *args, reference=True))
        for rows in ([5], [0, 1, 2], list(range(6)), list(range(9))):
            assert torch.equal(kernels.quant_linear(x[rows].contiguous(), *args), fast[rows])
        # A prefill chunk's rows: quantised on every thread, through the tiles 64 at a time.
        many = (torch.randn(150, K) * torch.linspace(0.01, 10, K)).to(dtype)
        with threads(2):
            fast = kernels.quant_linear(many, *args)
        assert torch.equal(fast, kernels.quant_linear(many, *args, reference=True))
        assert torch.equal(kernels.quant_linear(many[70:71].contiguous(), *args), fast[70:71])


@pytest.mark.skipif(native.cpu_kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_tile_does_not_change_a_product(qtype):
    """The same weights in 8- and 16-row tiles give the same outputs bit for bit (each
    output's sums run in one order whatever the tile), on whichever path each tile takes
    here; the default layout is 16-row tiles only where the build runs them in 512-bit
    vectors."""
    from specscope.models.quant import default_tile

    kernels = native.cpu_kernels()
    (narrow, _, _), (wide, _, _) = (_linear(qtype, 76, 576, 4, tile=t) for t in (8, 16))
    assert (narrow.tile, wide.tile) == (8, 16)
    for dtype in (torch.float32, torch.bfloat16):
        for M in (1, 6, 70):
            x = torch.randn(M, 576).to(dtype)
            assert torch.equal(narrow(x), wide(x))
    torch.testing.assert_close(narrow.weight, wide.weight, atol=0, rtol=0)
    assert default_tile() == (16 if kernels.wide else 8)


@pytest.mark.skipif(native.cpu_kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("bits", [4, 8])
def test_native_quant_outputs_past_the_range_round_as_the_scalar_loop(bits):
    """Outputs that overflow to inf, and NaNs (a block's +inf beside another's -inf), are
    written bit for bit as the scalar loop writes them, in bf16 (the vector rounding) and
    fp32; the same inputs against small scales stay finite, and equal too."""
    N, K = 72, 64
    q = np.full((N, K), 15 if bits == 4 else 100)
    lin = GgufLinear.from_codes(q, np.full((N, K // 32), 3e38, np.float32), None, bits, None)
    small = GgufLinear.from_codes(q, np.full((N, K // 32), 1e-3, np.float32), None, bits, None)
    kernels = native.cpu_kernels()
    for dtype, view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        x = torch.full((3, K), 1e30)  # a block's scale times the weights' is past fp32
        x[1, 32:] = -1e30  # block 0 at +inf, block 1 at -inf: NaN
        x = x.to(dtype)
        out = {}
        for name, layer in (("big", lin), ("small", small)):
            args = (layer.codes, layer.scales, layer.offsets, N, bits)
            out[name] = kernels.quant_linear(x, *args)
            ref = kernels.quant_linear(x, *args, reference=True)
            assert torch.equal(out[name].view(view), ref.view(view))
        assert out["big"][0].isposinf().all() and out["big"][1].isnan().all()
        assert out["small"].isfinite().all()


@pytest.fixture(scope="module")
def default_models(default_model_dir, specscope_cache_dir):
    from specscope.models.loader import load_model

    dense = load_model(None, torch.float32, "cpu", str(specscope_cache_dir))
    quant = load_model(None, torch.float32, "cpu", str(specscope_cache_dir),
                       quantization="int4-gguf")
    return dense, quant


def test_default_model_linears_are_quantised_and_exact(default_models):
    """Every layer linear and the Q8_0 output matrix are swapped; each one's weights equal
    the dense dequantised ones (a wrong q/k un-permute or nibble order would be off by
    ~100%), and its product is within 8-bit activation error of theirs."""
    dense, quant = default_models
    n_quant = sum(isinstance(m, GgufLinear) for m in quant.model.modules())
    assert n_quant == 4 * dense.config.num_layers + 1
    assert isinstance(quant.model.lm_head, GgufLinear) and quant.model.lm_head.bits == 8
    torch.testing.assert_close(quant.model.lm_head.weight, dense.model.lm_head.weight,
                               atol=1e-6, rtol=0)
    for n in (0, dense.config.num_layers - 1):
        for a, b in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                     ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            q_lin = getattr(getattr(quant.model.model.layers[n], a), b)
            d_lin = getattr(getattr(dense.model.model.layers[n], a), b)
            torch.testing.assert_close(q_lin.weight, d_lin.weight, atol=1e-6, rtol=0)
            x = torch.randn(4, q_lin.in_features)
            exact = x @ d_lin.weight.T
            err = (q_lin(x) - exact).norm() / exact.norm()
            assert err.item() < 2e-2, (n, b, err.item())


def test_default_model_int4_predictions_agree(default_models):
    dense, quant = default_models
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 253, 1345, 28, 357, 7306, 30, 378, 2476]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        top_d = dense.model.compute_logits(dense.model(ids, pos)[0]).argmax(-1)
        top_q = quant.model.compute_logits(quant.model(ids, pos)[0]).argmax(-1)
    assert (top_d == top_q).float().mean().item() >= 0.9


def test_int4_gguf_errors(tiny_model_dir, specscope_cache_dir):
    from specscope.models.loader import load_model

    with pytest.raises(ValueError, match="fp32 or bf16"):
        load_model(None, torch.float16, "cpu", str(specscope_cache_dir),
                   quantization="int4-gguf")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(str(tiny_model_dir), torch.bfloat16, "cpu", quantization="int4-gguf")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(str(tiny_model_dir), torch.float32, "cpu", quantization="awq")


def test_q8_0_codes_match_gguf_quantize():
    """quantize_q8_0's codes are llama.cpp's Q8_0 (gguf's reference quantizer), and the
    swapped linear computes the dequantised product within 8-bit activation error."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    from specscope.models.quant import q8_0_codes, quantize_q8_0

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 20, bias=True)
    q, d = q8_0_codes(lin.weight)
    ref = dequantize(quantize(lin.weight.detach().numpy(), GGMLQuantizationType.Q8_0),
                     GGMLQuantizationType.Q8_0).reshape(20, 96)
    np.testing.assert_allclose(q.astype(np.float32) * np.repeat(d, 32, axis=1), ref,
                               rtol=0, atol=1e-7)
    net = torch.nn.Sequential(lin, torch.nn.ReLU(), torch.nn.Linear(20, 4))  # 20: not /32
    x = torch.randn(3, 96)
    exact = lin(x)
    assert quantize_q8_0(net) == 1
    assert isinstance(net[0], GgufLinear) and type(net[2]) is torch.nn.Linear
    torch.testing.assert_close(net[0].weight, torch.from_numpy(ref), atol=1e-7, rtol=0)
    err = (net[0](x) - exact).norm() / exact.norm()
    assert err.item() < 1e-2
