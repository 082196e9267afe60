"""Frozen configuration dataclasses: the single source of defaults for the API and the CLI.

Everything here is validated in ``__post_init__`` so a bad value fails where it is given,
with a message naming the field, instead of deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json as _json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

# HF `architectures` entry -> family flags. One model implementation (models/llama.py) covers
# all of these; the differences are data, not code paths.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where specscope caches what it builds (converted GGUFs, the native CPU kernels):
    `cache_dir`, else $SPECSCOPE_CACHE_DIR, else ~/.cache/specscope."""
    return pathlib.Path(cache_dir or os.environ.get("SPECSCOPE_CACHE_DIR")
                        or "~/.cache/specscope").expanduser()


def normalize_dtype(name: str) -> str:
    """Map user spellings (fp32, bf16, half, ...) to a torch dtype name."""
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; choose one of fp32, bf16, fp16")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class MoEConfig:
    """A Mixture-of-Experts MLP: which layers are sparse and how tokens are routed.

    Routing: scores = softmax or sigmoid of the router logits; with n_group > 1 the experts
    are split into n_group groups and only the topk_group best groups (by the sum of their
    two best scores, DeepSeek-V3) are eligible; the top_k eligible experts are picked (by
    score plus the correction bias when there is one) and weighted by their scores,
    renormalised over the k when norm_topk_prob, times routed_scaling_factor.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int  # one routed expert's MLP width
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or a dense MLP
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # the shared expert MLP's whole width
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.top_k}) must be in "
                             f"1..num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"model config: unsupported router scoring {self.scoring!r} "
                             f"(field scoring_func); supported: softmax, sigmoid")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"model config: n_group ({self.n_group}) must divide n_routed_"
                             f"experts ({self.num_experts}) and topk_group "
                             f"({self.topk_group}) be in 1..n_group")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): queries through an optional
    low-rank q_lora_rank, keys and values from one compressed latent of kv_lora_rank plus a
    shared rope key of qk_rope_head_dim."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # DeepSeek's checkpoints store each rotary pair's two channels side by side (HF's
    # rope_interleave, true unless a config says otherwise); False: rotate-half, as Llama.
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config: {f} must be positive, got {getattr(self, f)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model config: qk_rope_head_dim must be even for RoPE, got "
                             f"{self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"model config: q_lora_rank must be positive or null, got "
                             f"{self.q_lora_rank}")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a target model, parsed from a HF ``config.json``."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # rope_scaling as sorted (key, value) pairs so the dataclass stays hashable/frozen.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Set by the MoE and MLA families (models/moe.py, models/deepseek.py); None: dense.
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    # Trailing decoder layers a checkpoint holds that the model never runs (DeepSeek-V3's
    # multi-token-prediction modules, num_nextn_predict_layers): the loader skips them.
    unused_checkpoint_layers: int = 0

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @staticmethod
    def from_hf(cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """A dense Llama-family config from a HF config dict (targets, and drafts' decoder
        layers); unsupported architectures fail listing the supported. Targets of every
        family load through models/registry.py, which calls this for the dense ones."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            found = archs or [cfg.get("model_type", "<none>")]
            raise ValueError(
                f"unsupported architecture {found} in {name or 'config.json'}; specscope "
                f"supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        cfg = text_config(cfg)
        common = hf_common_fields(cfg, name)
        attn_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if family == "qwen2" or family == "qwen3":
            # Qwen configs carry sliding_window but only use it with use_sliding_window.
            sliding = sliding if cfg.get("use_sliding_window") else None
        return ModelConfig(
            architecture=arch,
            family=family,
            intermediate_size=int(hf_need(cfg, "intermediate_size", name)),
            # HF: Llama and Qwen3 put attention_bias on q/k/v/o; Qwen2 always biases q/k/v
            # and never o; Mistral never biases (it ignores attention_bias).
            qkv_bias=family == "qwen2" or (family in ("llama", "qwen3") and attn_bias),
            o_bias=family in ("llama", "qwen3") and attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            **common,
        )

    def weight_bytes(self, bytes_per_param: int) -> int:
        """Bytes of weights streamed per decode step (lm_head counted once even when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        return (self.num_layers * per_layer + self.vocab_size * h + h) * bytes_per_param


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal wrapper (`text_config`), else cfg."""
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
        return {**cfg["text_config"], "architectures": cfg.get("architectures") or []}
    return cfg


def hf_need(cfg: dict[str, Any], key: str, name: str = "") -> Any:
    """A required field of a HF config, or an error naming it."""
    if cfg.get(key) is None:
        raise ValueError(f"config.json of {name or 'model'} lacks required field {key!r}")
    return cfg[key]


def hf_rope(cfg: dict[str, Any], name: str = "",
            supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES
            ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either HF spelling; an unsupported rope type
    fails naming it."""
    rope_scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if rope_scaling is None and isinstance(params, dict):
        # transformers >= 5 writes rope_parameters = {rope_type, rope_theta, ...}
        rope_scaling = params if params.get("rope_type", "default") != "default" else None
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None and isinstance(params, dict):
        rope_theta = params.get("rope_theta")
    if rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rtype == "default":
            rope_scaling = None
        elif rtype not in supported:
            raise ValueError(f"{name or 'config.json'}: unsupported rope_scaling type "
                             f"{rtype!r} (field rope_scaling.rope_type); supported: "
                             f"{', '.join(supported)}")
    return float(rope_theta if rope_theta is not None else 10000.0), rope_scaling


def hf_common_fields(cfg: dict[str, Any], name: str = "",
                     rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way from a HF config."""
    hidden = int(hf_need(cfg, "hidden_size", name))
    heads = int(hf_need(cfg, "num_attention_heads", name))
    head_dim = cfg.get("head_dim") or hidden // heads
    rope_theta, rope_scaling = hf_rope(cfg, name, rope_types)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        vocab_size=int(hf_need(cfg, "vocab_size", name)),
        hidden_size=hidden,
        num_layers=int(hf_need(cfg, "num_hidden_layers", name)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
    )


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output, vLLM's StructuredOutputsParams: exactly one of
    json (a JSON schema: a dict, or its JSON text), json_object (any JSON object), regex,
    choice (exactly one of these strings) or grammar (Lark, or llama.cpp's GBNF). Enforced
    token by token by the `structured` extra (llguidance; engine/grammar.py)."""

    json: str | dict | bool | None = None  # kept as JSON text, so the params stay hashable
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):  # key order kept: the properties' output order
            object.__setattr__(self, "json", _json.dumps(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("choice must hold at least one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string, got {type(v).__name__}")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n)
                 is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")


# The most top log-probabilities a token may return (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Mirrors the OpenAI / vLLM fields of the same names.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 disable those filters.

    Logits adjustments (vLLM's semantics and order, sampling.py `adjust_logits`): logit_bias
    (token id -> bias added to its logit, OpenAI's -100..100), min_tokens (EOS and
    stop_token_ids masked until min_tokens tokens are generated), repetition_penalty (HF:
    logits of tokens in the prompt or the output divided by it when positive, multiplied
    when negative), frequency_penalty and presence_penalty (OpenAI: minus penalty x count,
    minus penalty once, over the generated tokens). Greedy with adjustments is the argmax of
    the adjusted logits. min_p (after temperature): tokens below min_p x the top token's
    probability are dropped.

    logprobs: None for none; k (0..20) for each generated token's log-probability and rank
    under the target's raw distribution plus its k most likely tokens. n: independent
    completions of one prompt (seed + i for choice i when seeded).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Keep stop strings out of the returned text (OpenAI behaviour).
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (engine/grammar.py).
    structured_outputs: StructuredOutputs | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # Sorted (token id, bias) pairs; a dict is accepted (kept hashable, like the tuples above).
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each under its prefix), k top ones as above.
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, "
                             f"got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {so!r}")
        self._check_adjustments()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, 0, MAX_LOGPROBS)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")
        _check_int("n", self.n, 1)

    def _check_adjustments(self) -> None:
        """The penalties, min_p and logit_bias: finite and in range (vLLM's ranges)."""
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi):
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
                and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = sorted((int(t), float(b)) for t, b in pairs)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in pairs):
            raise ValueError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], "
                             f"got {bias!r}")
        object.__setattr__(self, "logit_bias", tuple(pairs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any adjustment before sampling applies (sampling.py `adjust_logits`);
        sequences without one skip that work altogether."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or bool(self.logit_bias)
                or self.min_tokens > 0)

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty reads the sequence's token counts."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass(frozen=True)
class EngineConfig:
    """Where and how the engine runs a model, and how it batches (vLLM's names)."""

    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    # Overrides the model's max_position_embeddings (smaller only).
    max_model_len: int | None = None
    cache_dir: str | None = None
    # Replay plain decode steps as a CUDA graph per batch-size bucket (CUDA only).
    cuda_graphs: bool = True
    # torch.compile the model's forward (minutes of compile on first use; faster steps).
    compile: bool = False
    # Tokens one step feeds the target (decode tokens, verify trees and prefill chunks):
    # a longer prompt is prefilled in chunks. SGLang: --chunked-prefill-size.
    max_num_batched_tokens: int = 2048
    # Sequences running at once. SGLang: --max-running-requests.
    max_num_seqs: int = 256
    block_size: int = 16  # tokens per KV block
    # The KV pools' budget: a fraction of the GPU (SGLang: --mem-fraction-static), or bytes.
    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            _check_int(name, getattr(self, name), 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs}): every running sequence "
                             f"feeds at least one token a step")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got "
                             f"{self.kv_cache_memory}")


# Upper bounds on the speculative knobs, for the CLI, the Python API and POST /admin/spec alike:
# past them a cycle's draft and verify buffers grow without any gain in accept length (a
# num_steps of 1000 turned an 8-token request into a minute of drafting).
MAX_NUM_STEPS = 16
MAX_TOPK = 16
MAX_NUM_DRAFT_TOKENS = 256


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """An integer (never a bool) in [lo, hi], or a ValueError naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or \
            (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding knobs, named as SGLang's flags (see DESIGN vocabulary).

    num_steps: draft forward passes per cycle (the draft extend counts as the first).
    topk: branches per node (1 = chain). num_draft_tokens: tokens sent to verify,
    including the root; with topk = 1 it must be num_steps + 1 (the default when None).
    simulate_acceptance: per-position acceptance rates (tuple) or a mean accept length
    (float, tau incl. the bonus token): the real draft and verify still run and real tokens
    are emitted, but how many are accepted is drawn from this profile. For benchmarking
    without a trained draft; every output says "simulated".
    simulate_sibling: with simulated acceptance and topk > 1, when the top-ranked child at a
    depth is not accepted, the next-ranked kept sibling is with this probability (and so on
    down the siblings): a tree's extra branches then buy acceptance as real ones do. 0: only
    the top-ranked path is ever accepted.
    draft_tensor_parallel_size: how the draft runs under tensor parallelism: 1 = whole on
    every rank (replicated: no collective in a draft step), or the target's size (sharded
    like the target). vLLM's speculative_config key of the same name; `--draft-tp-size`.
    confidence_stop: a chain's drafting ends at the first token where the product of the
    draft's probabilities of its picks so far falls below this, and that token is not
    verified: a cycle drafts and verifies only tokens likely to be accepted (lossless; the
    output is the same). 0: every cycle drafts num_steps tokens. None: the machine's choice
    (engine/machine.py resolve_confidence_stop: on for chains on the CPU, where each
    verified token costs compute, off on CUDA). Chains only (topk 1), no simulated
    acceptance; `--confidence-stop`.
    """

    draft: str | None = None
    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int | None = None
    draft_layer_ids: tuple[int, ...] | None = None
    simulate_acceptance: tuple[float, ...] | float | None = None
    simulate_seed: int = 0
    simulate_sibling: float = 0.0
    draft_tensor_parallel_size: int = 1
    confidence_stop: float | None = None

    def __post_init__(self) -> None:
        _check_int("num_steps", self.num_steps, 1, MAX_NUM_STEPS)
        _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)
        _check_int("topk", self.topk, 1, MAX_TOPK)
        max_nodes = min(1 + self.topk + (self.num_steps - 1) * self.topk * self.topk,
                        MAX_NUM_DRAFT_TOKENS)
        if self.num_draft_tokens is None:
            default = self.num_steps + 1 if self.topk == 1 else min(max_nodes, 4 * self.num_steps)
            object.__setattr__(self, "num_draft_tokens", default)
        n = self.num_draft_tokens
        _check_int("num_draft_tokens", n, 2, MAX_NUM_DRAFT_TOKENS)
        if self.topk == 1 and n != self.num_steps + 1:
            raise ValueError(f"with topk 1 (a chain) num_draft_tokens must be num_steps + 1 = "
                             f"{self.num_steps + 1}, got {n}")
        if not 2 <= n <= max_nodes:
            raise ValueError(f"num_draft_tokens must be in [2, {max_nodes}] for num_steps "
                             f"{self.num_steps} and topk {self.topk}, got {n}")
        if self.draft_layer_ids is not None:
            object.__setattr__(self, "draft_layer_ids", tuple(int(i) for i in
                                                              self.draft_layer_ids))
        if not 0.0 <= self.simulate_sibling < 1.0:
            raise ValueError(f"simulate_sibling must be in [0, 1), got {self.simulate_sibling!r}")
        sim = self.simulate_acceptance
        if isinstance(sim, (list, tuple)):
            rates = tuple(float(r) for r in sim)
            if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
                raise ValueError(f"simulated acceptance rates must be in [0, 1], got {sim!r}")
            object.__setattr__(self, "simulate_acceptance", rates)
        elif sim is not None:
            tau = float(sim)
            if not 1.0 <= tau <= self.num_steps + 1:
                raise ValueError(f"simulated mean accept length must be in [1, num_steps + 1 "
                                 f"= {self.num_steps + 1}], got {sim!r}")
            object.__setattr__(self, "simulate_acceptance", tau)
        self._check_confidence_stop()

    def _check_confidence_stop(self) -> None:
        c = self.confidence_stop
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:
            raise ValueError(f"confidence_stop must be a probability in [0, 1) (0: off), "
                             f"got {c!r}")
        object.__setattr__(self, "confidence_stop", float(c))
        if c > 0 and self.topk != 1:
            raise ValueError(f"confidence_stop applies to chains (topk 1), not to trees "
                             f"(topk {self.topk}); set it to 0 or use --topk 1")
        if c > 0 and self.simulated:
            raise ValueError("confidence_stop reads the draft's probabilities, which simulated "
                             "acceptance does not follow; set it to 0 with "
                             "--simulate-acceptance")

    @property
    def simulated(self) -> bool:
        return self.simulate_acceptance is not None

    def acceptance_rates(self) -> tuple[float, ...] | None:
        """Per-position conditional acceptance rates for simulation (length num_steps)."""
        sim = self.simulate_acceptance
        if sim is None:
            return None
        k = self.num_steps
        if isinstance(sim, tuple):
            return tuple(sim[i] if i < len(sim) else sim[-1] for i in range(k))
        # A constant rate r with E[accepted] = sum_{i=1..k} r^i = tau - 1, by bisection.
        lo, hi = 0.0, 1.0
        for _ in range(60):
            r = (lo + hi) / 2
            if sum(r ** i for i in range(1, k + 1)) < sim - 1:
                lo = r
            else:
                hi = r
        return tuple([(lo + hi) / 2] * k)


def chain_confidence_stop(topk: int, stop: float | None) -> float | None:
    """A configuration derived from another's confidence stop (a policy entry, a profiled
    or tuned shape): the same for a chain, off for a tree (which has none)."""
    return stop if topk == 1 or stop is None else 0.0


# vLLM's speculative_config keys specscope reads; the rest of vLLM's are refused by name.
VLLM_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")


def spec_fields_from_vllm(cfg: dict, draft: str | None = None) -> dict[str, Any]:
    """SpecConfig fields from vLLM's speculative_config (`--speculative-config` JSON,
    `LLM(speculative_config=...)`): method eagle3, model (the draft; `draft` is one given
    otherwise, which must agree), num_speculative_tokens (a chain that long),
    draft_tensor_parallel_size (1: the draft replicated on every rank; the target's size:
    sharded like it)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"speculative_config must be a JSON object / dict, got {cfg!r}")
    unknown = sorted(set(cfg) - set(VLLM_SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {unknown}; specscope "
                         f"reads {list(VLLM_SPEC_KEYS)}")
    method = str(cfg.get("method", "eagle3")).lower()
    if method != "eagle3":
        raise ValueError(f"speculative_config method {cfg['method']!r}: specscope runs "
                         f"EAGLE-3 drafts only (\"method\": \"eagle3\")")
    out: dict[str, Any] = {}
    if "draft_tensor_parallel_size" in cfg:
        tp = cfg["draft_tensor_parallel_size"]
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be a "
                             f"positive integer (1, or the target's tensor-parallel size), "
                             f"got {tp!r}")
        out["draft_tensor_parallel_size"] = tp
    if "model" in cfg:
        if draft not in (None, cfg["model"]):
            raise ValueError(f"two drafts given: {draft} and speculative_config model "
                             f"{cfg['model']}; give one")
        out["draft"] = str(cfg["model"])
    elif draft is None:
        raise ValueError("speculative_config needs \"model\": the draft checkpoint")
    if "num_speculative_tokens" in cfg:
        k = cfg["num_speculative_tokens"]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_STEPS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer "
                             f"in 1..{MAX_NUM_STEPS}, got {k!r}")
        out.update(num_steps=k, topk=1, num_draft_tokens=None)
    return out


@dataclass(frozen=True)
class SpecPolicy:
    """Speculation by batch size: for each batch-size bucket (the largest batch it covers),
    a speculative configuration or None (plain decoding there), in increasing bucket order;
    a batch past the last bucket takes the last entry (vLLM's
    num_speculative_tokens_per_batch_size, SGLang's adaptive speculation). Every entry uses
    the same draft."""

    entries: tuple[tuple[int, SpecConfig | None], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a speculation policy needs at least one batch-size bucket")
        buckets = [b for b, _ in self.entries]
        if any(not isinstance(b, int) or b < 1 for b in buckets) or buckets != sorted(set(
                buckets)):
            raise ValueError(f"policy buckets must be increasing positive integers, got "
                             f"{buckets}")
        drafts = {(c.draft, c.draft_layer_ids) for _, c in self.entries if c is not None}
        if len(drafts) > 1:
            raise ValueError("every entry of a speculation policy must use the same draft")

    def for_batch(self, n: int) -> SpecConfig | None:
        """The configuration a step of n sequences runs."""
        return next((c for b, c in self.entries if n <= b), self.entries[-1][1])

    @property
    def configs(self) -> list[SpecConfig]:
        return [c for _, c in self.entries if c is not None]

    def flag(self) -> str:
        """The --spec-policy text that gives this policy back."""
        return ";".join(f"{b}:" + ("off" if c is None else
                                   f"{c.num_steps},{c.topk},{c.num_draft_tokens}")
                        for b, c in self.entries)

    def describe(self) -> str:
        return "; ".join(f"<= {b}: " + ("off" if c is None else
                                        f"({c.num_steps}, {c.topk}, {c.num_draft_tokens})")
                         for b, c in self.entries)

    @classmethod
    def parse(cls, text: str, base: SpecConfig) -> SpecPolicy:
        """'1:5,1,6;4:3,1,4;16:off' -> a policy on base's draft and simulation settings:
        bucket:num_steps,topk,num_draft_tokens (or off), entries separated by ';'."""
        entries = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            bucket, sep, cfg = part.partition(":")
            if not sep:
                raise ValueError(f"policy entry {part!r}: write bucket:steps,topk,tokens or "
                                 f"bucket:off")
            try:
                b = int(bucket)
                if cfg.strip() == "off":
                    entries.append((b, None))
                    continue
                steps, topk, ndt = (int(x) for x in cfg.split(","))
            except ValueError:
                raise ValueError(f"policy entry {part!r}: write bucket:steps,topk,tokens or "
                                 f"bucket:off (integers)") from None
            entries.append((b, dataclasses.replace(
                base, num_steps=steps, topk=topk, num_draft_tokens=ndt,
                confidence_stop=chain_confidence_stop(topk, base.confidence_stop))))
        return cls(tuple(entries))


# Tool-call formats the server parses (server/tools.py): Hermes / Qwen
# `<tool_call>{...}</tool_call>`, and Llama 3.1's JSON `{"name": ..., "parameters": ...}`.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ServerConfig:
    """What `specscope serve` allows: access rules and per-request limits (the CLI's defaults).

    api_keys: with any, every route but /health needs `Authorization: Bearer KEY`.
    enable_admin: serve /admin/* (off by default; needs an API key). allowed_hosts: the Host
    header must name one of these (empty: any host). max_request_bytes: larger bodies get 413.
    max_prompt_tokens: None means the model's context length minus one. request_read_timeout:
    seconds a client has to send its whole body (408 after). max_stop_strings, max_stop_chars:
    how many stop strings a request may give and how long each may be. max_n: the largest
    `n`. shutdown_timeout: seconds running requests get after SIGTERM. log_stats_interval:
    seconds between the throughput log's lines (0: none; vLLM's --disable-log-stats).
    enable_auto_tool_choice, tool_call_parser: vLLM's flags of the same names: with both,
    tool_choice "auto" parses tool calls out of the answer in the parser's format
    (TOOL_CALL_PARSERS); without, "auto" is refused (tool_choice "required" or a named
    function needs neither: its output is constrained by a grammar).
    """

    # One name or several (vLLM's --served-model-name A B): requests may name any of them
    # (or the model path); responses carry the first.
    served_model_name: str | tuple[str, ...] | None = None
    max_queue: int = 64
    api_keys: tuple[str, ...] = ()
    enable_admin: bool = False
    enable_docs: bool = False
    allowed_hosts: tuple[str, ...] = ()
    max_request_bytes: int = 4 * 2**20
    max_prompt_tokens: int | None = None
    request_read_timeout: float = 30.0
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_n: int = 16
    shutdown_timeout: float = 5.0
    log_stats_interval: float = 10.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def model_names(self, default: str) -> tuple[str, ...]:
        """The names this server answers to, the first the one responses carry."""
        n = self.served_model_name
        return (n,) if isinstance(n, str) else n if n else (default,)

    def __post_init__(self) -> None:
        _check_int("max_queue", self.max_queue, 0)
        _check_int("max_request_bytes", self.max_request_bytes, 1024)
        if self.max_prompt_tokens is not None:
            _check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
        _check_int("max_stop_strings", self.max_stop_strings, 0)
        _check_int("max_stop_chars", self.max_stop_chars, 1)
        _check_int("max_n", self.max_n, 1)
        for name in ("request_read_timeout", "shutdown_timeout", "log_stats_interval"):
            v = getattr(self, name)
            lo_ok = v > 0 if name == "request_read_timeout" else v >= 0
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and lo_ok):
                raise ValueError(f"{name} must be a finite number "
                                 f"{'> 0' if name == 'request_read_timeout' else '>= 0'}, "
                                 f"got {v!r}")
        names = self.served_model_name
        if isinstance(names, (tuple, list)):
            if not names or any(not isinstance(n, str) or not n.strip() for n in names):
                raise ValueError(f"served model names must be non-empty strings, got {names!r}")
            object.__setattr__(self, "served_model_name",
                               names[0] if len(names) == 1 else tuple(names))
        if self.tool_call_parser is not None and \
                self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser "
                             f"({' or '.join(TOOL_CALL_PARSERS)}): --tool-call-parser NAME")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("an API key must be a non-empty string")
        if self.enable_admin and not self.api_keys:
            raise ValueError("enable_admin needs an API key (--api-key): admin routes change "
                             "the engine's configuration")
