"""The native CPU layer kernels (specscope/native) against their torch references: RMSNorm
with the residual add, silu * up, and q/k norms + rotary + the paged KV write + attention
for decode tokens, chains, trees and sliding windows side by side; a whole model's logits
and greedy text with the kernels on and off; the build cache never taking a broken file."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from reference import threads

import specscope.native as native
from specscope.kvcache.paged import BatchMeta, PagedKV, paged_attend, tree_meta
from specscope.models.rope import apply_rope_rolled, signed_sin

pytestmark = pytest.mark.usefixtures("single_thread")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    k = native.cpu_kernels()
    if k is None:
        pytest.skip("no C compiler here: the native kernels cannot be built")
    return k


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _ref_norm(x, w, eps):
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_equals_the_reference(kernels, dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    out, h = kernels.rms_norm(x, w, 1e-5)
    assert h is x
    torch.testing.assert_close(out, _ref_norm(x, w, 1e-5), **_tol(dtype))
    out, h = kernels.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(h, x + r, atol=0, rtol=0)  # the add rounds as torch's does
    torch.testing.assert_close(out, _ref_norm(x + r, w, 1e-5), **_tol(dtype))
    # Each row depends on itself alone: one row normed alone equals it normed among five.
    one, _ = kernels.rms_norm(x[2:3].contiguous(), w, 1e-5, r[2:3].contiguous())
    assert torch.equal(one[0], out[2])
    # A prefill chunk's rows are shared among the threads: the same rows as one at a time.
    xs, rs = (torch.randn(40, 576, generator=g).to(dtype) for _ in range(2))
    with threads(2):
        many, hs = kernels.rms_norm(xs, w, 1e-5, rs)
    for i in (0, 21, 39):
        one, h1 = kernels.rms_norm(xs[i:i + 1].contiguous(), w, 1e-5, rs[i:i + 1].contiguous())
        assert torch.equal(one[0], many[i]) and torch.equal(h1[0], hs[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_the_reference(kernels, dtype):
    gu = (torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gu.split(1536, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gate) * up, **_tol(dtype))
    assert torch.equal(kernels.silu_mul(gu[1:2].contiguous())[0], kernels.silu_mul(gu)[1])
    many = (torch.randn(40, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    with threads(2):
        out = kernels.silu_mul(many)
    for i in (0, 17, 39):
        assert torch.equal(kernels.silu_mul(many[i:i + 1].contiguous())[0], out[i])


def _ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _batch(bs: int, window: int | None):
    """A forward's BatchMeta over three sequences with scattered blocks: a decode token of
    sequence 0 at position 13, a 3-node chain after sequence 1's 7 tokens, and a 5-node
    tree after sequence 2's 10 tokens."""
    tables = torch.tensor([[5, 2, 9, 0, 11], [3, 7, 1, 12, 4], [8, 6, 10, 13, 14]])
    decode = BatchMeta.causal(tables, torch.tensor([0]), torch.tensor([13]), bs, window,
                              max_len=14)
    chain = BatchMeta.causal(tables, torch.tensor([1, 1, 1]), torch.tensor([7, 8, 9]), bs,
                             window, max_len=10)
    anc = _ancestors([-1, 0, 0, 1, 2])[None]
    rope = (10 + torch.tensor([0, 1, 1, 2, 2]))[None]
    tree = tree_meta(tables, torch.tensor([10]), anc, bs, rows=torch.tensor([2]), rope=rope,
                     sliding_window=window, max_len=15)
    return BatchMeta.cat([decode, chain, tree]), torch.cat([torch.tensor([13, 7, 8, 9]),
                                                            rope[0]])


def _reference(qkv, cos, sin, kc, vc, meta, scale, H, Hkv, norms, eps):
    N, D = qkv.shape[0], qkv.shape[1] // (H + 2 * Hkv)
    qk = qkv[:, :(H + Hkv) * D].view(N, H + Hkv, D)
    if norms is not None:
        qk = torch.cat((_ref_norm(qk[:, :H], norms[0], eps), _ref_norm(qk[:, H:], norms[1], eps)),
                       dim=1)
    qk = apply_rope_rolled(qk, cos[:, None], signed_sin(sin)[:, None])
    v = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
    return paged_attend(qk[:, :H], qk[:, H:], v, kc, vc, meta, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_of_decode_chain_and_tree_tokens_equals_the_reference(kernels, dtype,
                                                                        window, qk_norm):
    H, Hkv, D, bs = 6, 2, 16, 4
    meta, positions = _batch(bs, window)
    N = meta.num_tokens
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = positions[:, None].float() * torch.rand(D // 2, generator=g)[None]
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype) for f in (torch.cos, torch.sin))
    norms = tuple((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2)) \
        if qk_norm else None
    kv_ref = PagedKV(1, 16, bs, Hkv, D, dtype, "cpu")
    for t in (kv_ref.k[0], kv_ref.v[0]):  # earlier steps' keys and values
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    kv_nat = PagedKV(1, 16, bs, Hkv, D, dtype, "cpu")
    kv_nat.k[0].copy_(kv_ref.k[0])
    kv_nat.v[0].copy_(kv_ref.v[0])
    scale = D ** -0.5
    want = _reference(qkv, cos, sin, kv_ref.k[0], kv_ref.v[0], meta, scale, H, Hkv, norms, 1e-6)
    assert kernels.attend_applies(qkv, kv_nat.k[0], kv_nat.v[0], cos, D)
    got = kernels.attend_qkv(qkv, cos, sin, kv_nat.k[0], kv_nat.v[0], meta, scale, H, Hkv,
                             norms, 1e-6)
    torch.testing.assert_close(kv_nat.v[0], kv_ref.v[0], atol=0, rtol=0)
    torch.testing.assert_close(kv_nat.k[0], kv_ref.k[0], **_tol(dtype))
    torch.testing.assert_close(got, want, **_tol(dtype))
    # A token's row is its own: the decode token alone gives what it gave among the others.
    alone = kernels.attend_qkv(qkv[:1].contiguous(), cos[:1].contiguous(), sin[:1].contiguous(),
                               kv_nat.k[0], kv_nat.v[0], BatchMeta.cat([_first(meta)]), scale,
                               H, Hkv, norms, 1e-6)
    assert torch.equal(alone[0], got[0])


def _long_batch(bs: int, window: int | None):
    """Rows on both sides of the attention's key chunk (KEY_CHUNK = 512 keys): a decode token
    at position 1,100 (three chunks), a 4-node chain after 510 tokens (its rows see 511-514
    keys: whole, then split), a 5-node tree after 600 tokens, and a short decode at 40.
    Each sequence's blocks scattered over the pool."""
    per = 70  # blocks a sequence: 1,120 positions at bs 16
    perm = torch.randperm(4 * per, generator=torch.Generator().manual_seed(5))
    tables = perm.view(4, per)
    decode = BatchMeta.causal(tables, torch.tensor([0]), torch.tensor([1100]), bs, window,
                              max_len=1101)
    chain = BatchMeta.causal(tables, torch.tensor([1] * 4), torch.arange(510, 514), bs, window,
                             max_len=514)
    anc = _ancestors([-1, 0, 0, 1, 2])[None]
    rope = (600 + torch.tensor([0, 1, 1, 2, 2]))[None]
    tree = tree_meta(tables, torch.tensor([600]), anc, bs, rows=torch.tensor([2]), rope=rope,
                     sliding_window=window, max_len=605)
    short = BatchMeta.causal(tables, torch.tensor([3]), torch.tensor([40]), bs, window,
                             max_len=41)
    positions = torch.cat([torch.tensor([1100]), torch.arange(510, 514), rope[0],
                           torch.tensor([40])])
    return BatchMeta.cat([decode, chain, tree, short]), positions, 4 * per


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 700])
def test_long_rows_attend_in_key_chunks_as_the_reference(kernels, dtype, window):
    """Rows of more than KEY_CHUNK keys are attended chunk by chunk and merged (the threads
    share one token's few KV heads): the result equals the reference, and every token's
    row is the same alone as among the others (a decode step's logits equal a verify's)."""
    H, Hkv, D, bs = 6, 2, 64, 16
    meta, positions, blocks = _long_batch(bs, window)
    N = meta.num_tokens
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = positions[:, None].float() * torch.rand(D // 2, generator=g)[None] * 0.01
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype) for f in (torch.cos, torch.sin))
    kv_ref = PagedKV(1, blocks, bs, Hkv, D, dtype, "cpu")
    for t in (kv_ref.k[0], kv_ref.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    kv_nat = PagedKV(1, blocks, bs, Hkv, D, dtype, "cpu")
    kv_nat.k[0].copy_(kv_ref.k[0])
    kv_nat.v[0].copy_(kv_ref.v[0])
    scale = D ** -0.5
    want = _reference(qkv, cos, sin, kv_ref.k[0], kv_ref.v[0], meta, scale, H, Hkv, None, 1e-6)
    got = kernels.attend_qkv(qkv, cos, sin, kv_nat.k[0], kv_nat.v[0], meta, scale, H, Hkv,
                             None, 1e-6)
    torch.testing.assert_close(got, want, **_tol(dtype))
    for i in range(N):  # each token alone, its own K/V already in the cache
        one = dataclasses.replace(meta, **{f: getattr(meta, f)[i:i + 1] for f in (
            "slots", "seq_index", "visible", "window_start", "tree_start", "tree_mask")},
            spans=None, span_masks=None, span_blocks=None, native_args=None)
        alone = kernels.attend_qkv(qkv[i:i + 1].contiguous(), cos[i:i + 1].contiguous(),
                                   sin[i:i + 1].contiguous(), kv_nat.k[0], kv_nat.v[0],
                                   BatchMeta.cat([one]), scale, H, Hkv, None, 1e-6)
        assert torch.equal(alone[0], got[i]), i


def _first(meta: BatchMeta) -> BatchMeta:
    return dataclasses.replace(meta, **{f: getattr(meta, f)[:1] for f in (
        "slots", "seq_index", "visible", "window_start", "tree_start", "tree_mask")},
        spans=None, span_masks=None, span_blocks=None, native_args=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_chunks_attend_as_the_reference_on_any_thread_count(kernels, dtype, window):
    """Prefill-sized calls: a 150-token prompt whole (cut into pieces of at most 64 tokens)
    beside a 70-token chunk after 30 cached tokens of another sequence. The result equals
    the reference and does not depend on the threads; each token's row is its own (the
    first token of the chunk alone gives what it gave among the others)."""
    H, Hkv, D, bs = 6, 2, 64, 16
    tables = torch.randperm(26, generator=torch.Generator().manual_seed(7)).view(2, 13)
    a = BatchMeta.causal(tables, torch.zeros(150, dtype=torch.long), torch.arange(150), bs,
                         window, max_len=150)
    b = BatchMeta.causal(tables, torch.ones(70, dtype=torch.long), torch.arange(30, 100), bs,
                         window, max_len=100)
    meta = BatchMeta.cat([a, b])
    positions = torch.cat([torch.arange(150), torch.arange(30, 100)])
    N = meta.num_tokens
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    ang = positions[:, None].float() * torch.rand(D // 2, generator=g)[None] * 0.01
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype) for f in (torch.cos, torch.sin))
    kv_ref = PagedKV(1, 26, bs, Hkv, D, dtype, "cpu")
    for t in (kv_ref.k[0], kv_ref.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    scale = D ** -0.5
    want = _reference(qkv, cos, sin, kv_ref.k[0], kv_ref.v[0], meta, scale, H, Hkv, None, 1e-6)
    assert kernels.attend_applies(qkv, kv_ref.k[0], kv_ref.v[0], cos, D)
    outs = []
    for n in (1, 2):
        kv = PagedKV(1, 26, bs, Hkv, D, dtype, "cpu")
        kv.k[0].copy_(kv_ref.k[0])
        kv.v[0].copy_(kv_ref.v[0])
        with threads(n):
            outs.append(kernels.attend_qkv(qkv, cos, sin, kv.k[0], kv.v[0], meta, scale, H,
                                           Hkv, None, 1e-6))
    torch.testing.assert_close(outs[0], want, **_tol(dtype))
    assert torch.equal(outs[0], outs[1])
    first = dataclasses.replace(b, **{f: getattr(b, f)[:1] for f in (
        "slots", "seq_index", "visible", "window_start", "tree_start", "tree_mask")},
        spans=None, span_masks=None, span_blocks=None, native_args=None)
    alone = kernels.attend_qkv(qkv[150:151].contiguous(), cos[150:151].contiguous(),
                               sin[150:151].contiguous(), kv.k[0], kv.v[0],
                               BatchMeta.cat([first]), scale, H, Hkv, None, 1e-6)
    assert torch.equal(alone[0], outs[1][150])


def test_attention_declines_a_chunk_past_its_scratch_and_writes_nothing(kernels, monkeypatch):
    """A call whose key lists and split parts would pass ATTENTION_MAX_SCRATCH returns None
    (the caller runs the reference) before it writes the cache; under the bound it runs."""
    H, Hkv, D, bs, n = 2, 1, 8, 4, 40
    tables = torch.arange(16).view(1, 16)
    meta = BatchMeta.causal(tables, torch.zeros(n, dtype=torch.long), torch.arange(n), bs,
                            max_len=n)
    qkv = torch.randn(n, (H + 2 * Hkv) * D)
    cos, sin = torch.ones(n, D), torch.zeros(n, D)
    kv = PagedKV(1, 16, bs, Hkv, D, torch.float32, "cpu")
    monkeypatch.setattr(native.cpu, "ATTENTION_MAX_SCRATCH", 8 * n - 1)  # one run's list
    assert kernels.attend_qkv(qkv, cos, sin, kv.k[0], kv.v[0], meta, 1.0, H, Hkv, None,
                              0.0) is None
    assert not kv.k[0].any() and not kv.v[0].any()
    monkeypatch.setattr(native.cpu, "ATTENTION_MAX_SCRATCH", 8 * n)
    out = kernels.attend_qkv(qkv, cos, sin, kv.k[0], kv.v[0], dataclasses.replace(
        meta, native_args=None), 1.0, H, Hkv, None, 0.0)
    assert out is not None and kv.k[0].any()
    assert not kernels.attend_applies(qkv[:2], kv.k[0], kv.k[0].to(torch.bfloat16), cos, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_with_and_without_the_kernels_gives_the_same_logits(monkeypatch, dtype):
    import specscope.kvcache.paged as paged
    import specscope.models.llama as llama
    from specscope.config import ModelConfig
    from specscope.models.loader import random_model

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", family="llama", vocab_size=90,
                      hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=128, tie_word_embeddings=False, qk_norm=True,
                      name="tiny-qk-norm")
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    tables = torch.arange(16).view(2, 8)
    pos = torch.arange(12)
    logits = []
    for on in (True, False):
        chosen = native.cpu_kernels_for if on else (lambda x: None)
        monkeypatch.setattr(llama, "cpu_kernels_for", chosen)
        monkeypatch.setattr(paged, "cpu_kernels_for", chosen)
        model = random_model(cfg, dtype, "cpu", seed=3)
        kv = PagedKV(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        rows = []
        with torch.inference_mode():
            for a, b in ((0, 8), (8, 9), (9, 12)):  # a prefill, a decode token, a chain
                meta = BatchMeta.causal(tables, torch.zeros(b - a, dtype=torch.long), pos[a:b],
                                        4)
                h, _ = model(ids[:, a:b], pos[None, a:b], kv, batch=meta)
                rows.append(model.compute_logits(h[0]).float())
        logits.append(torch.cat(rows))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(logits[0], logits[1], **tol)


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SPECSCOPE_CACHE_DIR", str(tmp_path))
    native.cpu_kernels.cache_clear()
    path = native._library_path(native._compiler(), native.build_flags(), native._sources())
    assert path.parent == tmp_path / "native"
    # What a copy cut short would leave under the final name (the build itself writes a
    # temporary name and renames it, so it never leaves this).
    path.write_bytes(b"half a library")
    try:
        kernels = native.cpu_kernels()
        assert kernels is not None and kernels.path == path and path.stat().st_size > 1000
        assert not list(path.parent.glob("*.part"))  # no build leftovers
    finally:
        native.cpu_kernels.cache_clear()


def test_an_optional_flag_the_compiler_rejects_is_dropped(tmp_path, monkeypatch):
    """A CPU with AVX-VNNI under a compiler that does not know -mavxvnni: the build retries
    without it, and the next process finds that library rather than failing again."""
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SPECSCOPE_CACHE_DIR", str(tmp_path))
    bogus = "-mno-such-specscope-flag"
    base = native.build_flags()
    monkeypatch.setattr(native, "OPTIONAL_FLAGS", [bogus])
    monkeypatch.setattr(native, "build_flags", lambda: base + [bogus])
    built = []
    real_build = native._build
    monkeypatch.setattr(native, "_build", lambda *a: (built.append(a[1]), real_build(*a)))
    native.cpu_kernels.cache_clear()
    try:
        kernels = native.cpu_kernels()
        plain = native._library_path(native._compiler(), base, native._sources())
        assert kernels is not None and kernels.path == plain
        assert built == [base + [bogus], base]
        native.cpu_kernels.cache_clear()
        built.clear()
        assert native.cpu_kernels().path == plain and built == []
    finally:
        native.cpu_kernels.cache_clear()


def test_without_a_compiler_the_reference_runs(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("SPECSCOPE_CACHE_DIR", "/nonexistent-specscope-cache")
    native.cpu_kernels.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="specscope"):
            assert native.cpu_kernels() is None
        assert "torch reference" in caplog.text
        monkeypatch.setenv("SPECSCOPE_NATIVE", "0")
        monkeypatch.delenv("CC")
        native.cpu_kernels.cache_clear()
        assert native.cpu_kernels() is None
    finally:
        native.cpu_kernels.cache_clear()


def test_an_empty_batch_attends_to_nothing(kernels):
    meta = BatchMeta.causal(torch.zeros(1, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long), 4, max_len=1)
    kv = PagedKV(1, 2, 4, 1, 8, torch.float32, "cpu")
    out = kernels.attend_qkv(torch.zeros(0, 3 * 8), torch.zeros(0, 8), torch.zeros(0, 8),
                             kv.k[0], kv.v[0], meta, 1.0, 1, 1, None, 0.0)
    assert out.shape == (0, 8)


def _gguf_model(dtype, qk_norm: bool, window: int | None):
    """A tiny three-layer model whose products are GGUF codes: Q8_0 made from its weights,
    gate/up as 4-bit codes with offsets (Q4_1), so both code widths run."""
    import numpy as np

    from specscope.config import ModelConfig
    from specscope.models.loader import random_model
    from specscope.models.quant import GgufLinear, quantize_q8_0

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", family="llama", vocab_size=90,
                      hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=128, tie_word_embeddings=False, qk_norm=qk_norm,
                      sliding_window=window, name="tiny-gguf")
    model = random_model(cfg, dtype, "cpu", seed=5)
    quantize_q8_0(model.model.layers)
    rng = np.random.default_rng(6)
    for layer in model.model.layers:
        n, k = 2 * cfg.intermediate_size, cfg.hidden_size
        layer.mlp.gate_up_proj = GgufLinear.from_codes(
            rng.integers(0, 16, (n, k)).astype(np.uint8),
            (rng.random((n, k // 32)) * 0.02).astype(np.float32),
            (rng.random((n, k // 32)) * -0.15).astype(np.float32), 4, None)
    for norm in [m for m in model.modules() if type(m).__name__ == "RMSNorm"]:
        norm.weight.data = (1 + 0.1 * torch.randn(norm.weight.shape)).to(dtype)
    return model, cfg


def _count_native_calls(monkeypatch) -> dict[str, int]:
    """Counts of NativeDecoder.run and .run_first calls from now on."""
    from specscope.native.decoder import NativeDecoder

    calls = {"run": 0, "run_first": 0}

    def counting(name: str):
        original = getattr(NativeDecoder, name)

        def counted(self, *args):
            calls[name] += 1
            return original(self, *args)
        return counted

    for name in calls:
        monkeypatch.setattr(NativeDecoder, name, counting(name))
    return calls


def _paged_ctx(cfg, n: int, dtype=torch.float32):
    """What native_decoder reads of a ForwardContext: a paged batch, no training-time test,
    n rope rows."""
    import types

    cos = torch.zeros(n, 1, cfg.head_dim, dtype=dtype)
    return types.SimpleNamespace(paged=object(), ttt=None, rope_tokens=(cos, cos, cos))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,window", [(False, None), (True, 6)])
def test_the_native_decoder_equals_the_layers_one_by_one(kernels, monkeypatch, dtype, qk_norm,
                                                         window):
    """decoder.c's one call against the layer-by-layer path over a batch of a decode token,
    a chain and a tree: the hidden states, the taps (the embeddings' included) and every
    layer's cache bit-equal."""
    model, cfg = _gguf_model(dtype, qk_norm, window)
    calls = _count_native_calls(monkeypatch)
    model.set_taps([-1, 0, 2])
    meta, pos = _batch(4, window)
    ids = torch.randint(0, cfg.vocab_size, (1, pos.numel()),
                        generator=torch.Generator().manual_seed(7))
    base = PagedKV(cfg.num_layers, 15, 4, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    for t in base.k + base.v:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(8)))
    out = {}
    for on in (True, False):
        model.native_decoder_enabled = on
        kv = PagedKV(cfg.num_layers, 15, 4, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        for a, b in zip(kv.k + kv.v, base.k + base.v, strict=True):
            a.copy_(b)
        before = calls["run"]
        with torch.inference_mode():
            h, taps = model(ids, pos[None], kv, batch=dataclasses.replace(meta),
                            return_taps=True)
        assert (calls["run"] > before) == on
        out[on] = (h, taps, kv.k + kv.v)
    (h1, t1, c1), (h0, t0, c0) = out[True], out[False]
    assert torch.equal(h1, h0) and torch.equal(t1, t0)
    assert all(torch.equal(a, b) for a, b in zip(c1, c0, strict=True))


@torch.inference_mode()
def test_the_native_decoder_declines_what_it_does_not_run(kernels):
    """Dense products, more tokens than the native attention takes, and a model whose
    products were replaced after the first call (it is built again) go the other way."""
    from specscope.models.quant import GgufLinear
    from specscope.native.decoder import decoder_applies, native_decoder

    model, cfg = _gguf_model(torch.float32, False, None)
    kv = PagedKV(cfg.num_layers, 15, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    x = torch.zeros(4, cfg.hidden_size)
    nd = native_decoder(model, x, kv, _paged_ctx(cfg, 4))
    assert nd is not None and nd.current()
    assert native_decoder(model, torch.zeros(17, 64), kv, _paged_ctx(cfg, 17)) is None
    cos = torch.zeros(17, cfg.head_dim)
    assert nd.serves(torch.zeros(16, 64), kv, cos[:16])
    assert not nd.serves(torch.zeros(17, 64), kv, cos)
    assert not nd.serves(torch.zeros(4, 64, dtype=torch.bfloat16), kv, cos[:4])
    lin = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = GgufLinear(lin.codes.clone(), lin.scales.clone(),
                                                        None, 8, lin.in_features,
                                                        lin.out_features, None)
    assert not nd.current()
    again = native_decoder(model, x, kv, _paged_ctx(cfg, 4))
    assert again is not None and again is not nd
    model.model.layers[2].mlp.down_proj = torch.nn.Linear(96, 64, bias=False)
    assert not decoder_applies(model)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_native_draft_layer_equals_eagle3s_first_layer(kernels, monkeypatch, dtype,
                                                          norm_before_residual):
    """An EAGLE-3 draft on Q8_0 codes: decoder.c's first layer against FirstLayer over a
    decode token, a chain and a tree, the outputs and the draft's cache bit-equal."""
    from specscope.draft.eagle3 import random_draft
    from specscope.models.quant import quantize_q8_0
    target, cfg = _gguf_model(dtype, False, None)
    calls = _count_native_calls(monkeypatch)
    draft = random_draft(cfg, dtype, "cpu", seed=9, std=0.1,
                         norm_before_residual=norm_before_residual)
    draft.attach_target(target)
    quantize_q8_0(draft.layers)
    meta, pos = _batch(4, None)
    ids = torch.randint(0, cfg.vocab_size, (1, pos.numel()),
                        generator=torch.Generator().manual_seed(10))
    hidden = torch.randn(1, pos.numel(), cfg.hidden_size,
                         generator=torch.Generator().manual_seed(11)).to(dtype)
    out = {}
    for on in (True, False):
        draft.native_decoder_enabled = on
        kv = PagedKV(1, 15, 4, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        for t in kv.k + kv.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(12)))
        before = calls["run_first"]
        with torch.inference_mode():
            nxt, normed = draft(ids, hidden, pos[None], kv, batch=dataclasses.replace(meta))
        assert (calls["run_first"] > before) == on
        out[on] = (nxt, normed, kv.k + kv.v)
    (a1, b1, c1), (a0, b0, c0) = out[True], out[False]
    assert torch.equal(a1, a0) and torch.equal(b1, b0)
    assert all(torch.equal(x, y) for x, y in zip(c1, c0, strict=True))


def test_the_native_decoder_follows_a_new_kv_cache(kernels):
    """A second cache (an engine rebuilt with new pools) is written and read, not the first
    one whose addresses the decoder took before."""
    model, cfg = _gguf_model(torch.float32, False, None)
    meta, pos = _batch(4, None)
    ids = torch.randint(0, cfg.vocab_size, (1, pos.numel()),
                        generator=torch.Generator().manual_seed(13))

    def cache(seed: int) -> PagedKV:
        kv = PagedKV(cfg.num_layers, 15, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                     "cpu")
        for t in kv.k + kv.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
        return kv

    out = {}
    with torch.inference_mode():
        for on in (True, False):
            model.native_decoder_enabled = on
            first, second = cache(14), cache(15)
            model(ids, pos[None], first, batch=dataclasses.replace(meta))
            before = [t.clone() for t in first.k]
            h, _ = model(ids, pos[None], second, batch=dataclasses.replace(meta))
            assert all(torch.equal(a, b) for a, b in zip(first.k, before, strict=True))
            out[on] = (h, second.k + second.v)
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1], strict=True))


def _chain_runner(dtype, norm_output: bool):
    """A DraftRunner over an EAGLE-3 draft wholly on Q8_0 codes (its head included) with a
    draft vocabulary smaller than the target's, its cache filled with a prefix."""
    from specscope.draft.eagle3 import random_draft
    from specscope.engine.draft_runner import DraftRunner
    from specscope.models.quant import quantize_q8_0

    target, cfg = _gguf_model(dtype, False, None)
    draft = random_draft(cfg, dtype, "cpu", seed=13, std=0.1, draft_vocab_size=64,
                         norm_output=norm_output)
    draft.attach_target(target)
    quantize_q8_0(draft)
    runner = DraftRunner(draft, 15, 4, False, 64, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(14)
    for t in runner.kv.k + runner.kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return runner, cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_output", [False, True])
def test_the_native_draft_chain_equals_the_draft_steps_one_by_one(kernels, monkeypatch, dtype,
                                                                  norm_output):
    """Greedy chains of three sequences through decoder.c's chain step against
    draft_chain's steps through the draft's forward: the same tokens and the same draft
    cache, bit for bit; a sampled sequence among them takes the reference path."""
    from specscope.config import SamplingParams, SpecConfig
    from specscope.native.decoder import NativeDraftChain

    runner, cfg = _chain_runner(dtype, norm_output)
    steps = []
    monkeypatch.setattr(NativeDraftChain, "step", lambda self, j, _f=NativeDraftChain.step:
                        (steps.append(j), _f(self, j))[1])
    g = torch.Generator().manual_seed(15)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    n = torch.tensor([5, 9, 2])
    root = torch.tensor([3, 40, 77])
    h0 = torch.randn(3, cfg.hidden_size, generator=g).to(dtype)
    normed0 = runner.draft.norm(h0)
    spec = SpecConfig(num_steps=5, topk=1)
    base = [t.clone() for t in runner.kv.k + runner.kv.v]
    out = {}
    for on, temperature in ((True, 0.0), (False, 0.0), (True, 0.7)):
        runner.draft.native_decoder_enabled = on
        for a, b in zip(runner.kv.k + runner.kv.v, base, strict=True):
            a.copy_(b)
        before = len(steps)
        params = [SamplingParams(temperature=temperature)] * 3
        gens = [torch.Generator().manual_seed(1) for _ in range(3)]
        with torch.inference_mode():
            tree = runner.steps(tables, n, root, h0, normed0, spec, params, gens,
                                [int(x) + 4 for x in n])
        assert len(steps) - before == (5 if on and temperature == 0 else 0)
        out[on, temperature] = (tree, [t.clone() for t in runner.kv.k + runner.kv.v])
    (t1, c1), (t0, c0) = out[True, 0.0], out[False, 0.0]
    assert torch.equal(t1.tokens, t0.tokens) and t1.chain and t1.draft_probs is None
    assert torch.equal(t1.parents, t0.parents) and torch.equal(t1.depth, t0.depth)
    assert t1.tokens[:, 1:].unique().numel() > 3  # the chains chose varied tokens
    assert all(torch.equal(x, y) for x, y in zip(c1, c0, strict=True))
    assert not torch.equal(c1[0], base[0])  # the steps wrote the cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_output", [False, True])
def test_the_native_draft_extend_equals_project_then_forward(kernels, dtype, norm_output):
    """Three sequences' pending pairs (3, 1 and 2 of them) through decoder.c's extend
    against Eagle3Draft.project then forward over a causal BatchMeta: the same outputs at
    each sequence's last pair and the same draft cache, bit for bit."""
    from specscope.kvcache.paged import BatchMeta
    from specscope.native.decoder import native_draft_extend, native_extend

    runner, cfg = _chain_runner(dtype, norm_output)
    draft = runner.draft
    g = torch.Generator().manual_seed(16)
    tables = [[0, 1, 2, 3], [4, 5, 6], [8, 9, 10, 11]]
    pos = [5, 6, 7, 9, 2, 3]
    rows = [0, 0, 0, 1, 2, 2]
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()
    sel = [2, 3, 5]
    taps = torch.randn(6, 3 * cfg.hidden_size, generator=g).to(dtype)
    base = [t.clone() for t in runner.kv.k + runner.kv.v]
    with torch.inference_mode():
        nd = native_draft_extend(draft, taps, runner.kv, max(pos) + 1)
        assert nd is not None
        h1, n1 = native_extend(nd, draft, runner.kv, tables, ids, pos, rows, sel, taps)
        c1 = [t.clone() for t in runner.kv.k + runner.kv.v]
        for a, b in zip(runner.kv.k + runner.kv.v, base, strict=True):
            a.copy_(b)
        padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
        meta = BatchMeta.causal(padded, torch.tensor(rows), torch.tensor(pos), 4,
                                max_len=max(pos) + 1)
        meta = runner._pieces(meta, [(3, 0, 8), (1, 1, 10), (2, 2, 4)])
        h, normed = draft(torch.tensor(ids)[None], draft.project(taps[None]),
                          torch.tensor(pos)[None], runner.kv, batch=meta)
    assert torch.equal(h1, h[0, sel]) and torch.equal(n1, normed[0, sel])
    assert all(torch.equal(x, y) for x, y in zip(c1, runner.kv.k + runner.kv.v, strict=True))
    assert not torch.equal(c1[0], base[0])  # the extend wrote the cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_prob_is_the_softmax_of_the_pick(kernels, dtype):
    """sc_top_prob: the softmax probability of a row's largest column, as torch gives it
    (to float rounding) over odd lengths; NaN for a row holding a NaN, 1 for an infinite
    top."""
    import ctypes

    f = kernels.lib.sc_top_prob
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    f.restype = ctypes.c_float
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 1001, generator=g) * 4).to(dtype)
    want = x.float().softmax(-1).max(-1)
    for r in range(3):
        got = f(x.data_ptr(), r, 1001, int(want.indices[r]), int(dtype == torch.bfloat16))
        assert got == pytest.approx(float(want.values[r]), rel=1e-5)
    x[1, 7] = float("nan")
    assert math.isnan(f(x.data_ptr(), 1, 1001, 7, int(dtype == torch.bfloat16)))
    x[2, 9] = float("inf")
    assert f(x.data_ptr(), 2, 1001, 9, int(dtype == torch.bfloat16)) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_draft_chain_stops_where_the_reference_does(kernels, monkeypatch, dtype):
    """The confidence stop in decoder.c's chain step against draft_chain's: the picks'
    probabilities as torch's softmax gives them (to float rounding), and with a stop
    between the chains' running confidences after their second and third tokens, both
    keep two tokens, skip the third token's forward (the same draft cache) and end there;
    a stop past every confidence keeps no token at all."""
    import specscope.spec.drafter as drafter
    from specscope.config import SamplingParams, SpecConfig
    from specscope.native.decoder import NativeDraftChain

    runner, cfg = _chain_runner(dtype, False)
    g = torch.Generator().manual_seed(16)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    n, root = torch.tensor([5, 9, 2]), torch.tensor([3, 40, 77])
    h0 = torch.randn(3, cfg.hidden_size, generator=g).to(dtype)
    normed0 = runner.draft.norm(h0)
    probs, confs = [], []
    monkeypatch.setattr(drafter, "pick_probs", lambda *a, _f=drafter.pick_probs:
                        (probs.append(_f(*a)), probs[-1])[1])
    monkeypatch.setattr(NativeDraftChain, "step", lambda self, j, _f=NativeDraftChain.step:
                        (_f(self, j), confs.append(self.conf.clone()))[0])
    base = [t.clone() for t in runner.kv.k + runner.kv.v]

    def chains(native: bool, stop: float):
        runner.draft.native_decoder_enabled = native
        for a, b in zip(runner.kv.k + runner.kv.v, base, strict=True):
            a.copy_(b)
        spec = SpecConfig(num_steps=5, topk=1, confidence_stop=stop)
        with torch.inference_mode():
            tree = runner.steps(tables, n, root, h0, normed0, spec,
                                [SamplingParams()] * 3, [None] * 3, [int(x) + 4 for x in n],
                                stop=stop)
        return tree, [t.clone() for t in runner.kv.k + runner.kv.v]

    full, _ = chains(False, 1e-30)  # every step's probabilities, no stop
    cum = torch.stack(probs).cumprod(0)  # [5, S]
    assert full.size == 6 and len(probs) == 5
    assert bool(((cum > 0) & (cum < 1)).all())
    chains(True, 1e-30)
    assert torch.allclose(torch.stack(confs), cum, rtol=1e-5, atol=0)
    stop = float((cum[1].max() * cum[2].max()) ** 0.5)  # between steps 2 and 3 for all
    assert cum[2].max() < stop < cum[1].max()
    (t1, c1), (t0, c0) = chains(True, stop), chains(False, stop)
    assert t1.size == t0.size == 3 and t1.chain
    assert torch.equal(t1.tokens, t0.tokens) and torch.equal(t1.tokens, full.tokens[:, :3])
    assert all(torch.equal(x, y) for x, y in zip(c1, c0, strict=True))
    (t1, _), (t0, _) = chains(True, 0.999), chains(False, 0.999)
    assert t1.size == t0.size == 1 and torch.equal(t1.tokens, root[:, None])


@torch.inference_mode()
def test_the_native_draft_chain_declines_what_it_does_not_run(kernels):
    """A borrowed or dense head, a context past the rope tables and more chains than the
    native attention takes go the reference way."""
    from specscope.native.decoder import native_draft_chain

    runner, cfg = _chain_runner(torch.float32, False)
    draft, kv = runner.draft, runner.kv
    h0 = torch.zeros(2, cfg.hidden_size)
    assert native_draft_chain(draft, h0, kv, 40) is not None
    with torch.enable_grad():
        assert native_draft_chain(draft, h0, kv, 40) is None
    assert native_draft_chain(draft, h0, kv, draft.rope_len + 1) is None
    assert native_draft_chain(draft, torch.zeros(17, cfg.hidden_size), kv, 40) is None
    assert native_draft_chain(draft, h0.bfloat16(), kv, 40) is None
    draft.lm_head = torch.nn.Linear(cfg.hidden_size, 64, bias=False)
    assert native_draft_chain(draft, h0, kv, 40) is None


@torch.inference_mode()
def test_the_native_draft_extend_declines_what_it_does_not_run(kernels):
    """Grad mode, taps of another width or dtype, a context past the rope tables, more
    pairs than the native attention takes, a dense projection and norms before it go the
    reference way."""
    from specscope.native.decoder import native_draft_extend

    runner, cfg = _chain_runner(torch.float32, False)
    draft, kv = runner.draft, runner.kv
    taps = torch.zeros(3, 3 * cfg.hidden_size)
    assert native_draft_extend(draft, taps, kv, 40) is not None
    with torch.enable_grad():
        assert native_draft_extend(draft, taps, kv, 40) is None
    assert native_draft_extend(draft, taps[:, :-32], kv, 40) is None
    assert native_draft_extend(draft, taps.bfloat16(), kv, 40) is None
    assert native_draft_extend(draft, taps, kv, draft.rope_len + 1) is None
    assert native_draft_extend(draft, torch.zeros(17, 3 * cfg.hidden_size), kv, 40) is None
    draft.fc_norm = torch.nn.ModuleList([torch.nn.Identity()] * 3)
    assert native_draft_extend(draft, taps, kv, 40) is None
    draft.fc_norm = None
    draft.fc = torch.nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
    assert native_draft_extend(draft, taps, kv, 40) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_picks_as_torch_does(kernels, dtype):
    """The C argmax against torch's over the fp32 logits: ties to the first column, a NaN
    taken as the largest, -inf rows, leading dimensions; and a GGUF head's greedy_ids."""
    from specscope.models.quant import GgufLinear, q8_0_codes

    g = torch.Generator().manual_seed(16)
    x = torch.randn(4, 3, 1000, generator=g).to(dtype)
    x[0, 0, 10] = x[0, 0, 700] = 50.0  # a tie
    x[1, 1, 5] = float("nan")
    x[2, 2] = float("-inf")
    want = x.float().argmax(-1)
    assert torch.equal(kernels.argmax_rows(x), want)
    # The vector pass's lanes: ties within a lane and across lanes (a later lane holding
    # the earlier column), a maximum or a NaN in the tail past the last 8, a tie between
    # the lanes and the tail, rows of zeros of both signs, rows shorter than 8.
    for n in (1003, 1000, 7, 1):
        y = torch.randn(10, n, generator=g).to(dtype)
        if n > 20:
            y[0, 3] = y[0, 11] = 9.0
            y[1, 13] = y[1, 10] = 9.0
            y[2, n - 1] = 9.0
            y[3, n - 2] = float("nan")
            y[4, 5] = y[4, n - 1] = 9.0
            y[5] = 0.0
            y[5, 1::3] = -0.0
            y[6] = -0.0
            y[6, 17] = 0.0
            y[7, 12] = float("nan")
            y[7, 2] = float("nan")
            y[8] = float("-inf")
            y[9] = float("inf")
        assert torch.equal(kernels.argmax_rows(y), y.float().argmax(-1)), n
    w = torch.randn(100, 64, generator=g)
    head = GgufLinear.from_codes(*q8_0_codes(w), None, 8, None)
    h = torch.randn(5, 64, generator=g).to(dtype)
    with torch.inference_mode():
        assert torch.equal(head.greedy_ids(h), head(h).float().argmax(-1))
