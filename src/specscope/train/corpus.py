"""The run's conversations beyond its data files: requests the target writes itself
(--self-prompts) and the target's own answers (--regenerate), each in a file under OUT that a
rerun reads back. Data-parallel (train/parallel.py), rank r makes its share into its own
file, OUT/NAME.rank{r}-of-{world}.jsonl, and every rank reads all shares back in one order,
so each sees the same conversations."""

from __future__ import annotations

import logging
from pathlib import Path

from specscope.engine.tokenizer import Tokenizer
from specscope.models.registry import TargetModel
from specscope.train.config import TrainConfig
from specscope.train.parallel import Ranks, barrier, shard
from specscope.train.regenerate import read_regenerated, regenerate
from specscope.train.self_prompts import read_prompts, self_prompts, write_prompts

log = logging.getLogger("specscope.train")


def _self_prompts_file(target: TargetModel, tokenizer: Tokenizer, cfg: TrainConfig, path: Path,
                       openers: list[str] | None, n: int, seed: int) -> list[str]:
    """`n` self-written prompts: read back when a whole file of them exists (a resumed
    run must see the same data), else sampled from the target and written atomically."""
    if path.is_file():
        prompts = read_prompts(path)
        if len(prompts) >= n:
            log.info("train-draft: %d self-written prompts from %s", n, path)
            return prompts[:n]
    prompts = self_prompts(target, tokenizer, n, temperature=cfg.self_prompt_temperature,
                           top_p=cfg.self_prompt_top_p, batch_size=cfg.regen_batch_size,
                           seed=seed, openers=openers, progress=cfg.progress)
    write_prompts(path, prompts)
    log.info("train-draft: the target wrote %d prompts (%s)", len(prompts), path)
    return prompts


def _rank_file(out: Path, stem: str, ranks: Ranks, rank: int | None = None) -> Path:
    """OUT/stem.jsonl for one process; OUT/stem.rank{r}-of-{world}.jsonl per rank."""
    if not ranks.active:
        return out / f"{stem}.jsonl"
    return out / f"{stem}.rank{ranks.rank if rank is None else rank}-of-{ranks.world}.jsonl"


def _rank_seed(cfg: TrainConfig, ranks: Ranks) -> int:
    """The run's seed for rank 0 (and one process), a distinct one for every other rank."""
    return cfg.seed + 100_003 * ranks.rank


def run_self_prompts(target: TargetModel, tokenizer: Tokenizer, cfg: TrainConfig, out: Path,
                     openers: list[str] | None, ranks: Ranks) -> list[str]:
    """The run's self-written prompts. Data-parallel, each rank writes its share (its own
    seed and file) and all ranks read every share back, in rank order, without duplicates."""
    mine = _self_prompts_file(target, tokenizer, cfg, _rank_file(out, "self_prompts", ranks),
                              openers, len(shard(cfg.self_prompts, ranks)),
                              _rank_seed(cfg, ranks))
    if not ranks.active:
        return mine
    barrier(ranks)
    seen: set[str] = set()
    prompts = []
    for r in range(ranks.world):
        share = len(shard(cfg.self_prompts, Ranks(r, ranks.world, r)))
        for p in read_prompts(_rank_file(out, "self_prompts", ranks, r))[:share]:
            if p not in seen:
                seen.add(p)
                prompts.append(p)
    return prompts


def run_regenerate(target: TargetModel, tokenizer: Tokenizer, convs: list, cfg: TrainConfig,
                   out: Path, ranks: Ranks) -> list:
    """The conversations answered by the target. Data-parallel, rank r answers conversations
    r, r + world, … into its own resumable file; all ranks then read every file back and
    restore the input order, so each sees the same data."""
    mine = regenerate(target, tokenizer, [convs[i] for i in shard(len(convs), ranks)],
                      _rank_file(out, "regenerated", ranks), batch_size=cfg.regen_batch_size,
                      max_new_tokens=cfg.regen_max_new_tokens,
                      temperature=cfg.regen_temperature, top_p=cfg.regen_top_p,
                      seed=_rank_seed(cfg, ranks), max_prompt_len=cfg.max_len,
                      progress=cfg.progress)
    if not ranks.active:
        return mine
    barrier(ranks)
    done = [read_regenerated(_rank_file(out, "regenerated", ranks, r))
            for r in range(ranks.world)]
    # conversation i is rank (i mod world)'s number (i div world)
    return [done[i % ranks.world][i // ranks.world] for i in range(len(convs))
            if i // ranks.world in done[i % ranks.world]]
