"""Everything a draft-training run depends on, and what must not change across a resume."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TrainConfig:
    """Everything a run depends on. None means: pick by target size (see `resolved`)."""

    target: str | None  # model path / .gguf / hub id; None: the default model
    data: list[str]
    out: str
    draft_vocab_size: int | None = None
    layer_ids: tuple[int, ...] | None = None  # output-of-layer; None: EAGLE-3's defaults
    num_layers: int = 1
    ttt_length: int = 7
    loss_decay: float = 0.8
    ttt_attention: str = "dense"  # train/ttt.py StepKeys: "dense" (reference) or "sdpa"
    epochs: int = 1
    max_steps: int | None = None
    lr: float | None = None
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int | None = None
    max_len: int = 2048
    max_answer_tokens: int | None = None  # cut each example after this many assistant tokens
    eval_fraction: float = 0.02
    max_eval: int = 256
    eval_every: int = 200
    save_every: int = 500
    log_every: int = 10
    seed: int = 0
    regenerate: bool = True
    regen_temperature: float = 0.0
    regen_top_p: float = 1.0
    regen_max_new_tokens: int = 512
    regen_batch_size: int = 64
    init_from: str | None = None  # a trained draft to continue from (new schedule)
    self_prompts: int = 0  # requests the target writes itself (Magpie), added to the data
    self_prompt_temperature: float = 0.9
    self_prompt_top_p: float = 0.95
    self_prompt_openers: str | None = None  # file: first words of self-written requests
    device: str = "auto"
    budget_minutes: float | None = None  # stop (checkpoint + export) after this long
    resume: bool = False
    export_formats: tuple[str, ...] = ("sglang",)
    export_dtype: str = "bfloat16"
    cache_dir: str | None = None  # converted-GGUF cache
    tap_cache: str | None = None  # optional on-disk cache of target taps/outputs
    progress: bool = True
    stop_after_steps: int | None = field(default=None, repr=False)  # tests: emulate a kill

    def resolved(self, hidden: int, vocab: int, device: torch.device) -> TrainConfig:
        """Defaults that depend on the target: small targets (hidden < 2048) get a smaller
        draft vocabulary and a higher learning rate; CUDA gets bigger batches."""
        small = hidden < 2048
        upd: dict[str, Any] = {}
        if self.draft_vocab_size is None:
            upd["draft_vocab_size"] = min(vocab, 12288 if small else 32000)
        if self.lr is None:
            upd["lr"] = 3e-4 if small else 1e-4
        if self.batch_tokens is None:
            upd["batch_tokens"] = (32768 if small else 8192) if device.type == "cuda" else 2048
        return dataclasses.replace(self, **upd)


def fingerprint(cfg: TrainConfig, n_examples: int) -> str:
    """What must not change across a resume: data identity and anything that shapes batches
    or the draft."""
    files = []
    for p in cfg.data:
        st = Path(p).stat()
        files.append((Path(p).name, st.st_size))
    key = dict(files=files, n=n_examples, seed=cfg.seed, batch_tokens=cfg.batch_tokens,
               max_len=cfg.max_len, vocab=cfg.draft_vocab_size, layer_ids=cfg.layer_ids,
               ttt=cfg.ttt_length, num_layers=cfg.num_layers, epochs=cfg.epochs,
               max_steps=cfg.max_steps, eval_fraction=cfg.eval_fraction, lr=cfg.lr,
               regenerate=cfg.regenerate)
    if cfg.max_answer_tokens is not None:  # only when set: older runs keep their fingerprint
        key["max_answer_tokens"] = cfg.max_answer_tokens
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
