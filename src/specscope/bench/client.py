"""Async serving benchmark for any OpenAI-compatible server (specscope, SGLang, vLLM).

Each prompt is one streaming request: chat prompts (message lists) go to
`/v1/chat/completions`, raw string prompts to `/v1/completions`. Only portable request
fields are sent (`stream_options.include_usage`, no `ignore_eos`), so outputs stop at EOS
exactly as a real client's would.

Load: request arrival times follow a Poisson process at `request_rate` requests per second
(exponential gaps from `random.Random(seed)`; with `burstiness` != 1, gamma gaps of the same
mean, shape = burstiness: < 1 burstier, > 1 more even); an infinite rate sends every request
at once. Independently, a semaphore caps the requests in flight at `max_concurrency` (None: no
cap); an arrival that finds the cap full waits for a free slot.

Per request: TTFT (time to the first content chunk), inter-token latencies (gaps between
content chunks), completion tokens (the final `usage`, else the number of content chunks),
total latency, and the error if any (an error never stops the run). The speculative accept
length comes from specscope's `usage.spec` or SGLang-style `spec_accept_length` /
`spec_verify_ct` fields found anywhere in the final chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# httpx is an optional (test/bench) dependency and the CLI's parser imports this module's flag
# types, so run_bench imports it when it runs.
if TYPE_CHECKING:
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


# -- load: arrival schedule, cap and flag types ----------------------------------------


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: request 0 at 0, then
    n - 1 gaps drawn in order from `random.Random(seed)`, exponential with mean 1/rate when
    burstiness is 1 (a Poisson process), else gamma(shape=burstiness, scale=1/(rate *
    burstiness)), which keeps the mean at 1/rate. An infinite rate: all at 0."""
    check_load(request_rate, burstiness, None)
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        if burstiness == 1.0:  # expovariate draws exactly the Poisson gaps, not a gamma(1)
            t += rng.expovariate(request_rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        offsets.append(t)
    return offsets


def check_load(request_rate: float, burstiness: float, max_concurrency: int | None) -> None:
    """ValueError for a rate that is not > 0 (inf allowed), a burstiness that is not a finite
    number > 0, or a cap below 1."""
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 requests/s or inf, got {request_rate}")
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None (no cap), got {max_concurrency}")


def default_max_concurrency(max_concurrency: int | None, request_rate: float) -> int | None:
    """The CLI's cap when none is given: 1 at an infinite rate (one request at a time, the
    bench's behaviour before --request-rate existed, so old command lines measure the same
    thing instead of flooding the server), else no cap (the rate sets the load, as in
    `vllm bench serve`)."""
    if max_concurrency is not None:
        return max_concurrency
    return 1 if math.isinf(request_rate) else None


def request_rate_arg(text: str) -> float:
    """argparse type of --request-rate: a number > 0 or inf."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a number of requests per second > 0, or inf to send all at once; "
            f"got {text!r}")
    return value


def burstiness_arg(text: str) -> float:
    """argparse type of --burstiness: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0 (1.0 = Poisson arrivals, < 1 burstier, > 1 more "
            f"even); got {text!r}")
    return value


def max_concurrency_arg(text: str) -> int:
    """argparse type of --max-concurrency: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 (requests in flight at once; leave the flag out for "
            f"the default); got {text!r}")
    return value


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


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _resolve_cap(max_concurrency: int | None, concurrency: int | None) -> int | None:
    """`concurrency` is the old name of `max_concurrency` (callers such as
    benchmarks/server.py still pass it); both may be given only when they agree."""
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if max_concurrency is not None and concurrency is not None \
            and max_concurrency != concurrency:
        raise ValueError(f"max_concurrency={max_concurrency} and concurrency={concurrency} "
                         f"disagree (concurrency is the old name; pass one)")
    return max_concurrency if max_concurrency is not None else concurrency


async def _send_all(client: httpx.AsyncClient, url: str, model: str | None, prompts: list,
                    offsets: list[float], cap: int | None, bar: Any, max_tokens: int,
                    temperature: float) -> tuple[list[RequestResult], float]:
    """Send prompt i at `offsets[i]` s after the start (waiting for a slot under `cap`);
    (results in prompt order, wall seconds)."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(cap) if cap is not None else contextlib.nullcontext()

    async def task(p: Any, start_at: float) -> RequestResult:
        # Sleep to an absolute time, not by the gap since the previous request, so a late
        # wake-up delays one request instead of shifting every later one.
        delay = start_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            r = await _one(client, url, model, p, max_tokens, temperature)
        if bar is not None:
            bar.update(1)
        return r

    t0, start = time.perf_counter(), loop.time()
    tasks = [task(p, start + off) for p, off in zip(prompts, offsets, strict=True)]
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def run_bench(url: str, *, model: str | None, prompts: list, max_tokens: int,
                    max_concurrency: int | None = None, concurrency: int | None = None,
                    request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                    temperature: float = 0.0, timeout: float = 600.0,
                    progress: bool = True) -> dict:
    """Stream every prompt to the server at `url`: arrivals at `request_rate` req/s (see
    `arrival_offsets`; inf: all at once), at most `max_concurrency` in flight (None: no cap;
    `concurrency` is its old name). A dict of throughput, latency percentiles (ms), accept
    length and errors (see `summarize`); `config` records the load settings, with None for
    an infinite rate or no cap (JSON has no infinity)."""
    import httpx

    cap = _resolve_cap(max_concurrency, concurrency)
    check_load(request_rate, burstiness, cap)
    offsets = arrival_offsets(len(prompts), request_rate, burstiness, seed)
    url = _base_url(url)
    pool = (cap if cap is not None else max(len(prompts), 1)) + 2
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
                                 limits=limits) as client:
        model_error = None
        if model is None:
            try:
                ids = await list_models(client, url)
                model = ids[0] if ids else None
            except Exception as e:  # noqa: BLE001 - requests then go out without a model
                model_error = f"{type(e).__name__}: {e}"
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=f"bench {url}", unit="req")
        try:
            results, wall = await _send_all(client, url, model, prompts, offsets, cap, bar,
                                            max_tokens, temperature)
        finally:
            if bar is not None:
                bar.close()
    config = {"url": url, "model": model, "num_prompts": len(prompts),
              "request_rate": None if math.isinf(request_rate) else request_rate,
              "burstiness": burstiness, "seed": seed, "max_concurrency": cap,
              "concurrency": cap,  # the old key, kept for readers of earlier JSON
              "max_tokens": max_tokens, "temperature": temperature, "timeout": timeout}
    out = summarize(results, wall, config)
    if model_error is not None:
        out["model_lookup_error"] = model_error
    return out


# -- reports ------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _load_text(cfg: dict) -> str:
    """The load settings of a result's config: rate (None = inf), burstiness, cap."""
    rate = cfg.get("request_rate")
    cap = cfg.get("max_concurrency", cfg.get("concurrency"))  # earlier JSON: concurrency
    text = "request rate inf (no gaps between arrivals)" if rate is None else \
        f"request rate {rate:g}/s, burstiness {cfg.get('burstiness', 1.0):g}"
    return f"{text}, max concurrency {'unlimited' if cap is None else cap}"


def format_table(result: dict) -> str:
    cfg = result.get("config", {})
    rate = cfg.get("request_rate")
    lines = [
        f"server         {cfg.get('url')}  model={cfg.get('model')}",
        f"workload       {cfg.get('num_prompts')} prompts, max_tokens "
        f"{cfg.get('max_tokens')}, temperature {cfg.get('temperature')}",
        f"load           {_load_text(cfg)}",
        f"completed      {result['completed']}   errors {result['errors']}",
        f"wall           {result['wall_s']:.2f} s",
        f"output tok/s   {_fmt(result['output_tok_s'])}   "
        f"({result['total_completion_tokens']} tokens)",
        f"requests/s     {_fmt(result['request_throughput'], 3)} achieved   (target "
        f"{'inf' if rate is None else f'{rate:g}'})",
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
    rate = getattr(args, "request_rate", math.inf)
    cap = getattr(args, "max_concurrency", None)
    if cap is None:  # a Namespace built by hand may still use the old name
        cap = getattr(args, "concurrency", None)
    kw = dict(prompts=prompts, max_concurrency=default_max_concurrency(cap, rate),
              request_rate=rate, burstiness=getattr(args, "burstiness", 1.0),
              seed=getattr(args, "seed", 0), max_tokens=args.max_tokens,
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
