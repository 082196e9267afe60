"""The EAGLE-3 draft trainer: data -> (regenerated) conversations -> TTT training -> export.

One run, end to end (`specscope train-draft`):
  1. read JSONL conversations or prompts; regenerate every assistant turn with the target
     (on by default: a draft must learn its target's distribution), resumably;
  2. tokenize with the chat template, assistant-only loss mask; hold out an eval split;
  3. draft vocabulary = the most frequent assistant tokens (d2t/t2d);
  4. train: target taps and target distribution computed online per batch (no hidden-state
     dumps), the draft unrolled for ttt_length steps (train/ttt.py), AdamW, linear warmup and
     cosine decay, gradient clipping, bf16 autocast on CUDA; periodic held-out evaluation of
     acceptance by position and predicted accept length;
  5. atomic checkpoints (resume continues bit-for-bit), and an export in the SGLang/SpecForge
     format (plus others on request) with a provenance block the engine loads as is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specscope.draft.eagle3 import (
    DraftConfig,
    Eagle3Draft,
    default_layer_ids,
    random_draft,
)
from specscope.draft.formats import FORMATS, save_draft
from specscope.draft.loader import load_draft
from specscope.draft.vocab import frequent_vocab, vocab_coverage, vocab_maps
from specscope.engine.llm import resolve_device
from specscope.engine.tokenizer import Tokenizer
from specscope.models.loader import load_model
from specscope.models.registry import TargetModel
from specscope.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
    save_checkpoint,
)
from specscope.train.config import TrainConfig
from specscope.train.config import fingerprint as run_fingerprint
from specscope.train.corpus import run_regenerate, run_self_prompts
from specscope.train.data import (
    cap_answer_tokens,
    check_answer_cap,
    read_conversations,
    split_examples,
    token_batches,
    token_counts,
    tokenize_conversations,
)
from specscope.train.evaluation import evaluate
from specscope.train.parallel import (
    Ranks,
    all_sum,
    any_rank,
    average_gradients,
    barrier,
    check_in_sync,
    ranks_from_env,
    start,
    stop,
)
from specscope.train.provenance import build_provenance
from specscope.train.self_prompts import read_openers
from specscope.train.tap_cache import TapCache, target_batch
from specscope.train.ttt import (
    acceptance,
    check_attention,
    ttt_loss,
)

log = logging.getLogger("specscope.train")


def new_draft(target: TargetModel, layer_ids: tuple[int, ...], vocab_ids: torch.Tensor,
              num_layers: int, seed: int) -> Eagle3Draft:
    """A fresh draft for `target`: decoder weights N(0, 0.02), norms 1, lm_head = the
    target's lm_head rows of the draft vocabulary, final norm = the target's (a draft that
    starts by reading the target's own output head learns much faster)."""
    tc = target.config
    draft = random_draft(tc, torch.float32, "cpu", layer_ids=layer_ids,
                         draft_vocab_size=int(vocab_ids.numel()), seed=seed,
                         num_layers=num_layers, source_format="sglang",
                         layer_ids_source="trainer")
    d2t, t2d = vocab_maps(vocab_ids, tc.vocab_size)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.lm_head.weight.copy_(target.lm_head.weight.detach()[vocab_ids].float().cpu())
        draft.norm.weight.copy_(target.final_norm.weight.detach().float().cpu())
    return draft.requires_grad_(True).train()


def _lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


@torch.no_grad()
def _progress(total: int, initial: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (logs, CI) one log line per --log-every steps."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="train-draft", unit="step", file=sys.stderr,
                dynamic_ncols=True)


def train_draft(cfg: TrainConfig) -> Path:
    """Run the whole pipeline; returns the exported draft directory (SGLang format).

    Under torchrun (WORLD_SIZE > 1) every process runs this: data-parallel, one GPU each
    (train/parallel.py); rank 0 writes what is written."""
    ranks = ranks_from_env()
    try:
        return _train_draft(cfg, ranks)
    finally:
        stop(ranks)


def _train_draft(cfg: TrainConfig, ranks: Ranks) -> Path:
    for fmt in cfg.export_formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    if cfg.ttt_length < 1:
        raise ValueError(f"--ttt-length must be >= 1, got {cfg.ttt_length}")
    check_attention(cfg.ttt_attention)  # before the (slow) model load
    if cfg.max_answer_tokens is not None:
        check_answer_cap(cfg.max_answer_tokens)  # before the (slow) model load
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.data and not cfg.self_prompts:
        raise ValueError("no training data: pass --data FILE... and/or --self-prompts N")
    if cfg.self_prompts < 0:
        raise ValueError(f"--self-prompts must be >= 0, got {cfg.self_prompts}")
    openers = read_openers(cfg.self_prompt_openers)  # a bad file fails before the model loads
    convs = read_conversations(cfg.data)  # before the (slow) model load: bad data fails fast
    device = start(ranks, resolve_device(cfg.device))
    if not ranks.main:  # one voice: rank 0 logs and shows progress
        cfg = dataclasses.replace(cfg, progress=False)
        logging.getLogger("specscope").setLevel(logging.WARNING)
    tdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load_model(cfg.target, dtype=tdtype, device=device, cache_dir=cfg.cache_dir)
    target, tcfg = loaded.model, loaded.config
    cfg = cfg.resolved(tcfg.hidden_size, tcfg.vocab_size, device)
    tokenizer = Tokenizer(loaded.path, tcfg.eos_token_ids)
    if not tokenizer.has_chat_template:
        raise ValueError(f"{loaded.path}: the target's tokenizer has no chat template; "
                         f"train-draft needs one to find the assistant tokens")

    log.info("train-draft: %d conversations from %s%s", len(convs),
             ", ".join(cfg.data) or "no file",
             f"; data-parallel over {ranks.world} processes" if ranks.active else "")
    if cfg.self_prompts:
        convs += [[{"role": "user", "content": p}] for p in
                  run_self_prompts(target, tokenizer, cfg, out, openers, ranks)]
    if not convs:
        raise ValueError("no training data: pass --data FILE... and/or --self-prompts N")
    if cfg.regenerate:
        convs = run_regenerate(target, tokenizer, convs, cfg, out, ranks)
    examples = tokenize_conversations(tokenizer.hf, convs, cfg.max_len)
    if cfg.max_answer_tokens is not None:  # before the split: held out the same way
        examples = [cap_answer_tokens(e, cfg.max_answer_tokens) for e in examples]
    examples = [e for e in examples if len(e.ids) >= 3 and any(e.mask[2:])]
    if not examples:
        raise ValueError("no training example has assistant tokens to learn from (are the "
                         "conversations prompt-only with --no-regenerate?)")
    train, held = split_examples(examples, cfg.eval_fraction, cfg.seed, cfg.max_eval)
    n_tokens = sum(len(e.ids) for e in train)
    n_labels = sum(sum(e.mask) for e in train)
    log.info("train-draft: %d train / %d eval examples, %d tokens (%d assistant)",
             len(train), len(held), n_tokens, n_labels)

    init = None
    if cfg.init_from:  # continue from a trained draft: its weights, taps and vocabulary
        init = load_draft(cfg.init_from, tcfg, dtype=torch.float32, device="cpu",
                          layer_ids=list(cfg.layer_ids) if cfg.layer_ids else None)
        log.info("train-draft: starting from %s (%s)", cfg.init_from, init.message)
    layer_ids = tuple(sorted(cfg.layer_ids)) if cfg.layer_ids else \
        tuple(init.config.aux_layer_ids) if init is not None else \
        default_layer_ids(tcfg.num_layers)
    target.set_taps(layer_ids)
    ckpt_root = out / "checkpoints"
    fingerprint = run_fingerprint(cfg, len(examples))
    if ranks.active:  # a step is `world` batches: resume only with as many processes
        fingerprint = f"{fingerprint}-w{ranks.world}"
    ckpt = latest_checkpoint(ckpt_root) if cfg.resume else None
    if cfg.resume and ckpt is None:
        log.info("train-draft: --resume but no checkpoint in %s; starting fresh", ckpt_root)
    if ranks.main:
        remove_partial(ckpt_root)
    counts = token_counts(train, tcfg.vocab_size)
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        if state["fingerprint"] != fingerprint:
            raise ValueError(f"cannot resume from {ckpt}: it was made with other data or "
                             f"settings (fingerprint {state['fingerprint']} != {fingerprint}); "
                             f"use the same arguments, or a new --out")
        draft = Eagle3Draft(DraftConfig(**state["draft_config"]))
        draft.load_state_dict(state["draft"])
        draft.requires_grad_(True).train()
        log.info("train-draft: resumed from %s (step %d)", ckpt, state["step"])
    elif init is not None:
        state = None
        draft = init.model.requires_grad_(True).train()
        if cfg.draft_vocab_size not in (None, draft.config.draft_vocab_size):
            log.warning("train-draft: --init-from keeps its draft vocabulary of %d; "
                        "--draft-vocab-size %d is ignored", draft.config.draft_vocab_size,
                        cfg.draft_vocab_size)
    else:
        state = None
        vocab_ids = frequent_vocab(counts, cfg.draft_vocab_size)
        draft = new_draft(target, layer_ids, vocab_ids, cfg.num_layers, cfg.seed)
    coverage = vocab_coverage(counts, draft.to_target(torch.arange(
        draft.config.draft_vocab_size)))
    log.info("train-draft: draft vocab %d covers %.2f%% of assistant tokens",
             draft.config.draft_vocab_size, 100 * coverage)
    draft.to(device)
    draft.attach_target(target)
    draft.ensure_rope(cfg.max_len + cfg.ttt_length + 2)
    draft_ids = draft.to_target(torch.arange(draft.config.draft_vocab_size, device=device))

    # A step takes `world` batches of the shared order, one per rank (the epoch's remainder
    # is left out so the ranks stay in step).
    batches_per_epoch = len(token_batches(train, cfg.batch_tokens, cfg.seed, 0)) // ranks.world
    if batches_per_epoch < 1:
        raise ValueError(f"{len(train)} training examples make fewer batches than the "
                         f"{ranks.world} processes; use fewer processes or smaller "
                         f"--batch-tokens")
    total = cfg.max_steps or cfg.epochs * batches_per_epoch
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(total, max(1, int(cfg.warmup_ratio * total)), cfg.min_lr_ratio))
    step, epoch, pos_in_epoch = 0, 0, 0
    history: list[dict[str, Any]] = []
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, epoch, pos_in_epoch = state["step"], state["epoch"], state["pos_in_epoch"]
        history = state["history"]
        torch.set_rng_state(state["rng_cpu"])
    metrics_path = out / "metrics.jsonl"

    def record(entry: dict[str, Any]) -> None:
        history.append(entry)
        if ranks.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def checkpoint() -> None:
        check_in_sync(params, ranks)
        if not ranks.main:
            return
        save_checkpoint(ckpt_root, step, {
            "fingerprint": fingerprint, "draft_config": dataclasses.asdict(draft.config),
            "draft": {k: v.detach().cpu() for k, v in draft.state_dict().items()},
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
            "epoch": epoch, "pos_in_epoch": pos_in_epoch, "history": history,
            "rng_cpu": torch.get_rng_state(), "train_config": dataclasses.asdict(cfg)})

    tap_cache = None
    if cfg.tap_cache:
        size = TapCache.estimate_bytes(n_tokens, len(layer_ids), tcfg.hidden_size)
        if ranks.main:  # the ranks share one cache (per-example files, atomic renames)
            print(f"train-draft: the tap cache in {cfg.tap_cache} will take about "
                  f"{size / 1e9:.2f} GB ({n_tokens} tokens x {len(layer_ids) + 1} x "
                  f"{tcfg.hidden_size} bf16)", file=sys.stderr)
        tap_cache = TapCache(cfg.tap_cache, fingerprint)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    bar = _progress(total, step, cfg.progress and ranks.main)
    stopped = "finished"
    # Running sums stay on the device and are read once per log line (or per step when a
    # progress bar shows them): a read per step would make the host wait for every step.
    run_sums = torch.zeros(4, cfg.ttt_length, device=device)
    run_loss = torch.zeros((), device=device)
    run_n = 0
    t_train = time.perf_counter()
    while step < total:
        order = token_batches(train, cfg.batch_tokens, cfg.seed, epoch)
        while pos_in_epoch + ranks.world <= len(order) and step < total:
            idx = order[pos_in_epoch + ranks.rank]
            batch = target_batch(target, [train[i] for i in idx], draft_ids, device, idx,
                                 tap_cache)
            with autocast:
                loss, _, m = ttt_loss(draft, batch, cfg.ttt_length, cfg.loss_decay,
                                      cfg.ttt_attention)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(params, ranks)
            gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            pos_in_epoch += ranks.world
            run_sums += torch.stack([m.count, m.correct, m.chain, m.reached]).float()
            run_loss += loss.detach().float()
            run_n += 1
            if bar is not None:
                acc = (run_sums[1] / run_sums[0].clamp_min(1)).tolist()
                bar.set_postfix_str(f"loss {float(run_loss) / run_n:.3f} acc " +
                                    " ".join(f"{a:.2f}" for a in acc[:4]), refresh=False)
                bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                all_sum(run_sums, ranks)
                all_sum(run_loss, ranks)
                run_n *= ranks.world
                sums = run_sums.cpu()
                rates = acceptance(sums[2], sums[3])
                record({"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0],
                        "loss": round(float(run_loss) / run_n, 5),
                        "grad_norm": round(float(gnorm), 4),
                        "top1_by_position": [round(float(c / max(n, 1)), 4) for c, n in
                                             zip(sums[1], sums[0], strict=True)],
                        "acceptance_by_position": [round(a, 4) for a in rates],
                        "elapsed_s": round(time.perf_counter() - t_train, 1)})
                if bar is None and cfg.progress:
                    h = history[-1]
                    log.info("step %d/%d epoch %d lr %.2e loss %.4f top1 %s (%.0fs)", step,
                             total, epoch, h["lr"], h["loss"],
                             " ".join(f"{a:.3f}" for a in h["top1_by_position"]),
                             h["elapsed_s"])
                run_sums.zero_()
                run_loss.zero_()
                run_n = 0
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                ev = evaluate(draft, target, held, cfg, device) if ranks.main else {}
                barrier(ranks)
                record({"step": step, "eval": ev})
                log.info("eval at step %d: acceptance %s, accept length %s (engine walk; "
                         "formula %s)", step, ev.get("acceptance_by_position"),
                         ev.get("walk_accept_length"), ev.get("predicted_accept_length"))
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()
            if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
                if bar is not None:
                    bar.close()
                return ckpt_root  # emulated kill: only checkpoints survive
            # Data-parallel, the ranks agree on stopping at log steps (a collective per step
            # would make the host wait for every step).
            if cfg.budget_minutes is not None and (
                    not ranks.active or step % cfg.log_every == 0 or step == total) and \
                    any_rank(time.perf_counter() - t_start > cfg.budget_minutes * 60, ranks,
                             device):
                stopped = f"time budget of {cfg.budget_minutes} min reached"
                break
        if stopped != "finished":
            break
        if pos_in_epoch + ranks.world > len(order):
            epoch += 1
            pos_in_epoch = 0
    if bar is not None:
        bar.close()
    final_eval = evaluate(draft, target, held, cfg, device) if ranks.main else {}
    record({"step": step, "eval": final_eval, "final": True, "stopped": stopped})
    checkpoint()
    if not ranks.main:
        return out / "draft"  # rank 0 exports
    log.info("train-draft: %s at step %d/%d; held-out acceptance %s, accept length %s "
             "(engine walk; formula %s)", stopped, step, total,
             final_eval.get("acceptance_by_position"), final_eval.get("walk_accept_length"),
             final_eval.get("predicted_accept_length"))
    provenance = build_provenance(
        cfg, target_source=loaded.source, target_config=tcfg, layer_ids=layer_ids,
        draft_vocab_size=draft.config.draft_vocab_size, coverage=coverage,
        train_examples=len(train), train_tokens=n_tokens, steps=step, epochs=epoch,
        stopped=stopped, processes=ranks.world, heldout=final_eval)
    export_dtype = getattr(torch, cfg.export_dtype)
    exported = None
    for fmt in cfg.export_formats:
        name = "draft" if fmt == cfg.export_formats[0] else f"draft-{fmt}"
        d = save_draft(draft, draft.config, out / name, fmt, provenance=provenance,
                       dtype=export_dtype)
        exported = exported or d
        log.info("train-draft: exported %s (%s format)", d, fmt)
    assert exported is not None
    return exported
