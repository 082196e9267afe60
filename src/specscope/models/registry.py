"""The target model registry: which HF architectures load, and the protocol they implement.

Every target family lives in its own file under models/ (the dense Llama-family members share
models/llama.py) and registers a `Family`: the HF `architectures` / `model_type` names it
answers to, how it reads a HF config.json into a ModelConfig, and how it builds its module.
Loading, the engine, the draft, the trainer and the doctor use only `TargetModel`, never a
concrete class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from specscope.config import ModelConfig, text_config
from specscope.kvcache.budget import KVLayout
from specscope.kvcache.paged import BatchMeta, PagedKV

# HF tensor name -> (our parameter name, where it lands, expected HF shape). Where it lands:
# an int is the first row in the parameter (fused q/k/v, gate/up); a tuple is leading
# indices then the first row (stacked experts: (expert, row)).
Placement = tuple[str, int | tuple[int, ...], tuple[int, ...]]
CheckpointLayout = dict[str, Placement]


@runtime_checkable
class TargetModel(Protocol):
    """What every target model offers the rest of specscope.

    forward -> (hidden after the final norm, taps); compute_logits; its KV-cache layout; its
    checkpoint name map (`checkpoint_layout_for`: the map for a checkpoint holding the given
    names, where a family reads more than one form); its taps (output-of-layer ids, -1 =
    the embedding). Under tensor parallelism `tp` is the rank's parallel.TPGroup (None:
    unsharded), `local_heads` the (query, KV) heads this rank attends with, and
    compute_logits returns the whole vocabulary's logits on every rank.
    """

    config: ModelConfig
    tap_layer_ids: tuple[int, ...]
    lm_head: nn.Linear
    tp: Any
    local_heads: tuple[int, int]

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def final_norm(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def set_taps(self, layer_ids: tuple[int, ...] | list[int]) -> None: ...

    def ensure_rope(self, length: int) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: Any = None, *, kv_len: int | None = None,
                slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                return_taps: bool = False, batch: BatchMeta | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_layout(self) -> CheckpointLayout: ...

    def checkpoint_layout_for(self, names: set[str]) -> CheckpointLayout: ...

    def kv_layout(self, dtype: torch.dtype) -> KVLayout: ...

    def paged_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> PagedKV: ...


@dataclass(frozen=True)
class Family:
    """One target family: the HF names it answers to, its config parser, its module."""

    name: str
    architectures: tuple[str, ...]
    model_types: dict[str, str]  # HF model_type -> the architecture it means
    parse: Callable[[dict[str, Any], str], ModelConfig]  # (HF config dict, name) -> config
    build: Callable[..., TargetModel]  # (config) -> module; (config, tp=TPGroup) if sharded
    # Whether build takes tp= (parallel/): a sharded module per tensor-parallel rank.
    tensor_parallel: bool = False


# Modules that define families, each with a FAMILIES tuple; imported on first use.
_FAMILY_MODULES = ("specscope.models.llama", "specscope.models.mixtral",
                  "specscope.models.qwen_moe", "specscope.models.deepseek")
_families: list[Family] | None = None


def families() -> list[Family]:
    """Every registered family, in registration order."""
    global _families
    if _families is None:
        _families = [f for m in _FAMILY_MODULES
                     for f in importlib.import_module(m).FAMILIES]
    return _families


def supported_architectures() -> list[str]:
    return [a for f in families() for a in f.architectures]


def _model_type(cfg: dict[str, Any]) -> str | None:
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return inner.get("model_type") or cfg.get("model_type")


def family_for(cfg: dict[str, Any], name: str = "") -> Family:
    """The family a HF config belongs to, by `architectures` (then `model_type`), or an
    error listing what is supported."""
    archs = cfg.get("architectures") or []
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    inner_archs = inner.get("architectures") or []
    for arch in [*archs, *inner_archs]:
        for f in families():
            if arch in f.architectures:
                return f
    for mt in (cfg.get("model_type"), inner.get("model_type")):
        for f in families():
            if mt and mt in f.model_types:
                return f
    found = archs or [cfg.get("model_type", "<none>")]
    raise ValueError(f"unsupported architecture {found} in {name or 'config.json'}; "
                     f"specscope supports: {', '.join(supported_architectures())}")


def config_from_hf(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """A target's ModelConfig from its HF config dict (a multimodal wrapper's language model
    through `text_config`)."""
    family = family_for(cfg, name)
    inner = text_config(cfg)
    archs = [a for a in inner.get("architectures") or [] if a in family.architectures]
    if not archs:  # matched by model_type (a wrapper names its own class)
        mt = _model_type(cfg)
        archs = [family.model_types.get(mt, family.architectures[0])]
    inner = {**inner, "architectures": archs}
    return family.parse(inner, name)


def build_model(cfg: ModelConfig, tp: Any = None) -> TargetModel:
    """An (uninitialised) module of cfg's family; build it under torch.device("meta") to
    allocate nothing. tp: a parallel.TPGroup of more than one rank: this rank's shard."""
    for f in families():
        if cfg.architecture not in f.architectures:
            continue
        if tp is None:
            return f.build(cfg)
        if not f.tensor_parallel:
            raise ValueError(f"the {f.name} family ({cfg.architecture}) has no "
                             f"tensor-parallel sharding yet; run it with "
                             f"--tensor-parallel-size 1")
        return f.build(cfg, tp=tp)
    raise ValueError(f"no registered family builds architecture {cfg.architecture!r}")
