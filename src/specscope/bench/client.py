"""Async serving benchmark for any OpenAI-compatible server (specscope, SGLang, vLLM).

Each prompt is one streaming request: chat prompts (message lists) go to
`/v1/chat/completions`, raw string prompts to `/v1/completions`. Only portable request
fields are sent (`stream_options.include_usage`, no `ignore_eos`), so outputs stop at EOS
exactly as a real client's would. A semaphore bounds the requests in flight.

Per request: TTFT (time to the first content chunk), inter-token latencies (gaps between
content chunks), completion tokens (the final `usage`, else the number of content chunks),
total latency, and the error if any (an error never stops the run). The speculative accept
length comes from specscope's `usage.spec` or SGLang-style `spec_accept_length` /
`spec_verify_ct` fields found anywhere in the final chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MAX_ERROR_MESSAGES = 5


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float | None = None          # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = 0.0               # seconds
    chunks: int = 0                    # content chunks seen
    completion_tokens: int = 0
    usage_tokens: bool = False         # completion_tokens came from `usage`
    accept_length: float | None = None
    cycles: int | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


# -- helpers ------------------------------------------------------------------------------


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` times `scale` (seconds -> ms); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(v * scale for v in values)

    def pct(q: float) -> float:  # linear interpolation, like numpy's default
        pos = (len(xs) - 1) * q / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def _find_key(obj: Any, key: str) -> Any:
    """The first value stored under `key` anywhere in a nested dict/list."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def _spec_stats(chunk: dict, completion_tokens: int | None) -> tuple[float | None, int | None]:
    """(accept_length, cycles) from specscope's usage.spec or SGLang-style meta fields."""
    usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
    spec = usage.get("spec") if usage else None
    if isinstance(spec, dict) and spec.get("accept_length") is not None:
        cycles = spec.get("cycles")
        return float(spec["accept_length"]), int(cycles) if cycles is not None else None
    al = _find_key(chunk, "spec_accept_length")
    verify = _find_key(chunk, "spec_verify_ct")
    if isinstance(al, (int, float)):
        return float(al), int(verify) if isinstance(verify, (int, float)) else None
    if isinstance(verify, (int, float)) and verify > 0 and completion_tokens:
        return completion_tokens / verify, int(verify)
    return None, None


def _content(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += delta.get("content") or ""
            text += delta.get("reasoning_content") or ""
        text += choice.get("text") or ""
    return text


async def list_models(client: httpx.AsyncClient, url: str) -> list[str]:
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    return [m["id"] for m in r.json().get("data", [])]


# -- one request --------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, url: str, model: str | None, prompt: Any,
               max_tokens: int, temperature: float) -> RequestResult:
    res = RequestResult()
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if isinstance(prompt, str):
        endpoint, body["prompt"] = "/v1/completions", prompt
    else:
        endpoint, body["messages"] = "/v1/chat/completions", prompt
    t0 = time.perf_counter()
    last: float | None = None
    final: dict | None = None
    try:
        async with client.stream("POST", f"{url}{endpoint}", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {r.status_code}: {text}"
                return res
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    res.error = f"stream error: {msg}"
                    return res
                now = time.perf_counter()
                if _content(chunk):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
                # (the "spec_" test on the raw line spares a walk of every token's chunk)
                if chunk.get("usage") or ("spec_" in data and (
                        _find_key(chunk, "spec_verify_ct") is not None
                        or _find_key(chunk, "spec_accept_length") is not None)):
                    final = chunk
        res.latency = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - an error never crashes the run
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    usage = final.get("usage") if final else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens, res.usage_tokens = usage["completion_tokens"], True
    else:
        res.completion_tokens = res.chunks
    if final is not None:
        res.accept_length, res.cycles = _spec_stats(final, res.completion_tokens)
    res.ok = True
    return res


# -- the run ------------------------------------------------------------------------------


def summarize(results: list[RequestResult], wall: float, config: dict) -> dict:
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.completion_tokens for r in done)
    specs = [r for r in done if r.accept_length is not None]
    accept = None
    if specs:
        if all(r.cycles for r in specs):  # token-weighted: accepted tokens / cycles
            accept = sum(r.accept_length * r.cycles for r in specs) / sum(r.cycles
                                                                          for r in specs)
        else:
            accept = sum(r.accept_length for r in specs) / len(specs)
    return {
        "completed": len(done),
        "errors": len(errors),
        "error_messages": errors[:MAX_ERROR_MESSAGES],
        "wall_s": wall,
        "total_completion_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "request_throughput": len(done) / wall if wall > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": percentiles([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": percentiles([x for r in done for x in r.itl]),
        "e2e_latency_ms": percentiles([r.latency for r in done]),
        "accept_length": accept,
        "spec_requests": len(specs),
        "config": config,
    }


async def run_bench(url: str, *, model: str | None, prompts: list, concurrency: int,
                    max_tokens: int, temperature: float = 0.0, timeout: float = 600.0,
                    progress: bool = True) -> dict:
    """Stream every prompt to the server at `url` (at most `concurrency` at once); a dict
    of throughput, latency percentiles (ms), accept length and errors (see `summarize`)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    limits = httpx.Limits(max_connections=concurrency + 2,
                          max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
                                 limits=limits) as client:
        model_error = None
        if model is None:
            try:
                ids = await list_models(client, url)
                model = ids[0] if ids else None
            except Exception as e:  # noqa: BLE001 - requests then go out without a model
                model_error = f"{type(e).__name__}: {e}"
        sem = asyncio.Semaphore(concurrency)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=f"bench {url}", unit="req")

        async def task(p: Any) -> RequestResult:
            async with sem:
                r = await _one(client, url, model, p, max_tokens, temperature)
            if bar is not None:
                bar.update(1)
            return r

        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(task(p) for p in prompts))
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
    config = {"url": url, "model": model, "num_prompts": len(prompts),
              "concurrency": concurrency, "max_tokens": max_tokens,
              "temperature": temperature, "timeout": timeout}
    out = summarize(list(results), wall, config)
    if model_error is not None:
        out["model_lookup_error"] = model_error
    return out


# -- reports ------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(result: dict) -> str:
    cfg = result.get("config", {})
    lines = [
        f"server         {cfg.get('url')}  model={cfg.get('model')}",
        f"workload       {cfg.get('num_prompts')} prompts, concurrency "
        f"{cfg.get('concurrency')}, max_tokens {cfg.get('max_tokens')}, "
        f"temperature {cfg.get('temperature')}",
        f"completed      {result['completed']}   errors {result['errors']}",
        f"wall           {result['wall_s']:.2f} s",
        f"output tok/s   {_fmt(result['output_tok_s'])}   "
        f"({result['total_completion_tokens']} tokens)",
        f"requests/s     {_fmt(result['request_throughput'], 3)}",
        f"accept length  {_fmt(result.get('accept_length'), 3)}",
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
            ("requests/s", a.get("request_throughput"), b.get("request_throughput"))]
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


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as JSON atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main_bench(args) -> int:
    """`specscope bench`: run, print the table, optionally compare and write JSON."""
    from specscope.bench.datasets import load_prompts

    prompts = load_prompts(args.dataset, args.num_prompts)
    kw = dict(prompts=prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
              temperature=getattr(args, "temperature", 0.0) or 0.0,
              timeout=getattr(args, "timeout", 600.0) or 600.0,
              progress=not getattr(args, "no_progress", False))
    result = asyncio.run(run_bench(args.url, model=args.model, **kw))
    result["config"]["dataset"] = args.dataset
    print(format_table(result))
    out: dict = result
    compare_url = getattr(args, "compare", None)
    if compare_url:
        other = asyncio.run(run_bench(compare_url, model=getattr(args, "compare_model", None),
                                      **kw))
        other["config"]["dataset"] = args.dataset
        print()
        print(format_table(other))
        print()
        print(compare(result, other))
        out = {"a": result, "b": other}
    if getattr(args, "out", None):
        write_json(args.out, out)
        print(f"\nwrote {args.out}")
    failed = result["completed"] == 0 or (compare_url and out["b"]["completed"] == 0)
    return 1 if failed else 0
