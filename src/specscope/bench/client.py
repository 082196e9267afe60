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

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specscope.bench.datasets import Sample
from specscope.bench.load import (
    arrival_offsets,
    check_load,
    default_max_concurrency,
)
from specscope.bench.results import (
    RequestResult,
    check_goodput,
    compare,
    format_table,
    goodput_dict,
    result_path,
    summarize,
    vllm_record,
    write_json,
)
from specscope.bench.server_metrics import metrics_accept_length, scrape_metrics

# httpx is an optional (test/bench) dependency and the CLI's parser imports this module's flag
# types, so run_bench imports it when it runs.
if TYPE_CHECKING:
    import httpx

DEFAULT_MAX_TOKENS = 256  # --max-tokens when neither it nor the dataset sets a length


# -- helpers ------------------------------------------------------------------------------


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


# -- goodput: vLLM's service level objectives ------------------------------------------


# -- load: arrival schedule, cap and flag types ----------------------------------------


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


# -- --save-result: vLLM's flat result ---------------------------------------------------


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
