"""A dense decoder's layers as one native call (decoder.c): the CPU step of a model on GGUF
codes without Python between its ops.

It serves a flattened paged batch of at most ATTENTION_MAX_TOKENS tokens (decode steps,
verifies, draft-free chains of them) through layers that are all models/llama.py's
DecoderLayer with its Attention and MLP, every product a GgufLinear without a bias, and
activations, norms, rope rows and the KV cache in one dtype (fp32 or bf16). Anything else
runs the layer-by-layer path, which is its reference: the same kernels in the same order,
so the two are bit-equal (tests/test_native_cpu.py).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

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
                ("bits", _I)]


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


@cache
def _calls(lib: ctypes.CDLL) -> tuple[Any, Any]:
    """The library's sc_decoder and sc_decoder_work_bytes with their prototypes."""
    run = lib.sc_decoder
    run.argtypes = [ctypes.POINTER(_Layer), _I, ctypes.POINTER(_Dims), _P, _I, _P, _P,
                    ctypes.POINTER(_Batch), ctypes.POINTER(_I), _I, _P, _P, ctypes.c_int]
    run.restype = ctypes.c_int
    work = lib.sc_decoder_work_bytes
    work.argtypes = [ctypes.POINTER(_Dims), _I, ctypes.c_int]
    work.restype = _I
    return run, work


def _qlinear(lin: Any) -> _QLinear:
    off = lin.offsets
    return _QLinear(lin.codes.data_ptr(), lin.scales.data_ptr(),
                    None if off is None else off.data_ptr(), lin.out_features, lin.bits)


def _layer_refs(layers: Any, i: int) -> list[tuple[Any, str]]:
    """(owner, attribute) of every module and tensor decoder.c reads for layer i: what must
    stay the same object at the same address for the addresses taken from it to hold."""
    layer = layers[i]
    a, m = layer.self_attn, layer.mlp
    mods = [(layers, str(i)), (layer, "self_attn"), (layer, "mlp"),
            (layer, "input_layernorm"), (layer, "post_attention_layernorm"), (a, "qkv_proj"),
            (a, "o_proj"), (m, "gate_up_proj"), (m, "down_proj")]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if a.q_norm is not None:
        mods += [(a, "q_norm"), (a, "k_norm")]
        norms += [a.q_norm, a.k_norm]
    tensors = [(n, "weight") for n in norms]
    for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
        tensors += [(lin, "codes"), (lin, "scales"), (lin, "offsets")]
    return mods + tensors


def decoder_applies(model: Any) -> bool:
    """Whether every layer is one decoder.c runs: the dense DecoderLayer of models/llama.py,
    its products GGUF codes (models/quant.py GgufLinear) without biases, untouched by
    tensor parallelism, its norms' weights of one dtype."""
    from specscope.models.llama import MLP, Attention, DecoderLayer
    from specscope.models.quant import GgufLinear

    layers = list(model.model.layers)
    if not layers or getattr(model, "tp", None) is not None:
        return False
    dtype = layers[0].input_layernorm.weight.dtype
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or \
                type(layer.mlp) is not MLP:
            return False
        a, m = layer.self_attn, layer.mlp
        lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if not all(type(lin) is GgufLinear and lin.bias is None for lin in lins):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [] if a.q_norm is None else [a.q_norm, a.k_norm]
        if any(n.weight.dtype != dtype for n in norms):
            return False
    return True


class NativeDecoder:
    """The addresses decoder.c reads (weights once; the KV cache's when it changes) and the
    call. Build with decoder_applies(model) true."""

    def __init__(self, kernels: Any, model: Any) -> None:
        self._run, self._work_bytes = _calls(kernels.lib)
        layers = list(model.model.layers)
        a0, cfg = layers[0].self_attn, model.config
        self.dtype = layers[0].input_layernorm.weight.dtype
        self.head_dim = a0.head_dim
        self.num_layers = len(layers)
        self.dims = _Dims(cfg.hidden_size, a0.num_heads, a0.num_kv_heads, a0.head_dim,
                          layers[0].mlp.intermediate, cfg.rms_norm_eps,
                          0.0 if a0.q_norm is None else a0.q_norm.eps, a0.scale)
        self.layers = (_Layer * len(layers))()
        refs = [r for i in range(len(layers)) for r in _layer_refs(model.model.layers, i)]
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
        self._cache: tuple[int, int] | None = None
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
        key = (id(cache), cache.k[0].data_ptr())
        if key == self._cache:
            return
        for i in range(self.num_layers):
            self.layers[i].k_cache = cache.k[i].data_ptr()
            self.layers[i].v_cache = cache.v[i].data_ptr()
        self._cache = key

    def _bind_taps(self, tap_ids: tuple[int, ...]) -> None:
        if tap_ids == self._taps_key:
            return
        for i in range(self.num_layers):
            self._tap_slot[i] = tap_ids.index(i) if i in tap_ids else -1
        self._taps_key = tap_ids

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
            meta: Any, tap_ids: tuple[int, ...]) -> torch.Tensor | None:
        """Every layer over h [N, D] (updated in place: the last layer's output). cos/sin
        [N, Dh] rope rows; tap_ids: the layers whose outputs form the taps (-1: the
        embeddings, h as given). Returns taps [N, len(tap_ids) * D], or None without
        tap_ids."""
        N, D = h.shape
        bf16 = h.dtype == torch.bfloat16
        self._bind_cache(cache)
        self._bind_taps(tap_ids)
        taps = torch.empty(N, len(tap_ids) * D, dtype=h.dtype) if tap_ids else None
        if taps is not None and -1 in tap_ids:
            j = tap_ids.index(-1)
            taps[:, j * D:(j + 1) * D] = h
        need = self._work_bytes(self.dims, N, bf16)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.uint8)
        if meta.native_args is None:
            meta.native_args = _meta_args(meta)
        _, args = meta.native_args
        batch = _Batch(args[0], args[1], args[2], args[3], cache.k[0].shape[1], args[4],
                       args[5], args[6], args[7], args[8], meta.max_len)
        cos = cos if cos.is_contiguous() else cos.contiguous()
        sin = sin if sin.is_contiguous() else sin.contiguous()
        rc = self._run(self.layers, self.num_layers, self.dims, h.data_ptr(), N,
                                  cos.data_ptr(), sin.data_ptr(), batch, self._tap_slot,
                                  len(tap_ids), None if taps is None else taps.data_ptr(),
                                  self._work.data_ptr(), bf16)
        if rc != 0:
            raise MemoryError(f"native CPU attention could not allocate its scratch for {N} "
                              f"tokens over {meta.max_len} keys")
        return taps


def native_decoder(model: Any, h: torch.Tensor) -> NativeDecoder | None:
    """The model's NativeDecoder where decoder.c may run this forward's h (a CPU tensor at
    inference, the native kernels built, every layer one it runs), built at the first
    call and again if the model's tensors were replaced; None otherwise."""
    from specscope.native import cpu_kernels_for

    kernels = cpu_kernels_for(h)
    if kernels is None or not getattr(model, "native_decoder_enabled", True):
        return None
    # (the first layer's q/k/v product, its NativeDecoder or None where none applies)
    first = model.model.layers[0].self_attn.qkv_proj
    held = getattr(model, "_native_decoder", None)
    if held is not None and held[0] is first and (held[1] is None or held[1].current()):
        return held[1]
    nd = NativeDecoder(kernels, model) if decoder_applies(model) else None
    model._native_decoder = (first, nd)
    return nd
