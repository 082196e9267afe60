"""PackedLinear (models/packed.py) against its reference, F.linear: bit-identical outputs on
the CPU in bf16, the reference path wherever packing does not apply, and a repack after
in-place weight updates."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specscope.config import ModelConfig
from specscope.draft.eagle3 import random_draft
from specscope.models.loader import random_model
from specscope.models.packed import PackedLinear, pack_linears, packing_available

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not packing_available(), reason="torch built without mkldnn")]


def _linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576,), (1, 576), (1, 1, 576), (1, 6, 576), (2, 7, 576)])
def test_packed_equals_linear(shape, bias):
    ref = _linear(576, 1000, bias)
    packed = PackedLinear(ref)
    x = torch.randn(shape).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x, ref.weight, ref.bias)
        got = packed(x)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert packed._packed is not None  # the fast path ran


def test_reference_path_off_the_fast_path():
    ref = _linear(64, 32, True)
    packed = PackedLinear(ref)
    x = torch.randn(3, 64)
    assert torch.equal(packed(x.to(torch.bfloat16)), ref(x.to(torch.bfloat16)))
    packed.float()  # fp32 weights: F.linear, never packed
    ref.float()
    packed._packed = None
    assert torch.equal(packed(x), ref(x))
    assert packed._packed is None
    # Autograd recording: the reference path, so gradients flow.
    packed.requires_grad_(True)
    packed(x).sum().backward()
    assert packed.weight.grad is not None


def test_copies_and_pickles_drop_the_packed_copy():
    packed = PackedLinear(_linear(64, 32, True))
    x = torch.randn(1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = packed(x)
    for clone in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert clone._packed is None
        with torch.inference_mode():
            assert torch.equal(clone(x), want)


def test_repacks_after_in_place_update():
    ref = _linear(64, 32, False)
    packed = PackedLinear(ref)
    x = torch.randn(1, 64).to(torch.bfloat16)
    before = packed(x)
    with torch.no_grad():
        ref.weight.mul_(2)  # shared parameter: the packed copy is now stale
    after = packed(x)
    assert torch.equal(after, F.linear(x, ref.weight))
    assert not torch.equal(after, before)


def _tiny_pair(dtype: torch.dtype):
    """A tiny random target and EAGLE-3 draft (own lm_head over a draft vocab)."""
    cfg = ModelConfig.from_hf(dict(
        architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0), name="tiny")
    target = random_model(cfg, dtype, "cpu")
    draft = random_draft(cfg, dtype, "cpu", draft_vocab_size=40, std=0.3)
    draft.attach_target(target)
    return target, draft


def test_pack_linears_keeps_state_and_outputs():
    _, draft = _tiny_pair(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, 5), generator=g)
    taps = torch.randn(1, 5, 3 * 32, generator=g).to(torch.bfloat16)
    pos = torch.arange(5)[None]
    keys = list(draft.state_dict())

    def run() -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            h, normed = draft(ids, draft.project(taps), pos)
            return h, draft.compute_logits(normed), draft.compute_logits(normed[0, -1])

    want = run()
    n = pack_linears(draft)
    assert n == sum(isinstance(m, PackedLinear) for m in draft.modules()) > 0
    assert pack_linears(draft) == 0  # idempotent
    assert list(draft.state_dict()) == keys
    for w, g_ in zip(want, run(), strict=True):
        assert torch.equal(w, g_)


def test_pack_linears_skips_fp32():
    _, draft = _tiny_pair(torch.float32)
    assert pack_linears(draft) == 0


def test_packed_target_forward_is_bit_identical():
    """The runner packs the target's linears (engine/runner.py): prefill-sized and
    verify-sized forwards are unchanged, and a tied lm_head stays tied."""
    target, _ = _tiny_pair(torch.bfloat16)
    target.config = dataclasses.replace(target.config, tie_word_embeddings=True)
    target.lm_head.weight = target.model.embed_tokens.weight
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            hidden, _ = target(ids, pos)
            return hidden, target.compute_logits(hidden)

    want = run()
    assert pack_linears(target) == 4 * 4 + 1
    assert target.lm_head.weight is target.model.embed_tokens.weight
    for w, g in zip(want, run(), strict=True):
        assert torch.equal(w, g)


def test_pack_linears_respects_the_memory_share(monkeypatch):
    """A packed copy that would take more than the given share of free memory is not made
    (a large target on the CPU keeps F.linear rather than doubling its weights)."""
    import specscope.models.packed as packed

    _, draft = _tiny_pair(torch.bfloat16)
    need = packed.packable_bytes(draft)
    assert need > 0
    monkeypatch.setattr(packed, "available_memory_bytes", lambda: 2 * need)
    assert pack_linears(draft, memory_fraction=0.25) == 0
    assert not any(isinstance(m, PackedLinear) for m in draft.modules())
    monkeypatch.setattr(packed, "available_memory_bytes", lambda: 8 * need)
    assert pack_linears(draft, memory_fraction=0.25) > 0
