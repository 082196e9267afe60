"""The three EAGLE-3 draft checkpoint formats: how each spells its config, tensors and taps.

sglang (SpecForge, SGLang): flat Llama config with `architectures: [LlamaForCausalLMEagle3]`;
    `midlayer.*` safetensors; ids in `eagle_config.eagle_aux_hidden_state_layer_ids`,
    output-of-layer (SGLang captures the input of layer id + 1).
eagle (SafeAILab/EAGLE): flat Llama config with `architectures: [LlamaForCausalLM]`;
    `midlayer.*` in pytorch_model.bin (or safetensors); no ids: the taps are hard-wired to
    the input of layers [2, L//2, L-3].
speculators (vLLM): `speculators_model_type: eagle3`, the layer config nested in
    `transformer_layer_config`; `layers.{i}.*` safetensors, `d2t` (vLLM renames it
    `draft_id_to_target_id`); ids in top-level `eagle_aux_hidden_state_layer_ids`,
    input-to-layer (vLLM captures the residual stream entering layer id).

All three share the other names: `fc`, `norm`, `lm_head`, `d2t`/`t2d`, optional
`embed_tokens`, EAGLE-3.1 `fc_norm.{i}` / `input_norm` (norm_before_fc). Internally every name
is canonicalised to the speculators spelling (`layers.{i}.*`), which is what
Eagle3Draft.checkpoint_layout lists.

Flag defaults follow the engine that consumes each format: `norm_before_residual` is False
unless set for sglang/eagle (SGLang, SpecForge), True unless set for speculators (vLLM's
speculators config reader). `norm_output` means different things: in a speculators config
it is EAGLE-3.1's "feed the normed output to the next step" (DraftConfig.norm_output); in a
SpecForge config it means "apply the final norm before lm_head", true by default, which is
the only behaviour SGLang implements.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specscope.config import ModelConfig
from specscope.draft.eagle3 import (
    INPUT_TO_LAYER,
    OUTPUT_OF_LAYER,
    DraftConfig,
    Eagle3Draft,
    default_layer_ids,
)
from specscope.models.loader import weight_files

FORMATS = ("sglang", "eagle", "speculators")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLM"
SPECULATORS_ARCH = "Eagle3Speculator"
# transformer_layer_config.model_type -> the target-family architecture that parses it
_SPECULATORS_LAYER_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
D2T_NAMES = ("d2t", "draft_id_to_target_id")  # the latter: vLLM's in-memory name
# Tensors that hold no draft state: speculators' training-only verifier copies, rope caches.
_IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class ParsedConfig:
    """A draft config.json read in its format: DraftConfig fields, plus the raw layer ids."""

    fmt: str
    fields: dict[str, Any]  # DraftConfig fields (draft_vocab_size may be None: borrow head)
    layer_ids: list[int] | None  # as written, in `ids_convention`; None: not given
    ids_field: str  # where they were (or would be) written
    ids_convention: str


def detect_format(raw: dict[str, Any], name: str = "config.json") -> str:
    """sglang | eagle | speculators, from a draft's config.json; anything else is an error."""
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != "eagle3":
            raise ValueError(f"{name}: speculators_model_type {kind!r} is not an EAGLE-3 draft "
                             f"(only 'eagle3' is supported)")
        return "speculators"
    archs = raw.get("architectures") or []
    if SGLANG_ARCH in archs:
        return "sglang"
    if EAGLE_ARCH in archs:
        return "eagle"
    raise ValueError(f"{name}: not an EAGLE-3 draft config (architectures {archs}); expected "
                     f"{SGLANG_ARCH} (SGLang/SpecForge), {EAGLE_ARCH} with midlayer.* weights "
                     f"(official EAGLE), or speculators_model_type 'eagle3' (vLLM speculators)")


def _layer_fields(lcfg: ModelConfig) -> dict[str, Any]:
    """DraftConfig fields of the decoder layers, from their target-style ModelConfig."""
    if lcfg.qkv_bias != lcfg.o_bias:
        raise ValueError("draft layers with q/k/v bias but no o_proj bias are not supported")
    if lcfg.sliding_window is not None:
        raise ValueError("draft layers with sliding-window attention are not supported")
    return dict(hidden_size=lcfg.hidden_size, intermediate_size=lcfg.intermediate_size,
                num_heads=lcfg.num_heads, num_kv_heads=lcfg.num_kv_heads,
                head_dim=lcfg.head_dim, num_layers=lcfg.num_layers,
                rms_norm_eps=lcfg.rms_norm_eps, rope_theta=lcfg.rope_theta,
                rope_scaling=lcfg.rope_scaling,
                max_position_embeddings=lcfg.max_position_embeddings,
                vocab_size=lcfg.vocab_size, attention_bias=lcfg.qkv_bias,
                mlp_bias=lcfg.mlp_bias, qk_norm=lcfg.qk_norm)


def _check_act(cfg: dict[str, Any], where: str) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (EAGLE-3 drafts use silu)")


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    """A flag at the top level or (NVIDIA's SGLang-style checkpoints) inside eagle_config."""
    if raw.get(key) is not None:
        return bool(raw[key])
    nested = raw.get("eagle_config") or {}
    return bool(nested[key]) if nested.get(key) is not None else default


def parse_config(raw: dict[str, Any], fmt: str, name: str = "config.json") -> ParsedConfig:
    """Read a draft config of format `fmt` (see detect_format) into DraftConfig fields."""
    if fmt == "speculators":
        return _parse_speculators(raw, name)
    if fmt not in ("sglang", "eagle"):
        raise ValueError(f"unknown draft format {fmt!r}; choose one of {', '.join(FORMATS)}")
    _check_act(raw, name)
    if raw.get("tie_word_embeddings"):
        raise ValueError(f"{name}: tie_word_embeddings true is not supported for a draft "
                         f"(its lm_head is over the draft vocabulary)")
    lcfg = ModelConfig.from_hf({**raw, "architectures": [EAGLE_ARCH],
                                "num_hidden_layers": raw.get("num_hidden_layers", 1)}, name)
    if lcfg.num_layers != 1:
        raise ValueError(f"{name}: num_hidden_layers {lcfg.num_layers}: {fmt} drafts have one "
                         f"decoder layer (midlayer); multi-layer drafts need the speculators "
                         f"format")
    if raw.get("norm_output") is False:
        raise ValueError(f"{name}: norm_output false (SpecForge: lm_head over the un-normed "
                         f"output) is not supported; SGLang always applies the final norm")
    fields = _layer_fields(lcfg)
    fields.update(
        draft_vocab_size=raw.get("draft_vocab_size"),
        target_hidden_size=raw.get("target_hidden_size") or lcfg.hidden_size,
        fc_norm=_flag(raw, "fc_norm", False),
        norm_before_fc=_flag(raw, "norm_before_fc", False),
        norm_before_residual=_flag(raw, "norm_before_residual", False),
        norm_output=False)
    if fmt == "eagle":
        return ParsedConfig(fmt, fields, None, "EAGLE's hard-wired taps", INPUT_TO_LAYER)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return ParsedConfig(fmt, fields, list(ids) if ids else None,
                        "eagle_config.eagle_aux_hidden_state_layer_ids", OUTPUT_OF_LAYER)


def _parse_speculators(raw: dict[str, Any], name: str) -> ParsedConfig:
    tlc = raw.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise ValueError(f"{name}: speculators config lacks transformer_layer_config")
    kind = tlc.get("model_type", "llama")
    if kind not in _SPECULATORS_LAYER_TYPES:
        raise ValueError(f"{name}: transformer_layer_config.model_type {kind!r} is not "
                         f"supported; supported: {', '.join(_SPECULATORS_LAYER_TYPES)}")
    _check_act(tlc, name)
    lcfg = ModelConfig.from_hf({**tlc, "architectures": [_SPECULATORS_LAYER_TYPES[kind]],
                                "num_hidden_layers": tlc.get("num_hidden_layers", 1)}, name)
    fields = _layer_fields(lcfg)
    fields.update(
        draft_vocab_size=raw.get("draft_vocab_size"),
        target_hidden_size=raw.get("target_hidden_size") or lcfg.hidden_size,
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        # vLLM reads a missing norm_before_residual as True (speculators always writes it).
        norm_before_residual=bool(raw.get("norm_before_residual", True)),
        norm_output=bool(raw.get("norm_output", False)))
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return ParsedConfig("speculators", fields, list(ids) if ids else None,
                        "eagle_aux_hidden_state_layer_ids", INPUT_TO_LAYER)


# -- tensor names -------------------------------------------------------------------------

def canonical_name(name: str) -> str:
    """A checkpoint tensor name -> the canonical (speculators) spelling.

    Every format accepts both `midlayer.` and `layers.0.` for the first layer (vLLM renames
    the former; SpecForge and SGLang write it), and `draft_id_to_target_id` for d2t.
    """
    if name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    if name in D2T_NAMES:
        return "d2t"
    return name


def format_name(canonical: str, fmt: str) -> str:
    """A canonical tensor name -> how format `fmt` writes it."""
    if fmt in ("sglang", "eagle") and canonical.startswith("layers.0."):
        return "midlayer." + canonical[len("layers.0."):]
    return canonical


def is_ignored(name: str) -> bool:
    return name in _IGNORED or name.endswith(_IGNORED_SUFFIXES)


# -- weight files -------------------------------------------------------------------------

class TensorSource:
    """The tensors of a draft directory (safetensors, sharded or not, or pytorch_model.bin),
    read lazily by name."""

    def __init__(self, model_dir: Path) -> None:
        self.files: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        if any(model_dir.glob("*.safetensors")):
            self.files = weight_files(model_dir, "draft checkpoint")
            self.kind = "safetensors"
        elif (model_dir / "pytorch_model.bin").exists():
            # weights_only: a checkpoint is data, never code to unpickle and run.
            path = model_dir / "pytorch_model.bin"
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # mmap needs the zip format; legacy pickles load whole
                state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise ValueError(f"{path} is not a state dict")
            self._bin = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            self.kind = "pytorch_model.bin"
        else:
            raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {model_dir}")

    @property
    def names(self) -> list[str]:
        return list(self._bin) if self._bin is not None else list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._bin is not None:
            return tuple(self._bin[name].shape)
        with safe_open(str(self.files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if self._bin is not None:
            return self._bin[name]
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """tensor[index] (slices), reading only that part of a safetensors file (a
        pytorch_model.bin is memory-mapped where its format allows)."""
        if self._bin is not None:
            return self._bin[name][index]
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_slice(name)[index]


# -- writers ------------------------------------------------------------------------------

def _dtype_name(model: Eagle3Draft) -> str:
    return str(model.fc.weight.dtype).removeprefix("torch.")


def _layer_dict(cfg: DraftConfig) -> dict[str, Any]:
    """The Llama-style fields shared by every format's config."""
    return {
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
    }


def config_dict(cfg: DraftConfig, fmt: str, dtype: str = "float32",
                verifier: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """The config.json format `fmt` writes for `cfg`, its layer ids in that format's
    convention. verifier: the target's (name or path, architecture), which speculators
    records so vLLM can find the target a draft belongs to. Raises for what the format
    cannot express."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown draft format {fmt!r}; choose one of {', '.join(FORMATS)}")
    L = cfg.target_num_layers
    if fmt == "speculators":
        if not cfg.has_lm_head:
            raise ValueError("the speculators format needs the draft's own lm_head "
                             "(draft_vocab_size is required there)")
        return {
            "architectures": [SPECULATORS_ARCH],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": verifier[0],
                             "architectures": [verifier[1]] if verifier[1] else []},
            },
            "transformer_layer_config": {**_layer_dict(cfg), "torch_dtype": dtype},
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
            "torch_dtype": dtype,
        }
    problems = []
    if cfg.num_layers != 1:
        problems.append(f"{cfg.num_layers} decoder layers (it has one midlayer)")
    if cfg.qk_norm:
        problems.append("q/k norms (its layer is Llama's)")
    if cfg.norm_output:
        problems.append("norm_output (EAGLE-3.1 normed feedback)")
    if fmt == "eagle" and cfg.aux_layer_ids != default_layer_ids(L):
        problems.append(f"layer ids {list(cfg.aux_layer_ids)} (its taps are hard-wired to "
                        f"{list(default_layer_ids(L))} output-of-layer for {L} layers)")
    if problems:
        raise ValueError(f"the {fmt} format cannot express " + "; ".join(problems))
    out = {
        "architectures": [SGLANG_ARCH if fmt == "sglang" else EAGLE_ARCH],
        **_layer_dict(cfg),
        "draft_vocab_size": cfg.draft_vocab_size if cfg.has_lm_head else None,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype,
    }
    for flag in ("fc_norm", "norm_before_fc", "norm_before_residual"):
        if getattr(cfg, flag):
            out[flag] = True
    if fmt == "sglang":
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                               "use_aux_hidden_state": True}
    return out


def save_draft(model: Eagle3Draft, config: DraftConfig, out_dir: str | Path, fmt: str,
               provenance: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
               verifier: tuple[str | None, str | None] | None = None) -> Path:
    """Write `model` as a draft checkpoint of format `fmt` (config.json + weights) to out_dir.

    Weights: model.safetensors in every format (the official EAGLE drafts' pytorch_model.bin is
    read too, but a pickle is not written), in `dtype` (default: the model's). verifier: the
    target's (name or path, architecture), default from the provenance block. d2t/t2d are always
    written except by speculators when the draft vocabulary is the whole target vocabulary
    (speculators then has no maps). Borrowed target weights are not written. `provenance` goes
    into config.json as `specscope_provenance`. The directory is written under a temporary name
    and renamed into place, so out_dir is either the previous checkpoint or the whole new one,
    never a mix.
    """
    if config != model.config:
        raise ValueError("save_draft: config differs from model.config")
    state = model.canonical_state()
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.") if state \
        else _dtype_name(model)
    if verifier is None:
        prov = provenance or {}
        verifier = (prov.get("target"), prov.get("target_architecture"))
    cfg_json = config_dict(config, fmt, dtype_name, verifier)
    if provenance:
        cfg_json["specscope_provenance"] = provenance
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {format_name(k, fmt): v.contiguous().cpu() for k, v in state.items()}
    if not (fmt == "speculators" and config.draft_vocab_size == config.vocab_size):
        tensors["d2t"] = model.d2t.detach().cpu().clone()
        tensors["t2d"] = model.t2d.detach().cpu().clone()
    (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    # safetensors refuses tensors that share storage (fused rows are views): copy them.
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    old = out.parent / f".old-{out.name}-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out
