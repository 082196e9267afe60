"""Convert an EAGLE-3 draft between the SGLang/SpecForge, official EAGLE and vLLM speculators
formats, losslessly: tensors keep their dtype and bits, layer ids are rewritten in the target
format's own convention, and a provenance block records the conversion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specscope.config import ModelConfig
from specscope.draft.formats import FORMATS, detect_format, parse_config, save_draft
from specscope.draft.loader import _resolve_dir, load_draft

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _target_stub(fields: dict[str, Any], num_layers: int) -> ModelConfig:
    """The facts about the target that a conversion needs: vocab, hidden width, layers."""
    return ModelConfig(
        architecture="LlamaForCausalLM", family="llama", vocab_size=fields["vocab_size"],
        hidden_size=fields["target_hidden_size"], intermediate_size=1,
        num_layers=num_layers, num_heads=1, num_kv_heads=1,
        head_dim=fields["target_hidden_size"], rms_norm_eps=fields["rms_norm_eps"],
        rope_theta=fields["rope_theta"],
        max_position_embeddings=fields["max_position_embeddings"],
        tie_word_embeddings=False, name="conversion target")


def convert_draft(src: str | Path, out: str | Path, to: str, *,
                  target_config: ModelConfig | None = None,
                  num_target_layers: int | None = None, target_name: str | None = None
                  ) -> Path:
    """Write the draft at `src` to `out` in format `to`; returns `out`. target_name: the
    target's name or path (speculators' verifier), default the draft's provenance.

    The target's layer count fixes the meaning of the ids (the official EAGLE format has none;
    speculators' are input-to-layer). It comes from `target_config`, `num_target_layers`,
    or the draft's own specscope provenance block; otherwise this raises asking for it.
    """
    if to not in FORMATS:
        raise ValueError(f"unknown draft format {to!r}; choose one of {', '.join(FORMATS)}")
    d = _resolve_dir(src)
    raw = json.loads((d / "config.json").read_text())
    fmt = detect_format(raw, str(d / "config.json"))
    parsed = parse_config(raw, fmt, str(d / "config.json"))
    prov = dict(raw.get("specscope_provenance") or {})
    if target_config is not None:
        L = target_config.num_layers
    elif num_target_layers is not None:
        L = int(num_target_layers)
    elif "target_num_layers" in prov:
        L = int(prov["target_num_layers"])
    else:
        raise ValueError(f"{d}: the target's layer count is needed to convert layer ids "
                         f"between conventions; pass --target MODEL or --target-layers N")
    tc = target_config or _target_stub(parsed.fields, L)
    dtype_name = raw.get("torch_dtype") or (raw.get("transformer_layer_config") or {}).get(
        "torch_dtype") or "float32"
    dtype = _DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32)
    loaded = load_draft(d, tc, dtype=dtype)
    prov.setdefault("target_num_layers", L)
    prov["converted_from"] = {"format": fmt, "path": str(d)}
    prov["aux_layer_ids"] = list(loaded.config.aux_layer_ids)
    prov["aux_layer_ids_convention"] = "output-of-layer"
    if target_name is not None:
        prov["target"] = target_name
    if target_config is not None:
        prov["target_architecture"] = target_config.architecture
    return save_draft(loaded.model, loaded.config, out, to, provenance=prov)
