"""Tests for specscope.sampling and SamplingParams validation (pure CPU, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from specscope.config import SamplingParams
from specscope.sampling import (
    apply_top_k,
    apply_top_p,
    make_generator,
    processed_logits,
    sample,
)

# Six-token vocabulary with well separated probabilities (no ties).
LOGITS6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])


def _kept(x: torch.Tensor) -> set[int]:
    """Indices of a 1-row logits tensor that survived a filter."""
    return {i for i, v in enumerate(x.reshape(-1).tolist()) if v != float("-inf")}


def _probs_logits(*probs: float) -> torch.Tensor:
    """[1, V] logits whose softmax is exactly `probs` (powers of two stay exact)."""
    return torch.tensor([[math.log(p) for p in probs]])


# ---------------------------------------------------------------- greedy / temperature


def test_greedy_is_argmax_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    out = sample(logits, params, None)
    assert out.dtype == torch.int64 and out.shape == (8,)
    assert out.tolist() == logits.argmax(-1).tolist()
    # A generator changes nothing in greedy mode.
    out2 = sample(logits, params, make_generator(123, "cpu"))
    assert out2.tolist() == out.tolist()


def test_temperature_scales_logits() -> None:
    logits = LOGITS6[None].clone()
    for t in (0.25, 0.7, 1.0, 3.0):
        x = processed_logits(logits, SamplingParams(temperature=t))
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, logits / t)
        torch.testing.assert_close(x.softmax(-1), (logits / t).softmax(-1))


def test_processed_logits_upcasts_half_inputs() -> None:
    logits = LOGITS6[None].to(torch.bfloat16)
    x = processed_logits(logits, SamplingParams(temperature=0.5))
    assert x.dtype == torch.float32
    torch.testing.assert_close(x, logits.float() / 0.5)


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10, 49])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    torch.manual_seed(k)
    logits = torch.randn(4, 50)
    out = apply_top_k(logits, k)
    for row in range(4):
        kept = _kept(out[row])
        assert kept == set(torch.topk(logits[row], k).indices.tolist())
        # Kept values are unchanged.
        idx = sorted(kept)
        assert torch.equal(out[row, idx], logits[row, idx])


@pytest.mark.parametrize("k", [0, 50, 1000])
def test_top_k_off(k: int) -> None:
    logits = torch.randn(2, 50)
    assert torch.equal(apply_top_k(logits, k), logits)


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, 1.0]])
    assert _kept(apply_top_k(logits, 2)) == {0, 1, 2, 4}


# ---------------------------------------------------------------- top-p


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        # probs 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1.0)
        (0.1, {0}),
        (0.45, {0}),
        (0.6, {0, 1}),
        (0.79, {0, 1}),
        (0.81, {0, 1, 2}),
        (0.94, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_minimal_nucleus(p: float, expected: set[int]) -> None:
    logits = _probs_logits(0.5, 0.3, 0.15, 0.05)
    assert _kept(apply_top_p(logits, p)) == expected


def test_top_p_is_order_independent() -> None:
    # Same probabilities, shuffled positions: the same tokens (by value) survive.
    logits = _probs_logits(0.15, 0.05, 0.5, 0.3)
    assert _kept(apply_top_p(logits, 0.6)) == {2, 3}
    assert _kept(apply_top_p(logits, 0.81)) == {0, 2, 3}


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        # probs 0.5, 0.25, 0.125, 0.125 are exact in binary, so are their sums: the smallest
        # set whose mass *reaches* p (HF / vLLM semantics, and the docstring's) is the answer.
        (0.5, {0}),
        (0.75, {0, 1}),
        (0.875, {0, 1, 2}),
    ],
)
def test_top_p_boundary_mass_exactly_p(p: float, expected: set[int]) -> None:
    logits = _probs_logits(0.5, 0.25, 0.125, 0.125)
    assert _kept(apply_top_p(logits, p)) == expected


def test_top_p_always_keeps_the_top_token() -> None:
    logits = _probs_logits(0.9, 0.05, 0.05)
    assert _kept(apply_top_p(logits, 1e-6)) == {0}


def test_top_k_then_top_p_order() -> None:
    # temperature, then top-k, then top-p over the renormalised top-k distribution.
    logits = LOGITS6[None]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.7)
    kept = _kept(processed_logits(logits, params))
    p3 = logits[0, :3].softmax(-1)  # 0.629, 0.231, 0.140 over the top 3 (renormalised)
    assert p3[0] < 0.7 < p3[0] + p3[1]
    assert kept == {0, 1}


# ---------------------------------------------------------------- exponential race law

N_DRAWS = 20000


def _empirical(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    gen = make_generator(seed, "cpu")
    draws = sample(logits.expand(N_DRAWS, -1).contiguous(), params, gen)
    return torch.bincount(draws, minlength=logits.shape[-1]).double()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    ],
    ids=["t1", "t0.5", "t2", "topk3", "topp0.8", "t0.8-k4-p0.9"],
)
def test_exponential_race_matches_softmax(params: SamplingParams) -> None:
    logits = LOGITS6[None]
    expected = processed_logits(logits, params).softmax(-1)[0].double()
    counts = _empirical(logits, params, seed=1234)
    assert counts.sum() == N_DRAWS
    # Filtered tokens never appear.
    filtered = expected == 0
    assert counts[filtered].sum() == 0, (counts, expected)
    freq = counts / N_DRAWS
    assert (freq - expected).abs().max() < 0.015, (freq, expected)
    # Pearson chi-square over the surviving tokens; 0.1% critical values for df 1..5.
    live = ~filtered
    chi2 = ((counts[live] - N_DRAWS * expected[live]) ** 2 / (N_DRAWS * expected[live])).sum()
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[int(live.sum()) - 1]
    assert chi2 < critical, (chi2.item(), freq, expected)


def test_exponential_race_handles_a_single_survivor() -> None:
    params = SamplingParams(temperature=1.0, top_k=1)
    counts = _empirical(LOGITS6[None], params, seed=7)
    assert counts[0] == N_DRAWS


def test_sample_returns_int64_on_logits_device() -> None:
    out = sample(LOGITS6[None], SamplingParams(temperature=1.0), make_generator(0, "cpu"))
    assert out.dtype == torch.int64 and out.shape == (1,) and out.device.type == "cpu"


# ---------------------------------------------------------------- seeding


def _sequence(seed: int | None, steps: int = 64) -> list[int]:
    torch.manual_seed(0)
    logits = torch.randn(steps, 1, 1000)  # fixed logits; only the generator differs
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
    gen = make_generator(seed, "cpu")
    return [int(sample(logits[i], params, gen)) for i in range(steps)]


def test_same_seed_same_tokens() -> None:
    assert _sequence(42) == _sequence(42)
    assert _sequence(0) == _sequence(0)


def test_different_seeds_different_tokens() -> None:
    seqs = {tuple(_sequence(s)) for s in (0, 1, 2, 3)}
    assert len(seqs) == 4


def test_unseeded_generators_differ() -> None:
    assert _sequence(None) != _sequence(None)


# ---------------------------------------------------------------- SamplingParams validation


def test_sampling_params_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert p.greedy and p.max_tokens > 0 and p.top_k == 0 and p.top_p == 1.0
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(seed=0).seed == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
