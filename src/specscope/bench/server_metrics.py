"""A server's speculative counters from its Prometheus /metrics (vLLM's, or specscope's with
the same names): scraped before and after a run, their deltas give the run's accept length
when the responses carry none."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


# Prometheus names of the speculative counters; vLLM's first, then specscope's own.
SPEC_METRIC_PREFIXES = ("vllm:", "specscope:")


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
