"""int4-gguf: GGUF Q4_0/Q4_1 codes run natively must compute the dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specscope.models.quant import Int4Linear, q4_codes


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF blocks with random codes and realistic fp16 scale/min."""
    nb = cols // 32
    d = rng.uniform(0.001, 0.05, (rows, nb)).astype(np.float16)
    qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    parts = [d.view(np.uint8).reshape(rows, nb, 2)]
    if qtype == "Q4_1":
        m = rng.uniform(-0.3, 0.0, (rows, nb)).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(rows, nb, 2))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_codes_match_gguf_dequantize(qtype):
    from gguf import GGMLQuantizationType, dequantize

    rng = np.random.default_rng(0)
    rows, cols = 24, 96
    raw = _random_blocks(qtype, rows, cols, rng)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    q, scale, zero = q4_codes(raw, qtype, rows, cols)
    assert q.min() >= 0 and q.max() <= 15
    ours = (q.astype(np.float32) - 8).reshape(rows, -1, 32) * scale[..., None] + zero[..., None]
    np.testing.assert_allclose(ours.reshape(rows, cols), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_linear_matches_dense(qtype):
    from gguf import GGMLQuantizationType, dequantize

    rng = np.random.default_rng(1)
    rows, cols = 64, 128
    raw = _random_blocks(qtype, rows, cols, rng)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols))
    bias = torch.randn(rows, dtype=torch.bfloat16)
    lin = Int4Linear.from_codes(*q4_codes(raw, qtype, rows, cols), torch.bfloat16, bias)
    x = torch.randn(5, 3, cols)
    y = lin(x.bfloat16()).float()
    ref = x @ w.T + bias.float()
    assert y.shape == (5, 3, rows)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2  # bf16 activations and scales


@pytest.fixture(scope="module")
def default_models(default_model_dir, specscope_cache_dir):
    from specscope.models.loader import load_model

    dense = load_model(None, torch.float32, "cpu", str(specscope_cache_dir))
    quant = load_model(None, torch.bfloat16, "cpu", str(specscope_cache_dir),
                       quantization="int4-gguf")
    return dense, quant


def test_default_model_linears_are_int4_and_exact(default_models):
    """Every layer linear is swapped; its effective weight equals the fp32 dequantised one
    up to bf16 rounding (a wrong q/k un-permute or nibble order would be off by ~100%)."""
    dense, quant = default_models
    n_int4 = sum(isinstance(m, Int4Linear) for m in quant.model.modules())
    assert n_int4 == 4 * dense.config.num_layers
    for n in (0, dense.config.num_layers - 1):
        for a, b in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                     ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            q_lin = getattr(getattr(quant.model.model.layers[n], a), b)
            d_lin = getattr(getattr(dense.model.model.layers[n], a), b)
            eye = torch.eye(q_lin.in_features, dtype=torch.bfloat16)
            w_eff = q_lin(eye).float().T  # [N, K]
            err = (w_eff - d_lin.weight).norm() / d_lin.weight.norm()
            assert err.item() < 1e-2, (n, b, err.item())


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

    with pytest.raises(ValueError, match="bf16"):
        load_model(None, torch.float32, "cpu", str(specscope_cache_dir),
                   quantization="int4-gguf")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(str(tiny_model_dir), torch.bfloat16, "cpu", quantization="int4-gguf")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(str(tiny_model_dir), torch.float32, "cpu", quantization="awq")
