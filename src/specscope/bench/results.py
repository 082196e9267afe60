"""A benchmark run's results: per request (RequestResult), the summary (throughput, latency
percentiles, goodput against SLOs, accept length), the text tables and comparison, and the
saved files (specscope's JSON and vLLM's flat result record), written atomically."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

MAX_ERROR_MESSAGES = 5


GOODPUT_KEYS = ("ttft", "tpot", "e2el")  # vLLM's SLO names (milliseconds)


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float | None = None          # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = 0.0               # seconds
    chunks: int = 0                    # content chunks seen
    completion_tokens: int = 0
    usage_tokens: bool = False         # completion_tokens came from `usage`
    prompt_tokens: int | None = None   # the final usage.prompt_tokens, None if not reported
    accept_length: float | None = None
    cycles: int | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 and std (population, numpy's default) of `values` times `scale`
    (seconds -> ms); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "std": None}
    xs = sorted(v * scale for v in values)

    def pct(q: float) -> float:  # linear interpolation, like numpy's default
        pos = (len(xs) - 1) * q / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {"mean": mean, "p50": pct(50), "p90": pct(90), "p99": pct(99), "std": std}


def goodput_arg(text: str) -> tuple[str, float]:
    """argparse type of one --goodput item, KEY:MS with KEY in GOODPUT_KEYS."""
    key, sep, value = text.partition(":")
    try:
        ms = float(value) if sep else math.nan
    except ValueError:
        ms = math.nan
    if key not in GOODPUT_KEYS or not math.isfinite(ms) or ms < 0:
        raise argparse.ArgumentTypeError(
            f"must be KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_KEYS)} and a "
            f"finite number >= 0, e.g. ttft:500; got {text!r}")
    return key, ms


def check_goodput(slos: dict[str, float] | None) -> None:
    """ValueError for an SLO name vLLM does not define or a bound that is not a number >= 0."""
    for key, ms in (slos or {}).items():
        if key not in GOODPUT_KEYS:
            raise ValueError(f"goodput SLO {key!r} is not one of {', '.join(GOODPUT_KEYS)}")
        if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"goodput SLO {key}:{ms} must be a finite number of ms >= 0")


def goodput_dict(pairs: list[tuple[str, float]] | None) -> dict[str, float] | None:
    """--goodput's pairs as a dict; a key given twice is an error (which bound is meant?)."""
    if not pairs:
        return None
    out: dict[str, float] = {}
    for key, ms in pairs:
        if key in out:
            raise ValueError(f"--goodput gives {key} twice ({out[key]:g} and {ms:g} ms)")
        out[key] = ms
    return out


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A completed request within every bound (vLLM's test: value <= bound). A request of
    one token has no TPOT, which passes (vLLM counts it as 0)."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
    for key, ms in slos.items():
        value = values[key]
        if value is None or value * 1000.0 > ms:
            return False
    return True


def _accept_from_responses(done: list[RequestResult]) -> tuple[float | None, int]:
    """(accept length over the requests that report one, how many do)."""
    specs = [r for r in done if r.accept_length is not None]
    if not specs:
        return None, 0
    if all(r.cycles for r in specs):  # token-weighted: accepted tokens / cycles
        return sum(r.accept_length * r.cycles for r in specs) / sum(r.cycles
                                                                     for r in specs), len(specs)
    return sum(r.accept_length for r in specs) / len(specs), len(specs)


def per_request(results: list[RequestResult]) -> dict[str, list]:
    """vLLM's per-request lists, in prompt order: input_lens (None: not reported),
    output_lens (0 for a failed request), ttfts and itls (seconds), errors ("" if none)."""
    return {"input_lens": [r.prompt_tokens for r in results],
            "output_lens": [r.completion_tokens if r.ok else 0 for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error or "" for r in results],
            "accept_lengths": [r.accept_length for r in results]}


def summarize(results: list[RequestResult], wall: float, config: dict,
              goodput: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.completion_tokens for r in done)
    known_in = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    # None, not 0, when no response reported usage.prompt_tokens: unknown is not zero
    inputs = sum(known_in) if known_in else None
    accept, n_spec = _accept_from_responses(done)

    def rate(x: float | None) -> float | None:
        return None if x is None else (x / wall if wall > 0 else 0.0)

    return {
        "completed": len(done),
        "errors": len(errors),
        "error_messages": errors[:MAX_ERROR_MESSAGES],
        "wall_s": wall,
        "total_completion_tokens": tokens,
        "total_input_tokens": inputs,
        "input_tokens_reported": len(known_in),
        "output_tok_s": rate(tokens),
        "total_token_throughput": rate(None if inputs is None else inputs + tokens),
        "request_throughput": rate(len(done)),
        "request_goodput": rate(sum(meets_slos(r, goodput) for r in done))
        if goodput else None,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": percentiles([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": percentiles([x for r in done for x in r.itl]),
        "e2e_latency_ms": percentiles([r.latency for r in done]),
        "accept_length": accept,
        "accept_length_source": "responses" if accept is not None else None,
        "spec_requests": n_spec,
        "config": config,
        "per_request": per_request(results),
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _load_text(cfg: dict) -> str:
    """The load settings of a result's config: rate (None = inf), burstiness, cap."""
    rate = cfg.get("request_rate")
    cap = cfg.get("max_concurrency", cfg.get("concurrency"))  # earlier JSON: concurrency
    text = "request rate inf (no gaps between arrivals)" if rate is None else \
        f"request rate {rate:g}/s, burstiness {cfg.get('burstiness', 1.0):g}"
    return f"{text}, max concurrency {'unlimited' if cap is None else cap}"


def _workload_text(cfg: dict) -> str:
    max_tokens = cfg.get("max_tokens")
    text = f"{cfg.get('num_prompts')} prompts"
    if cfg.get("dataset"):
        text += f" of {cfg['dataset']}"
    text += ", max_tokens " + ("per request" if max_tokens is None else str(max_tokens))
    text += f", temperature {cfg.get('temperature')}"
    return text + (", ignore_eos" if cfg.get("ignore_eos") else "")


def _goodput_text(result: dict) -> str:
    slos = result.get("config", {}).get("goodput")
    bounds = "  ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
    return f"goodput        {_fmt(result.get('request_goodput'), 3)} req/s   ({bounds})"


def format_table(result: dict) -> str:
    cfg = result.get("config", {})
    rate = cfg.get("request_rate")
    source = result.get("accept_length_source")
    lines = [
        f"server         {cfg.get('url')}  model={cfg.get('model')}",
        f"workload       {_workload_text(cfg)}",
        f"load           {_load_text(cfg)}",
        f"completed      {result['completed']}   errors {result['errors']}",
        f"wall           {result['wall_s']:.2f} s",
        f"input tokens   {_fmt(result.get('total_input_tokens'), 0)}   (usage.prompt_tokens)",
        f"output tok/s   {_fmt(result['output_tok_s'])}   "
        f"({result['total_completion_tokens']} tokens)",
        f"total tok/s    {_fmt(result.get('total_token_throughput'))}   (input + output)",
        f"requests/s     {_fmt(result['request_throughput'], 3)} achieved   (target "
        f"{'inf' if rate is None else f'{rate:g}'})",
        *([_goodput_text(result)] if cfg.get("goodput") else []),
        f"accept length  {_fmt(result.get('accept_length'), 3)}"
        + (f"   (from {source})" if source else ""),
        "",
        f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2e_latency_ms")):
        s = result.get(key) or {}
        lines.append(f"{name:<8}" + "".join(f"{_fmt(s.get(q)):>10}"
                                            for q in ("mean", "p50", "p90", "p99")))
    for msg in result.get("error_messages", []):
        lines.append(f"error: {msg}")
    return "\n".join(lines)


def _ratio(b: float | None, a: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.3f}x"


def compare(a: dict, b: dict) -> str:
    """Ratios B / A of throughput and latencies (A = first server, B = second)."""
    rows = [("output tok/s", a.get("output_tok_s"), b.get("output_tok_s")),
            ("total tok/s", a.get("total_token_throughput"), b.get("total_token_throughput")),
            ("requests/s", a.get("request_throughput"), b.get("request_throughput"))]
    if a.get("request_goodput") is not None or b.get("request_goodput") is not None:
        rows.append(("goodput (req/s)", a.get("request_goodput"), b.get("request_goodput")))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms")):
        for q in ("mean", "p50", "p99"):
            rows.append((f"{name} {q} (ms)", (a.get(key) or {}).get(q),
                         (b.get(key) or {}).get(q)))
    rows.append(("accept length", a.get("accept_length"), b.get("accept_length")))
    ua, ub = a.get("config", {}).get("url"), b.get("config", {}).get("url")
    lines = [f"A = {ua}", f"B = {ub}", "",
             f"{'metric':<18}{'A':>12}{'B':>12}{'B/A':>10}"]
    for name, x, y in rows:
        lines.append(f"{name:<18}{_fmt(x):>12}{_fmt(y):>12}{_ratio(y, x):>10}")
    return "\n".join(lines)


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write `obj` as JSON atomically (a temp file in the same directory, then a
    rename), so a reader never sees a half-written result, even after a crash."""
    from specscope.profiler.trace import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def _flat_stats(result: dict, name: str, key: str) -> dict[str, float | None]:
    s = result.get(key) or {}
    return {f"mean_{name}_ms": s.get("mean"), f"median_{name}_ms": s.get("p50"),
            f"std_{name}_ms": s.get("std"), f"p99_{name}_ms": s.get("p99")}


def vllm_record(result: dict, date: str | None = None) -> dict:
    """`result` (run_bench's) as one flat JSON object with the keys of `vllm bench serve
    --save-result`, so tools that read vLLM's results read it, plus specscope's own
    (url, dataset, seed, max_tokens, temperature, ignore_eos, slo_*_ms, accept_length when
    known). As vLLM writes it, request_rate is "inf" for an infinite rate."""
    cfg = result.get("config", {})
    rate = cfg.get("request_rate")
    rec: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai",
        "model_id": cfg.get("model"), "num_prompts": cfg.get("num_prompts"),
        "request_rate": "inf" if rate is None else rate, "burstiness": cfg.get("burstiness"),
        "max_concurrency": cfg.get("max_concurrency"), "duration": result["wall_s"],
        "completed": result["completed"],
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result["total_completion_tokens"],
        "request_throughput": result["request_throughput"],
        "request_goodput": result.get("request_goodput"),
        "output_throughput": result["output_tok_s"],
        "total_token_throughput": result.get("total_token_throughput")}
    for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"),
                      ("e2el", "e2e_latency_ms")):
        rec.update(_flat_stats(result, name, key))
    per = result.get("per_request") or {}
    for key in ("input_lens", "output_lens", "ttfts", "itls", "errors"):
        rec[key] = per.get(key, [])
    for key in ("url", "dataset", "dataset_path", "seed", "max_tokens", "temperature",
                "ignore_eos"):
        rec[key] = cfg.get(key)
    for key, ms in (cfg.get("goodput") or {}).items():
        rec[f"slo_{key}_ms"] = ms
    if result.get("accept_length") is not None:
        rec["accept_length"] = result["accept_length"]
        rec["accept_length_source"] = result.get("accept_length_source")
    return rec


def result_path(record: dict, result_dir: str | None, result_filename: str | None) -> Path:
    """Where --save-result writes: `result_dir` (default: the current directory) /
    `result_filename`, by default named as vLLM names it,
    openai-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    name = result_filename
    if not name:
        rate, cap = record["request_rate"], record["max_concurrency"]
        rate = rate if isinstance(rate, str) else f"{rate:g}"
        model = str(record.get("model_id") or "unknown").rstrip("/").rsplit("/", 1)[-1]
        model = "".join(c if c.isalnum() or c in "._-" else "_" for c in model)
        name = (f"openai-{rate}qps{'' if cap is None else f'-concurrency{cap}'}-{model}-"
                f"{record['date']}.json")
    return Path(result_dir or ".") / name
