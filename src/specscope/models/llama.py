"""The Llama family as one plain nn.Module: Llama-2/3/3.1/3.2, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

The members differ only in data (ModelConfig flags): q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), explicit head_dim, tied embeddings, rope theta/scaling, sliding window. Module and
parameter names follow HF's, except that q/k/v and gate/up are fused into one matmul each
(fewer kernels per layer); `checkpoint_layout` maps HF tensor names onto the fused rows.

`forward` returns (hidden, taps): the final normed hidden state and, when asked, the residual
stream after each configured tap layer (output-of-layer convention: tap k = output of decoder
layer k, 0-based, i.e. HF's hidden_states[k + 1]).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specscope.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specscope.kvcache import KVCache, attention, causal_mask, write_kv
from specscope.kvcache.attention import fold_mask
from specscope.kvcache.budget import KVLayout
from specscope.kvcache.paged import BatchMeta, PagedKV, paged_attend, paged_attend_qkv
from specscope.models.linear import (
    Linear,
    few_row_kernel,
    hand_kernels_apply,
    linear,
    linear_argmax,
)
from specscope.models.registry import Family
from specscope.models.rope import apply_rope_rolled, rope_tables, signed_sin
from specscope.native import cpu_kernels_for
from specscope.native.decoder import native_decoder
from specscope.parallel.group import TPGroup
from specscope.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from specscope.parallel.shard import attention_pieces, gated_mlp_pieces


@cache
def _fused_backend():
    """The fused Triton kernels (models/fused_triton.py), or None without Triton. Cached:
    the import is tried once, not per layer per step."""
    try:
        from specscope.models import fused_triton
    except ImportError:
        return None
    return fused_triton


def fused_kernels(x: torch.Tensor):
    """The fused layer kernels where they apply to x: Triton's on CUDA (models/linear.py
    hand_kernels_apply), the native C kernels on the CPU (specscope/native); None: the
    torch reference."""
    if x.is_cuda:
        return _fused_backend() if hand_kernels_apply(x) else None
    return cpu_kernels_for(x)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _fast(self, x: torch.Tensor):
        fast = fused_kernels(x)
        # The native CPU kernel takes a weight of the activation's dtype only.
        return fast if fast is None or x.is_cuda or self.weight.dtype == x.dtype else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast(x)
        if fast is not None:
            return fast.rms_norm(x.contiguous(), self.weight, self.eps)[0]
        # One fused op instead of pow/mean/add/rsqrt/mul: same result, fewer kernels.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of h, h) for h = residual + x: the residual add and the norm after it
        in one kernel on CUDA and on the CPU."""
        fast = self._fast(x)
        if fast is not None:
            return fast.rms_norm(x.contiguous(), self.weight, self.eps, residual.contiguous())
        h = residual + x
        return self(h), h


@dataclass
class ForwardContext:
    """Per-forward data shared by every layer (built once, not per layer)."""

    cos: torch.Tensor  # [B, 1, T, D] model dtype
    sin: torch.Tensor  # [B, 1, T, D]
    mask: torch.Tensor | None  # [B, 1, G*T, S] bool, folded GQA layout (None: paged)
    slots: torch.Tensor | None  # [B, T] cache slots to write, None without a cache
    kv_len: int  # keys visible: cache slots [0, kv_len)
    # Training-time test (train/ttt.py): attention over the keys of earlier unrolled draft
    # steps instead of a cache. None at inference.
    ttt: Any = None
    # A flattened ragged batch over a paged cache (B = 1, T = its N tokens): where each
    # token writes and what it attends to.
    paged: BatchMeta | None = None
    # The paged cache's scratch block as a slot range [first, end): CUDA-graph padding rows
    # write only there. None: every token is real.
    scratch_slots: tuple[int, int] | None = None
    # A paged forward's rope rows token-major, (cos, sin, rope.signed_sin(sin)) [N, 1, D]
    # each: the layout of q/k heads [N, heads, D] in a token-major attention.
    rope_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def live_slots(self) -> tuple[torch.Tensor, int, int] | None:
        """(slots [N], first, end): a token of a paged forward is real, not CUDA-graph
        padding, where its slot is outside [first, end) (None: every token is). What
        per-token statistics (MoE expert counts) count; the math ignores it."""
        if self.paged is None or self.scratch_slots is None:
            return None
        return (self.paged.slots, *self.scratch_slots)


def forward_context(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                    cache: KVCache | PagedKV | None, kv_len: int | None,
                    slots: torch.Tensor | None, attn_mask: torch.Tensor | None, groups: int,
                    sliding_window: int | None = None, batch: BatchMeta | None = None
                    ) -> ForwardContext:
    """Rope rows, mask and cache window for one forward (shared by target and draft).

    With a cache, slot s holds position s: keys are slots [0, kv_len) and this step writes
    at `slots` (default `positions`). Without one, the T tokens attend to each other.
    attn_mask [B, T, S] overrides the causal mask (tree attention). A PagedKV cache takes
    a flattened batch (positions [1, N]) described by `batch`.
    """
    cos_t, sin_t = rope
    T = positions.shape[1]
    if isinstance(cache, PagedKV):
        if batch is None:
            raise ValueError("a paged KV cache needs the batch's BatchMeta")
        scratch = cache.scratch_block
        span = None if scratch is None else (scratch * cache.block_size,
                                             (scratch + 1) * cache.block_size)
        cos, sin = cos_t[positions[0]][:, None], sin_t[positions[0]][:, None]  # [N, 1, D]
        return ForwardContext(cos=cos.transpose(0, 1)[None], sin=sin.transpose(0, 1)[None],
                              mask=None, slots=None, kv_len=0, paged=batch,
                              scratch_slots=span, rope_tokens=(cos, sin, signed_sin(sin)))
    if cache is not None:
        kv_len = kv_len if kv_len is not None else cache.capacity
        k_pos = torch.arange(kv_len, device=positions.device)
        slots = positions if slots is None else slots
    else:
        kv_len, k_pos, slots = T, positions, None
    if attn_mask is not None:
        mask = fold_mask(attn_mask, groups)
    else:
        mask = causal_mask(positions, k_pos, groups, sliding_window)
    return ForwardContext(cos=cos_t[positions][:, None], sin=sin_t[positions][:, None],
                          mask=mask, slots=slots, kv_len=kv_len)  # cos/sin [B, 1, T, D]


def local_heads(cfg: ModelConfig, tp: TPGroup | None) -> tuple[int, int]:
    """The (query, KV) heads one rank attends with: all of them without tensor parallelism,
    else its share (KV heads replicated when there are fewer than ranks)."""
    if tp is None:
        return cfg.num_heads, cfg.num_kv_heads
    return attention_pieces(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp.rank,
                            tp.size)[:2]


class Attention(nn.Module):
    """GQA attention with q/k/v fused. With a TPGroup it holds only its rank's heads
    (`shards` says which rows of the checkpoint's q/k/v and columns of o_proj), and o_proj
    all-reduces."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        D, h = cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        self.head_dim = D
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        self.qkv_proj = Linear(h, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        if tp is None:
            self.o_proj = Linear(q_size, h, bias=cfg.o_bias)
        else:
            _, _, qkv, o = attention_pieces(cfg.num_heads, cfg.num_kv_heads, D, tp.rank,
                                            tp.size)
            self.o_proj = RowParallelLinear(q_size, h, cfg.o_bias, tp, o)
            self.shards = {"qkv_proj.weight": qkv, "qkv_proj.bias": qkv}
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.head_dim ** -0.5

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
              qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, hidden] -> token-major heads: q and k side by side as they sit in the
        fused projection, normed and rotated in one pass, qk [..., T, H + Hkv, D], and v
        [..., T, Hkv, D] (views of the projection: no transposes). cos and sin_signed
        (rope.signed_sin) [..., T, 1, D]. qkv: the projection of x where the caller has it."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if qkv is None:
            qkv = self.qkv_proj(x)  # [..., T, (H + 2 Hkv) D]
        lead = qkv.shape[:-1]
        qk = qkv[..., :(H + Hkv) * D].view(*lead, H + Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[..., :H, :]), self.k_norm(qk[..., H:, :])), dim=-2)
        qk = apply_rope_rolled(qk, cos, sin_signed)
        return qk, qkv[..., (H + Hkv) * D:].view(*lead, Hkv, D)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> rotated q [B, H, T, D], rotated k and v [B, Hkv, T, D];
        cos/sin [B, 1, T, D]."""
        qk, v = self.heads(x, cos.transpose(1, 2), signed_sin(sin).transpose(1, 2))
        qk = qk.transpose(1, 2)  # [B, H + Hkv, T, D]
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v.transpose(1, 2)

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if ctx.paged is not None and ctx.ttt is None:
            # A flattened batch, token-major: x [N, hidden] (a dense model's backbone) or
            # [1, N, hidden] (a family whose other layers keep the batch axis).
            rows = x if x.dim() == 2 else x[0]
            if fused_kernels(x) is not None:
                out = self._paged_fused(rows, ctx, kv)
            else:
                out = self._paged(rows, ctx, kv)
            out = self.o_proj(out)  # [N, hidden]
            return out if x.dim() == 2 else out[None]
        q, k, v = self.project(x, ctx.cos, ctx.sin)
        if ctx.ttt is not None:
            return self.o_proj(ctx.ttt.attend(self, q, k, v, self.scale))
        if kv is not None:
            k_cache, v_cache = kv
            write_kv(k_cache, v_cache, k, v, ctx.slots)
            k, v = k_cache[:, :, :ctx.kv_len], v_cache[:, :, :ctx.kv_len]
        out = attention(q, k, v, ctx.mask, self.scale)  # [B, T, H*D]
        return self.o_proj(out)

    def _paged(self, x: torch.Tensor, ctx: ForwardContext,
               kv: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor | None = None
               ) -> torch.Tensor:
        """A paged forward's attention, token-major and unfused: x [N, hidden] -> [N, H*D]
        (the cache is token-major too); qkv: x's projection where already computed."""
        cos, _, sin_signed = ctx.rope_tokens
        qk, v = self.heads(x, cos, sin_signed, qkv)
        H = self.num_heads
        return paged_attend(qk[:, :H], qk[:, H:], v, kv[0], kv[1], ctx.paged, self.scale)

    def _paged_fused(self, x: torch.Tensor, ctx: ForwardContext,
                     kv: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """A paged forward's attention from the projection rows in fused kernels (norms,
        rotary and the KV write in one; then the attention: kvcache/paged.py
        paged_attend_qkv), or the reference from the same rows where they do not apply.
        x [N, hidden] -> [N, H*D]; qkv: x's projection where the caller made it."""
        if qkv is None:
            qkv = self.qkv_proj(x)  # [N, (H + 2 Hkv) D]
        norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        cos, sin, _ = ctx.rope_tokens
        out = paged_attend_qkv(qkv, cos[:, 0], sin[:, 0], kv[0], kv[1], ctx.paged,
                               self.scale, self.num_heads, self.num_kv_heads, norms, eps)
        return out if out is not None else self._paged(x, ctx, kv, qkv)


class MLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one matmul (width: cfg's, or `intermediate`).
    With a TPGroup it holds its rank's slice of the width (gate rows and up rows alike) and
    down_proj all-reduces."""

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        i, h = intermediate or cfg.intermediate_size, cfg.hidden_size
        if tp is None:
            self.intermediate = i
            self.down_proj = Linear(i, h, bias=cfg.mlp_bias)
        else:
            self.intermediate, gate_up, down = gated_mlp_pieces(i, tp.rank, tp.size)
            self.down_proj = RowParallelLinear(self.intermediate, h, cfg.mlp_bias, tp, down)
            self.shards = {"gate_up_proj.weight": gate_up, "gate_up_proj.bias": gate_up}
        self.gate_up_proj = Linear(h, 2 * self.intermediate, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: one kernel on CUDA and on the CPU."""
        fast = fused_kernels(gate_up)
        if fast is not None:
            return fast.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism: this rank's part of the output, before the all-reduce
        (and without the bias): for a caller that sums it with other parts first."""
        return linear(self.act(self.gate_up_proj(x)), self.down_proj.weight)


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual stream. A family passes its
    own attention or MLP module (MoE, MLA): anything with the same call signature; an MLP
    with `takes_context = True` is also given the ForwardContext and the residual stream,
    and returns residual + its output itself (models/moe.py: inside its last kernel where
    it can)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self._mlp_context = getattr(self.mlp, "takes_context", False)

    def forward(self, h: torch.Tensor, ctx: ForwardContext,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        fast = few_row_layer_kernel(h, self.self_attn, ctx, kv)
        if fast is not None:
            return self._few_rows(fast, h, ctx, kv)
        a = self.self_attn(self.input_layernorm(h), ctx, kv)
        x, h = self.post_attention_layernorm.add(a, h)  # h + a, and its norm
        return self._mlp_add(x, h, ctx)

    def _mlp_add(self, x: torch.Tensor, h: torch.Tensor, ctx: ForwardContext
                 ) -> torch.Tensor:
        """h + mlp(x)."""
        return self.mlp(x, ctx, residual=h) if self._mlp_context else h + self.mlp(x)

    def _few_rows(self, fast, h: torch.Tensor, ctx: ForwardContext,
                  kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """forward's layer with the residual adds inside o_proj's and down's products and
        silu * up inside gate/up's (models/linear_triton.py): two launches fewer a layer.
        An MLP other than this file's (MoE) runs as in forward."""
        rows = h if h.dim() == 2 else h[0]  # [N, hidden]
        h2 = attend_folded(fast, self.self_attn, self.input_layernorm(rows), ctx, kv, rows)
        x = self.post_attention_layernorm(h2)
        h3 = mlp_folded(fast, self.mlp, x, h2)
        if h3 is None:
            h3 = self._mlp_add(x.view(h.shape), h2.view(h.shape), ctx)
        return h3.view(h.shape)


def few_row_layer_kernel(h: torch.Tensor, attn: nn.Module, ctx: ForwardContext,
                         kv: tuple[torch.Tensor, torch.Tensor] | None):
    """models/linear_triton where a layer's products can take its residual adds and SwiGLU
    (attend_folded, mlp_folded): a paged forward of at most 16 rows h on CUDA through this
    file's unsharded attention (decode steps, verifies, draft steps), else None."""
    if (ctx.paged is None or ctx.ttt is not None or kv is None or not h.is_cuda
            or type(attn) is not Attention or type(attn.qkv_proj) is not Linear
            or type(attn.o_proj) is not Linear):
        return None
    fast = few_row_kernel(h)
    return fast if fast is not None and all(
        fast.weight_fits(p.weight, h.dtype) for p in (attn.qkv_proj, attn.o_proj)) else None


def attend_folded(fast, attn: Attention, x: torch.Tensor, ctx: ForwardContext,
                  kv: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor
                  ) -> torch.Tensor:
    """residual + attn(x) for x, residual [N, hidden] rows, the add inside o_proj's
    product."""
    qkv = fast.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
    out = attn._paged_fused(x, ctx, kv, qkv)  # [N, H * D]
    return fast.linear(out, attn.o_proj.weight, attn.o_proj.bias, residual=residual)


def mlp_folded(fast, mlp: nn.Module, x: torch.Tensor, h: torch.Tensor
               ) -> torch.Tensor | None:
    """h + mlp(x) for rows x, h [N, hidden] in two few-row products (silu * up inside
    gate/up's, the residual add inside down's), or None for an MLP other than this file's
    unsharded one."""
    if type(mlp) is not MLP or not all(type(p) is Linear and fast.weight_fits(p.weight, x.dtype)
                                       for p in (mlp.gate_up_proj, mlp.down_proj)):
        return None
    act = fast.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True)
    return fast.linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module],
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only target model (models/registry.py's TargetModel). See the module
    docstring for the family it covers; other families subclass it, replacing a layer's
    attention or MLP (`attention_for`, `mlp_for`) and their checkpoint names
    (`layer_layout`).

    tp: run as one rank of a tensor-parallel group (parallel/): each layer's attention and
    MLP hold the rank's heads and width, the embedding and lm_head their vocabulary block;
    `config` stays the whole model's, `local_heads` is what this rank attends with."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.local_heads = local_heads(cfg, tp)
        self.model = Backbone(cfg, [DecoderLayer(cfg, self.attention_for(i), self.mlp_for(i))
                                    for i in range(cfg.num_layers)], tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if tp is None \
            else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tap_layer_ids: tuple[int, ...] = ()
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dense: bool | None = None  # _dense_layers, worked out at the first forward

    def attention_for(self, layer: int) -> nn.Module:
        """Decoder layer `layer`'s attention module."""
        return Attention(self.config, self.tp)

    def mlp_for(self, layer: int) -> nn.Module:
        """Decoder layer `layer`'s MLP module."""
        return MLP(self.config, tp=self.tp)

    # -- what the engine, the draft and the trainer use -------------------------------------

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """What the paged cache stores per token: K and V of every KV head this rank holds,
        every layer."""
        cfg = self.config
        return KVLayout(cfg.num_layers, self.local_heads[1], cfg.head_dim, dtype)

    def paged_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> PagedKV:
        """The paged cache this model attends over, in its layout."""
        cfg = self.config
        return PagedKV(cfg.num_layers, num_blocks, block_size, self.local_heads[1],
                       cfg.head_dim, dtype, device)

    # -- configuration --------------------------------------------------------------------

    def set_taps(self, layer_ids: tuple[int, ...] | list[int]) -> None:
        """Configure, once, which decoder layers' outputs `forward(return_taps=True)` returns.
        Id -1 is the embedding output (the input to layer 0; vLLM's input-to-layer id 0)."""
        ids = tuple(int(i) for i in layer_ids)
        L = self.config.num_layers
        bad = [i for i in ids if not -1 <= i < L]
        if bad:
            raise ValueError(f"tap layer ids {bad} out of range for a {L}-layer model "
                             f"(output-of-layer ids are 0..{L - 1}, -1 = the embedding)")
        self.tap_layer_ids = ids

    def init_rope(self, max_len: int) -> None:
        """Build the rope tables (fp32, then model dtype) for positions [0, max_len)."""
        cfg = self.config
        dev = self.model.embed_tokens.weight.device
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = rope_tables(self.rope_dim, cfg.rope_theta, cfg.rope_scaling_dict, max_len,
                               dev)
        # HF casts cos/sin to the activation dtype before rotating; so do we.
        self._rope = (cos.to(dtype), sin.to(dtype))

    @property
    def rope_dim(self) -> int:
        """The rotated width of a query/key head."""
        return self.config.head_dim

    def ensure_rope(self, length: int) -> None:
        """Rope tables covering positions [0, length) at least (rebuilt only if shorter)."""
        if self._rope is None or self._rope[0].shape[0] < length:
            self.init_rope(max(length, self.config.max_position_embeddings))

    # -- forward --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | PagedKV | None = None, *, kv_len: int | None = None,
                slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                return_taps: bool = False, batch: BatchMeta | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder.

        input_ids, positions: [B, T] (rope positions).
        cache: KV cache to write this step's keys/values into (at `slots`, default
            `positions`) and attend over slots [0, kv_len). Without a cache, the T tokens
            attend to each other causally (full recompute; training and reference path).
        attn_mask: optional [B, T, S] bool overriding the causal mask (tree verification).
        batch: with a PagedKV cache, the flattened ragged batch (input_ids and positions
            [1, N]) the tokens form.
        Returns hidden [B, T, hidden] after the final norm, and taps [B, T, n_taps * hidden]
        (None unless return_taps).
        """
        cfg = self.config
        if self._rope is None:  # the engine builds it sized to its context; this is a fallback
            self.init_rope(cfg.max_position_embeddings)
        heads, kv_heads = self.local_heads
        ctx = forward_context(self._rope, positions, cache, kv_len, slots, attn_mask,
                              heads // kv_heads, cfg.sliding_window, batch)

        # A flattened batch through dense layers runs token-major, h [N, hidden]: no batch
        # axis to reshape around every linear and attention (about a third of a CPU
        # decode step's ops); other families keep [1, N, hidden].
        flat = batch is not None and self._dense_layers()
        h = self.model.embed_tokens(input_ids[0] if flat else input_ids)  # [B, T, hidden]
        if return_taps and not self.tap_layer_ids:
            raise ValueError("return_taps=True but no tap layers configured; call set_taps")
        tap_set = tuple(self.tap_layer_ids) if return_taps else ()
        native = native_decoder(self, h, cache, ctx) if flat else None
        if native is not None:
            cos, sin, _ = ctx.rope_tokens
            tap_out = native.run(h, cos[:, 0], sin[:, 0], cache, ctx.paged, tap_set)
        else:
            h, tap_out = self._layers(h, ctx, cache, tap_set)
        h = self.model.norm(h)
        if flat:
            return h[None], None if tap_out is None else tap_out[None]
        return h, tap_out  # [B, T, hidden], [B, T, n_taps * hidden]

    def _layers(self, h: torch.Tensor, ctx: ForwardContext, cache: KVCache | PagedKV | None,
                tap_set: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers one by one: (their output, the taps [..., n_taps * hidden] or
        None without tap_set)."""
        taps: dict[int, torch.Tensor] = {}
        if -1 in tap_set:
            taps[-1] = h
        for i, layer in enumerate(self.model.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            h = layer(h, ctx, kv)
            if i in tap_set:
                taps[i] = h  # h is rebound each layer, never mutated: no copy needed
        return h, torch.cat([taps[i] for i in tap_set], -1) if tap_set else None

    def _dense_layers(self) -> bool:
        """Whether every decoder layer is this file's attention and MLP (shape-agnostic
        over leading axes, so a paged forward can run them token-major)."""
        if self._dense is None:
            self._dense = all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                              and type(layer.mlp) is MLP for layer in self.model.layers)
        return self._dense

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in fp32 (sampling wants fp32)."""
        return self.lm_head(hidden).float()

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1) -> int64 [...]: with a 16-bit head on CUDA, the
        head and the argmax in one pass, no logits written (models/linear.py); a head on
        GGUF codes picks in C (GgufLinear.greedy_ids)."""
        if type(self.lm_head) is Linear:
            return linear_argmax(hidden, self.lm_head.weight, self.lm_head.bias)
        pick = getattr(self.lm_head, "greedy_ids", None)
        if pick is not None:
            return pick(hidden)
        return self.compute_logits(hidden).argmax(-1)

    # -- checkpoint mapping ---------------------------------------------------------------

    def checkpoint_layout(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """HF tensor name -> (our parameter name, where it lands, expected HF shape).

        q/k/v land in rows of qkv_proj and gate/up in rows of gate_up_proj; every other
        tensor maps one-to-one (row 0, full shape). See registry.Placement.
        """
        cfg = self.config
        h = cfg.hidden_size
        out: dict[str, tuple[str, int, tuple[int, ...]]] = {
            "model.embed_tokens.weight": ("model.embed_tokens.weight", 0, (cfg.vocab_size, h)),
            "model.norm.weight": ("model.norm.weight", 0, (h,)),
        }
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = ("lm_head.weight", 0, (cfg.vocab_size, h))
        for n in range(cfg.num_layers):
            out.update(self.layer_layout(n))
        return out

    def checkpoint_layout_for(self, names: set[str]) -> dict[str, tuple[str, int, tuple]]:
        """The layout for a checkpoint holding tensors `names`: where a family accepts
        more than one form of a tensor (MoE experts per expert or fused), the form the
        checkpoint has. One form here."""
        return self.checkpoint_layout()

    def layer_layout(self, n: int) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """Checkpoint layout of decoder layer n."""
        cfg = self.config
        d = cfg.head_dim
        return decoder_layer_layout(
            f"model.layers.{n}.", hidden=cfg.hidden_size, in_width=cfg.hidden_size,
            q=cfg.num_heads * d, kv=cfg.num_kv_heads * d, head_dim=d,
            intermediate=cfg.intermediate_size, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm, mlp_bias=cfg.mlp_bias)


def decoder_layer_layout(p: str, *, hidden: int, in_width: int, q: int, kv: int,
                         head_dim: int, intermediate: int, qkv_bias: bool, o_bias: bool,
                         qk_norm: bool, mlp_bias: bool) -> dict[str, tuple[str, int, tuple]]:
    """Checkpoint layout of one decoder layer under prefix `p` (HF names -> fused rows).

    in_width is the attention input width (hidden, or 2 * hidden for an EAGLE-3 draft's
    first layer, which attends over cat(embedding, hidden)).
    """
    h, i = hidden, intermediate
    a, m = p + "self_attn.", p + "mlp."
    out: dict[str, tuple[str, int, tuple]] = {
        p + "input_layernorm.weight": (p + "input_layernorm.weight", 0, (h,)),
        p + "post_attention_layernorm.weight": (p + "post_attention_layernorm.weight", 0, (h,)),
    }
    for name, row, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
        out[a + f"{name}_proj.weight"] = (a + "qkv_proj.weight", row, (rows, in_width))
        if qkv_bias:
            out[a + f"{name}_proj.bias"] = (a + "qkv_proj.bias", row, (rows,))
    out[a + "o_proj.weight"] = (a + "o_proj.weight", 0, (h, q))
    if o_bias:
        out[a + "o_proj.bias"] = (a + "o_proj.bias", 0, (h,))
    if qk_norm:
        out[a + "q_norm.weight"] = (a + "q_norm.weight", 0, (head_dim,))
        out[a + "k_norm.weight"] = (a + "k_norm.weight", 0, (head_dim,))
    out.update(mlp_layout(m, hidden=h, intermediate=i, bias=mlp_bias))
    return out


def mlp_layout(m: str, *, hidden: int, intermediate: int, bias: bool = False,
               hf: str | None = None) -> dict[str, tuple[str, int, tuple]]:
    """A gated MLP's checkpoint layout: HF's gate/up/down under `hf` (default m) onto our
    fused gate_up_proj and down_proj under m."""
    h, i, src = hidden, intermediate, hf if hf is not None else m
    out: dict[str, tuple[str, int, tuple]] = {
        src + "gate_proj.weight": (m + "gate_up_proj.weight", 0, (i, h)),
        src + "up_proj.weight": (m + "gate_up_proj.weight", i, (i, h)),
        src + "down_proj.weight": (m + "down_proj.weight", 0, (h, i)),
    }
    if bias:
        out[src + "gate_proj.bias"] = (m + "gate_up_proj.bias", 0, (i,))
        out[src + "up_proj.bias"] = (m + "gate_up_proj.bias", i, (i,))
        out[src + "down_proj.bias"] = (m + "down_proj.bias", 0, (h,))
    return out


FAMILIES = (Family("llama", tuple(SUPPORTED_ARCHITECTURES),
                   {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"},
                   ModelConfig.from_hf, CausalLM, tensor_parallel=True),)
