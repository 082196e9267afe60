"""A dense decoder's layers as one native call (decoder.c): the CPU step of a model on GGUF
codes without Python between its ops; an EAGLE-3 draft's single layer likewise.

It serves a flattened paged batch of at most ATTENTION_MAX_TOKENS tokens (decode steps,
verifies, draft-free chains of them) through layers that are all models/llama.py's
DecoderLayer with its Attention and MLP, every product a GgufLinear without a bias, and
activations, norms, rope rows and the KV cache in one dtype (fp32 or bf16). Anything else
runs the layer-by-layer path, which is its reference: the same kernels in the same order,
so the two are bit-equal (tests/test_native_cpu.py).
"""

from __future__ import annotations

import ctypes
import weakref
from functools import cache
from typing import Any

import torch

from specscope.kvcache.paged import PagedKV, padded_rows
from specscope.native import cpu_kernels_for
from specscope.native.cpu import ATTENTION_MAX_TOKENS, _meta_args

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

# Counts every module, parameter and buffer assigned anywhere in the process (torch's global
# registration hooks): a NativeDecoder re-checks its ~30 references a layer (~1 ms for 30
# layers) only after one, not at every step.
_assignments = [0]


def _count(*_: Any) -> None:
    _assignments[0] += 1


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(_count)


class _QLinear(ctypes.Structure):
    _fields_ = [("codes", _P), ("scales", _P), ("offsets", _P), ("out_features", _I),
                ("bits", _I), ("tile", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
                ("k_cache", _P), ("v_cache", _P)]


class _Batch(ctypes.Structure):
    _fields_ = [("slots", _P), ("seq_index", _P), ("block_tables", _P), ("max_blocks", _I),
                ("block_size", _I), ("visible", _P), ("window_start", _P), ("tree_start", _P),
                ("tree_mask", _P), ("T", _I), ("max_len", _I)]


class _Dims(ctypes.Structure):
    _fields_ = [("D", _I), ("H", _I), ("Hkv", _I), ("Dh", _I), ("I", _I), ("norm_eps", _F),
                ("qk_eps", _F), ("scale", _F)]


class _Chain(ctypes.Structure):
    _fields_ = [("embed", _P), ("norm", _P), ("head", _QLinear), ("d2t", _P), ("cos", _P),
                ("sin", _P), ("hidden_norm", _P), ("norm_before_residual", _I),
                ("norm_output", _I), ("block_tables", _P), ("max_blocks", _I),
                ("block_size", _I), ("n", _P), ("max_len", _I)]


@cache
def _chain_calls(lib: ctypes.CDLL) -> tuple[Any, Any]:
    """The library's sc_eagle3_chain_step and sc_eagle3_chain_work_bytes with their
    prototypes."""
    step = lib.sc_eagle3_chain_step
    step.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Dims), ctypes.POINTER(_Chain), _I,
                     _I, ctypes.c_int, _P, _P, _P, _I, _P, ctypes.c_int, _P, ctypes.c_float]
    step.restype = ctypes.c_int
    work = lib.sc_eagle3_chain_work_bytes
    work.argtypes = [ctypes.POINTER(_Dims), _I, _I, ctypes.c_int]
    work.restype = _I
    return step, work


@cache
def _calls(lib: ctypes.CDLL) -> tuple[Any, Any, Any]:
    """The library's sc_decoder, sc_decoder_work_bytes and sc_eagle3_layer with their
    prototypes."""
    run = lib.sc_decoder
    run.argtypes = [ctypes.POINTER(_Layer), _I, ctypes.POINTER(_Dims), _P, _I, _P, _P,
                    ctypes.POINTER(_Batch), ctypes.POINTER(_I), _I, _P, _P, ctypes.c_int]
    run.restype = ctypes.c_int
    work = lib.sc_decoder_work_bytes
    work.argtypes = [ctypes.POINTER(_Dims), _I, ctypes.c_int]
    work.restype = _I
    first = lib.sc_eagle3_layer
    first.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Dims), _P, _P, _P, ctypes.c_int,
                      _P, _I, _P, _P, ctypes.POINTER(_Batch), _P, ctypes.c_int]
    first.restype = ctypes.c_int
    return run, work, first


def _qlinear(lin: Any) -> _QLinear:
    off = lin.offsets
    return _QLinear(lin.codes.data_ptr(), lin.scales.data_ptr(),
                    None if off is None else off.data_ptr(), lin.out_features, lin.bits,
                    lin.tile)


def _norms(layer: Any) -> list[Any]:
    """A layer's RMSNorm modules decoder.c reads: the two around attention, q/k norms where
    the model has them, and EAGLE-3's hidden_norm on its first draft layer."""
    a = layer.self_attn
    out = [layer.input_layernorm, layer.post_attention_layernorm]
    out += [] if a.q_norm is None else [a.q_norm, a.k_norm]
    return out + ([layer.hidden_norm] if hasattr(layer, "hidden_norm") else [])


def _layer_refs(layers: Any, i: int) -> list[tuple[Any, str]]:
    """(owner, attribute) of every module and tensor decoder.c reads for layer i: what must
    stay the same object at the same address for the addresses taken from it to hold."""
    layer = layers[i]
    a, m = layer.self_attn, layer.mlp
    mods = [(layers, str(i)), (layer, "self_attn"), (layer, "mlp"),
            (layer, "input_layernorm"), (layer, "post_attention_layernorm"), (a, "qkv_proj"),
            (a, "o_proj"), (m, "gate_up_proj"), (m, "down_proj")]
    if a.q_norm is not None:
        mods += [(a, "q_norm"), (a, "k_norm")]
    if hasattr(layer, "hidden_norm"):
        mods.append((layer, "hidden_norm"))
    tensors = [(n, "weight") for n in _norms(layer)]
    for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
        tensors += [(lin, "codes"), (lin, "scales"), (lin, "offsets")]
    return mods + tensors


def layers_apply(layers: list[Any], kind: type) -> bool:
    """Whether every layer is one decoder.c runs: `kind` (models/llama.py's DecoderLayer,
    or draft/eagle3.py's FirstLayer) with that file's Attention and MLP, its products GGUF
    codes (models/quant.py GgufLinear) without biases, its norms' weights of one dtype."""
    from specscope.models.llama import MLP, Attention
    from specscope.models.quant import GgufLinear

    if not layers:
        return False
    dtype = layers[0].input_layernorm.weight.dtype
    for layer in layers:
        if type(layer) is not kind or type(layer.self_attn) is not Attention or \
                type(layer.mlp) is not MLP:
            return False
        a, m = layer.self_attn, layer.mlp
        lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if not all(type(lin) is GgufLinear and lin.bias is None for lin in lins):
            return False
        if any(n.weight.dtype != dtype for n in _norms(layer)):
            return False
    return True


def decoder_applies(model: Any) -> bool:
    """Whether decoder.c runs every layer of this target (layers_apply; no tensor
    parallelism)."""
    from specscope.models.llama import DecoderLayer

    return getattr(model, "tp", None) is None and \
        layers_apply(list(model.model.layers), DecoderLayer)


class NativeDecoder:
    """The addresses decoder.c reads (weights once; the KV cache's when it changes) and the
    call. Build with decoder_applies(model) true."""

    def __init__(self, kernels: Any, container: Any, hidden_size: int, eps: float) -> None:
        """container: the ModuleList of the layers (checked with layers_apply)."""
        self.lib = kernels.lib
        self._run, self._work_bytes, self._first = _calls(kernels.lib)
        layers = list(container)
        a0 = layers[0].self_attn
        self.dtype = layers[0].input_layernorm.weight.dtype
        self.head_dim = a0.head_dim
        self.num_layers = len(layers)
        self.dims = _Dims(hidden_size, a0.num_heads, a0.num_kv_heads, a0.head_dim,
                          layers[0].mlp.intermediate, eps,
                          0.0 if a0.q_norm is None else a0.q_norm.eps, a0.scale)
        self.layers = (_Layer * len(layers))()
        refs = [r for i in range(len(layers)) for r in _layer_refs(container, i)]
        self._held = [(o, n, getattr(o, n)) for o, n in refs]
        self._addresses = [(t, t.data_ptr()) for _, _, t in self._held
                           if isinstance(t, torch.Tensor)]
        self._checked = _assignments[0]
        first = layers[0]
        # Moved or cast in place (`.to()`), every tensor moves: these two tell at no cost.
        self._probe = [(first.input_layernorm, "weight"), (first.self_attn.qkv_proj, "scales")]
        self._probe_at = [getattr(o, n).data_ptr() for o, n in self._probe]
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            qn = None if a.q_norm is None else a.q_norm.weight.data_ptr()
            kn = None if a.k_norm is None else a.k_norm.weight.data_ptr()
            self.layers[i] = _Layer(layer.input_layernorm.weight.data_ptr(),
                                    layer.post_attention_layernorm.weight.data_ptr(), qn, kn,
                                    _qlinear(a.qkv_proj), _qlinear(a.o_proj),
                                    _qlinear(m.gate_up_proj), _qlinear(m.down_proj), None, None)
        hn = getattr(first, "hidden_norm", None)
        self._hidden_norm = None if hn is None else hn.weight.data_ptr()
        self._norm_before_residual = int(getattr(first, "norm_before_residual", False))
        self._cache: weakref.ref | None = None
        self._work = torch.empty(0, dtype=torch.uint8)
        self._taps_key: tuple | None = None
        self._tap_slot = (_I * len(layers))()

    def current(self) -> bool:
        """Whether the model still holds the modules and tensors the addresses were taken
        from, at those addresses (a module's `.to()` keeps a parameter, not its storage):
        checked in full after any assignment in the process, else by two probes."""
        if any(getattr(o, n).data_ptr() != p
               for (o, n), p in zip(self._probe, self._probe_at, strict=True)):
            return False
        if self._checked == _assignments[0]:
            return True
        ok = all(getattr(o, n) is t for o, n, t in self._held) and \
            all(t.data_ptr() == p for t, p in self._addresses)
        if ok:
            self._checked = _assignments[0]
        return ok

    def serves(self, h: torch.Tensor, cache: Any, cos: torch.Tensor) -> bool:
        """Whether this forward can run here: few enough tokens, one dtype throughout, a
        K/V cache of separate contiguous tensors of the head dim."""
        k, v = cache.k[0], cache.v[0]
        return (h.shape[0] <= ATTENTION_MAX_TOKENS and h.dtype == self.dtype == k.dtype
                == v.dtype == cos.dtype and self.head_dim % 8 == 0 and k.is_contiguous()
                and v.is_contiguous() and k.shape[-1] == v.shape[-1] == self.head_dim)

    def _bind_cache(self, cache: Any) -> None:
        """The cache's per-layer addresses, taken again for another cache object (a weak
        reference: a freed pool's id may come back for a new one, its address may not
        hold; nor is a pool kept alive here)."""
        if self._cache is not None and self._cache() is cache:
            return
        for i in range(self.num_layers):
            self.layers[i].k_cache = cache.k[i].data_ptr()
            self.layers[i].v_cache = cache.v[i].data_ptr()
        self._cache = weakref.ref(cache)

    def _bind_taps(self, tap_ids: tuple[int, ...]) -> None:
        if tap_ids == self._taps_key:
            return
        for i in range(self.num_layers):
            self._tap_slot[i] = tap_ids.index(i) if i in tap_ids else -1
        self._taps_key = tap_ids

    def _setup(self, N: int, bf16: bool, cache: Any, meta: Any) -> _Batch:
        """The cache's addresses, a work area for N tokens and the batch's metadata."""
        self._bind_cache(cache)
        need = self._work_bytes(self.dims, N, bf16)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.uint8)
        if meta.native_args is None:
            meta.native_args = _meta_args(meta)
        _, args = meta.native_args
        return _Batch(args[0], args[1], args[2], args[3], cache.k[0].shape[1], args[4],
                      args[5], args[6], args[7], args[8], meta.max_len)

    @staticmethod
    def _checked_rc(rc: int, N: int, meta: Any) -> None:
        if rc != 0:
            raise MemoryError(f"native CPU attention could not allocate its scratch for {N} "
                              f"tokens over {meta.max_len} keys")

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
            meta: Any, tap_ids: tuple[int, ...]) -> torch.Tensor | None:
        """Every layer over h [N, D] (updated in place: the last layer's output). cos/sin
        [N, Dh] rope rows; tap_ids: the layers whose outputs form the taps (-1: the
        embeddings, h as given). Returns taps [N, len(tap_ids) * D], or None without
        tap_ids."""
        N, D = h.shape
        bf16 = h.dtype == torch.bfloat16
        batch = self._setup(N, bf16, cache, meta)
        self._bind_taps(tap_ids)
        taps = torch.empty(N, len(tap_ids) * D, dtype=h.dtype) if tap_ids else None
        if taps is not None and -1 in tap_ids:
            j = tap_ids.index(-1)
            taps[:, j * D:(j + 1) * D] = h
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = self._run(self.layers, self.num_layers, self.dims, h.data_ptr(), N,
                       cos.data_ptr(), sin.data_ptr(), batch, self._tap_slot, len(tap_ids),
                       None if taps is None else taps.data_ptr(), self._work.data_ptr(), bf16)
        self._checked_rc(rc, N, meta)
        return taps

    def run_first(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, cache: Any, meta: Any) -> torch.Tensor:
        """EAGLE-3's first draft layer (one layer built from a FirstLayer): emb and hidden
        [N, D] -> its output [N, D]."""
        N = emb.shape[0]
        bf16 = emb.dtype == torch.bfloat16
        batch = self._setup(N, bf16, cache, meta)
        emb, hidden, cos, sin = (t.contiguous() for t in (emb, hidden, cos, sin))
        out = torch.empty_like(emb)
        rc = self._first(self.layers, self.dims, emb.data_ptr(), hidden.data_ptr(),
                         self._hidden_norm, self._norm_before_residual, out.data_ptr(), N,
                         cos.data_ptr(), sin.data_ptr(), batch, self._work.data_ptr(), bf16)
        self._checked_rc(rc, N, meta)
        return out


def _held_or_built(owner: Any, container: Any, kernels: Any, build: Any
                   ) -> NativeDecoder | None:
    """owner's NativeDecoder over container's layers: the one it holds while current, else
    a new one (build() returns it or None where none applies). Held as (first layer's q/k/v
    product, it): a new first product means new layers."""
    first = container[0].self_attn.qkv_proj
    held = getattr(owner, "_native_decoder", None)
    if held is not None and held[0] is first and (held[1] is None or held[1].current()):
        return held[1]
    nd = build()
    owner._native_decoder = (first, nd)
    return nd


def _serving(nd: NativeDecoder | None, h: torch.Tensor, cache: Any, ctx: Any
             ) -> NativeDecoder | None:
    """nd where it serves this forward (NativeDecoder.serves), else None."""
    return nd if nd is not None and nd.serves(h, cache, ctx.rope_tokens[0]) else None


def _native_forward(h: torch.Tensor, cache: Any, ctx: Any) -> Any:
    """The native kernels where a forward of token-major rows h [N, D] may run in decoder.c:
    on the CPU at inference with them built, over a paged cache, not training-time test."""
    if h.is_cuda or not isinstance(cache, PagedKV) or ctx.paged is None or \
            ctx.ttt is not None:
        return None
    return cpu_kernels_for(h)


def native_decoder(model: Any, h: torch.Tensor, cache: Any, ctx: Any
                   ) -> NativeDecoder | None:
    """The target's NativeDecoder where decoder.c runs this forward (h [N, D] token-major
    rows, `cache` and `ctx` its KV cache and ForwardContext): built at the first call and
    again if the model's tensors were replaced; None where the layers run one by one."""
    kernels = _native_forward(h, cache, ctx)
    if kernels is None or not getattr(model, "native_decoder_enabled", True):
        return None
    cfg = model.config
    return _serving(_held_or_built(model, model.model.layers, kernels, lambda: NativeDecoder(
        kernels, model.model.layers, cfg.hidden_size, cfg.rms_norm_eps)
        if decoder_applies(model) else None), h, cache, ctx)


def native_draft_layer(draft: Any, emb: torch.Tensor, cache: Any, ctx: Any
                       ) -> NativeDecoder | None:
    """An EAGLE-3 draft's first (and only) layer in decoder.c, where it runs this forward
    (emb [N, D] token-major rows; as native_decoder); None for a draft of more layers, a
    sharded one, or other products."""
    kernels = _native_forward(emb, cache, ctx)
    return _serving(_draft_decoder(draft, kernels), emb, cache, ctx)


def _draft_decoder(draft: Any, kernels: Any) -> NativeDecoder | None:
    """The draft's NativeDecoder (held, or built): None without the kernels, for a draft
    of more layers, a sharded one, or other products."""
    from specscope.draft.eagle3 import FirstLayer

    if kernels is None or len(draft.layers) != 1 or draft.tp is not None or \
            not getattr(draft, "native_decoder_enabled", True):
        return None
    cfg = draft.config
    return _held_or_built(draft, draft.layers, kernels, lambda: NativeDecoder(
        kernels, draft.layers, cfg.hidden_size, cfg.rms_norm_eps)
        if layers_apply(list(draft.layers), FirstLayer) else None)


def _embedding_weight(draft: Any) -> torch.Tensor | None:
    """The draft's token embedding as one dense [V, D] tensor (its own, or the target's
    borrowed whole); None for a sharded one."""
    if draft.embed_tokens is not None:
        return draft.embed_tokens.weight
    return None if draft._target_embed_module is not None else draft._target_embed


def native_draft_chain(draft: Any, h0: torch.Tensor, cache: Any, reach: int
                       ) -> NativeDecoder | None:
    """The draft's NativeDecoder where a greedy chain's steps for h0 [S, D] may run in
    decoder.c (NativeDraftChain): as native_draft_layer, and besides a head of its own on
    GGUF codes without a bias, a dense embedding, final norm and rope tables of the
    activations' dtype, at most ATTENTION_MAX_TOKENS chains, and rope rows for every
    position below `reach`; else None."""
    from specscope.models.quant import GgufLinear

    head = draft.lm_head
    if type(head) is not GgufLinear or head.bias is not None or draft.d2t.dtype != torch.int64:
        return None
    return _draft_in_c(draft, h0, cache, reach)


def _draft_in_c(draft: Any, x: torch.Tensor, cache: Any, reach: int) -> NativeDecoder | None:
    """The draft's NativeDecoder where decoder.c may run a forward of the draft over rows
    x [N, ...] (a chain's or an extend's): a CPU paged cache, a dense embedding, the final
    norm and rope tables contiguous in x's dtype, rope rows below `reach`; else None."""
    if x.is_cuda or not isinstance(cache, PagedKV):
        return None
    embed, rope = _embedding_weight(draft), draft._rope
    if embed is None or rope is None or rope[0].shape[0] < reach:
        return None
    if any(t.dtype != x.dtype or not t.is_contiguous()
           for t in (embed, draft.norm.weight, *rope)) or draft.norm.eps != \
            draft.config.rms_norm_eps:
        return None
    nd = _draft_decoder(draft, cpu_kernels_for(x))
    return nd if nd is not None and nd.serves(x, cache, rope[0]) else None


def _chain_args(nd: NativeDecoder, draft: Any, head: _QLinear, d2t: int | None,
                tables: int, width: int, block_size: int, n: int | None,
                max_len: int) -> _Chain:
    """What decoder.c's chain step and extend read besides the layer: the draft's
    embedding, final norm, rope tables and first-layer choices, a head (empty for the
    extend) and the sequences' draft block tables (addresses)."""
    cos, sin = draft._rope
    return _Chain(_embedding_weight(draft).data_ptr(), draft.norm.weight.data_ptr(), head,
                  d2t, cos.data_ptr(), sin.data_ptr(), nd._hidden_norm,
                  nd._norm_before_residual, int(draft.config.norm_output), tables, width,
                  block_size, n, max_len)


class NativeDraftChain:
    """One cycle's greedy draft chains in decoder.c, a call a draft step
    (sc_eagle3_chain_step): the head over the step's normed rows, the argmax and the
    vocabulary map, then the draft's forward of the chosen tokens (embedding, first
    layer, final norm), with no Python between them. spec/drafter.py draft_chain's greedy
    path is its reference, bit-equal (its confidence stop too, up to the rounding of the
    softmax's sum). nd: from native_draft_chain for h0."""

    def __init__(self, nd: NativeDecoder, draft: Any, cache: Any, tables: torch.Tensor,
                 n: torch.Tensor, reach: int, h0: torch.Tensor, normed0: torch.Tensor,
                 root: torch.Tensor, num_steps: int, stop: float = 0.0) -> None:
        """tables [S, blocks] the chains' draft block tables, n [S] their roots' positions,
        root [S] the roots, reach a bound on every position a step sees; h0, normed0 [S, D]
        the extend's outputs (not modified). stop: draft_chain's confidence stop (0: off)."""
        from specscope.native.cpu import _i64

        self._nd = nd
        self._step_call, work_bytes = _chain_calls(nd.lib)
        S = h0.shape[0]
        self.S, self.num_steps = S, num_steps
        self.bf16 = h0.dtype == torch.bfloat16
        nd._bind_cache(cache)
        self.h, self.normed = h0.contiguous().clone(), normed0.contiguous().clone()
        self.tokens = torch.empty(S, num_steps + 1, dtype=torch.long)
        self.tokens[:, 0] = root
        self.stop = float(stop)
        self.conf = torch.ones(S, dtype=torch.float32) if stop > 0 else None  # [S]
        self._held = (_i64(tables), _i64(n))
        head = draft.lm_head
        self._chain = _chain_args(nd, draft, _qlinear(head), draft.d2t.data_ptr(),
                                  self._held[0].data_ptr(), self._held[0].shape[1],
                                  cache.k[0].shape[1], self._held[1].data_ptr(), reach)
        need = work_bytes(nd.dims, S, head.out_features, self.bf16)
        if nd._work.numel() < need:
            nd._work = torch.empty(need, dtype=torch.uint8)

    def step(self, j: int) -> bool:
        """Draft step j (1-based): token j of every chain into tokens[:, j], then (before
        the last) the draft's forward of it at position n + j - 1. False where the
        confidence stop ended the chains at token j (dropped: tokens[:, :j] stand)."""
        nd = self._nd
        conf = self.conf.data_ptr() if self.conf is not None else None
        rc = self._step_call(nd.layers, nd.dims, self._chain, self.S, j,
                             int(j == self.num_steps), self.h.data_ptr(),
                             self.normed.data_ptr(), self.tokens.data_ptr(),
                             self.num_steps + 1, nd._work.data_ptr(), self.bf16, conf,
                             self.stop)
        if rc == 1:
            return False
        if rc != 0:
            raise MemoryError(f"native CPU attention could not allocate its scratch for "
                              f"{self.S} draft tokens")
        return True


@cache
def _extend_calls(lib: ctypes.CDLL) -> tuple[Any, Any]:
    """The library's sc_eagle3_extend and sc_eagle3_extend_work_bytes with their
    prototypes."""
    run = lib.sc_eagle3_extend
    run.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Dims), ctypes.POINTER(_Chain),
                    ctypes.POINTER(_QLinear), _I, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P,
                    ctypes.c_int]
    run.restype = ctypes.c_int
    work = lib.sc_eagle3_extend_work_bytes
    work.argtypes = [ctypes.POINTER(_Dims), _I, _I, ctypes.c_int]
    work.restype = _I
    return run, work


def native_draft_extend(draft: Any, taps: torch.Tensor, cache: Any, reach: int
                        ) -> NativeDecoder | None:
    """The draft's NativeDecoder where an extend of N pending pairs with taps [N, K] may run
    in decoder.c (native_extend): as native_draft_chain's draft (a dense embedding, its final
    norm and rope tables of the taps' dtype, rope rows below `reach`), besides a projection
    on GGUF codes without a bias and without norms before it; else None."""
    from specscope.models.quant import GgufLinear

    fc = draft.fc
    if type(fc) is not GgufLinear or fc.bias is not None or draft.input_norm is not None or \
            draft.fc_norm is not None or taps.dim() != 2 or taps.shape[1] != fc.in_features \
            or fc.out_features != draft.config.hidden_size:
        return None
    return _draft_in_c(draft, taps, cache, reach)


def native_extend(nd: NativeDecoder, draft: Any, cache: Any, tables: list[list[int]],
                  ids: list[int], pos: list[int], rows: list[int], sel: list[int],
                  taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft extend in one call (sc_eagle3_extend; nd from native_draft_extend): pair i
    is taps[i] at position pos[i] of the sequence whose draft block table is
    tables[rows[i]], followed by token ids[i]. Its K/V go to the draft's cache; returns
    (h0, normed0) [len(sel), D] at the pairs sel, as Eagle3Draft.forward(ids,
    project(taps), pos) gives them there: one host list to one tensor instead of the
    metadata's, the rope rows' and the modules' dozens of small torch calls."""
    run, work_bytes = _extend_calls(nd.lib)
    N, K = taps.shape
    S, D = len(sel), draft.config.hidden_size
    padded, width = padded_rows(tables)
    flat = torch.tensor(ids + pos + rows + sel + padded, dtype=torch.long)
    at = flat.data_ptr()
    nd._bind_cache(cache)
    chain = _chain_args(nd, draft, _QLinear(), None, at + 8 * (3 * N + S), width,
                        cache.k[0].shape[1], None, max(pos) + 1)
    bf16 = taps.dtype == torch.bfloat16
    need = work_bytes(nd.dims, N, K, bf16)
    if nd._work.numel() < need:
        nd._work = torch.empty(need, dtype=torch.uint8)
    taps = taps.contiguous()
    h, normed = (torch.empty(S, D, dtype=taps.dtype) for _ in range(2))
    rc = run(nd.layers, nd.dims, chain, _qlinear(draft.fc), N, at, at + 8 * N, at + 16 * N,
             taps.data_ptr(), K, S, at + 24 * N, h.data_ptr(), normed.data_ptr(),
             nd._work.data_ptr(), bf16)
    if rc != 0:
        raise MemoryError(f"native CPU attention could not allocate its scratch for the "
                          f"draft extend of {N} pairs")
    return h, normed
