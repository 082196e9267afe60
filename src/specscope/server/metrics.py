"""Server counters in the Prometheus text exposition format (written by hand).

All names carry the `specscope_` prefix. Updated from the event loop and read by /metrics;
a lock keeps a scrape consistent.
"""

from __future__ import annotations

import threading
from collections import Counter

# Request latency histogram bucket upper bounds, seconds.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(**kv: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in kv.items())
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, status code)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.spec_cycles = 0
        self.accept_length_sum = 0.0  # tokens emitted by speculative cycles (tau summed)
        self.accept_length_count = 0  # speculative cycles
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.cancelled = 0
        self.queue_depth = 0  # requests waiting or running (set by the app)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def generation_done(self, prompt_tokens: int, completion_tokens: int,
                        spec: dict | None, latency_s: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            if spec:
                cycles = int(spec.get("cycles", 0))
                self.spec_cycles += cycles
                per_cycle = spec.get("accepted_per_cycle")
                if per_cycle is not None:  # exact: tau = accepted draft tokens + the bonus
                    self.accept_length_sum += sum(per_cycle) + len(per_cycle)
                else:
                    self.accept_length_sum += float(spec.get("accept_length", 0.0)) * cycles
                self.accept_length_count += cycles
            self.latency_sum += latency_s
            self.latency_count += 1
            for i, bound in enumerate(LATENCY_BUCKETS):
                if latency_s <= bound:
                    self.latency_buckets[i] += 1

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self, guardrail: dict | None = None, engine: dict | None = None) -> str:
        """The exposition text; `guardrail` is Guardrail.state() when the server has one,
        `engine` Engine.state()."""
        m = _labels(model=self.model)
        with self._lock:
            out = [
                "# HELP specscope_requests_total HTTP requests by endpoint and status code.",
                "# TYPE specscope_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"specscope_requests_total"
                           f"{_labels(model=self.model, endpoint=endpoint, status=status)} {n}")
            out += _counter("specscope_prompt_tokens_total", "Prompt tokens processed.", m,
                            self.prompt_tokens)
            out += _counter("specscope_generation_tokens_total", "Completion tokens generated.",
                            m, self.generation_tokens)
            out += _counter("specscope_spec_cycles_total", "Speculative decode cycles.", m,
                            self.spec_cycles)
            out += _counter("specscope_requests_cancelled_total",
                            "Requests whose client went away before the end.", m,
                            self.cancelled)
            out += [
                "# HELP specscope_spec_accept_length Tokens emitted per speculative cycle "
                "(tau, bonus token included).",
                "# TYPE specscope_spec_accept_length summary",
                f"specscope_spec_accept_length_sum{m} {self.accept_length_sum:.6g}",
                f"specscope_spec_accept_length_count{m} {self.accept_length_count}",
                "# HELP specscope_request_latency_seconds Time from arrival to the last token.",
                "# TYPE specscope_request_latency_seconds histogram",
            ]
            for bound, n in zip(LATENCY_BUCKETS, self.latency_buckets, strict=True):
                le = _labels(model=self.model, le=f"{bound:g}")
                out.append(f"specscope_request_latency_seconds_bucket{le} {n}")
            inf = _labels(model=self.model, le="+Inf")
            out += [
                f"specscope_request_latency_seconds_bucket{inf} {self.latency_count}",
                f"specscope_request_latency_seconds_sum{m} {self.latency_sum:.6g}",
                f"specscope_request_latency_seconds_count{m} {self.latency_count}",
                "# HELP specscope_queue_depth Requests waiting or running.",
                "# TYPE specscope_queue_depth gauge",
                f"specscope_queue_depth{m} {self.queue_depth}",
            ]
        if engine is not None:
            out += _engine_lines(engine, m)
        if guardrail is not None:
            out += _guardrail_lines(guardrail, m)
        return "\n".join(out) + "\n"


def _gauge(name: str, help: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name}{labels} {value:.6g}"]


def _engine_lines(e: dict, m: str) -> list[str]:
    """The batched engine's queues, KV blocks and prefix cache."""
    usage = e["kv_blocks_in_use"] / e["kv_blocks"] if e["kv_blocks"] else 0.0
    rate = e["prefix_hits"] / e["prefix_queries"] if e["prefix_queries"] else 0.0
    return (_gauge("specscope_num_requests_running", "Requests in the engine's batch.", m,
                   e["running"])
            + _gauge("specscope_num_requests_waiting", "Requests waiting to be scheduled.", m,
                     e["waiting"])
            + _gauge("specscope_kv_cache_blocks_total", "KV blocks in the target's pool.", m,
                     e["kv_blocks"])
            + _gauge("specscope_kv_cache_blocks_in_use", "KV blocks held by requests.", m,
                     e["kv_blocks_in_use"])
            + _gauge("specscope_kv_cache_usage_perc", "Fraction of KV blocks in use.", m,
                     usage)
            + _counter("specscope_prefix_cache_queries_total",
                       "Prompt blocks looked up in the prefix cache.", m, e["prefix_queries"])
            + _counter("specscope_prefix_cache_hits_total",
                       "Prompt blocks found in the prefix cache (their prefill skipped).", m,
                       e["prefix_hits"])
            + _gauge("specscope_prefix_cache_hit_rate", "Prefix-cache hits over queries.", m,
                     rate)
            + _counter("specscope_num_preemptions_total",
                       "Requests preempted when KV blocks ran out (recomputed later).", m,
                       e["preemptions"]))


def _counter(name: str, help: str, labels: str, value: int) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name}{labels} {value}"]


def _guardrail_lines(g: dict, m: str) -> list[str]:
    """Per batch-size bucket (label `bucket`, its largest batch) the window's rate, the
    prediction and the verdict; the switch-offs in total."""
    rows = [(m[:-1] + f',bucket="{b["bucket"]}"}}', b) for b in g["buckets"]]
    return [
        "# HELP specscope_guardrail_window_tok_per_s Speculative tok/s over the guardrail's "
        "window of a batch-size bucket (0 while it is empty).",
        "# TYPE specscope_guardrail_window_tok_per_s gauge",
        *(f"specscope_guardrail_window_tok_per_s{lb} {b['window_tok_per_s']:.6g}"
          for lb, b in rows),
        "# HELP specscope_guardrail_plain_tok_per_s Predicted plain-decoding tok/s of a "
        "batch-size bucket, which its window is compared with.",
        "# TYPE specscope_guardrail_plain_tok_per_s gauge",
        *(f"specscope_guardrail_plain_tok_per_s{lb} {b['plain_tok_per_s']:.6g}"
          for lb, b in rows),
        "# HELP specscope_guardrail_slower 1 while speculation is judged slower than plain "
        "decoding in a batch-size bucket.",
        "# TYPE specscope_guardrail_slower gauge",
        *(f"specscope_guardrail_slower{lb} {int(b['verdict'] == 'slower')}" for lb, b in rows),
        *_counter("specscope_guardrail_switch_offs_total",
                  "Times the guardrail switched speculation off for a bucket.", m,
                  g["switch_offs"]),
    ]


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
