"""Load an EAGLE-3 draft checkpoint (any of formats.FORMATS) strictly, for a given target.

Strict, as for targets: every tensor the draft needs is present with the shape the target
implies (fc input = num_taps x target hidden; vocab sizes = the target's), nothing is left
over, and the vocabulary maps satisfy nonzero(t2d) == d2t + arange(Vd). Any violation is a
ValueError naming the tensor or field.

Layer ids (taps) are resolved once, in this order: the `layer_ids` argument (output-of-layer)
> the ids in the checkpoint config (converted from its convention) > the EAGLE-3 default
[1, L//2-1, L-4]. They are sorted ascending, because SGLang, vLLM and EAGLE all capture taps
in layer order, so a draft's fc was trained on them in that order. The resolution (source,
convention, final ids) is logged and returned as LoadedDraft.message.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specscope.config import ModelConfig
from specscope.draft.eagle3 import (
    INPUT_TO_LAYER,
    OUTPUT_OF_LAYER,
    DraftConfig,
    Eagle3Draft,
    default_layer_ids,
)
from specscope.draft.formats import (
    ParsedConfig,
    TensorSource,
    canonical_name,
    detect_format,
    format_name,
    is_ignored,
    parse_config,
)
from specscope.draft.vocab import check_vocab_maps
from specscope.models.loader import name_list, weight_files
from specscope.models.safetensors_check import check_safetensors
from specscope.parallel.group import TPGroup
from specscope.parallel.layers import zero_padding
from specscope.parallel.shard import param_shards, shard_reads

log = logging.getLogger("specscope.draft")


@dataclass
class LoadedDraft:
    model: Eagle3Draft  # not yet attached: call model.attach_target(target)
    config: DraftConfig
    source_format: str  # sglang | eagle | speculators
    message: str  # the layer-id resolution, then notes on borrowed or ignored weights
    reads: dict[str, int] = field(default_factory=dict)  # elements read, per tensor name


def resolve_layer_ids(parsed: ParsedConfig, num_target_layers: int,
                      override: list[int] | tuple[int, ...] | None = None
                      ) -> tuple[tuple[int, ...], str, str, str]:
    """Final output-of-layer ids for a parsed draft config and an optional override.

    Returns (ids, source, convention of the source, message); ids out of [0, L) raise
    ValueError naming where they came from.
    """
    L = num_target_layers
    fmt = parsed.fmt
    given = parsed.layer_ids
    conv_given = "used as-is" if parsed.ids_convention == OUTPUT_OF_LAYER else "minus 1"
    if override is not None:
        ids = [int(i) for i in override]
        source, conv = "override", OUTPUT_OF_LAYER
        desc = "the layer_ids override"
        if given is not None:
            desc += f" (the config's {parsed.ids_field} {given}, {parsed.ids_convention}, " \
                    f"is not used)"
    elif given is not None:
        shift = 1 if parsed.ids_convention == INPUT_TO_LAYER else 0
        ids = [int(i) - shift for i in given]
        source, conv = parsed.ids_field, parsed.ids_convention
        desc = f"{parsed.ids_field} {given} ({conv}, {conv_given})"
    elif fmt == "eagle":
        ids = list(default_layer_ids(L))
        source, conv = "eagle-hardwired", INPUT_TO_LAYER
        desc = f"EAGLE's hard-wired taps {[i + 1 for i in ids]} (input-to-layer, minus 1)"
    else:
        ids = list(default_layer_ids(L))
        source, conv = "default", OUTPUT_OF_LAYER
        desc = f"the EAGLE-3 default [1, L//2-1, L-4] for a {L}-layer target (the config " \
               f"has no {parsed.ids_field})"
    bad = [i for i in ids if not -1 <= i < L]
    if bad:
        raise ValueError(f"draft layer ids {ids} (output-of-layer) from {desc}: {bad} out of "
                         f"range for a {L}-layer target (valid: 0..{L - 1}, or -1 for the "
                         f"embedding output)")
    final = tuple(sorted(ids))
    order = "" if list(final) == ids else ", sorted into layer order (taps are captured " \
                                          "in layer order)"
    message = f"draft layer ids {list(final)} (output-of-layer) from {desc}{order} " \
              f"({fmt} format)"
    return final, source, conv, message


DEFAULT_DRAFT = "default"  # the draft shipped for the default model (specscope/drafts/)


def default_draft_dir() -> Path:
    """The EAGLE-3 draft trained for SmolLM2-135M-Instruct that ships with specscope."""
    return Path(__file__).resolve().parent.parent / "drafts" / "smollm2_135m_instruct"


def _resolve_dir(path: str | os.PathLike) -> Path:
    if str(path) == DEFAULT_DRAFT:
        return default_draft_dir()
    p = Path(path).expanduser()
    if p.is_file() and p.name == "config.json":
        return p.parent
    if p.is_dir() and (p / "config.json").exists():
        return p
    what = "does not exist" if not p.exists() else "is not a directory holding config.json"
    raise FileNotFoundError(f"draft {str(path)!r} {what}: give a draft checkpoint directory "
                            f"(or {DEFAULT_DRAFT}, random or none)")


def _read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"draft config {cfg_path} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"draft config {cfg_path} is not a text file") from None
    if not isinstance(raw, dict):
        raise ValueError(f"draft config {cfg_path} is a JSON {type(raw).__name__}, not an "
                         f"object")
    return raw


def check_draft_files(path: str | os.PathLike) -> Path:
    """Check the draft checkpoint at `path` without loading it (the CLI does this before the
    target loads, so a wrong draft costs seconds, not a target load): its config.json parses
    as a draft config of a known format and every weight file's header is sound. Reads no
    tensor; returns the checkpoint directory. Raises ValueError or OSError naming the file.
    """
    model_dir = _resolve_dir(path)
    raw = _read_config(model_dir)
    cfg_path = str(model_dir / "config.json")
    parse_config(raw, detect_format(raw, cfg_path), cfg_path)
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:  # the index, if any, against the shards; each file's header checked once
        checked = set(weight_files(model_dir, "draft checkpoint").values())
        for shard in shards:  # also a file the index leaves out: it is in the checkpoint
            if shard not in checked:
                check_safetensors(shard, "draft checkpoint")
    elif (model_dir / "pytorch_model.bin").exists():
        _check_torch_file(model_dir / "pytorch_model.bin")
    else:
        raise FileNotFoundError(f"draft checkpoint {model_dir} holds no weights: no "
                                f"*.safetensors or pytorch_model.bin next to its config.json")
    return model_dir


def _check_torch_file(path: Path) -> None:
    """A torch.save file: a zip whose central directory (at its end) is readable, so not
    truncated; the legacy pickle format (torch < 1.6) cannot be checked without loading."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path):
                return
        except zipfile.BadZipFile as e:
            raise ValueError(f"draft checkpoint {path} is truncated or corrupt: {e} (re-download "
                             f"or re-export it)") from None
    if magic[:1] != b"\x80":  # the pickle protocol opcode a legacy torch.save starts with
        raise ValueError(f"draft checkpoint {path} is not a PyTorch checkpoint (neither a zip "
                         f"archive nor a pickle)")


def load_draft(path: str | os.PathLike, target_config: ModelConfig, *,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               layer_ids: list[int] | None = None, tp: TPGroup | None = None
               ) -> LoadedDraft:
    """Read, check and load the draft at `path` for a target of `target_config`.

    layer_ids: output-of-layer ids overriding whatever the checkpoint says. tp: load this
    rank's shard (`--draft-tp-size N`), reading only its slices of each tensor.
    """
    model_dir = _resolve_dir(path)
    cfg_path = model_dir / "config.json"
    raw = _read_config(model_dir)
    fmt = detect_format(raw, str(cfg_path))
    parsed = parse_config(raw, fmt, str(cfg_path))
    tc = target_config
    fields = dict(parsed.fields)
    ids, ids_source, ids_conv, message = resolve_layer_ids(parsed, tc.num_layers, layer_ids)
    _check_fit(model_dir, fields, tc)

    source = TensorSource(model_dir)
    files = _canonical_files(model_dir, source)
    has_lm_head, own_embed, notes = _drop_borrowed(fields, files, tc)
    d2t_name, t2d_name = files.pop("d2t", None), files.pop("t2d", None)

    cfg = DraftConfig(**fields, target_num_layers=tc.num_layers, aux_layer_ids=ids,
                      num_taps=len(ids), has_lm_head=has_lm_head, own_embed_tokens=own_embed,
                      source_format=fmt, layer_ids_source=ids_source,
                      layer_ids_convention=ids_conv)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    zero_padding(model)

    layout = model.checkpoint_layout()
    _check_names(model_dir, fmt, cfg, layout, files, d2t_name, t2d_name)
    _check_shapes(model_dir, cfg, layout, files, source)
    reads = _copy_weights(model, layout, files, source, d2t_name, t2d_name)
    model.eval().requires_grad_(False)
    full = ". ".join([message] + notes)
    log.info("%s", full)
    return LoadedDraft(model=model, config=cfg, source_format=fmt, message=full, reads=reads)


# Eagle3Draft.checkpoint_layout: canonical tensor name -> (parameter name, first row in it,
# the tensor's shape in the checkpoint).
_Layout = dict[str, tuple[str, int, tuple[int, ...]]]


def _check_fit(model_dir: Path, fields: dict[str, Any], tc: ModelConfig) -> None:
    """The draft fits the target: the same vocabulary, and taps as wide as the target's
    hidden size (the fc input). Checked from the config, before any tensor is read."""
    errors = []
    if fields["vocab_size"] != tc.vocab_size:
        errors.append(f"vocab_size {fields['vocab_size']} != the target's {tc.vocab_size}")
    if fields["target_hidden_size"] != tc.hidden_size:
        errors.append(f"target_hidden_size {fields['target_hidden_size']} != the target's "
                      f"hidden_size {tc.hidden_size} (fc input width)")
    if errors:
        raise ValueError(f"draft {model_dir} does not fit the target {tc.name or ''}: "
                         + "; ".join(errors))


def _canonical_files(model_dir: Path, source: TensorSource) -> dict[str, str]:
    """Canonical tensor name -> the name in the checkpoint, ignorable tensors left out. Two
    checkpoint names for one canonical tensor (formats mixed in one file) are an error:
    which one the draft would get is not knowable."""
    files: dict[str, str] = {}  # canonical -> name in the checkpoint
    dupes = []
    for name in source.names:
        if is_ignored(name):
            continue
        canon = canonical_name(name)
        if canon in files:
            dupes.append(" and ".join(sorted((files[canon], name))))
        files[canon] = name
    if dupes:
        raise ValueError(f"draft checkpoint {model_dir} holds the same tensor twice: "
                         + "; ".join(dupes))
    return files


def _drop_borrowed(fields: dict[str, Any], files: dict[str, str], tc: ModelConfig
                   ) -> tuple[bool, bool, list[str]]:
    """Apply SGLang's borrowing rules: a draft_vocab_size of null means the target's lm_head
    (fields' draft_vocab_size becomes the target's vocabulary), and a draft as wide as the
    target uses the target's embedding; a checkpoint's own copy of either is dropped from
    `files`. Returns (has_lm_head, own_embed, notes for the load message)."""
    notes = []
    has_lm_head = fields["draft_vocab_size"] is not None
    if not has_lm_head:  # SGLang: draft_vocab_size null -> the target's lm_head, always
        fields["draft_vocab_size"] = tc.vocab_size
        notes.append("lm_head borrowed from the target (draft_vocab_size is null)")
        if files.pop("lm_head.weight", None):
            notes.append("the checkpoint's lm_head.weight is ignored, as SGLang does")
    own_embed = fields["hidden_size"] != fields["target_hidden_size"]
    if not own_embed and files.pop("embed_tokens.weight", None):
        # SGLang replaces a draft's embedding with the target's whenever the widths match.
        notes.append("the checkpoint's embed_tokens.weight is ignored: the draft uses the "
                     "target's embedding, as SGLang does")
    return has_lm_head, own_embed, notes


def _check_names(model_dir: Path, fmt: str, cfg: DraftConfig, layout: _Layout,
                 files: dict[str, str], d2t_name: str | None, t2d_name: str | None) -> None:
    """Strictness on names: every tensor the layout needs is there (the vocabulary maps too,
    for a draft vocabulary smaller than the target's, or both or neither otherwise), and
    nothing is left over. All of the missing and unexpected tensors are named at once."""
    missing = [k for k in layout if k not in files]
    if cfg.draft_vocab_size < cfg.vocab_size:  # a real draft vocabulary needs its maps
        missing += [n for n, have in (("d2t", d2t_name), ("t2d", t2d_name)) if have is None]
    elif (d2t_name is None) != (t2d_name is None):
        missing.append("d2t" if d2t_name is None else "t2d")
    unexpected = sorted(files[k] for k in files if k not in layout)
    problems = []
    if missing:
        problems.append("missing tensors: " + name_list(
            [format_name(k, fmt) for k in missing]))
        if "lm_head.weight" in missing:
            problems[-1] += (f" (draft_vocab_size is {cfg.draft_vocab_size}; a draft that "
                             f"borrows the target's lm_head has draft_vocab_size null)")
    if unexpected:
        problems.append("unexpected tensors: " + name_list(unexpected))
    if problems:
        raise ValueError(f"draft checkpoint {model_dir} ({fmt} format) does not match its "
                         f"config: " + "; ".join(problems))


def _check_shapes(model_dir: Path, cfg: DraftConfig, layout: _Layout, files: dict[str, str],
                  source: TensorSource) -> None:
    """Every tensor's shape (from the file header; no tensor read) is the one the draft
    config and target imply; the first 12 misfits are named, each with what it depends on."""
    bad_shapes = []
    for canon, (_, _, want) in layout.items():
        shape = source.shape(files[canon])
        if shape != want:
            bad_shapes.append(f"{files[canon]} has shape {list(shape)}, expected {list(want)}"
                              + _shape_hint(canon, cfg))
    if bad_shapes:
        raise ValueError(f"draft checkpoint {model_dir} tensor shapes do not fit the draft "
                         f"config and target: " + "; ".join(bad_shapes[:12]))


def _copy_weights(model: Eagle3Draft, layout: _Layout, files: dict[str, str],
                  source: TensorSource, d2t_name: str | None, t2d_name: str | None
                  ) -> dict[str, int]:
    """Copy the checkpoint into the (empty) model: each parameter reads only this rank's
    slices under tensor parallelism, then the vocabulary maps, checked (identity maps when
    the checkpoint has none). Returns the elements read per checkpoint tensor name."""
    params = dict(model.named_parameters())
    shards = param_shards(model)
    reads: dict[str, int] = {}
    with torch.no_grad():
        for canon, (param, row, want) in layout.items():
            for src, at in shard_reads(row, want, shards.get(param)):
                part = source.read(files[canon], src)
                params[param][at].copy_(part)
                reads[files[canon]] = reads.get(files[canon], 0) + part.numel()
        if d2t_name is not None:
            d2t, t2d = source.get(d2t_name), source.get(t2d_name)
            check_vocab_maps(d2t, t2d, model.config.vocab_size, model.config.draft_vocab_size)
            model.d2t.copy_(d2t.long())
            model.t2d.copy_(t2d.bool())
        else:
            model.d2t.zero_()
            model.t2d.fill_(True)
    return reads


def _shape_hint(canon: str, cfg: DraftConfig) -> str:
    if canon == "fc.weight":
        return (f" (fc input = num_taps {cfg.num_taps} x target hidden "
                f"{cfg.target_hidden_size})")
    if canon == "lm_head.weight":
        return f" (draft_vocab_size {cfg.draft_vocab_size})"
    if canon == "embed_tokens.weight":
        return f" (target vocab {cfg.vocab_size} x draft hidden {cfg.hidden_size})"
    return ""
