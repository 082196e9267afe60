"""`specscope bench`'s load controls (--request-rate, --burstiness, --max-concurrency) against
a fake OpenAI-compatible streaming server on localhost that records when each request arrives
and how many are in flight. No model is loaded, so the module runs in a few seconds.

Timing assertions are bounds with wide margins (a loaded 2-core CI machine wakes sleepers
late); the concurrency ones use a barrier in the fake server, so they do not depend on
timing at all."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from specscope.bench.client import main_bench, run_bench  # noqa: E402
from specscope.bench.load import arrival_offsets  # noqa: E402
from specscope.bench.results import format_table  # noqa: E402
from specscope.cli import build_parser  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

BARRIER_TIMEOUT_S = 10.0  # a broken cap fails the test after this, instead of hanging it


@dataclass
class Fake:
    """What the fake server saw. A request streams its answer only once `release_at_peak`
    requests have been in flight together (or after BARRIER_TIMEOUT_S), then `hold_s` more,
    so a cap of N shows up as a peak of exactly N whatever the machine's speed."""

    arrivals: dict[str, float] = field(default_factory=dict)  # prompt -> perf_counter()
    models_at: float = 0.0  # when GET /v1/models was answered (the client starts after it)
    in_flight: int = 0
    peak: int = 0
    release_at_peak: int = 0
    hold_s: float = 0.0

    def reset(self, release_at_peak: int = 0, hold_s: float = 0.0) -> None:
        self.arrivals.clear()
        self.in_flight = self.peak = 0
        self.models_at = 0.0
        self.release_at_peak, self.hold_s = release_at_peak, hold_s


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def make_app(fake: Fake) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        fake.models_at = time.perf_counter()
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        chat = "messages" in body
        key = body["messages"][-1]["content"] if chat else body["prompt"]
        fake.arrivals[key] = time.perf_counter()
        fake.in_flight += 1
        fake.peak = max(fake.peak, fake.in_flight)

        async def stream():
            try:
                deadline = time.perf_counter() + BARRIER_TIMEOUT_S
                while fake.peak < fake.release_at_peak and time.perf_counter() < deadline:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(fake.hold_s)
                for tok in ("a", "b"):
                    yield _sse({"choices": [{"index": 0, "delta": {"content": tok}}
                                            if chat else {"index": 0, "text": tok}]})
                yield _sse({"choices": [], "usage": {"completion_tokens": 2}})
            finally:
                # Counted out before [DONE]: the client cannot start the next request before
                # it reads [DONE], so a request that is done is never counted as in flight.
                fake.in_flight -= 1
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def server():
    fake = Fake()
    running = BackgroundServer(make_app(fake))
    yield running, fake
    running.stop()


def _bench(url: str, n: int, **kw) -> dict:
    prompts = [f"p{i}" for i in range(n)]
    return asyncio.run(run_bench(url, model=None, prompts=prompts, max_tokens=4, timeout=30.0,
                                 progress=False, **kw))


# -- the arrival schedule -----------------------------------------------------------------


def test_poisson_offsets_are_the_seeded_exponential_gaps():
    rng = random.Random(7)
    gaps = [rng.expovariate(20.0) for _ in range(9)]
    want = [0.0] + [sum(gaps[:i + 1]) for i in range(9)]
    assert arrival_offsets(10, 20.0, 1.0, seed=7) == pytest.approx(want, abs=1e-12)
    assert arrival_offsets(10, 20.0, seed=7) == arrival_offsets(10, 20.0, seed=7)
    assert arrival_offsets(10, 20.0, seed=8) != arrival_offsets(10, 20.0, seed=7)
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_keep_the_mean_and_set_the_spread(burstiness: float):
    # Seeded, so deterministic: mean 1/rate at any burstiness; squared coefficient of
    # variation 1/burstiness (1 for Poisson, larger = burstier).
    offsets = arrival_offsets(20001, 10.0, burstiness, seed=0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
    assert mean == pytest.approx(0.1, rel=0.05)
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.2)


# -- against the fake server --------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_finite_rate_spaces_the_sends_as_the_seeded_gaps_say(server, burstiness: float):
    running, fake = server
    fake.reset()
    n, rate, seed = 12, 50.0, 3
    # The expected schedule, drawn here independently of the client's code.
    rng = random.Random(seed)
    draw = (lambda: rng.expovariate(rate)) if burstiness == 1.0 else \
        (lambda: rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    want = [0.0]
    for _ in range(n - 1):
        want.append(want[-1] + draw())
    assert want[-1] > 0.15  # (this seed's schedule is long enough to tell from all-at-once)
    res = _bench(running.url, n, request_rate=rate, burstiness=burstiness, seed=seed)
    assert res["completed"] == n and res["errors"] == 0, res["error_messages"]
    # Lower bound, causal (holds on any machine): the client's schedule starts after it
    # has the /v1/models answer, so request i reaches the server no earlier than that plus
    # its offset. Upper bound: late by at most a generous margin after request 0, which
    # also checks that lateness does not pile up along the schedule.
    arrivals = [fake.arrivals[f"p{i}"] for i in range(n)]
    for i, (at, w) in enumerate(zip(arrivals, want, strict=True)):
        assert at - fake.models_at >= w - 0.001, (i, arrivals, want)
        assert at - arrivals[0] <= w + 0.5, (i, arrivals, want)
    assert res["wall_s"] >= want[-1]
    cfg = res["config"]
    assert (cfg["request_rate"], cfg["burstiness"], cfg["seed"]) == (rate, burstiness, seed)
    assert cfg["max_concurrency"] is None and fake.peak >= 1


def test_infinite_rate_sends_all_at_once(server):
    running, fake = server
    fake.reset(release_at_peak=8)  # no request answers until all 8 are in flight
    res = _bench(running.url, 8)
    assert res["completed"] == 8, res["error_messages"]
    assert fake.peak == 8
    assert res["config"]["request_rate"] is None and res["config"]["max_concurrency"] is None


@pytest.mark.parametrize("cap", [2, 5])
def test_max_concurrency_caps_requests_in_flight(server, cap: int):
    running, fake = server
    # Each request waits until `cap` are in flight, then 0.1 s more: a request beyond the
    # cap would arrive in that window and raise the peak above it.
    fake.reset(release_at_peak=cap, hold_s=0.1)
    res = _bench(running.url, 2 * cap + 1, max_concurrency=cap)
    assert res["completed"] == 2 * cap + 1, res["error_messages"]
    assert fake.peak == cap
    assert res["config"]["max_concurrency"] == cap == res["config"]["concurrency"]


def test_cap_also_holds_at_a_finite_rate(server):
    running, fake = server
    fake.reset(release_at_peak=2, hold_s=0.1)
    res = _bench(running.url, 6, max_concurrency=2, request_rate=1000.0)
    assert res["completed"] == 6 and fake.peak == 2


def test_old_concurrency_keyword_still_works(server):
    running, fake = server
    fake.reset(release_at_peak=3, hold_s=0.05)
    res = _bench(running.url, 4, concurrency=3)
    assert fake.peak == 3 and res["config"]["max_concurrency"] == 3
    with pytest.raises(ValueError, match="disagree"):
        _bench(running.url, 1, concurrency=3, max_concurrency=2)


@pytest.mark.parametrize("kw", [{"request_rate": 0.0}, {"request_rate": -1.0},
                                {"request_rate": math.nan}, {"burstiness": 0.0},
                                {"burstiness": math.inf}, {"max_concurrency": 0},
                                {"concurrency": 0}])
def test_run_bench_rejects_bad_load(kw: dict):
    with pytest.raises(ValueError):
        # rejected before any connection: the URL is never contacted
        _bench("http://127.0.0.1:9", 2, **kw)


# -- the command line ---------------------------------------------------------------------


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "--url", "http://x", *argv])


def test_flag_defaults_and_alias():
    args = _parse()
    assert math.isinf(args.request_rate) and args.burstiness == 1.0 and args.seed == 0
    assert args.max_concurrency is None  # main_bench resolves it (next test)
    assert _parse("--concurrency", "3").max_concurrency == 3
    assert _parse("--max-concurrency", "4").max_concurrency == 4
    args = _parse("--request-rate", "12.5", "--burstiness", "0.5", "--seed", "9")
    assert (args.request_rate, args.burstiness, args.seed) == (12.5, 0.5, 9)
    assert math.isinf(_parse("--request-rate", "inf").request_rate)


@pytest.mark.parametrize("argv,flag,hint", [
    (["--request-rate", "0"], "--request-rate", "inf"),
    (["--request-rate", "-2"], "--request-rate", "> 0"),
    (["--request-rate", "fast"], "--request-rate", "requests per second"),
    (["--request-rate", "nan"], "--request-rate", "> 0"),
    (["--burstiness", "0"], "--burstiness", "> 0"),
    (["--burstiness", "-1"], "--burstiness", "Poisson"),
    (["--burstiness", "inf"], "--burstiness", "finite"),
    (["--max-concurrency", "0"], "--max-concurrency", ">= 1"),
    (["--max-concurrency", "1.5"], "--max-concurrency", "integer"),
    (["--concurrency", "0"], "--max-concurrency", ">= 1"),
])
def test_bad_flag_values_are_argparse_errors(argv, flag, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and hint in err, err


def test_main_bench_default_is_one_request_at_a_time(server, tmp_path, capsys):
    # Neither flag: the behaviour from before --request-rate, one request in flight.
    running, fake = server
    fake.reset(hold_s=0.05)
    out = tmp_path / "r.json"
    args = _parse("--num-prompts", "3", "--max-tokens", "4", "--no-progress",
                  "--out", str(out))
    args.url = running.url
    assert main_bench(args) == 0
    assert fake.peak == 1
    cfg = json.loads(out.read_text())["config"]
    assert cfg["max_concurrency"] == 1 and cfg["request_rate"] is None
    printed = capsys.readouterr().out
    assert "request rate inf" in printed and "max concurrency 1" in printed


def test_main_bench_json_and_table_have_the_load_fields(server, tmp_path, capsys):
    running, fake = server
    fake.reset()
    out = tmp_path / "r.json"
    args = _parse("--num-prompts", "4", "--max-tokens", "4", "--no-progress", "--out",
                  str(out), "--request-rate", "200", "--burstiness", "2", "--seed", "5")
    args.url = running.url
    assert main_bench(args) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text  # strict JSON
    data = json.loads(text)
    cfg = data["config"]
    assert cfg["request_rate"] == 200.0 and cfg["burstiness"] == 2.0 and cfg["seed"] == 5
    assert cfg["max_concurrency"] is None  # a finite rate without a cap: no cap
    assert data["completed"] == 4 and data["request_throughput"] > 0
    assert data["request_throughput"] == pytest.approx(4 / data["wall_s"])
    for key in ("output_tok_s", "ttft_ms", "tpot_ms", "itl_ms"):
        assert key in data
    printed = capsys.readouterr().out
    assert "request rate 200/s, burstiness 2" in printed
    assert "max concurrency unlimited" in printed and "achieved" in printed
    assert "(target 200)" in format_table(data)
