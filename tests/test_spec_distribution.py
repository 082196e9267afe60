"""End to end: sampled speculative decoding emits tokens with exactly the target's law, with
16 sequences per batch (each its own seeded generator).

A tiny 8-token-vocabulary target and a random draft; 3 tokens per request at temperature 1,
thousands of seeds. The joint law of (t1, t2, t3) is computed exactly from the target by full
forwards, and the empirical counts are compared with a chi-square test (p = 1e-3). t1 comes
from the prefill; t2 and t3 come from speculative cycles (accepted drafts, residual samples,
bonus tokens), chain (sampled drafts, rejection with q) and tree (top-k children,
sibling-by-sibling recursive rejection). Also with logits adjustments (penalties, logit_bias,
min_tokens by depth, min_p): the law is then the adjusted one, each token's distribution
computed by the per-token reference at its own prefix.
"""

from __future__ import annotations

import math

import pytest
import torch

from specscope import LLM, SamplingParams
from specscope.config import ModelConfig, SpecConfig
from specscope.models.loader import random_model
from specscope.sampling import adjust_logits_reference, processed_logits

V = 8
PROMPT = "1 2 3"


def _critical(dof: int, z: float = 3.090232) -> float:
    """Upper 1e-3 quantile of chi-square(dof), Wilson-Hilferty approximation."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64})
    model = random_model(cfg, torch.float32, "cpu", seed=3)
    with torch.no_grad():  # spread the logits: a peaked, non-uniform target law
        model.lm_head.weight.mul_(12.0)
    return model


# Every adjustment at once; min_tokens=2 masks the stop id for t1 and t2 only (t3 may be
# it), so the verify trees straddle the depth where the mask lifts.
ADJUSTED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                logit_bias={2: 1.5, 5: -2.0}, min_tokens=2, stop_token_ids=(4,), min_p=0.02)


def _exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] from full forwards (no cache, no speculation), each token's
    distribution adjusted by the per-token reference at its prefix."""
    prompt = [1, 2, 3]

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            h, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None])
            x = adjust_logits_reference(model.compute_logits(h[0, -1]), prompt,
                                        ids[len(prompt):], params, set(params.stop_token_ids))
            return processed_logits(x[None], params)[0].softmax(-1).double()

    joint = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = probs(prompt)
    for a in range(V):
        p2 = probs(prompt + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "topk", "ndt", "adjusted", "stop"), [
    (2, 1, None, False, 0.0), (2, 2, 4, False, 0.0), (2, 1, None, True, 0.0),
    (2, 2, 4, True, 0.0), (3, 1, None, False, 0.02)])
def test_sampled_speculative_output_has_the_target_law(single_thread, target, steps, topk,
                                                       ndt, adjusted, stop):
    """stop: the confidence stop, which cuts the chains at varied depths (0 to steps)."""
    spec = SpecConfig(draft="random", num_steps=steps, topk=topk, num_draft_tokens=ndt,
                      confidence_stop=stop)
    llm = LLM.from_model(target, spec=spec)
    extra = ADJUSTED if adjusted else {}
    joint = _exact_joint(target, SamplingParams(temperature=1.0, **extra)).reshape(-1)
    n, per_batch = 4000, 16
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    accepted, drafted = 0, set()
    ids = llm.encode_prompt(PROMPT)
    for first in range(0, n, per_batch):
        # Several sequences per step, each with its own seeded generator.
        for seed in range(first, first + per_batch):
            llm.add_request(ids, SamplingParams(max_tokens=3, temperature=1.0, seed=seed,
                                                ignore_eos=True, **extra))
        outs = []
        while llm.has_unfinished_requests():
            outs += [d.output for d in llm.step() if d.finished]
        for out in outs:
            a, b, c = out.token_ids
            counts[(a * V + b) * V + c] += 1
            accepted += sum(out.spec["accepted_per_cycle"])
            drafted.update(out.spec["drafted_per_cycle"])
    assert accepted > 0.05 * n  # drafts were really accepted, not only rejected
    assert drafted == {steps} if not stop else len(drafted) > 1  # the stop cut chains
    expected = joint * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    stat = ((obs - exp) ** 2 / exp).sum().item()
    crit = _critical(obs.numel() - 1)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: the output law is not the target's"
