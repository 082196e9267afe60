"""Command line: `specscope generate | profile | serve | bench`. serve's flags and start-up
are in cli_serve.py, the draft commands (train-draft, doctor, convert-draft, tune) in
cli_draft.py, the parser and the flags they share in cli_args.py."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from specscope.cli_args import (
    Parser,
    add_model_args,
    add_spec_args,
    check_engine_args,
    engine_kwargs,
    fail,
    non_negative_float,
    non_negative_int,
    policy_from_args,
    positive_float,
    positive_int,
    spec_from_args,
)
from specscope.cli_draft import add_draft_commands
from specscope.cli_serve import add_serve_command
from specscope.config import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    # Ranges are SamplingParams' (checked by _sampling before the model loads), so the CLI
    # and the API say the same thing.
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (or -1) = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from specscope.engine.llm import LLM
    from specscope.engine.machine import freeze_heap

    params = _sampling(args)  # validate before the (slow) model load
    check_engine_args(args)
    spec = spec_from_args(args, machine_default=True)
    policy = policy_from_args(args, spec)
    if args.prompt is None and args.messages is None:
        args.prompt = "Write a haiku about speculative decoding."
        args.chat = True
    if args.messages is not None:
        try:
            prompt = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise ValueError(f"--messages is not valid JSON: {e}") from None
    else:
        prompt = args.prompt
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir,
              quantization=args.quantization, cuda_graphs=args.cuda_graphs,
              **engine_kwargs(args),
              compile=args.compile, spec=spec, spec_policy=policy, profile=args.profile,
              profile_interval=args.profile_interval)
    freeze_heap()  # the engine is built: no full collection stalls a cycle from here
    load_s = time.perf_counter() - t0
    final = None
    for delta in llm.stream(prompt, params, chat=args.chat):
        if not args.json:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        final = delta.output
    assert final is not None
    m = final.metrics
    if args.json:
        print(json.dumps({"text": final.text, "token_ids": final.token_ids,
                          "finish_reason": final.finish_reason, "spec": final.spec,
                          "prompt_tokens": m.prompt_tokens,
                          "completion_tokens": m.completion_tokens,
                          "ttft_s": round(m.ttft_s, 4),
                          "decode_tok_per_s": round(m.decode_tokens_per_s, 2)}))
    else:
        sys.stdout.write("\n")
        weights = llm.quantization if llm.quantization != "none" else str(llm.dtype)
        note = f" ({llm.config_note})" if llm.config_note else ""
        print(f"[{llm.model_config.architecture} {weights}{note} {llm.device} | "
              f"load {load_s:.1f}s | "
              f"prompt {m.prompt_tokens} tok | {m.completion_tokens} tok | ttft "
              f"{m.ttft_s * 1e3:.0f} ms | decode {m.decode_tokens_per_s:.1f} tok/s | "
              f"finish {final.finish_reason}]", file=sys.stderr)
        if final.spec:
            st = final.spec
            label = "SIMULATED acceptance" if st["simulated"] else "speculative"
            rates = " ".join(f"{x:.2f}" for x in st["acceptance_by_position"])
            per = " ".join(f"{x:.2f}" for x in st["acceptance_per_draft_by_position"])
            drafted = st.get("drafted_per_cycle") or []
            of = f", {sum(drafted) / len(drafted):.2f} drafted a cycle" if drafted else ""
            print(f"[{label}: {st['cycles']} cycles | accept length {st['accept_length']:.2f}"
                  f"{of} "
                  f"| acceptance by position (conditional) {rates} | (per draft) {per}]",
                  file=sys.stderr)
    return 0


def _parse_spec_list(values: list[str], base: argparse.Namespace) -> list:
    """--spec STEPS,TOPK[,NDT] (repeatable) -> SpecConfigs sharing the draft and sim flags."""
    from specscope.config import SpecConfig, chain_confidence_stop

    first = spec_from_args(base)
    if first is None:
        return []
    out = []
    for v in values:
        try:
            parts = [int(x) for x in v.split(",")]
        except ValueError:
            raise ValueError(f"--spec must be STEPS,TOPK[,NUM_DRAFT_TOKENS], got {v!r}") from None
        if len(parts) not in (2, 3):
            raise ValueError(f"--spec must be STEPS,TOPK[,NUM_DRAFT_TOKENS], got {v!r}")
        out.append(SpecConfig(draft=first.draft, num_steps=parts[0], topk=parts[1],
                              num_draft_tokens=parts[2] if len(parts) == 3 else None,
                              draft_layer_ids=first.draft_layer_ids,
                              simulate_acceptance=first.simulate_acceptance,
                              confidence_stop=chain_confidence_stop(parts[1],
                                                                    first.confidence_stop)))
    return out or [first]


def cmd_profile(args: argparse.Namespace) -> int:
    from specscope.bench.datasets import load_prompts
    from specscope.engine.llm import LLM
    from specscope.engine.machine import freeze_heap
    from specscope.profiler import format_summary
    from specscope.profiler.report import write_report
    from specscope.profiler.trace import write_chrome_trace, write_text_atomic

    params = _sampling(args)
    check_engine_args(args)
    specs = _parse_spec_list(args.spec, args)
    prompts = load_prompts(args.dataset, args.num_prompts)
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir,
              quantization=args.quantization, cuda_graphs=args.cuda_graphs,
              **engine_kwargs(args),
              compile=args.compile, profile=False, spec=None)
    freeze_heap()
    configs = ([None] if not args.no_baseline else []) + specs
    if not configs:
        raise ValueError("nothing to profile: give --draft (and --spec) or drop --no-baseline")
    prof = llm.enable_profiling(True, interval=args.profile_interval)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        tqdm = None
    summaries: list[dict] = []
    records: list = []
    for spec in configs:
        llm.set_spec(spec)
        llm.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        prof.reset()  # drop the warm-up's cycles (graph capture, first-call costs)
        it = prompts if tqdm is None else tqdm(prompts, desc=prof.config, unit="prompt")
        for prompt in it:
            llm.generate(prompt, params, chat=isinstance(prompt, str) and args.chat)
        summaries.append(prof.summary(prof.config))
        records.extend(prof.records.get(prof.config, []))
    base = summaries[0]["tok_per_s"] if summaries else 0.0
    for s in summaries:
        print(format_summary(s))
    print(f"\n{'configuration':<44} {'tok/s':>8} {'speedup':>8} {'accept len':>10} "
          f"{'attributed':>10}")
    for s in summaries:
        tau = f"{s['accept_length']:.2f}" if s["accept_length"] else "1.00"
        print(f"{s['config']:<44} {s['tok_per_s']:>8.1f} {s['tok_per_s'] / base:>7.2f}x "
              f"{tau:>10} {s['attributed']:>9.1%}")
    meta = {"model": llm.model_name, "dtype": str(llm.dtype).removeprefix("torch."),
            "device": str(llm.device), "dataset": args.dataset, "num_prompts": len(prompts),
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "draft": llm.draft_info,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    write_text_atomic(out_dir / "profile.json",
                      json.dumps({"meta": meta, "summaries": summaries}, indent=1))
    write_chrome_trace(records, out_dir / "trace.json", last=args.trace_cycles)
    write_report(summaries, records, out_dir / "report.html", meta=meta)
    print(f"wrote {out_dir / 'profile.json'}, {out_dir / 'trace.json'} (open in "
          f"ui.perfetto.dev), {out_dir / 'report.html'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specscope.bench.client import main_bench

    return main_bench(args)


def _add_bench_dataset_args(b: argparse.ArgumentParser) -> None:
    from specscope.bench.load import range_ratio_arg

    b.add_argument("--dataset", "--dataset-name", dest="dataset", default="mt_bench",
                   help="mt_bench | humaneval | gsm8k | sharegpt (with --dataset-path) | "
                        "random | a JSONL file of prompts/messages")
    b.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="the ShareGPT JSON array or JSONL for --dataset sharegpt")
    b.add_argument("--num-prompts", type=positive_int, default=80,
                   help="requests to send; more than the dataset holds is an error")
    b.add_argument("--sharegpt-output-len", type=positive_int, default=None, metavar="N",
                   help="sharegpt: max_tokens of every request (default: --max-tokens if "
                        "given, else each first answer's length, 1.3 tokens per word)")
    b.add_argument("--random-input-len", type=positive_int, default=None, metavar="N",
                   help="random: prompt length in tokens, about one word each (default 1024)")
    b.add_argument("--random-output-len", type=positive_int, default=None, metavar="N",
                   help="random: output tokens per request, sent with ignore_eos "
                        "(default 128)")
    b.add_argument("--random-range-ratio", type=range_ratio_arg, default=None,
                   metavar="R", help="random: lengths uniform in [L*(1-R), L*(1+R)], "
                                     "0 <= R < 1 (default 0: exactly L)")


def _add_bench_request_args(b: argparse.ArgumentParser) -> None:
    """The load and the request fields (vLLM's flags), and the goodput SLOs."""
    # (imported here, like cmd_bench's import: no other command needs the bench module)
    from specscope.bench.load import burstiness_arg, max_concurrency_arg, request_rate_arg
    from specscope.bench.results import goodput_arg

    b.add_argument("--request-rate", type=request_rate_arg, default=float("inf"),
                   metavar="R", help="requests per second, arrivals a Poisson process "
                                     "(default inf: all requests at once)")
    b.add_argument("--burstiness", type=burstiness_arg, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals at a finite "
                        "--request-rate: 1.0 = Poisson (default), < 1 burstier, > 1 more even")
    b.add_argument("--seed", type=int, default=0,
                   help="seed of the arrival gaps and the random dataset, for reproducible "
                        "runs (default 0)")
    b.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency",
                   type=max_concurrency_arg, default=None, metavar="N",
                   help="cap on requests in flight (--concurrency is the old name); default: "
                        "1 when --request-rate is inf (one at a time), else no cap")
    b.add_argument("--max-tokens", type=positive_int, default=None,
                   help="max_tokens of each request (default 256; sharegpt: see "
                        "--sharegpt-output-len; not for random)")
    b.add_argument("--ignore-eos", action="store_true",
                   help='send "ignore_eos": true (specscope, vLLM and SGLang accept it), so '
                        "every request produces max_tokens tokens (always on for random)")
    b.add_argument("--temperature", type=non_negative_float, default=0.0)
    b.add_argument("--timeout", type=positive_float, default=600.0,
                   help="per-request timeout (s)")
    b.add_argument("--goodput", nargs="+", type=goodput_arg, default=None,
                   metavar="KEY:MS", help="SLOs for request_goodput (requests/s meeting all "
                                          "of them), KEY one of ttft, tpot, e2el, e.g. "
                                          "--goodput ttft:500 tpot:50")


def _add_bench_output_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--save-result", action="store_true",
                   help="write the result as vLLM's flat JSON (see --result-dir)")
    b.add_argument("--result-dir", default=None, metavar="DIR",
                   help="directory for --save-result (default .; implies --save-result)")
    b.add_argument("--result-filename", default=None, metavar="NAME",
                   help="file name for --save-result (default openai-{rate}qps"
                        "[-concurrency{N}]-{model}-{date}.json; implies --save-result)")
    b.add_argument("--out", default=None,
                   help="write specscope's nested result JSON here (--compare: {a, b})")
    b.add_argument("--compare", default=None, metavar="URL2",
                   help="also run the same prompts against URL2 and print B/A ratios")
    b.add_argument("--compare-model", default=None,
                   help="model id for --compare (default: URL2's first /v1/models id)")
    b.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (specscope, "
                                     "SGLang, vLLM): throughput, TTFT/TPOT/ITL, accept length")
    b.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", default=None,
                   help="model id to send (default: the first id from GET /v1/models)")
    _add_bench_dataset_args(b)
    _add_bench_request_args(b)
    _add_bench_output_args(b)
    b.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specscope", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    add_model_args(g)
    _add_sampling_args(g)
    add_spec_args(g)
    g.add_argument("--prompt", default=None, help="the prompt (default: a demo chat prompt)")
    g.add_argument("--messages", default=None,
                   help='chat messages as JSON, e.g. \'[{"role":"user","content":"hi"}]\'')
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--profile", action="store_true", default=None,
                   help="time every phase of every cycle (also SPECSCOPE_PROFILE=1)")
    g.add_argument("--profile-interval", type=positive_int, default=None,
                   help="log a phase summary every N cycles (default 100 when profiling)")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("profile", help="phase table of plain and speculative decoding on a "
                                       "workload, in one process")
    add_model_args(p)
    _add_sampling_args(p)
    add_spec_args(p)
    p.add_argument("--spec", action="append", default=[],
                   help="a speculative configuration STEPS,TOPK[,NUM_DRAFT_TOKENS] "
                        "(repeatable; default: --num-steps/--topk/--num-draft-tokens)")
    p.add_argument("--dataset", default="mt_bench",
                   help="mt_bench | humaneval | gsm8k | a JSONL file of prompts/messages")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--chat", action="store_true",
                   help="send raw string prompts through the chat template")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding")
    p.add_argument("--out", default="specscope-profile",
                   help="directory for profile.json, trace.json and report.html")
    p.add_argument("--trace-cycles", type=non_negative_int, default=200,
                   help="cycles per configuration kept in the trace")
    p.add_argument("--profile-interval", type=positive_int, default=None,
                   help="also log a summary every N cycles")
    p.set_defaults(func=cmd_profile, max_tokens=128)

    _add_bench_command(sub)
    add_serve_command(sub)
    add_draft_commands(sub, add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.verbose or args.command == "train-draft" or \
        getattr(args, "profile", None) or \
        getattr(args, "profile_interval", None) or os.environ.get("SPECSCOPE_PROFILE")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    if getattr(args, "log_level", None):  # serve: its level is specscope's own too
        logging.getLogger("specscope").setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except (ValueError, OSError, TypeError, RuntimeError) as e:  # what the checks raise
        return fail("specscope", str(e))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a library's own error type, or a bug: still one line
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (specscope -v ... prints the traceback)"
        return fail("specscope", f"{type(e).__name__}: {e}{hint}")


if __name__ == "__main__":
    sys.exit(main())
