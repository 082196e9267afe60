"""Async serving benchmark for any OpenAI-compatible server (specscope, SGLang, vLLM).

Each prompt is one streaming request: chat prompts (message lists) go to
`/v1/chat/completions`, raw string prompts to `/v1/completions`. By default only portable
request fields are sent (`stream_options.include_usage`, no `ignore_eos`), so outputs stop at
EOS exactly as a real client's would; `ignore_eos=True` (--ignore-eos, and always with the
random dataset) adds `"ignore_eos": true`, an extra field specscope, vLLM and SGLang accept,
so every request runs to its max_tokens. Workloads (datasets.py): the built-in sets, a JSONL,
ShareGPT (`--dataset sharegpt --dataset-path`) or synthetic random prompts.

Load: request arrival times follow a Poisson process at `request_rate` requests per second
(exponential gaps from `random.Random(seed)`; with `burstiness` != 1, gamma gaps of the same
mean, shape = burstiness: < 1 burstier, > 1 more even); an infinite rate sends every request
at once. Independently, a semaphore caps the requests in flight at `max_concurrency` (None: no
cap); an arrival that finds the cap full waits for a free slot.

Per request: TTFT (time to the first content chunk), inter-token latencies (gaps between
content chunks), prompt and completion tokens (the final `usage`; completion falls back to
the number of content chunks), total latency, and the error if any (an error never stops the
run). Goodput (`goodput={"ttft": ms, "tpot": ms, "e2el": ms}`, vLLM's SLOs): completed
requests per second that met every given bound.

The speculative accept length comes from specscope's `usage.spec` or SGLang-style
`spec_accept_length` / `spec_verify_ct` fields found anywhere in the final chunk; when no
response carries one, from the server's Prometheus counters scraped from GET /metrics before
and after the run (`vllm:` or `specscope:` `spec_decode_num_drafts_total` and
`spec_decode_num_accepted_tokens_total`): 1 + accepted / drafts over the run. Those counters
also count any other client's requests in that window.

`--save-result` writes `vllm_record`: one flat JSON object with `vllm bench serve`'s keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specscope.bench.datasets import Sample

# httpx is an optional (test/bench) dependency and the CLI's parser imports this module's flag
# types, so run_bench imports it when it runs.
if TYPE_CHECKING:
    import httpx

MAX_ERROR_MESSAGES = 5
DEFAULT_MAX_TOKENS = 256  # --max-tokens when neither it nor the dataset sets a length
GOODPUT_KEYS = ("ttft", "tpot", "e2el")  # vLLM's SLO names (milliseconds)
# Prometheus names of the speculative counters; vLLM's first, then specscope's own.
SPEC_METRIC_PREFIXES = ("vllm:", "specscope:")


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


# -- helpers ------------------------------------------------------------------------------


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


# -- the server's Prometheus counters -----------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """{metric name: value summed over its label sets} from Prometheus text exposition.
    Tolerant: comments, blank and unparsable lines are skipped, and a trailing timestamp
    is ignored, so any exporter's output reads."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = rest[rest.rfind("}") + 1:]  # rfind: a label value may hold a "}"
        else:
            name, _, rest = line.replace("\t", " ").partition(" ")
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            name = name.strip()
            sums[name] = sums.get(name, 0.0) + value
    return sums


def spec_counters(metrics: dict[str, float]) -> dict[str, Any] | None:
    """{"prefix", "drafts", "accepted"} from the first of SPEC_METRIC_PREFIXES whose drafts
    counter is exposed (with prometheus-client's `_total` suffix, or without it); None if
    neither server family exposes one. A missing accepted counter reads 0: an exporter may
    show a labelled series only once it has been incremented."""
    for prefix in SPEC_METRIC_PREFIXES:
        found = []
        for name in ("drafts", "accepted_tokens"):
            full = f"{prefix}spec_decode_num_{name}"
            found.append(metrics.get(full + "_total", metrics.get(full)))
        drafts, accepted = found
        if drafts is not None:
            return {"prefix": prefix, "drafts": drafts, "accepted": accepted or 0.0}
    return None


def metrics_accept_length(before: dict[str, float] | None,
                          after: dict[str, float] | None) -> dict[str, Any] | None:
    """The run's counter deltas and accept length 1 + d(accepted) / d(drafts) (each draft
    ends with one token of the target's own) from two `parse_prometheus` scrapes; None
    without both scrapes or any draft. A counter missing before the run but present after
    started at 0: prometheus-client shows a labelled series only once it is incremented."""
    if before is None or after is None:
        return None
    after = spec_counters(after)
    if after is None:
        return None
    before = spec_counters(before) or {"prefix": after["prefix"], "drafts": 0.0,
                                       "accepted": 0.0}
    if before["prefix"] != after["prefix"]:
        return None
    drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
    if drafts <= 0:
        return None
    return {"prefix": after["prefix"], "drafts": drafts, "accepted_tokens": accepted,
            "accept_length": 1.0 + accepted / drafts}


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """`parse_prometheus` of GET /metrics; None on any failure (many servers expose none)."""
    try:
        r = await client.get(f"{url}/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)
    except Exception:  # noqa: BLE001 - no metrics only means no accept length from them
        return None


# -- goodput: vLLM's service level objectives ------------------------------------------


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


def range_ratio_arg(text: str) -> float:
    """argparse type of --random-range-ratio: a number in [0, 1) (vLLM's range; 1 would allow
    empty prompts)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1); got {text!r}")
    return value


# -- one request --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Fields:
    """The request fields every request of a run shares."""

    model: str | None
    max_tokens: int  # a Sample's own output_len overrides it
    temperature: float
    ignore_eos: bool


def _as_sample(p: Any) -> Sample:
    # run_bench also takes bare prompts (benchmarks/server.py sends JSON-decoded lists).
    return p if isinstance(p, Sample) else Sample(p)


async def _one(client: httpx.AsyncClient, url: str, fields: _Fields,
               sample: Sample) -> RequestResult:
    res = RequestResult()
    prompt = sample.prompt
    max_tokens = sample.output_len if sample.output_len is not None else fields.max_tokens
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": fields.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if fields.model is not None:
        body["model"] = fields.model
    if fields.ignore_eos:
        body["ignore_eos"] = True
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
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        res.prompt_tokens = usage["prompt_tokens"]
    if final is not None:
        res.accept_length, res.cycles = _spec_stats(final, res.completion_tokens)
    res.ok = True
    return res


# -- the run ------------------------------------------------------------------------------


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


async def _send_all(client: httpx.AsyncClient, url: str, fields: _Fields,
                    samples: list[Sample], offsets: list[float], cap: int | None,
                    bar: Any) -> tuple[list[RequestResult], float]:
    """Send sample i at `offsets[i]` s after the start (waiting for a slot under `cap`);
    (results in prompt order, wall seconds)."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(cap) if cap is not None else contextlib.nullcontext()

    async def task(sample: Sample, start_at: float) -> RequestResult:
        # Sleep to an absolute time, not by the gap since the previous request, so a late
        # wake-up delays one request instead of shifting every later one.
        delay = start_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            r = await _one(client, url, fields, sample)
        if bar is not None:
            bar.update(1)
        return r

    t0, start = time.perf_counter(), loop.time()
    tasks = [task(p, start + off) for p, off in zip(samples, offsets, strict=True)]
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def _lookup_model(client: httpx.AsyncClient, url: str) -> tuple[str | None, str | None]:
    """(the first id of GET /v1/models, the error if the lookup failed)."""
    try:
        ids = await list_models(client, url)
        return (ids[0] if ids else None), None
    except Exception as e:  # noqa: BLE001 - requests then go out without a model
        return None, f"{type(e).__name__}: {e}"


async def _measure(client: httpx.AsyncClient, url: str, fields: _Fields,
                   samples: list[Sample], offsets: list[float], cap: int | None,
                   progress: bool) -> tuple[list[RequestResult], float, dict | None]:
    """The run between two scrapes of the speculative counters: (results, wall, the
    counters' deltas and accept length, or None)."""
    before = await scrape_metrics(client, url)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), desc=f"bench {url}", unit="req")
    try:
        results, wall = await _send_all(client, url, fields, samples, offsets, cap, bar)
    finally:
        if bar is not None:
            bar.close()
    after = await scrape_metrics(client, url) if before is not None else None
    return results, wall, metrics_accept_length(before, after)


async def run_bench(url: str, *, model: str | None, prompts: list, max_tokens: int,
                    max_concurrency: int | None = None, concurrency: int | None = None,
                    request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                    temperature: float = 0.0, timeout: float = 600.0,
                    progress: bool = True, ignore_eos: bool = False,
                    goodput: dict[str, float] | None = None) -> dict:
    """Stream every prompt (a prompt or a `Sample`, whose output_len overrides `max_tokens`)
    to the server at `url`: arrivals at `request_rate` req/s (see `arrival_offsets`; inf: all
    at once), at most `max_concurrency` in flight (None: no cap; `concurrency` is its old
    name). `ignore_eos` sends "ignore_eos": true; `goodput` holds SLOs in ms (GOODPUT_KEYS).
    A dict of throughput, latency percentiles (ms), accept length, goodput and errors (see
    `summarize`); `config` records the settings, with None for an infinite rate or no cap
    (JSON has no infinity)."""
    import httpx

    cap = _resolve_cap(max_concurrency, concurrency)
    check_load(request_rate, burstiness, cap)
    check_goodput(goodput)
    samples = [_as_sample(p) for p in prompts]
    offsets = arrival_offsets(len(samples), request_rate, burstiness, seed)
    url = _base_url(url)
    pool = (cap if cap is not None else max(len(samples), 1)) + 2
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
                                 limits=limits) as client:
        model_error = None
        if model is None:
            model, model_error = await _lookup_model(client, url)
        fields = _Fields(model, max_tokens, temperature, ignore_eos)
        results, wall, spec = await _measure(client, url, fields, samples, offsets, cap,
                                             progress)
    # None: every request has its own length (the dataset's), so no run-wide max_tokens
    own_lens = bool(samples) and all(s.output_len is not None for s in samples)
    config = {"url": url, "model": model, "num_prompts": len(samples),
              "request_rate": None if math.isinf(request_rate) else request_rate,
              "burstiness": burstiness, "seed": seed, "max_concurrency": cap,
              "concurrency": cap,  # the old key, kept for readers of earlier JSON
              "max_tokens": None if own_lens else max_tokens,  # None: set per request
              "temperature": temperature, "timeout": timeout, "ignore_eos": ignore_eos,
              "goodput": goodput or None}
    out = summarize(results, wall, config, goodput)
    out["spec_metrics"] = spec
    out["metrics_accept_length"] = spec["accept_length"] if spec else None
    if out["accept_length"] is None and spec is not None:  # responses carried none
        out["accept_length"], out["accept_length_source"] = spec["accept_length"], "metrics"
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


# -- --save-result: vLLM's flat result ---------------------------------------------------


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


def _save_results(args: Any, result: dict, other: dict | None) -> None:
    """--save-result (implied by --result-dir / --result-filename): A's flat record, and
    with --compare B's next to it as <name>-compare.json."""
    result_dir = getattr(args, "result_dir", None)
    result_filename = getattr(args, "result_filename", None)
    if not (getattr(args, "save_result", False) or result_dir or result_filename):
        return
    record = vllm_record(result)
    path = result_path(record, result_dir, result_filename)
    write_json(path, record, indent=None)  # compact: the per-request ITL lists are long
    print(f"\nwrote {path}")
    if other is not None:
        other_path = path.with_name(f"{path.stem}-compare{path.suffix or '.json'}")
        write_json(other_path, vllm_record(other, record["date"]), indent=None)
        print(f"wrote {other_path}")


# -- the command ----------------------------------------------------------------------------


def _samples_from_args(args: Any) -> list[Sample]:
    from specscope.bench.datasets import load_samples

    return load_samples(
        args.dataset, args.num_prompts, dataset_path=getattr(args, "dataset_path", None),
        max_tokens=getattr(args, "max_tokens", None),
        sharegpt_output_len=getattr(args, "sharegpt_output_len", None),
        random_input_len=getattr(args, "random_input_len", None),
        random_output_len=getattr(args, "random_output_len", None),
        random_range_ratio=getattr(args, "random_range_ratio", None),
        seed=getattr(args, "seed", 0))


def _run_kwargs(args: Any, samples: list[Sample]) -> dict[str, Any]:
    rate = getattr(args, "request_rate", math.inf)
    cap = getattr(args, "max_concurrency", None)
    if cap is None:  # a Namespace built by hand may still use the old name
        cap = getattr(args, "concurrency", None)
    max_tokens = getattr(args, "max_tokens", None)
    return dict(prompts=samples, max_concurrency=default_max_concurrency(cap, rate),
                request_rate=rate, burstiness=getattr(args, "burstiness", 1.0),
                seed=getattr(args, "seed", 0),
                max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                temperature=getattr(args, "temperature", 0.0) or 0.0,
                timeout=getattr(args, "timeout", 600.0) or 600.0,
                progress=not getattr(args, "no_progress", False),
                # random prompts ask for an exact output length, which only ignore_eos keeps
                ignore_eos=bool(getattr(args, "ignore_eos", False)) or args.dataset == "random",
                goodput=goodput_dict(getattr(args, "goodput", None)))


def main_bench(args: Any) -> int:
    """`specscope bench`: run, print the table, optionally compare and write JSON."""
    samples = _samples_from_args(args)  # (dataset errors come before any connection)
    kw = _run_kwargs(args, samples)

    def run(url: str, model: str | None) -> dict:
        res = asyncio.run(run_bench(url, model=model, **kw))
        res["config"]["dataset"] = args.dataset
        res["config"]["dataset_path"] = getattr(args, "dataset_path", None)
        return res

    result = run(args.url, args.model)
    print(format_table(result))
    out: dict = result
    other = None
    compare_url = getattr(args, "compare", None)
    if compare_url:
        other = run(compare_url, getattr(args, "compare_model", None))
        print()
        print(format_table(other))
        print()
        print(compare(result, other))
        out = {"a": result, "b": other}
    if getattr(args, "out", None):
        write_json(args.out, out)
        print(f"\nwrote {args.out}")
    _save_results(args, result, other)
    failed = result["completed"] == 0 or (other is not None and other["completed"] == 0)
    return 1 if failed else 0
