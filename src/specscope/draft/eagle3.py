"""The EAGLE-3 draft head: a one-layer (sometimes N-layer) Llama decoder fed target taps.

One draft forward at position p (embedding FIRST in the concatenation, as every EAGLE-3
implementation trains it):

    g    = fc(taps_p)                                   # [H]; taps_p: [num_taps * Ht]
    x    = cat(input_layernorm(embed(t_{p+1})), hidden_norm(g))        # [2H]
    h    = r + attn(x)        r = g, or hidden_norm(g) with norm_before_residual
    h    = h + mlp(post_attention_layernorm(h))
    (layers 1.. are plain Llama decoder layers over h)
    out  = h (pre-norm) ;  logits = lm_head(norm(h))    # over the draft vocab Vd

Later draft steps feed the draft's own pre-norm output back as `hidden` instead of
fc(taps) (EAGLE-3.1 `norm_output` feeds the normed output instead; see `forward`).

Optional EAGLE-3.1 input norms (mutually exclusive): `fc_norm` = one RMSNorm per tap before
the concatenation (`fc_norm.{i}`); `norm_before_fc` = one RMSNorm over the concatenated taps
(`input_norm`). Vocabulary maps: target_id = draft_id + d2t[draft_id]; t2d[v] says whether
target id v is in the draft vocabulary, so nonzero(t2d) == d2t + arange(Vd).

The draft borrows the target's token embedding (SGLang does the same, whatever the draft
checkpoint holds) unless its hidden size differs from the target's; and the target's lm_head
when the checkpoint has none (draft_vocab_size null: Vd = V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specscope.config import ModelConfig
from specscope.draft.vocab import vocab_maps
from specscope.kvcache import KVCache
from specscope.kvcache.paged import BatchMeta, PagedKV
from specscope.models.linear import Linear, linear, linear_argmax
from specscope.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    ForwardContext,
    RMSNorm,
    attend_folded,
    decoder_layer_layout,
    few_row_layer_kernel,
    forward_context,
    local_heads,
    mlp_folded,
)
from specscope.models.registry import TargetModel
from specscope.models.rope import rope_tables
from specscope.native.decoder import native_draft_layer
from specscope.parallel.group import TPGroup
from specscope.parallel.layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    full_vocab_weight,
    zero_padding,
)
from specscope.parallel.shard import copy_from_full

OUTPUT_OF_LAYER = "output-of-layer"
INPUT_TO_LAYER = "input-to-layer"


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps, output-of-layer: [1, L//2 - 1, L - 4] (= input-to-layer [2, L//2, L-3]),
    clamped into [0, L) for targets under 4 layers (tiny test models) and sorted."""
    L = num_target_layers
    return tuple(sorted(min(max(i, 0), L - 1) for i in (1, L // 2 - 1, L - 4)))


@dataclass(frozen=True)
class DraftConfig:
    """Architecture of an EAGLE-3 draft, plus where its layer ids came from."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd (== V when the checkpoint borrows the target's lm_head)
    target_hidden_size: int  # Ht
    target_num_layers: int  # L: aux ids live in [0, L)
    aux_layer_ids: tuple[int, ...]  # output-of-layer, 0-based, in concatenation order
    num_taps: int = 3
    has_lm_head: bool = True  # False: borrow the target's lm_head (then Vd == V)
    own_embed_tokens: bool = False  # True only when hidden_size != target_hidden_size
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3-style per-head q/k RMSNorm (speculators qwen3 layers)
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm per tap before the concatenation
    norm_before_fc: bool = False  # RMSNorm over the concatenated taps
    norm_before_residual: bool = False  # first layer's residual is hidden_norm(g), not g
    norm_output: bool = False  # EAGLE-3.1: later steps are fed the normed output
    source_format: str = ""  # sglang | eagle | speculators | random | ""
    layer_ids_source: str = ""  # e.g. "eagle_config.eagle_aux_hidden_state_layer_ids"
    layer_ids_convention: str = OUTPUT_OF_LAYER  # convention of that source

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "num_layers", "max_position_embeddings", "vocab_size", "draft_vocab_size",
                  "target_hidden_size", "target_num_layers", "num_taps"):
            if getattr(self, f) <= 0:
                raise ValueError(f"draft config: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft config: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"draft config: head_dim must be even for RoPE, got {self.head_dim}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        ids, L = self.aux_layer_ids, self.target_num_layers
        if len(ids) != self.num_taps:
            raise ValueError(f"draft config: {len(ids)} aux layer ids {list(ids)} but num_taps "
                             f"is {self.num_taps}")
        bad = [i for i in ids if not -1 <= i < L]
        if bad:
            raise ValueError(f"draft layer ids {bad} out of range for a {L}-layer target "
                             f"(output-of-layer ids are 0..{L - 1}, -1 = the embedding)")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft config: draft_vocab_size {self.draft_vocab_size} exceeds "
                             f"the target vocab_size {self.vocab_size}")
        if not self.has_lm_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError("draft config: a draft without its own lm_head borrows the "
                             "target's, so draft_vocab_size must equal vocab_size")
        if self.own_embed_tokens != (self.hidden_size != self.target_hidden_size):
            raise ValueError("draft config: own_embed_tokens must be set exactly when the "
                             "draft hidden_size differs from target_hidden_size "
                             f"({self.hidden_size} vs {self.target_hidden_size})")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("draft config: fc_norm and norm_before_fc are mutually exclusive")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def layer_config(self) -> ModelConfig:
        """The draft's decoder layers as a target-style ModelConfig (for the shared modules)."""
        return ModelConfig(
            architecture="Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM",
            family="qwen3" if self.qk_norm else "llama",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            qkv_bias=self.attention_bias, o_bias=self.attention_bias, mlp_bias=self.mlp_bias,
            qk_norm=self.qk_norm, rope_scaling=self.rope_scaling, name="eagle3-draft")


class FirstLayer(nn.Module):
    """EAGLE-3's first decoder layer: attention over cat(embedding, hidden) [2H]."""

    def __init__(self, cfg: DraftConfig, lcfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the projected / fed-back hidden
        self.self_attn = Attention(lcfg, tp)
        q_kv = self.self_attn.qkv_proj.out_features  # this rank's heads' rows
        self.self_attn.qkv_proj = Linear(2 * H, q_kv, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(lcfg, tp=tp)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        g = self.hidden_norm(hidden)  # [B, T, H]
        residual = g if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(emb), g), dim=-1)  # [B, T, 2H], embedding first
        fast = few_row_layer_kernel(x, self.self_attn, ctx, kv)
        if fast is not None:  # a paged forward: x [1, N, 2H]; the residual adds folded
            h = attend_folded(fast, self.self_attn, x[0], ctx, kv, residual[0])[None]
        else:
            h = residual + self.self_attn(x, ctx, kv)
        y = self.post_attention_layernorm(h)
        out = None if fast is None else mlp_folded(fast, self.mlp, y[0], h[0])
        return h + self.mlp(y) if out is None else out[None]


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft head. Call `attach_target` before `forward` (it borrows weights).

    tp: shard it like the target over a tensor-parallel group (`--draft-tp-size N`): its
    layers hold the rank's heads and MLP width, its head (and its own embedding) a
    vocabulary block. None: whole on this rank (`--draft-tp-size 1`, replicated on every
    rank: its inputs, the taps, are replicated residual streams, so its steps need no
    collective; it then holds whole copies of the target's embedding and head it borrows).
    fc and the norms are replicated either way."""

    def __init__(self, cfg: DraftConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        lcfg = cfg.layer_config()
        self.local_heads = local_heads(lcfg, tp)
        H, Ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_taps
        self.input_norm = RMSNorm(n * Ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n)) \
            if cfg.fc_norm else None
        self.fc = Linear(n * Ht, H, bias=False)
        self.layers = nn.ModuleList(
            [FirstLayer(cfg, lcfg, tp)] + [DecoderLayer(lcfg, Attention(lcfg, tp),
                                                        MLP(lcfg, tp=tp))
                                           for _ in range(1, cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        Vd = cfg.draft_vocab_size
        self.lm_head = None if not cfg.has_lm_head else Linear(H, Vd, bias=False) \
            if tp is None else ParallelLMHead(H, Vd, tp)
        self.embed_tokens = None if not cfg.own_embed_tokens else \
            nn.Embedding(cfg.vocab_size, H) if tp is None else \
            VocabParallelEmbedding(cfg.vocab_size, H, tp)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        # Borrowed target weights: plain attributes, not parameters, so they never show up
        # in this module's state_dict (and are never saved as the draft's).
        self._target_embed: torch.Tensor | None = None  # [V, H]
        self._target_head: torch.Tensor | None = None  # [V, H]
        # A sharded draft calls the target's vocab-parallel modules themselves instead.
        self._target_embed_module: nn.Module | None = None
        self._target_head_module: nn.Module | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- wiring -----------------------------------------------------------------------------

    def attach_target(self, target: TargetModel) -> None:
        """Borrow the target's embedding (unless the draft has its own) and lm_head (when the
        draft has none), after checking that the draft was built for this target."""
        cfg, tc = self.config, target.config
        errors = []
        if tc.vocab_size != cfg.vocab_size:
            errors.append(f"vocab size {tc.vocab_size} != draft's target vocab {cfg.vocab_size}")
        if tc.hidden_size != cfg.target_hidden_size:
            errors.append(f"hidden size {tc.hidden_size} != draft's target_hidden_size "
                          f"{cfg.target_hidden_size}")
        if tc.num_layers != cfg.target_num_layers:
            errors.append(f"{tc.num_layers} layers != the draft's {cfg.target_num_layers}")
        if self.tp is not None and getattr(target, "tp", None) is not self.tp:
            errors.append("a sharded draft needs a target sharded over the same group")
        if errors:
            raise ValueError("draft does not fit this target: " + "; ".join(errors))
        if self.tp is not None:  # shares the target's vocabulary split
            self._target_embed_module = None if cfg.own_embed_tokens else target.embed_tokens
            self._target_head_module = None if cfg.has_lm_head else target.lm_head
            return
        # The whole tables, as plain tensors (a Parameter would be registered): the target's
        # own (detached, the same storage), or gathered from its ranks once, here.
        self._target_embed = None if cfg.own_embed_tokens else \
            full_vocab_weight(target.embed_tokens)
        self._target_head = None if cfg.has_lm_head else full_vocab_weight(target.lm_head)

    def init_rope(self, max_len: int) -> None:
        """Rope tables for positions [0, max_len) with the draft's own theta and scaling."""
        cfg = self.config
        w = self.norm.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, max_len,
                               w.device)
        self._rope = (cos.to(w.dtype), sin.to(w.dtype))

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (its linears may hold quantised codes instead)."""
        return self.norm.weight.dtype

    @property
    def rope_len(self) -> int:
        """Positions the rope tables cover now (0 before they are made)."""
        return 0 if self._rope is None else int(self._rope[0].shape[0])

    def ensure_rope(self, length: int) -> None:
        """Rope tables covering positions [0, length) at least (rebuilt only if shorter)."""
        if self.rope_len < length:
            self.init_rope(max(length, self.config.max_position_embeddings))

    # -- forward ----------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embedding [B, T] -> [B, T, H] (own, or the target's)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if self._target_embed_module is not None:
            return self._target_embed_module(input_ids)
        if self._target_embed is None:
            raise RuntimeError("Eagle3Draft: call attach_target(target) before forward")
        return F.embedding(input_ids, self._target_embed)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps [B, T, num_taps * Ht] -> the draft's hidden input [B, T, H]."""
        cfg = self.config
        assert taps.shape[-1] == cfg.num_taps * cfg.target_hidden_size, taps.shape
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        if self.fc_norm is not None:
            chunks = taps.split(cfg.target_hidden_size, dim=-1)
            taps = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)],
                             dim=-1)
        return self.fc(taps)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | PagedKV | None = None, *, kv_len: int | None = None,
                slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                ttt: Any = None, batch: BatchMeta | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over T tokens.

        input_ids, positions: [B, T]; hidden: [B, T, H], either `project(taps)` (draft extend)
        or the first output of an earlier pass (later draft steps).
        cache / kv_len / slots / attn_mask: as CausalLM.forward (the draft's own KV cache,
        num_layers layers; attn_mask [B, T, S] bool overrides the causal mask); with a
        PagedKV cache, `batch` describes the flattened ragged batch (B = 1, T = N tokens).
        Returns (next_hidden, normed), both [B, T, H]: `normed` = norm(h) feeds
        `compute_logits`; `next_hidden` is what the next draft step takes as `hidden`: the
        pre-norm output h, or `normed` for EAGLE-3.1 drafts with config.norm_output.
        ttt: a train.ttt.StepKeys (training-time test, no cache): attention sees the keys of
        the earlier unrolled steps it holds, instead of a causal window over T.
        """
        B, T = input_ids.shape
        cfg = self.config
        assert hidden.shape == (B, T, cfg.hidden_size), hidden.shape
        if self._rope is None:  # the engine sizes it to its context; this is a fallback
            self.init_rope(cfg.max_position_embeddings)
        heads, kv_heads = self.local_heads
        ctx = forward_context(self._rope, positions, cache, kv_len, slots, attn_mask,
                              heads // kv_heads, batch=batch)
        ctx.ttt = ttt

        def kv(i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            return (cache.k[i], cache.v[i]) if cache is not None else None

        emb = self.embed(input_ids)
        native = native_draft_layer(self, emb[0], cache, ctx) if emb.shape[0] == 1 else None
        if native is not None:
            cos, sin, _ = ctx.rope_tokens
            h = native.run_first(emb[0], hidden[0], cos[:, 0], sin[:, 0], cache,
                                 ctx.paged)[None]
        else:
            h = self.layers[0](emb, hidden, ctx, kv(0))  # [B, T, H]
        for i in range(1, len(self.layers)):
            h = self.layers[i](h, ctx, kv(i))
        normed = self.norm(h)
        return (normed if cfg.norm_output else h), normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [..., H] -> draft-vocab logits [..., Vd] in fp32."""
        if self.lm_head is not None:
            return self.lm_head(normed).float()
        if self._target_head_module is not None:
            return self._target_head_module(normed).float()
        if self._target_head is None:
            raise RuntimeError("Eagle3Draft: call attach_target(target) before compute_logits")
        return linear(normed, self._target_head).float()

    def greedy_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [..., H] -> the target-vocab id of each row's most likely draft token [...]:
        to_target(compute_logits(normed).argmax(-1)), the same ids; with the draft's own
        (or the borrowed whole) 16-bit head on CUDA, one pass of the head over its rows with
        the argmax and the vocabulary map folded in (models/linear.py linear_argmax)."""
        if self.lm_head is None:  # the borrowed whole head (None: the sharded module's)
            weight, bias = self._target_head, None
        elif type(self.lm_head) is Linear:
            weight, bias = self.lm_head.weight, self.lm_head.bias
        else:  # a sharded or quantised head of its own
            weight = bias = None
        if weight is None:
            return self.to_target(self.compute_logits(normed).argmax(-1))
        return linear_argmax(normed, weight, bias, self.d2t)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (target = draft + d2t[draft]); any shape."""
        return draft_ids + self.d2t[draft_ids]

    # -- checkpoint mapping -----------------------------------------------------------------

    def checkpoint_layout(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """Canonical tensor name -> (our parameter name, first row in it, expected shape).

        Canonical names are the vLLM/speculators ones (`layers.{i}.*`, unfused q/k/v and
        gate/up); formats.py maps each format's names onto them. The d2t/t2d buffers and
        borrowed target weights are not listed.
        """
        cfg = self.config
        H, Ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_taps
        d, i = cfg.head_dim, cfg.intermediate_size
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        out: dict[str, tuple[str, int, tuple[int, ...]]] = {
            "fc.weight": ("fc.weight", 0, (H, n * Ht)),
            "norm.weight": ("norm.weight", 0, (H,)),
        }
        if cfg.norm_before_fc:
            out["input_norm.weight"] = ("input_norm.weight", 0, (n * Ht,))
        if cfg.fc_norm:
            for t in range(n):
                out[f"fc_norm.{t}.weight"] = (f"fc_norm.{t}.weight", 0, (Ht,))
        if cfg.has_lm_head:
            out["lm_head.weight"] = ("lm_head.weight", 0, (cfg.draft_vocab_size, H))
        if cfg.own_embed_tokens:
            out["embed_tokens.weight"] = ("embed_tokens.weight", 0, (cfg.vocab_size, H))
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            # The first layer attends over cat(embedding, hidden): 2H inputs, and a hidden_norm.
            out.update(decoder_layer_layout(
                p, hidden=H, in_width=2 * H if layer == 0 else H, q=q, kv=kv, head_dim=d,
                intermediate=i, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                qk_norm=cfg.qk_norm, mlp_bias=cfg.mlp_bias))
            if layer == 0:
                out[p + "hidden_norm.weight"] = (p + "hidden_norm.weight", 0, (H,))
        return out

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """The draft's own weights under canonical names (fused rows split back out)."""
        params = dict(self.named_parameters())
        out = {}
        for name, (param, row, shape) in self.checkpoint_layout().items():
            out[name] = params[param].detach()[row:row + shape[0]]
        return out


def shard_draft(full: Eagle3Draft, tp: TPGroup) -> Eagle3Draft:
    """The rank's shard of a draft held whole in memory (a random draft, a draft being
    trained): its slices, copied. A checkpoint loads sharded without this
    (load_draft(..., tp=...) reads only the rank's slices). Not attached: call
    attach_target."""
    p = next(full.parameters())
    with torch.device("meta"):
        local = Eagle3Draft(full.config, tp)
    local = local.to(dtype=p.dtype).to_empty(device=p.device)
    zero_padding(local)
    copy_from_full(full, local)
    return local.eval().requires_grad_(False)


# -- random drafts (benchmarks, tests) ----------------------------------------------------

def random_draft(target_config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 *, layer_ids: tuple[int, ...] | list[int] | None = None,
                 draft_vocab_size: int | None = None, seed: int = 0, std: float = 0.02,
                 **overrides: Any) -> Eagle3Draft:
    """A random-weight EAGLE-3 draft shaped for `target_config` (one layer of the target's
    width; draft vocab min(V, 32000), a random subset of the target's; weights N(0, std),
    norms near 1). `overrides` replace DraftConfig fields. Not attached: call
    attach_target."""
    tc = target_config
    V = tc.vocab_size
    Vd = draft_vocab_size if draft_vocab_size is not None else min(V, 32000)
    fields: dict[str, Any] = dict(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
        num_layers=1, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings,
        vocab_size=V, draft_vocab_size=Vd, target_hidden_size=tc.hidden_size,
        target_num_layers=tc.num_layers,
        # sorted, as load_draft sorts: every engine concatenates taps in layer order
        aux_layer_ids=tuple(sorted(layer_ids)) if layer_ids else default_layer_ids(tc.num_layers),
        source_format="random",
        layer_ids_source="override" if layer_ids else "default",
    )
    fields.update(overrides)
    fields["num_taps"] = len(fields["aux_layer_ids"])
    fields["own_embed_tokens"] = fields["hidden_size"] != fields["target_hidden_size"]
    cfg = DraftConfig(**fields)
    g = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or ".q_norm." in name or ".k_norm." in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        ids = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size]
        d2t, t2d = vocab_maps(ids, cfg.vocab_size)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
