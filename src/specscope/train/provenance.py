"""The provenance block of an exported draft: what it was trained for and on, and how.

It goes into the export's config.json (`specscope_provenance`), so a draft found later says
which target, taps (and their convention), draft vocabulary, data and schedule made it, and
how it did on held-out data at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specscope import __version__
from specscope.config import ModelConfig
from specscope.draft.eagle3 import OUTPUT_OF_LAYER
from specscope.train.config import TrainConfig

TRAINER_VERSION = f"specscope-train-draft {__version__}"


def short_names(paths: list[str]) -> list[str]:
    """Each data file by its shortest trailing path that tells it from the others, for the
    provenance block: rounds of regeneration all write `regenerated.jsonl`, so bare names say
    nothing, and whole paths would publish the trainer's directories."""
    parts = [Path(p).parts for p in paths]
    for k in range(1, max((len(q) for q in parts), default=1) + 1):
        names = [str(Path(*q[-k:])) if q else "" for q in parts]
        if len(set(names)) == len(names):
            return names
    return [str(Path(p)) for p in paths]  # the same file twice: as given


def build_provenance(cfg: TrainConfig, *, target_source: str, target_config: ModelConfig,
                     layer_ids: tuple[int, ...], draft_vocab_size: int, coverage: float,
                     train_examples: int, train_tokens: int, steps: int, epochs: int,
                     stopped: str, processes: int, heldout: dict[str, Any]) -> dict[str, Any]:
    """The block for a run that ended at `steps` (`stopped` says why) with `heldout` as its
    final evaluation."""
    return {
        "trainer": TRAINER_VERSION,
        "target": target_source,
        "target_architecture": target_config.architecture,
        "target_num_layers": target_config.num_layers,
        "target_hidden_size": target_config.hidden_size,
        "target_vocab_size": target_config.vocab_size,
        "aux_layer_ids": list(layer_ids),
        "aux_layer_ids_convention": OUTPUT_OF_LAYER,
        "draft_vocab_size": draft_vocab_size,
        "draft_vocab_coverage": round(coverage, 4),
        "data": short_names(cfg.data),
        "regenerated": cfg.regenerate,
        "regen_temperature": cfg.regen_temperature if cfg.regenerate else None,
        "train_examples": train_examples, "train_tokens": train_tokens,
        "steps": steps, "epochs_completed": epochs, "stopped": stopped,
        "ttt_length": cfg.ttt_length, "ttt_attention": cfg.ttt_attention, "lr": cfg.lr,
        "warmup_ratio": cfg.warmup_ratio, "batch_tokens": cfg.batch_tokens,
        "processes": processes, "max_answer_tokens": cfg.max_answer_tokens,
        "init_from": Path(cfg.init_from).name if cfg.init_from else None,
        "heldout": heldout,
    }
