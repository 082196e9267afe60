"""Static checks of an EAGLE-3 draft against its target: config and tensor shapes only.

Each problem is a named Finding with the fix, never an exception: a user gets every problem of
a broken checkpoint at once, where the strict loader would stop at the first.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specscope.config import ModelConfig
from specscope.draft.eagle3 import INPUT_TO_LAYER, OUTPUT_OF_LAYER
from specscope.draft.formats import (
    ParsedConfig,
    TensorSource,
    canonical_name,
    detect_format,
    is_ignored,
    parse_config,
)
from specscope.draft.loader import resolve_layer_ids
from specscope.draft.vocab import check_vocab_maps

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass
class Finding:
    code: str  # stable name, e.g. "static.fc_width", "wiring.shifted_plus1"
    severity: str  # error | warning | info
    message: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _provenance_ids(raw: dict[str, Any], ids: tuple[int, ...], overridden: bool
                    ) -> list[Finding]:
    """A draft that records the taps it was trained on (specscope's provenance block, which
    the converters carry along) must run on exactly those: anything else is a wiring fault,
    known for certain without a probe. (An adjacent layer can be almost as good for a
    well-trained draft, so the probe alone may call an off-by-one within noise.)"""
    prov = raw.get("specscope_provenance") or {}
    trained = prov.get("aux_layer_ids")
    if not isinstance(trained, list) or \
            prov.get("aux_layer_ids_convention", OUTPUT_OF_LAYER) != OUTPUT_OF_LAYER:
        return []
    trained_ids = tuple(int(i) for i in trained)
    if trained_ids == tuple(ids):
        return []
    where = "--draft-layer-ids" if overridden else "the config's tap ids"
    return [Finding("static.provenance_ids", ERROR,
                    f"the draft was trained on taps {list(trained_ids)} (output-of-layer, per "
                    f"its specscope_provenance block) but {where} make it run on {list(ids)}",
                    f"serve with --draft-layer-ids {','.join(map(str, trained_ids))} (or drop "
                    f"the override), or write those ids into the config "
                    f"(specscope convert-draft writes them in each format's convention)")]


def static_checks(draft_dir: Path, target: ModelConfig, target_dir: Path | None = None,
                  layer_ids: tuple[int, ...] | None = None) -> list[Finding]:
    """Every static finding for the draft at `draft_dir` and a target of config `target`."""
    out: list[Finding] = []
    cfg_path = draft_dir / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
        fmt = detect_format(raw, str(cfg_path))
        parsed = parse_config(raw, fmt, str(cfg_path))
    except (OSError, ValueError) as e:
        return [Finding("static.config", ERROR, f"cannot read the draft config: {e}",
                        "point --draft at an EAGLE-3 checkpoint (SGLang/SpecForge, EAGLE or "
                        "vLLM speculators format)")]
    f = parsed.fields
    out.append(Finding("static.format", INFO, f"{fmt} format ({cfg_path})"))
    out += _architecture(raw, fmt)
    out += _widths(f, target)
    ids, found = _layer_id_checks(raw, parsed, target, layer_ids)
    out += found
    try:
        src = TensorSource(draft_dir)
    except (OSError, ValueError) as e:
        out.append(Finding("static.weights", ERROR, f"cannot read the draft weights: {e}",
                           "the checkpoint directory needs model.safetensors (or "
                           "pytorch_model.bin)"))
        return out
    names = {canonical_name(n): n for n in src.names if not is_ignored(n)}
    out += _fc_width(src, names, target, ids)
    out += _head_and_embedding(src, names, f)
    out += _vocab_maps(src, names, f)
    out += _numerics(raw, f, target)
    out += _special_tokens(raw, target_dir)
    return out


def _architecture(raw: dict[str, Any], fmt: str) -> list[Finding]:
    """The draft's decoder layer must be a Llama-style EAGLE-3 layer (llama or qwen3)."""
    archs = raw.get("architectures") or []
    # An sglang/eagle draft's layer is Llama's by its architecture, whatever model_type says
    # (SpecForge copies the target's there, e.g. kimi_k2); speculators names the layer's own.
    layer_type = (raw["transformer_layer_config"].get("model_type", "llama")
                  if fmt == "speculators" else "llama")
    if layer_type not in ("llama", "qwen3"):
        return [Finding("static.architecture", ERROR,
                        f"draft layer model_type {layer_type!r} (architectures {archs}) is "
                        f"not a Llama-style EAGLE-3 layer",
                        "use a LlamaForCausalLMEagle3 / Eagle3Speculator draft")]
    return []


def _widths(f: dict[str, Any], target: ModelConfig) -> list[Finding]:
    """The vocabulary and the tap width must be the target's: otherwise the draft was made
    for another model (or tokenizer)."""
    out: list[Finding] = []
    if f["vocab_size"] != target.vocab_size:
        out.append(Finding("static.vocab_size", ERROR,
                           f"draft vocab_size {f['vocab_size']} != the target's "
                           f"{target.vocab_size}: this draft was made for another tokenizer",
                           "use a draft trained for this target (specscope train-draft)"))
    if f["target_hidden_size"] != target.hidden_size:
        out.append(Finding("static.target_hidden_size", ERROR,
                           f"draft target_hidden_size {f['target_hidden_size']} != the "
                           f"target's hidden_size {target.hidden_size}",
                           "use a draft trained for this target"))
    return out


def _layer_id_checks(raw: dict[str, Any], parsed: ParsedConfig, target: ModelConfig,
                     layer_ids: tuple[int, ...] | None
                     ) -> tuple[tuple[int, ...] | None, list[Finding]]:
    """(the tap ids the loader would use, or None when they are out of range; the findings
    on them): how they were resolved, a default or an embedding tap (both suspicious), and
    a mismatch with the ids the draft's provenance says it was trained on."""
    out: list[Finding] = []
    ids: tuple[int, ...] | None = None
    try:
        ids, source, conv, message = resolve_layer_ids(parsed, target.num_layers, layer_ids)
        out.append(Finding("static.layer_ids", INFO, message))
        if source == "default":
            out.append(Finding("static.layer_ids_default", WARNING,
                               f"the config names no tap layers; EAGLE-3's defaults "
                               f"{list(ids)} are assumed",
                               "write the ids the draft was trained with into the config "
                               "(specscope convert-draft writes them explicitly)"))
        if -1 in ids:
            out.append(Finding("static.embedding_tap", WARNING,
                               "a tap is the embedding output (output-of-layer -1 = "
                               f"input-to-layer 0{' as written' if conv == INPUT_TO_LAYER else ''}"
                               "); EAGLE-3 drafts tap decoder layers",
                               "check the probe table below; the ids may be off by one"))
        out += _provenance_ids(raw, ids, layer_ids is not None)
    except ValueError as e:
        out.append(Finding("static.layer_ids_range", ERROR, str(e),
                           f"tap ids must be output-of-layer 0..{target.num_layers - 1} "
                           f"(SGLang) or input-to-layer 1..{target.num_layers} (vLLM); "
                           f"override with --draft-layer-ids"))
    return ids, out


def _fc_width(src: TensorSource, names: dict[str, str], target: ModelConfig,
              ids: tuple[int, ...] | None) -> list[Finding]:
    """fc.weight must be there and take num_taps x target hidden inputs (3 taps assumed
    when the ids are unknown); a wrong width says how many taps it was built for."""
    n_taps = len(ids) if ids else 3
    fc = names.get("fc.weight")
    if fc is None:
        return [Finding("static.fc_missing", ERROR, "fc.weight is missing",
                        "the draft checkpoint is incomplete")]
    shape = src.shape(fc)
    want = n_taps * target.hidden_size
    if len(shape) != 2 or shape[1] != want:
        return [Finding("static.fc_width", ERROR,
                        f"fc.weight has input width {shape[-1]}, but {n_taps} taps x "
                        f"target hidden {target.hidden_size} = {want}",
                        f"the draft was built for {shape[-1] / target.hidden_size:g} "
                        f"taps or another hidden size: use a draft for this target, "
                        f"or give it exactly {shape[-1] // max(1, target.hidden_size)} "
                        f"layer ids")]
    return []


def _head_and_embedding(src: TensorSource, names: dict[str, str], f: dict[str, Any]
                        ) -> list[Finding]:
    """The draft's own lm_head (unless draft_vocab_size is null: the target's is borrowed)
    with the shape the config says, and its own embedding when it is narrower or wider than
    the target (otherwise the target's is borrowed, as SGLang does)."""
    out: list[Finding] = []
    Vd = f["draft_vocab_size"]
    head = names.get("lm_head.weight")
    if Vd is None:
        out.append(Finding("static.lm_head", INFO, "lm_head borrowed from the target "
                           "(draft_vocab_size null)"))
    elif head is None:
        out.append(Finding("static.lm_head_missing", ERROR,
                           f"lm_head.weight is missing but draft_vocab_size is {Vd}: the "
                           f"draft has no head for its vocabulary",
                           "re-export the draft with its lm_head; set draft_vocab_size to "
                           "null only if it was trained with the target's head"))
    elif src.shape(head) != (Vd, f["hidden_size"]):
        out.append(Finding("static.lm_head_shape", ERROR,
                           f"lm_head.weight has shape {list(src.shape(head))}, expected "
                           f"[{Vd}, {f['hidden_size']}] (draft_vocab_size, hidden_size)",
                           "the config's draft_vocab_size does not match the weights"))
    own_embed = f["hidden_size"] != f["target_hidden_size"]
    if own_embed and "embed_tokens.weight" not in names:
        out.append(Finding("static.embed_missing", ERROR,
                           "the draft is narrower/wider than the target but has no "
                           "embed_tokens.weight of its own", "re-export with the embedding"))
    elif not own_embed:
        out.append(Finding("static.embedding", INFO, "token embedding borrowed from the "
                           "target" + (" (the checkpoint's copy is ignored, as SGLang does)"
                                       if "embed_tokens.weight" in names else "")))
    return out


def _vocab_maps(src: TensorSource, names: dict[str, str], f: dict[str, Any]
                ) -> list[Finding]:
    """A draft vocabulary smaller than the target's needs d2t/t2d, and they must be
    consistent: a broken map sends draft tokens to the wrong target tokens."""
    Vd = f["draft_vocab_size"]
    if Vd is None or Vd >= f["vocab_size"]:
        return []
    d2t, t2d = names.get("d2t"), names.get("t2d")
    if d2t is None or t2d is None:
        return [Finding("static.vocab_map_missing", ERROR,
                        f"draft_vocab_size {Vd} < vocab_size {f['vocab_size']} but "
                        f"{'d2t' if d2t is None else 't2d'} is missing",
                        "re-export the draft with its d2t/t2d maps")]
    try:
        check_vocab_maps(src.get(d2t), src.get(t2d), f["vocab_size"], Vd)
    except ValueError as e:
        return [Finding("static.vocab_map", ERROR,
                        f"vocabulary map broken: {e}; draft tokens would be "
                        f"mapped to the wrong target tokens",
                        "rebuild d2t from the draft vocabulary (ascending target "
                        "ids): d2t[i] = id_i - i, t2d[id_i] = True")]
    return []


def _numerics(raw: dict[str, Any], f: dict[str, Any], target: ModelConfig) -> list[Finding]:
    """Numerics against the target: norm eps, rope and context length that differ from the
    target's are warnings (a draft may be trained so); the stored dtype is noted."""
    out: list[Finding] = []
    if abs(f["rms_norm_eps"] - target.rms_norm_eps) > 1e-12:
        out.append(Finding("static.norm_eps", WARNING,
                           f"draft rms_norm_eps {f['rms_norm_eps']} != target's "
                           f"{target.rms_norm_eps}", "usually copied from the target"))
    if f["rope_theta"] != target.rope_theta or (f.get("rope_scaling") or None) != (
            target.rope_scaling or None):
        out.append(Finding("static.rope", WARNING,
                           f"draft rope (theta {f['rope_theta']}, scaling "
                           f"{f.get('rope_scaling')}) differs from the target's (theta "
                           f"{target.rope_theta}, scaling {target.rope_scaling_dict})",
                           "fine if the draft was trained this way; otherwise copy the "
                           "target's rope settings into the draft config"))
    if f["max_position_embeddings"] < target.max_position_embeddings:
        out.append(Finding("static.context", WARNING,
                           f"draft max_position_embeddings {f['max_position_embeddings']} < "
                           f"target's {target.max_position_embeddings}",
                           "positions past it are outside what the draft saw"))
    dtype = raw.get("torch_dtype") or (raw.get("transformer_layer_config") or {}).get(
        "torch_dtype")
    out.append(Finding("static.dtype", INFO, f"draft weights stored as {dtype or 'unknown'}; "
                       "they run in the engine's dtype"))
    return out


def _special_tokens(raw: dict[str, Any], target_dir: Path | None) -> list[Finding]:
    """Special tokens: a draft config that names bos/eos/pad ids must agree with the
    target's config (when the target's directory is known)."""
    out: list[Finding] = []
    if target_dir is not None and (target_dir / "config.json").exists():
        tcfg = json.loads((target_dir / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in raw and raw[key] is not None and key in tcfg and tcfg[key] is not None \
                    and raw[key] != tcfg[key]:
                out.append(Finding("static.special_tokens", WARNING,
                                   f"draft {key} {raw[key]} != target's {tcfg[key]}: the "
                                   f"draft may come from another tokenizer",
                                   "check the draft was trained for this target"))
    return out
