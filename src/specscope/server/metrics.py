"""The server's Prometheus metrics, on prometheus-client: one registry per app, served at
/metrics.

Names follow vLLM's with the `specscope:` prefix where the meaning matches (a vLLM dashboard
or `vllm bench` reads them after swapping the prefix), every series labelled with
`model_name`; docs/metrics.md maps each to its vLLM and SGLang counterpart. Request counters
and latency histograms are updated by the app as requests finish; the speculative counters
and inter-token latency per engine step (engine thread); the engine's queues, KV blocks,
prefix cache and the guardrail are read when scraped. prometheus-client is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specscope.engine.llm import StepRecord

P = "specscope:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's bucket bounds (seconds), with finer ones below 10 ms: a speculative step on a GPU
# emits a token every 2 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """The app's metrics. `sources` (set by the app): the engine's state (Engine.state)
    and the guardrail's (Guardrail.state), read at each scrape."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, [*m, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, m, buckets=buckets, registry=r)

        self.http_requests = counter("http_requests", "HTTP requests by endpoint and status "
                                     "code.", ("endpoint", "status"))
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed (prompts).")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.request_success = counter("request_success", "Finished requests by finish "
                                       "reason.", ("finished_reason",))
        self.cancelled = counter("requests_cancelled", "Requests whose client went away "
                                 "before the end.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first "
                              "token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Per request: decode time (first "
                              "token to last) over the tokens after the first.", TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's "
                             "consecutive outputs (the tokens of one speculative step arrive "
                             "together: one sample).", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last "
                             "token.", E2E_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified (one "
                                   "per speculating sequence per step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens "
                                         "verified (the tree's nodes past the root).")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens "
                                     "accepted.")
        self.spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Drafts "
                                         "whose token at this position was accepted "
                                         "(position 0: the first draft token).", ("position",))
        self.queue = Gauge(P + "queue_depth", "Requests waiting or running (the server's "
                           "queue).", m, registry=r)
        self.engine_state: Callable[[], dict] | None = None
        self.guardrail_state: Callable[[], dict] | None = None
        r.register(_Scraped(self))

    # -- updates ----------------------------------------------------------------------------

    def request_done(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(self.model, endpoint, str(status)).inc()

    def generation_done(self, prompt_tokens: int, completion_tokens: int,
                        finish_reason: str, ttft_s: float, decode_s: float,
                        latency_s: float) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.request_success.labels(m, finish_reason).inc()
        self.ttft.labels(m).observe(ttft_s)
        if completion_tokens > 1:
            self.tpot.labels(m).observe(decode_s / (completion_tokens - 1))
        self.e2e.labels(m).observe(latency_s)

    def cancel(self) -> None:
        self.cancelled.labels(self.model).inc()

    def set_queue_depth(self, n: int) -> None:
        self.queue.labels(self.model).set(n)

    def step(self, step: StepRecord) -> None:
        """One engine step's speculative counters (vLLM's spec_decode_* per step)."""
        if not step.accepted:
            return
        m = self.model
        self.spec_drafts.labels(m).inc(len(step.accepted))
        self.spec_draft_tokens.labels(m).inc(step.drafted)
        self.spec_accepted.labels(m).inc(sum(step.accepted))
        for pos in range(max(step.accepted)):
            self.spec_accepted_pos.labels(m, str(pos)).inc(
                sum(1 for a in step.accepted if a > pos))

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


class _Scraped:
    """The engine's queues, KV blocks, prefix cache and preemptions, and the guardrail's
    per-bucket state, read when scraped (a custom prometheus-client collector)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        mt = self.metrics
        if mt.engine_state is not None:
            yield from _engine_families(mt.engine_state(), mt.model)
        if mt.guardrail_state is not None:
            yield from _guardrail_families(mt.guardrail_state(), mt.model)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
    g.add_metric([model], value)
    return g


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(P + name, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c


def _engine_families(e: dict, model: str) -> Iterator[Metric]:
    yield _gauge("num_requests_running", "Requests in the engine's batch.", model, e["running"])
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", model,
                 e["waiting"])
    yield _gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent (blocks in use "
                 "over the target's pool).", model,
                 e["kv_blocks_in_use"] / e["kv_blocks"] if e["kv_blocks"] else 0.0)
    yield _gauge("kv_cache_blocks", "KV blocks in the target's pool.", model, e["kv_blocks"])
    yield _gauge("kv_cache_blocks_in_use", "KV blocks held by requests.", model,
                 e["kv_blocks_in_use"])
    yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (in "
                   "full blocks).", model, e["prefix_queries"] * e["block_size"])
    yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                   "prefill skipped).", model, e["prefix_hits"] * e["block_size"])
    yield _counter("num_preemptions", "Requests preempted when KV blocks ran out "
                   "(recomputed later).", model, e["preemptions"])


def _guardrail_families(g: dict, model: str) -> Iterator[Metric]:
    """Per batch-size bucket (label `bucket`, its largest batch) the window's rate, the
    prediction and the verdict; the switch-offs in total."""
    rows = [("window_tok_per_s", "Speculative tok/s over the guardrail's window of a "
             "batch-size bucket (0 while it is empty).", lambda b: b["window_tok_per_s"]),
            ("plain_tok_per_s", "Predicted plain-decoding tok/s of a batch-size bucket, "
             "which its window is compared with.", lambda b: b["plain_tok_per_s"]),
            ("slower", "1 while speculation is judged slower than plain decoding in a "
             "batch-size bucket.", lambda b: float(b["verdict"] == "slower"))]
    for name, doc, value in rows:
        fam = GaugeMetricFamily(P + "guardrail_" + name, doc, labels=["model_name", "bucket"])
        for b in g["buckets"]:
            fam.add_metric([model, str(b["bucket"])], value(b))
        yield fam
    yield _counter("guardrail_switch_offs", "Times the guardrail switched speculation off "
                   "for a bucket.", model, g["switch_offs"])
class CountRequests:
    """Pure ASGI middleware counting /v1 requests by endpoint and status code (a
    BaseHTTPMiddleware would interfere with streaming and client-disconnect detection)."""

    def __init__(self, app, metrics: Metrics, endpoints: tuple[str, ...]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.request_done(path if path in self.endpoints else "other", status)
