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

from specscope.config import ModelConfig
from specscope.draft.eagle3 import (
    DraftConfig,
    Eagle3Draft,
    default_layer_ids,
    random_draft,
)
from specscope.draft.formats import FORMATS, save_draft
from specscope.draft.loader import LoadedDraft, load_draft
from specscope.draft.vocab import frequent_vocab, vocab_coverage, vocab_maps
from specscope.engine.llm import resolve_device
from specscope.engine.tokenizer import Tokenizer
from specscope.models.loader import LoadedModel, load_model
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
    Example,
    Messages,
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
    StepMetrics,
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
    """train_draft on this process: the module docstring's steps 1-5, each a helper below."""
    _check_settings(cfg)
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    openers, convs = _read_inputs(cfg)
    device = start(ranks, resolve_device(cfg.device))
    if not ranks.main:  # one voice: rank 0 logs and shows progress
        cfg = dataclasses.replace(cfg, progress=False)
        logging.getLogger("specscope").setLevel(logging.WARNING)
    cfg, loaded, tokenizer = _load_target(cfg, device)
    target, tcfg = loaded.model, loaded.config
    convs = _conversations(cfg, target, tokenizer, convs, openers, out, ranks)
    data = _examples(cfg, tokenizer, convs)

    init = _init_draft(cfg, tcfg)
    layer_ids = tuple(sorted(cfg.layer_ids)) if cfg.layer_ids else \
        tuple(init.config.aux_layer_ids) if init is not None else \
        default_layer_ids(tcfg.num_layers)
    target.set_taps(layer_ids)
    ckpt_root = out / "checkpoints"
    fingerprint, ckpt = _find_checkpoint(cfg, ranks, ckpt_root, data.n_examples)
    counts = token_counts(data.train, tcfg.vocab_size)
    draft, state = _starting_draft(cfg, ckpt, fingerprint, init, target, layer_ids, counts)
    coverage, draft_ids = _place_draft(cfg, draft, target, counts, device)

    total = _total_steps(cfg, data.train, ranks)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt, sched = _optimizer(cfg, params, total)
    run = _Run(cfg=cfg, ranks=ranks, device=device, out=out, ckpt_root=ckpt_root,
               fingerprint=fingerprint, target=target, draft=draft, draft_ids=draft_ids,
               train=data.train, held=data.held, params=params, opt=opt, sched=sched,
               total=total)
    if state is not None:
        run.resume(state)
    run.tap_cache = _tap_cache(cfg, ranks, data.n_tokens, layer_ids, tcfg.hidden_size,
                               fingerprint)
    stopped = _train_loop(run, t_start)
    if stopped is None:
        return ckpt_root  # emulated kill: only checkpoints survive
    return _finish(run, loaded, layer_ids, coverage, data.n_tokens, stopped)


def _check_settings(cfg: TrainConfig) -> None:
    """Reject bad export formats, TTT settings and answer caps before the (slow) model load,
    so a typo costs seconds."""
    for fmt in cfg.export_formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    if cfg.ttt_length < 1:
        raise ValueError(f"--ttt-length must be >= 1, got {cfg.ttt_length}")
    check_attention(cfg.ttt_attention)  # before the (slow) model load
    if cfg.max_answer_tokens is not None:
        check_answer_cap(cfg.max_answer_tokens)  # before the (slow) model load


def _read_inputs(cfg: TrainConfig) -> tuple[list[str] | None, list[Messages]]:
    """(self-prompt openers, conversations) read from their files before the model loads:
    missing or bad data fails fast."""
    if not cfg.data and not cfg.self_prompts:
        raise ValueError("no training data: pass --data FILE... and/or --self-prompts N")
    if cfg.self_prompts < 0:
        raise ValueError(f"--self-prompts must be >= 0, got {cfg.self_prompts}")
    openers = read_openers(cfg.self_prompt_openers)  # a bad file fails before the model loads
    convs = read_conversations(cfg.data)  # before the (slow) model load: bad data fails fast
    return openers, convs


def _load_target(cfg: TrainConfig, device: torch.device
                 ) -> tuple[TrainConfig, LoadedModel, Tokenizer]:
    """The target (bf16 on CUDA), the settings resolved for its size, and its tokenizer,
    which must have a chat template: the loss mask is the template's assistant tokens."""
    tdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load_model(cfg.target, dtype=tdtype, device=device, cache_dir=cfg.cache_dir)
    tcfg = loaded.config
    cfg = cfg.resolved(tcfg.hidden_size, tcfg.vocab_size, device)
    tokenizer = Tokenizer(loaded.path, tcfg.eos_token_ids)
    if not tokenizer.has_chat_template:
        raise ValueError(f"{loaded.path}: the target's tokenizer has no chat template; "
                         f"train-draft needs one to find the assistant tokens")
    return cfg, loaded, tokenizer


def _conversations(cfg: TrainConfig, target: TargetModel, tokenizer: Tokenizer,
                   convs: list[Messages], openers: list[str] | None, out: Path, ranks: Ranks
                   ) -> list[Messages]:
    """The training conversations: the files' plus any self-prompts, every assistant turn
    regenerated by the target unless --no-regenerate (the draft learns the target's own
    distribution). Both steps resume from their files under `out`."""
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
    return convs


@dataclasses.dataclass
class _Data:
    """The tokenized examples: the train and held-out splits, how many examples there were
    before the split (part of the run's fingerprint) and the train split's token count."""

    train: list[Example]
    held: list[Example]
    n_examples: int
    n_tokens: int


def _examples(cfg: TrainConfig, tokenizer: Tokenizer, convs: list[Messages]) -> _Data:
    """Tokenize with the chat template (assistant-only loss mask), cap answers, drop
    examples with nothing to learn, and hold out the eval split."""
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
    return _Data(train=train, held=held, n_examples=len(examples), n_tokens=n_tokens)


def _init_draft(cfg: TrainConfig, tcfg: ModelConfig) -> LoadedDraft | None:
    """The --init-from draft (its weights, taps and vocabulary to continue from), or None."""
    if not cfg.init_from:
        return None
    init = load_draft(cfg.init_from, tcfg, dtype=torch.float32, device="cpu",
                      layer_ids=list(cfg.layer_ids) if cfg.layer_ids else None)
    log.info("train-draft: starting from %s (%s)", cfg.init_from, init.message)
    return init


def _find_checkpoint(cfg: TrainConfig, ranks: Ranks, ckpt_root: Path, n_examples: int
                     ) -> tuple[str, Path | None]:
    """(the run's fingerprint, the checkpoint to resume from or None). Rank 0 clears a
    partial checkpoint a killed save left behind."""
    fingerprint = run_fingerprint(cfg, n_examples)
    if ranks.active:  # a step is `world` batches: resume only with as many processes
        fingerprint = f"{fingerprint}-w{ranks.world}"
    ckpt = latest_checkpoint(ckpt_root) if cfg.resume else None
    if cfg.resume and ckpt is None:
        log.info("train-draft: --resume but no checkpoint in %s; starting fresh", ckpt_root)
    if ranks.main:
        remove_partial(ckpt_root)
    return fingerprint, ckpt


def _starting_draft(cfg: TrainConfig, ckpt: Path | None, fingerprint: str,
                    init: LoadedDraft | None, target: TargetModel, layer_ids: tuple[int, ...],
                    counts: torch.Tensor) -> tuple[Eagle3Draft, dict[str, Any] | None]:
    """(the draft to train, the checkpoint state to resume or None): a checkpoint's draft
    (only of the same fingerprint: other data or settings would not continue the run), else
    the --init-from draft, else a new one over the most frequent assistant tokens."""
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
        return draft, state
    if init is not None:
        draft = init.model.requires_grad_(True).train()
        if cfg.draft_vocab_size not in (None, draft.config.draft_vocab_size):
            log.warning("train-draft: --init-from keeps its draft vocabulary of %d; "
                        "--draft-vocab-size %d is ignored", draft.config.draft_vocab_size,
                        cfg.draft_vocab_size)
        return draft, None
    vocab_ids = frequent_vocab(counts, cfg.draft_vocab_size)
    return new_draft(target, layer_ids, vocab_ids, cfg.num_layers, cfg.seed), None


def _place_draft(cfg: TrainConfig, draft: Eagle3Draft, target: TargetModel,
                 counts: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Log the draft vocabulary's coverage of the assistant tokens, move the draft to
    `device` on the target, with rope for the longest unroll; returns (coverage, the target
    ids of the draft vocabulary)."""
    coverage = vocab_coverage(counts, draft.to_target(torch.arange(
        draft.config.draft_vocab_size)))
    log.info("train-draft: draft vocab %d covers %.2f%% of assistant tokens",
             draft.config.draft_vocab_size, 100 * coverage)
    draft.to(device)
    draft.attach_target(target)
    draft.ensure_rope(cfg.max_len + cfg.ttt_length + 2)
    draft_ids = draft.to_target(torch.arange(draft.config.draft_vocab_size, device=device))
    return coverage, draft_ids


def _total_steps(cfg: TrainConfig, train: list[Example], ranks: Ranks) -> int:
    """The run's optimizer steps (--max-steps, else the epochs' worth). A step takes `world`
    batches of the shared order, one per rank (the epoch's remainder is left out so the
    ranks stay in step)."""
    batches_per_epoch = len(token_batches(train, cfg.batch_tokens, cfg.seed, 0)) // ranks.world
    if batches_per_epoch < 1:
        raise ValueError(f"{len(train)} training examples make fewer batches than the "
                         f"{ranks.world} processes; use fewer processes or smaller "
                         f"--batch-tokens")
    return cfg.max_steps or cfg.epochs * batches_per_epoch


def _optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter], total: int
               ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warmup and cosine decay to min_lr_ratio over `total` steps."""
    opt = torch.optim.AdamW(params, lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(total, max(1, int(cfg.warmup_ratio * total)), cfg.min_lr_ratio))
    return opt, sched


def _tap_cache(cfg: TrainConfig, ranks: Ranks, n_tokens: int, layer_ids: tuple[int, ...],
               hidden: int, fingerprint: str) -> TapCache | None:
    """The --tap-cache (target taps kept on disk across epochs), its size announced by rank
    0, or None."""
    if not cfg.tap_cache:
        return None
    size = TapCache.estimate_bytes(n_tokens, len(layer_ids), hidden)
    if ranks.main:  # the ranks share one cache (per-example files, atomic renames)
        print(f"train-draft: the tap cache in {cfg.tap_cache} will take about "
              f"{size / 1e9:.2f} GB ({n_tokens} tokens x {len(layer_ids) + 1} x "
              f"{hidden} bf16)", file=sys.stderr)
    return TapCache(cfg.tap_cache, fingerprint)


@dataclasses.dataclass
class _Run:
    """What the training loop shares: the settings, models, data and optimizer, and where
    the run is (step, epoch, position in the epoch's batch order, metrics history), which a
    checkpoint saves and a resume restores."""

    cfg: TrainConfig
    ranks: Ranks
    device: torch.device
    out: Path
    ckpt_root: Path
    fingerprint: str
    target: TargetModel
    draft: Eagle3Draft
    draft_ids: torch.Tensor
    train: list[Example]
    held: list[Example]
    params: list[torch.nn.Parameter]
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    total: int
    tap_cache: TapCache | None = None
    step: int = 0
    epoch: int = 0
    pos_in_epoch: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue where the checkpoint `state` left off (bit-for-bit: RNG included)."""
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.pos_in_epoch = state["pos_in_epoch"]
        self.history = state["history"]
        torch.set_rng_state(state["rng_cpu"])

    def record(self, entry: dict[str, Any]) -> None:
        """Append a metrics entry to the history (and, on rank 0, to metrics.jsonl)."""
        self.history.append(entry)
        if self.ranks.main:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def checkpoint(self) -> None:
        """Check the ranks hold the same weights, then rank 0 saves an atomic checkpoint."""
        check_in_sync(self.params, self.ranks)
        if not self.ranks.main:
            return
        draft = self.draft
        save_checkpoint(self.ckpt_root, self.step, {
            "fingerprint": self.fingerprint, "draft_config": dataclasses.asdict(draft.config),
            "draft": {k: v.detach().cpu() for k, v in draft.state_dict().items()},
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "step": self.step, "epoch": self.epoch, "pos_in_epoch": self.pos_in_epoch,
            "history": self.history, "rng_cpu": torch.get_rng_state(),
            "train_config": dataclasses.asdict(self.cfg)})


class _RunningSums:
    """Training metrics summed since the last log line. They stay on the device and are read
    once per log line (or per step when a progress bar shows them): a read per step would
    make the host wait for every step."""

    def __init__(self, ttt_length: int, device: torch.device) -> None:
        self.sums = torch.zeros(4, ttt_length, device=device)  # count, correct, chain, reached
        self.loss = torch.zeros((), device=device)
        self.n = 0

    def add(self, loss: torch.Tensor, m: StepMetrics) -> None:
        self.sums += torch.stack([m.count, m.correct, m.chain, m.reached]).float()
        self.loss += loss.detach().float()
        self.n += 1

    def reset(self) -> None:
        self.sums.zero_()
        self.loss.zero_()
        self.n = 0


def _train_loop(run: _Run, t_start: float) -> str | None:
    """Train until run.total steps or the time budget; returns why it stopped ("finished" or
    the budget), or None after --stop-after-steps (an emulated kill, for resume tests)."""
    cfg, ranks = run.cfg, run.ranks
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.device.type == "cuda")
    bar = _progress(run.total, run.step, cfg.progress and ranks.main)
    stopped = "finished"
    sums = _RunningSums(cfg.ttt_length, run.device)
    t_train = time.perf_counter()
    while run.step < run.total:
        order = token_batches(run.train, cfg.batch_tokens, cfg.seed, run.epoch)
        while run.pos_in_epoch + ranks.world <= len(order) and run.step < run.total:
            gnorm = _train_step(run, order[run.pos_in_epoch + ranks.rank], autocast, sums)
            if bar is not None:
                acc = (sums.sums[1] / sums.sums[0].clamp_min(1)).tolist()
                bar.set_postfix_str(f"loss {float(sums.loss) / sums.n:.3f} acc " +
                                    " ".join(f"{a:.2f}" for a in acc[:4]), refresh=False)
                bar.update(1)
            if run.step % cfg.log_every == 0 or run.step == run.total:
                _log_step(run, sums, gnorm, t_train, quiet=bar is not None)
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < run.total:
                _evaluate_step(run)
            if cfg.save_every and run.step % cfg.save_every == 0:
                run.checkpoint()
            if cfg.stop_after_steps is not None and run.step >= cfg.stop_after_steps:
                if bar is not None:
                    bar.close()
                return None
            if _over_budget(run, t_start):
                stopped = f"time budget of {cfg.budget_minutes} min reached"
                break
        if stopped != "finished":
            break
        if run.pos_in_epoch + ranks.world > len(order):
            run.epoch += 1
            run.pos_in_epoch = 0
    if bar is not None:
        bar.close()
    return stopped


def _train_step(run: _Run, idx: list[int], autocast: torch.autocast, sums: _RunningSums
                ) -> torch.Tensor:
    """One optimizer step on this rank's batch `idx` (example indices): the target's taps
    and distribution computed online (or from the tap cache), the draft unrolled for
    ttt_length steps, gradients averaged over the ranks and clipped. Advances the run's
    position and adds to `sums`; returns the gradient norm before clipping."""
    cfg = run.cfg
    batch = target_batch(run.target, [run.train[i] for i in idx], run.draft_ids, run.device,
                         idx, run.tap_cache)
    with autocast:
        loss, _, m = ttt_loss(run.draft, batch, cfg.ttt_length, cfg.loss_decay,
                              cfg.ttt_attention)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    average_gradients(run.params, run.ranks)
    gnorm = torch.nn.utils.clip_grad_norm_(run.draft.parameters(), cfg.grad_clip)
    run.opt.step()
    run.sched.step()
    run.step += 1
    run.pos_in_epoch += run.ranks.world
    sums.add(loss, m)
    return gnorm


def _log_step(run: _Run, sums: _RunningSums, gnorm: torch.Tensor, t_train: float,
              quiet: bool) -> None:
    """Record the metrics since the last log line, summed over the ranks (loss, top-1 and
    acceptance by position), log them unless a progress bar shows them (`quiet`), and start
    the sums afresh."""
    all_sum(sums.sums, run.ranks)
    all_sum(sums.loss, run.ranks)
    sums.n *= run.ranks.world
    s = sums.sums.cpu()
    rates = acceptance(s[2], s[3])
    run.record({"step": run.step, "epoch": run.epoch, "lr": run.sched.get_last_lr()[0],
                "loss": round(float(sums.loss) / sums.n, 5),
                "grad_norm": round(float(gnorm), 4),
                "top1_by_position": [round(float(c / max(n, 1)), 4) for c, n in
                                     zip(s[1], s[0], strict=True)],
                "acceptance_by_position": [round(a, 4) for a in rates],
                "elapsed_s": round(time.perf_counter() - t_train, 1)})
    if not quiet and run.cfg.progress:
        h = run.history[-1]
        log.info("step %d/%d epoch %d lr %.2e loss %.4f top1 %s (%.0fs)", run.step,
                 run.total, run.epoch, h["lr"], h["loss"],
                 " ".join(f"{a:.3f}" for a in h["top1_by_position"]),
                 h["elapsed_s"])
    sums.reset()


def _evaluate_step(run: _Run) -> None:
    """A periodic held-out evaluation (rank 0 evaluates, the others wait), recorded and
    logged."""
    ev = evaluate(run.draft, run.target, run.held, run.cfg, run.device) \
        if run.ranks.main else {}
    barrier(run.ranks)
    run.record({"step": run.step, "eval": ev})
    log.info("eval at step %d: acceptance %s, accept length %s (engine walk; "
             "formula %s)", run.step, ev.get("acceptance_by_position"),
             ev.get("walk_accept_length"), ev.get("predicted_accept_length"))


def _over_budget(run: _Run, t_start: float) -> bool:
    """Whether --budget-minutes is spent. Data-parallel, the ranks agree on stopping at log
    steps (a collective per step would make the host wait for every step)."""
    cfg, ranks = run.cfg, run.ranks
    return cfg.budget_minutes is not None and (
        not ranks.active or run.step % cfg.log_every == 0 or run.step == run.total) and \
        any_rank(time.perf_counter() - t_start > cfg.budget_minutes * 60, ranks, run.device)


def _finish(run: _Run, loaded: LoadedModel, layer_ids: tuple[int, ...], coverage: float,
            n_tokens: int, stopped: str) -> Path:
    """The final held-out evaluation and checkpoint, then (rank 0) the export in every
    requested format with its provenance block; returns the first format's directory."""
    cfg, ranks, draft = run.cfg, run.ranks, run.draft
    final_eval = evaluate(draft, run.target, run.held, cfg, run.device) if ranks.main else {}
    run.record({"step": run.step, "eval": final_eval, "final": True, "stopped": stopped})
    run.checkpoint()
    if not ranks.main:
        return run.out / "draft"  # rank 0 exports
    log.info("train-draft: %s at step %d/%d; held-out acceptance %s, accept length %s "
             "(engine walk; formula %s)", stopped, run.step, run.total,
             final_eval.get("acceptance_by_position"), final_eval.get("walk_accept_length"),
             final_eval.get("predicted_accept_length"))
    provenance = build_provenance(
        cfg, target_source=loaded.source, target_config=loaded.config, layer_ids=layer_ids,
        draft_vocab_size=draft.config.draft_vocab_size, coverage=coverage,
        train_examples=len(run.train), train_tokens=n_tokens, steps=run.step,
        epochs=run.epoch, stopped=stopped, processes=ranks.world, heldout=final_eval)
    export_dtype = getattr(torch, cfg.export_dtype)
    exported = None
    for fmt in cfg.export_formats:
        name = "draft" if fmt == cfg.export_formats[0] else f"draft-{fmt}"
        d = save_draft(draft, draft.config, run.out / name, fmt, provenance=provenance,
                       dtype=export_dtype)
        exported = exported or d
        log.info("train-draft: exported %s (%s format)", d, fmt)
    assert exported is not None
    return exported
