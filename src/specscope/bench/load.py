"""The load of a benchmark run: request arrival times (a Poisson process, or gamma gaps with
a burstiness), the cap on requests in flight, and the flags that set them (vLLM's names)."""

from __future__ import annotations

import argparse
import math
import random


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
