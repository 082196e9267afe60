"""The draft commands: `train-draft`, `doctor`, `convert-draft` and `tune`; and the draft's
start-up in `serve`: --auto-tune and the goodput guardrail."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specscope.cli_args import (
    check_draft_arg,
    check_engine_args,
    engine_kwargs,
    float_in,
    non_negative_float,
    non_negative_int,
    policy_from_args,
    positive_float,
    positive_int,
)
from specscope.config import SpecConfig

if TYPE_CHECKING:  # the command modules import heavy packages only when they run
    from specscope.engine.llm import LLM
    from specscope.server.guardrail import Guardrail

GUARDRAIL_MODES = ("warn", "off-when-slower", "off")  # server/guardrail.py's MODES
TTT_ATTENTION = ("dense", "sdpa")  # train/ttt.py's ATTENTION (tested equal)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specscope.train.trainer import TrainConfig, train_draft

    layer_ids = tuple(int(x) for x in args.layer_ids.split(",")) if args.layer_ids else None
    cfg = TrainConfig(
        target=args.target, data=args.data, out=args.out,
        draft_vocab_size=args.draft_vocab_size, layer_ids=layer_ids,
        num_layers=args.num_layers, ttt_length=args.ttt_length,
        ttt_attention=args.ttt_attention, epochs=args.epochs,
        max_steps=args.max_steps, lr=args.lr, warmup_ratio=args.warmup_ratio,
        grad_clip=args.grad_clip, batch_tokens=args.batch_tokens, max_len=args.max_len,
        max_answer_tokens=args.max_answer_tokens,
        eval_fraction=args.eval_fraction, eval_every=args.eval_every,
        save_every=args.save_every, seed=args.seed, regenerate=args.regenerate,
        regen_temperature=args.regen_temperature,
        regen_max_new_tokens=args.regen_max_new_tokens,
        regen_batch_size=args.regen_batch_size, device=args.device,
        init_from=args.init_from, self_prompts=args.self_prompts,
        self_prompt_temperature=args.self_prompt_temperature,
        self_prompt_openers=args.self_prompt_openers,
        budget_minutes=args.budget_minutes, resume=args.resume,
        export_formats=tuple(args.export_formats.split(",")), export_dtype=args.export_dtype,
        cache_dir=args.cache_dir, tap_cache=args.tap_cache)
    out = train_draft(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 exported it
        print(f"draft written to {out}; serve it with: specscope serve "
              f"{args.target or ''} --draft {out}".replace("  ", " "))
    return 0


def doctor_prompts(prompts_file: str | None, num_prompts: int) -> list:
    """The doctor's probe prompts: from a dataset or file, else a few of each built-in set."""
    from specscope.bench.datasets import load_prompts
    from specscope.doctor import default_probe_prompts

    return load_prompts(prompts_file, num_prompts) if prompts_file else \
        default_probe_prompts(num_prompts)


def doctor_report(llm, draft: str, prompts: list, layer_ids: tuple[int, ...] | None,
                  max_new_tokens: int):
    from specscope.doctor import run_doctor

    return run_doctor(llm, draft, prompts=prompts, layer_ids=layer_ids,
                      max_new_tokens=max_new_tokens)


def _layer_ids_arg(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--draft-layer-ids must be comma-separated integers, got "
                         f"{text!r}") from None


def cmd_doctor(args: argparse.Namespace) -> int:
    from specscope.engine.llm import LLM

    check_engine_args(args)  # everything that can fail does so before the target loads
    layer_ids = _layer_ids_arg(args.draft_layer_ids)
    check_draft_arg(args.draft)
    prompts = doctor_prompts(args.prompts, args.num_prompts)
    llm = LLM(args.target or args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir,
              # The wiring probe reads the target's taps on dense weights, the ones a
              # draft is trained on: the 4-bit codes' taps misread as other layers'.
              quantization="none" if args.quantization == "auto" else args.quantization,
              cuda_graphs=args.cuda_graphs,
              spec=None,
              **engine_kwargs(args))
    report = doctor_report(llm, args.draft, prompts, layer_ids, args.max_new_tokens)
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.format())
    return 0 if report.healthy else 1


def cmd_convert_draft(args: argparse.Namespace) -> int:
    from specscope.draft.convert import convert_draft

    check_draft_arg(args.input)  # before the target is resolved (a download, a conversion)
    target_config = None
    if args.target:
        from specscope.models.loader import read_config, resolve_model_dir

        target_config = read_config(resolve_model_dir(args.target, args.cache_dir))
    out = convert_draft(args.input, args.output, args.to, target_config=target_config,
                        num_target_layers=args.target_layers, target_name=args.target)
    print(f"wrote {out} ({args.to} format)")
    return 0


def served_config(text: str) -> tuple[int, int, int]:
    """--served STEPS,TOPK[,NUM_DRAFT_TOKENS] as a tuner configuration."""
    try:
        parts = [int(x) for x in text.split(",")]
        if len(parts) not in (2, 3):
            raise ValueError
    except ValueError:
        raise ValueError(f"--served must be STEPS,TOPK[,NUM_DRAFT_TOKENS], got {text!r}") \
            from None
    spec = SpecConfig(num_steps=parts[0], topk=parts[1],
                      num_draft_tokens=parts[2] if len(parts) == 3 else None)
    return spec.num_steps, spec.topk, spec.num_draft_tokens


def cmd_tune(args: argparse.Namespace) -> int:
    from specscope.bench.datasets import load_prompts
    from specscope.engine.llm import LLM
    from specscope.engine.machine import freeze_heap
    from specscope.tune.result import write_plot
    from specscope.tune.tuner import tune

    check_engine_args(args)
    check_draft_arg(args.draft)  # before the target loads
    served = served_config(args.served)
    prompts = load_prompts(args.dataset, args.num_prompts)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir,
              quantization=args.quantization, cuda_graphs=args.cuda_graphs,
              **engine_kwargs(args),
              compile=args.compile, spec=None)
    freeze_heap()
    res = tune(llm, args.draft, prompts, max_tokens=args.max_tokens, confirm=args.confirm,
               budget_seconds=args.budget_seconds, served=served,
               batch_sizes=args.batch_sizes)
    print(res.table())
    for line in res.term_lines():
        print(line)
    print(res.recommendation())
    (out_dir / "tune.json").write_text(json.dumps(res.as_dict(), indent=1) + "\n")
    write_plot(res, out_dir / "tune.svg")
    print(f"wrote {out_dir / 'tune.json'} and {out_dir / 'tune.svg'}")
    return 0


def batch_sizes(text: str) -> list[int]:
    """'4,16,64' -> [4, 16, 64] (positive integers)."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"must be comma-separated batch sizes >= 1, got "
                                         f"{text!r}")
    return out


def add_serve_draft_args(s: argparse.ArgumentParser) -> None:
    """`serve`'s start-up flags for the draft: --doctor, --auto-tune*, --guardrail*."""
    s.add_argument("--doctor", action="store_true",
                   help="run specscope doctor on the draft first; refuse to serve if unhealthy")
    s.add_argument("--auto-tune", action="store_true",
                   help="before serving, tune num_steps/topk/num_draft_tokens on a few "
                        "built-in prompts (specscope tune) and serve the best; speculation "
                        "off if nothing beats plain decoding")
    s.add_argument("--auto-tune-dataset", default="mt_bench",
                   help="mt_bench | humaneval | gsm8k | FILE.jsonl")
    s.add_argument("--auto-tune-prompts", type=positive_int, default=3)
    s.add_argument("--auto-tune-max-tokens", type=positive_int, default=64)
    s.add_argument("--auto-tune-budget-seconds", type=positive_float, default=None,
                   help="stop confirming predictions once the tuner has run this long")
    s.add_argument("--auto-tune-batch-sizes", type=batch_sizes, default=None,
                   help="also fit speculation by batch size at these batch sizes, e.g. "
                        "4,16,64, and serve that policy")
    s.add_argument("--guardrail", choices=GUARDRAIL_MODES, default=None,
                   help="compare speculative decode tok/s over a rolling window with the "
                        "predicted plain-decoding tok/s: warn logs when slower, "
                        "off-when-slower also switches speculation off (default: warn with "
                        "--draft, else off)")
    s.add_argument("--guardrail-window", type=positive_int, default=512, metavar="TOKENS",
                   help="decode tokens in the rolling window, which also holds at least 3 "
                        "requests (default 512)")
    s.add_argument("--guardrail-margin", type=float, default=0.05,  # checked below
                   help="slower means below (1 - margin) x plain tok/s (default 0.05)")


def check_serve_draft_args(args: argparse.Namespace, spec: Any) -> str:
    """Check --doctor, --auto-tune and --guardrail against the draft before the (slow) model
    load; returns the guardrail mode."""
    checkpoint = (spec is not None and spec.draft != "random"
                  and spec.simulate_acceptance is None)
    if args.doctor and not checkpoint:
        raise ValueError("--doctor checks a draft checkpoint: give --draft DIR (or "
                         "--draft default)")
    if args.auto_tune:
        if not checkpoint:
            raise ValueError("--auto-tune tunes a draft checkpoint: give --draft DIR (or "
                             "--draft default)")
        if spec.draft_layer_ids is not None:
            raise ValueError("--auto-tune does not take --draft-layer-ids: the tuner runs "
                             "the draft with its config's taps (fix them with specscope "
                             "convert-draft, or drop --auto-tune)")
        if args.auto_tune_prompts < 1 or args.auto_tune_max_tokens < 1:
            raise ValueError("--auto-tune-prompts and --auto-tune-max-tokens must be >= 1")
        from specscope.bench.datasets import load_prompts

        load_prompts(args.auto_tune_dataset, args.auto_tune_prompts)  # a bad file fails now
    mode = args.guardrail or ("warn" if spec is not None else "off")
    if mode != "off" and spec is None:
        raise ValueError(f"--guardrail {mode} compares speculative decoding with plain "
                         f"decoding: give --draft")
    if args.guardrail_window < 1 or not 0 <= args.guardrail_margin < 1:
        raise ValueError("--guardrail-window must be >= 1 and --guardrail-margin in [0, 1)")
    return mode


def start_serve_draft(llm: LLM, spec: Any, args: argparse.Namespace,
                      guardrail_mode: str) -> Guardrail | None:
    """Put the draft to work on `llm` (loaded with speculation off): --auto-tune, or
    `spec` as given; then the guardrail with its plain-decoding prediction, from the
    tuner's cost model or else a short plain calibration. Reports go to stderr. Returns
    the Guardrail, or None."""
    if spec is None:
        return None
    from specscope.bench.datasets import load_prompts
    from specscope.engine.cuda_graph import bucket_for
    from specscope.server.guardrail import Guardrail, calibrate_plain

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    timer = llm.timer  # the tuner and the calibration time their own runs
    plain: dict[int, float] | None = None
    if args.auto_tune:
        from specscope.tune.tuner import tune

        prompts = load_prompts(args.auto_tune_dataset, args.auto_tune_prompts)
        say(f"[auto-tune] {spec.draft} on {len(prompts)} {args.auto_tune_dataset} prompts, "
            f"{args.auto_tune_max_tokens} tokens each")
        res = tune(llm, spec.draft, prompts, max_tokens=args.auto_tune_max_tokens,
                   budget_seconds=args.auto_tune_budget_seconds, log=say,
                   served=(spec.num_steps, spec.topk, spec.num_draft_tokens),
                   batch_sizes=args.auto_tune_batch_sizes)
        say(res.table())
        say(res.recommendation())
        say(f"[auto-tune] serving by batch size: {res.policy.describe()}" if res.policy else
            f"[auto-tune] serving with {res.recommended}" if res.recommended else
            "[auto-tune] serving with speculation OFF (POST /admin/spec can switch it on)")
        plain = {1: res.cost.plain_tok_per_s}
        for row in res.batch_rows or []:  # each fitted batch size's measured plain decoding
            if bucket_for(row.batch) == row.batch:
                plain[row.batch] = row.plain_tok_per_s
        source = "the --auto-tune cost model" + (" and its batch-size fit"
                                                  if len(plain) > 1 else "")
    elif guardrail_mode != "off":
        calib = 32
        plain = {1: calibrate_plain(llm, load_prompts("mt_bench", 1)[0], max_tokens=calib)}
        source = f"a plain calibration at start-up ({calib} tokens, 2 runs, 1 mt_bench prompt)"
    if not args.auto_tune:
        llm.set_spec(spec, policy_from_args(args, spec))  # after the calibration: one load
    if timer is not None and plain is not None:  # a fresh profiler: it shows serving only
        llm.enable_profiling(True, timer.interval)
    if guardrail_mode == "off":
        return None
    assert plain is not None
    g = Guardrail(plain, source, mode=guardrail_mode, window_tokens=args.guardrail_window,
                  margin=args.guardrail_margin)
    w = next(iter(g.windows.values()))
    predicted = ", ".join(f"batch <= {b}: {p:.1f} tok/s" for b, p in sorted(plain.items()))
    say(f"[guardrail] {guardrail_mode}: plain decoding predicted at {predicted} (from "
        f"{source}); speculation counts as slower at a batch size below (1 - "
        f"{w.margin:g}) x its prediction over >= {w.window_tokens} tokens and "
        f"{w.min_samples} steps, for most of the window's tokens; batch sizes without a "
        f"prediction are not judged")
    return g


def _add_train_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--target", default=None,
                   help="target model: HF dir, .gguf or hub id (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    t.add_argument("--data", nargs="+", default=[],
                   help="JSONL files: OpenAI 'messages', ShareGPT 'conversations', or "
                        "prompts ('prompt' / 'question' / 'instruction')")
    t.add_argument("--out", required=True, help="run directory: regenerated data, "
                                                "checkpoints, metrics, exported draft")
    t.add_argument("--no-regenerate", dest="regenerate", action="store_false",
                   help="train on the dataset's own answers instead of the target's")
    t.add_argument("--regen-temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature of the regenerated answers (0: greedy)")
    t.add_argument("--regen-max-new-tokens", type=positive_int, default=512)
    t.add_argument("--regen-batch-size", type=positive_int, default=64)
    t.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from this trained draft (any format; its taps and vocabulary) "
                        "instead of a fresh one, with a new optimizer and schedule")
    t.add_argument("--self-prompts", type=non_negative_int, default=0, metavar="N",
                   help="add N requests written by the target itself (Magpie: its chat "
                        "template up to an opened user turn, sampled); saved to "
                        "OUT/self_prompts.jsonl")
    t.add_argument("--self-prompt-temperature", type=non_negative_float, default=0.9)
    t.add_argument("--self-prompt-openers", default=None, metavar="FILE",
                   help="first words of the self-written requests, one per line, used in "
                        "turn (e.g. 'Write a', 'Imagine you are'); the target writes the rest")
    t.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help="default: 12288 for targets under 2048 hidden, else 32000 (capped "
                        "at the target vocab)")
    t.add_argument("--layer-ids", default=None,
                   help="target tap layers, output-of-layer ids (default: EAGLE-3's "
                        "[1, L/2-1, L-4])")
    t.add_argument("--num-layers", type=positive_int, default=1, help="draft decoder layers")
    t.add_argument("--ttt-length", type=positive_int, default=7,
                   help="training-time-test unroll depth (loss weight 0.8^i per step)")
    t.add_argument("--ttt-attention", choices=TTT_ATTENTION, default="dense",
                   help="how the unrolled steps attend: dense fp32 scores (the reference) "
                        "or one masked scaled_dot_product_attention call per step (stores "
                        "no score matrix); same result")
    t.add_argument("--epochs", type=positive_int, default=1)
    t.add_argument("--max-steps", type=positive_int, default=None, help="overrides --epochs")
    t.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate (default 3e-4 small targets, 1e-4 large)")
    t.add_argument("--warmup-ratio", type=float_in(0.0, 1.0, hi_open=True), default=0.02)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--batch-tokens", type=positive_int, default=None,
                   help="padded tokens per batch (default: 2048 CPU, 32768/8192 CUDA)")
    t.add_argument("--max-len", type=positive_int, default=2048, help="tokens per conversation")
    t.add_argument("--max-answer-tokens", type=positive_int, default=None, metavar="N",
                   help="cut each example after N assistant tokens, to train where an engine "
                        "serving answers of about N tokens drafts (default: keep all)")
    t.add_argument("--eval-fraction", type=float_in(0.0, 1.0, hi_open=True), default=0.02)
    t.add_argument("--eval-every", type=non_negative_int, default=200, help="0: never")
    t.add_argument("--save-every", type=non_negative_int, default=500, help="0: never")
    t.add_argument("--seed", type=non_negative_int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--budget-minutes", type=positive_float, default=None,
                   help="stop after this long (checkpoint and export); --resume continues")
    t.add_argument("--resume", action="store_true",
                   help="continue from the last complete checkpoint in --out")
    t.add_argument("--export-formats", default="sglang",
                   help="comma list of sglang, eagle, speculators (first: OUT/draft)")
    t.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float16",
                                                                   "float32"])
    t.add_argument("--tap-cache", default=None,
                   help="optional directory caching the target's taps per example on disk "
                        "(size printed first); default: computed online each step")
    t.add_argument("--cache-dir", default=None, help="converted-GGUF cache directory")


def add_draft_commands(sub: argparse._SubParsersAction,
                       add_model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register train-draft, doctor, convert-draft and tune on the `specscope` parser."""
    d = sub.add_parser("doctor", help="check that a draft is wired to its target: static "
                                      "checks, then a probe of every plausible wiring")
    add_model_args(d)
    d.add_argument("--target", default=None, help="alias of --model")
    d.add_argument("--draft", required=True,
                   help="draft checkpoint directory, or 'default'")
    d.add_argument("--draft-layer-ids", default=None,
                   help="check these output-of-layer tap ids instead of the config's")
    d.add_argument("--prompts", default=None,
                   help="probe prompts: mt_bench | humaneval | gsm8k | FILE.jsonl "
                        "(default: a few of each built-in set)")
    d.add_argument("--num-prompts", type=positive_int, default=8)
    d.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="length of the target's answers the draft is probed on")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=cmd_doctor)

    u = sub.add_parser("tune", help="the best num_steps/topk/num_draft_tokens from a cost "
                                    "model and an acceptance model, confirmed by real runs")
    add_model_args(u)
    u.add_argument("--draft", default="default", help="draft checkpoint, or 'default'")
    u.add_argument("--dataset", default="mt_bench",
                   help="mt_bench | humaneval | gsm8k | FILE.jsonl")
    u.add_argument("--num-prompts", type=positive_int, default=4)
    u.add_argument("--max-tokens", type=positive_int, default=128)
    u.add_argument("--confirm", type=non_negative_int, default=1,
                   help="next-best predictions confirmed by real runs beyond those always "
                        "run (the top prediction, the best predicted chain and tree, and "
                        "the --served one)")
    u.add_argument("--batch-sizes", type=batch_sizes, default=None, metavar="B,B,...",
                   help="also fit speculation by batch size: re-measure the costs with B "
                        "concurrent requests for each B (e.g. 4,16,64) and print the "
                        "--spec-policy table")
    u.add_argument("--served", default="5,1", metavar="STEPS,TOPK[,NDT]",
                   help="the configuration served today, always confirmed (default 5,1)")
    u.add_argument("--budget-seconds", type=positive_float, default=None,
                   help="stop confirming once this much time is spent")
    u.add_argument("--out", default="tune-out", help="directory for tune.json and tune.svg")
    u.set_defaults(func=cmd_tune)

    c = sub.add_parser("convert-draft", help="convert a draft between the sglang, eagle and "
                                             "speculators formats (lossless)")
    c.add_argument("input", help="draft checkpoint directory (any format), or 'default'")
    c.add_argument("output", help="output directory")
    c.add_argument("--to", required=True, choices=["sglang", "eagle", "speculators"])
    c.add_argument("--target", default=None,
                   help="the target model (for its layer count); or --target-layers")
    c.add_argument("--target-layers", type=positive_int, default=None,
                   help="the target's number of decoder layers")
    c.add_argument("--cache-dir", default=None)
    c.set_defaults(func=cmd_convert_draft)

    t = sub.add_parser("train-draft", help="train an EAGLE-3 draft for a target (regenerates "
                                           "the data with the target, TTT, exports SGLang)",
                       epilog="Several GPUs: torchrun --nproc-per-node N -m specscope.cli "
                              "train-draft ... (data-parallel: regeneration and batches are "
                              "shared out, gradients averaged; rank 0 writes).")
    _add_train_args(t)
    t.set_defaults(func=cmd_train_draft)
