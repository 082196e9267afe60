"""`specscope bench`'s `vllm bench serve` features: the sharegpt and random datasets,
--num-prompts beyond a dataset, --ignore-eos, input tokens from usage, --goodput,
--save-result's flat JSON, and the accept length read from a server's /metrics. Against a
fake OpenAI-compatible server on localhost that records every request body; no model loads,
so the module runs in seconds."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from specscope.bench.client import main_bench, run_bench  # noqa: E402
from specscope.bench.datasets import (  # noqa: E402
    WORDS,
    _uniform_lens,
    load_samples,
    random_samples,
)
from specscope.bench.results import (  # noqa: E402
    RequestResult,
    format_table,
    goodput_dict,
    summarize,
    vllm_record,
    write_json,
)
from specscope.bench.server_metrics import metrics_accept_length, parse_prometheus  # noqa: E402
from specscope.cli import build_parser, main  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

EOS_AFTER = 3  # the fake "model" stops after this many tokens unless ignore_eos is set
DRAFTS_PER_REQUEST, ACCEPTED_PER_REQUEST = 2, 3  # -> accept length 1 + 3/2 = 2.5


@dataclass
class Fake:
    bodies: list[dict] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    metrics_prefix: str | None = None  # None: GET /metrics is a 404
    report_prompt_tokens: bool = True
    drafts: int = 100  # earlier traffic: the bench must use the run's deltas
    accepted: int = 70

    def reset(self, metrics_prefix: str | None = None, report_prompt_tokens: bool = True):
        self.bodies.clear()
        self.endpoints.clear()
        self.metrics_prefix, self.report_prompt_tokens = metrics_prefix, report_prompt_tokens


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _metrics_text(fake: Fake) -> str:
    p = fake.metrics_prefix
    # Two label sets per counter (summed), _created samples, a histogram, a timestamp and
    # a "}" inside a label value: what real exporters write.
    d0, a0 = fake.drafts // 2, fake.accepted // 2
    return "\n".join([
        f"# HELP {p}spec_decode_num_drafts Number of spec decoding drafts.",
        f"# TYPE {p}spec_decode_num_drafts counter",
        f'{p}spec_decode_num_drafts_total{{engine="0",model_name="fake"}} {d0}',
        f'{p}spec_decode_num_drafts_total{{engine="1",model_name="fa}}ke"}} '
        f"{fake.drafts - d0}",
        f'{p}spec_decode_num_drafts_created{{engine="0",model_name="fake"}} 1.7e+09',
        f'{p}spec_decode_num_accepted_tokens_total{{engine="0"}} {a0} 1700000000000',
        f'{p}spec_decode_num_accepted_tokens_total{{engine="1"}} {fake.accepted - a0}',
        f'{p}e2e_request_latency_seconds_bucket{{le="+Inf"}} 4',
        "not a sample line", ""])


def make_app(fake: Fake) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "org/fake", "object": "model"}]})

    async def metrics(request: Request) -> PlainTextResponse:
        if fake.metrics_prefix is None:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(_metrics_text(fake))

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        fake.bodies.append(body)
        fake.endpoints.append(request.url.path)
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], EOS_AFTER)

        async def stream():
            for _ in range(n):
                yield _sse({"choices": [{"index": 0, "delta": {"content": "w"}}
                                        if chat else {"index": 0, "text": "w"}]})
            usage = {"completion_tokens": n}
            if fake.report_prompt_tokens:
                usage["prompt_tokens"] = len(text.split())  # one token a word, here
            fake.drafts += DRAFTS_PER_REQUEST  # counted before the final chunk is sent
            fake.accepted += ACCEPTED_PER_REQUEST
            yield _sse({"choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def server():
    fake = Fake()
    running = BackgroundServer(make_app(fake))
    yield running, fake
    running.stop()


def _args(url: str, *argv: str):
    return build_parser().parse_args(["bench", "--url", url, "--no-progress", *argv])


def _run(url: str, *argv: str) -> int:
    return main_bench(_args(url, *argv))


def _strict_json(text: str):
    def no_constant(name: str):
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=no_constant)


# -- datasets ----------------------------------------------------------------------------

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "be nice"},
        {"from": "human", "value": "first question here"},
        {"from": "gpt", "value": "one two three four five six seven eight nine ten"},
        {"from": "human", "value": "second question"},
        {"from": "gpt", "value": "short"}]},
    {"id": "empty", "conversations": []},
    {"id": "b", "conversations": [{"from": "human", "value": "no answer yet"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello there"}]},
]


def _write_sharegpt(tmp_path, fmt: str):
    if fmt == "json":
        path = tmp_path / "sg.json"
        path.write_text(json.dumps(SHAREGPT, indent=1))
    else:
        path = tmp_path / "sg.jsonl"
        path.write_text("\n".join(json.dumps(row) for row in SHAREGPT) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_sharegpt_first_human_turn_and_estimated_lengths(tmp_path, fmt):
    path = _write_sharegpt(tmp_path, fmt)
    samples = load_samples("sharegpt", 3, dataset_path=str(path))
    assert [s.prompt for s in samples] == [[{"role": "user", "content": c}] for c in
                                           ("first question here", "no answer yet", "hi")]
    # round(1.3 x words): 10 words -> 13, none -> the run's default, 2 words -> 3
    assert [s.output_len for s in samples] == [13, None, 3]
    fixed = load_samples("sharegpt", 3, dataset_path=str(path), sharegpt_output_len=7,
                         max_tokens=99)
    assert [s.output_len for s in fixed] == [7, 7, 7]  # --sharegpt-output-len wins
    given = load_samples("sharegpt", 2, dataset_path=str(path), max_tokens=5)
    assert [s.output_len for s in given] == [5, 5]


def test_sharegpt_end_to_end(server, tmp_path, capsys):
    running, fake = server
    fake.reset()
    path = _write_sharegpt(tmp_path, "json")
    assert _run(running.url, "--dataset", "sharegpt", "--dataset-path", str(path),
                "--num-prompts", "3", "--max-concurrency", "3") == 0
    by_prompt = {b["messages"][0]["content"]: b for b in fake.bodies}
    assert by_prompt["first question here"]["max_tokens"] == 13
    assert by_prompt["no answer yet"]["max_tokens"] == 256  # no answer: the default
    assert by_prompt["hi"]["max_tokens"] == 3
    assert all(len(b["messages"]) == 1 for b in fake.bodies)
    assert "3 prompts of sharegpt" in capsys.readouterr().out


def test_random_dataset_lengths_are_seeded_and_in_range():
    a = random_samples(50, 40, 8, range_ratio=0.25, seed=3)
    assert a == random_samples(50, 40, 8, range_ratio=0.25, seed=3)
    assert a != random_samples(50, 40, 8, range_ratio=0.25, seed=4)
    ins = [len(s.prompt.split()) for s in a]
    outs = [s.output_len for s in a]
    assert all(30 <= n <= 50 for n in ins) and len(set(ins)) > 5
    assert all(6 <= n <= 10 for n in outs) and len(set(outs)) > 1
    assert all(w in WORDS for s in a for w in s.prompt.split())
    # 100 * 1.1 is 110.00000000000001 in floats: the range must still end at 110
    noisy = random_samples(300, 100, 10, range_ratio=0.1, seed=0)
    assert max(len(s.prompt.split()) for s in noisy) == 110
    assert min(len(s.prompt.split()) for s in noisy) == 90
    assert {s.output_len for s in noisy} == set(range(9, 12))
    class Bounds:  # an rng that returns the range it is asked to draw from
        def randint(self, lo: int, hi: int) -> tuple[int, int]:
            return lo, hi

    assert _uniform_lens(Bounds(), 1, 1000, 0.9) == [(100, 1900)]  # 99.99999999999997
    assert _uniform_lens(Bounds(), 1, 3, 0.5) == [(1, 5)]  # floor(1.5), ceil(4.5)
    assert _uniform_lens(Bounds(), 1, 1, 0.9) == [(1, 2)]  # never below 1
    exact = random_samples(5, 17, 4, seed=0)  # ratio 0: exactly the lengths asked for
    assert [len(s.prompt.split()) for s in exact] == [17] * 5
    assert [s.output_len for s in exact] == [4] * 5
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="range-ratio"):
            random_samples(2, 10, 4, range_ratio=bad)


def test_random_dataset_end_to_end_sends_ignore_eos(server, tmp_path):
    running, fake = server
    fake.reset()
    out = tmp_path / "r.json"
    assert _run(running.url, "--dataset", "random", "--random-input-len", "20",
                "--random-output-len", "5", "--num-prompts", "6", "--max-concurrency", "3",
                "--seed", "1", "--out", str(out)) == 0
    assert len(fake.bodies) == 6 and set(fake.endpoints) == {"/v1/completions"}
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 5 for b in fake.bodies)
    assert sorted(len(b["prompt"].split()) for b in fake.bodies) == [20] * 6
    data = json.loads(out.read_text())
    # every request ran to its length (5 > the fake's EOS at 3)
    assert data["per_request"]["output_lens"] == [5] * 6
    assert data["total_input_tokens"] == 6 * 20
    assert data["config"]["max_tokens"] is None and data["config"]["ignore_eos"] is True


@pytest.mark.parametrize("dataset,num", [("mt_bench", 80), ("humaneval", 164),
                                         ("gsm8k", 1319)])
def test_num_prompts_beyond_a_builtin_set_is_an_error(dataset, num):
    assert len(load_samples(dataset, num)) == num
    with pytest.raises(ValueError, match=rf"--num-prompts {num + 1} .* {num} prompts"):
        load_samples(dataset, num + 1)


def test_num_prompts_beyond_a_file_is_an_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"--num-prompts 3 .* 2 prompts"):
        load_samples(str(f), 3)
    sg = _write_sharegpt(tmp_path, "json")
    with pytest.raises(ValueError, match=r"--num-prompts 4 .* 3 prompts .*1 rows without"):
        load_samples("sharegpt", 4, dataset_path=str(sg))


def test_num_prompts_error_on_the_command_line_sends_nothing(server, capsys):
    running, fake = server
    fake.reset()
    rc = main(["bench", "--url", running.url, "--dataset", "mt_bench", "--num-prompts", "81",
               "--no-progress"])
    assert rc == 2 and fake.bodies == []
    err = capsys.readouterr().err
    assert "--num-prompts 81" in err and "80 prompts" in err


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan", "wide"])
def test_bad_range_ratio_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _args("http://x", "--dataset", "random", "--random-range-ratio", value)
    assert exc.value.code == 2
    assert "argument --random-range-ratio: must be a number in [0, 1)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("kw,match", [
    ({"dataset": "mt_bench", "dataset_path": "x.json"}, "--dataset-path apply only to"),
    ({"dataset": "sharegpt"}, "needs --dataset-path"),
    ({"dataset": "sharegpt", "dataset_path": "x", "random_input_len": 5},
     "--random-input-len apply only to --dataset random"),
    ({"dataset": "random", "max_tokens": 5}, "--random-output-len"),
    ({"dataset": "random", "sharegpt_output_len": 5}, "--sharegpt-output-len"),
])
def test_dataset_flags_of_another_dataset_are_errors(kw, match):
    dataset = kw.pop("dataset")
    with pytest.raises(ValueError, match=match):
        load_samples(dataset, 2, **kw)


def test_missing_sharegpt_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--dataset-path"):
        load_samples("sharegpt", 2, dataset_path=str(tmp_path / "nope.json"))


# -- request fields and token counts -----------------------------------------------------


def test_ignore_eos_is_off_by_default_and_sent_with_the_flag(server, tmp_path):
    running, fake = server
    fake.reset()
    out = tmp_path / "r.json"
    assert _run(running.url, "--num-prompts", "2", "--max-tokens", "6", "--out",
                str(out)) == 0
    assert fake.bodies and all("ignore_eos" not in b for b in fake.bodies)
    assert json.loads(out.read_text())["per_request"]["output_lens"] == [EOS_AFTER] * 2
    fake.reset()
    assert _run(running.url, "--num-prompts", "2", "--max-tokens", "6", "--ignore-eos",
                "--out", str(out)) == 0
    assert [b["ignore_eos"] for b in fake.bodies] == [True, True]
    assert json.loads(out.read_text())["per_request"]["output_lens"] == [6, 6]


@pytest.mark.parametrize("reported", [True, False])
def test_input_tokens_come_from_usage(server, reported):
    running, fake = server
    fake.reset(report_prompt_tokens=reported)
    prompts = ["one two three", [{"role": "user", "content": "four five"}], "six"]
    res = asyncio.run(run_bench(running.url, model=None, prompts=prompts, max_tokens=4,
                                max_concurrency=3, progress=False))
    assert res["completed"] == 3, res["error_messages"]
    if reported:
        assert res["per_request"]["input_lens"] == [3, 2, 1]
        assert res["total_input_tokens"] == 6
        total = (6 + res["total_completion_tokens"]) / res["wall_s"]
        assert res["total_token_throughput"] == pytest.approx(total)
        assert re.search(r"input tokens\s+6\b", format_table(res))
    else:  # unknown is not zero
        assert res["total_input_tokens"] is None and res["total_token_throughput"] is None
        assert re.search(r"input tokens\s+-", format_table(res))


# -- goodput -----------------------------------------------------------------------------


def _done(ttft: float, latency: float, tokens: int) -> RequestResult:
    return RequestResult(ok=True, ttft=ttft, latency=latency, completion_tokens=tokens)


def test_goodput_counts_requests_within_every_slo():
    results = [
        _done(0.1, 1.0, 10),   # tpot 100 ms
        _done(0.3, 1.2, 10),   # ttft too slow for 200 ms
        _done(0.1, 3.1, 11),   # tpot 300 ms
        _done(0.05, 0.05, 1),  # one token: no TPOT, passes it
        RequestResult(ok=False, error="boom"),
    ]
    goodput = lambda slos: summarize(results, 2.0, {}, slos)["request_goodput"]  # noqa: E731
    assert goodput({"ttft": 200}) == pytest.approx(3 / 2.0)
    assert goodput({"ttft": 200, "tpot": 150}) == pytest.approx(2 / 2.0)
    assert goodput({"e2el": 1000}) == pytest.approx(2 / 2.0)  # 1.0 s is within (<=)
    assert goodput({"ttft": 300, "tpot": 300, "e2el": 5000}) == pytest.approx(4 / 2.0)
    assert summarize(results, 2.0, {})["request_goodput"] is None


def test_goodput_flag_end_to_end(server, tmp_path, capsys):
    running, fake = server
    fake.reset()
    out = tmp_path / "r.json"
    assert _run(running.url, "--num-prompts", "3", "--max-tokens", "4", "--goodput",
                "e2el:60000", "ttft:60000", "--out", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["config"]["goodput"] == {"e2el": 60000.0, "ttft": 60000.0}
    assert "goodput" in capsys.readouterr().out
    assert _run(running.url, "--num-prompts", "2", "--max-tokens", "4", "--goodput",
                "ttft:0", "--out", str(out)) == 0  # no TTFT is 0 ms: none is good
    assert json.loads(out.read_text())["request_goodput"] == 0.0


@pytest.mark.parametrize("item", ["foo:10", "ttft", "ttft:", "ttft:fast", "ttft:-1",
                                  "ttft:nan", "e2el:inf", "TTFT:10"])
def test_bad_goodput_items_are_argparse_errors(item, capsys):
    with pytest.raises(SystemExit) as exc:
        _args("http://x", "--goodput", item)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --goodput" in err and "ttft, tpot, e2el" in err, err


def test_goodput_key_twice_is_an_error():
    args = _args("http://x", "--goodput", "ttft:10", "tpot:5", "ttft:20")
    assert args.goodput == [("ttft", 10.0), ("tpot", 5.0), ("ttft", 20.0)]
    with pytest.raises(ValueError, match="ttft twice"):
        goodput_dict(args.goodput)
    with pytest.raises(ValueError, match="not one of"):
        asyncio.run(run_bench("http://127.0.0.1:9", model=None, prompts=["a"], max_tokens=1,
                              progress=False, goodput={"latency": 5.0}))


# -- --save-result ------------------------------------------------------------------------

VLLM_KEYS = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput",
             "output_throughput", "total_token_throughput", "input_lens", "output_lens",
             "ttfts", "itls", "errors"} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
    for m in ("ttft", "tpot", "itl", "e2el")}


def test_save_result_writes_vllm_flat_json(server, tmp_path, capsys):
    running, fake = server
    fake.reset()
    assert _run(running.url, "--num-prompts", "4", "--max-tokens", "4", "--ignore-eos",
                "--save-result", "--result-dir", str(tmp_path / "res"),
                "--result-filename", "run.json", "--goodput", "e2el:60000") == 0
    path = tmp_path / "res" / "run.json"
    rec = _strict_json(path.read_text())
    assert rec.keys() >= VLLM_KEYS, VLLM_KEYS - rec.keys()
    assert not [k for k, v in rec.items() if isinstance(v, dict)]  # flat
    assert rec["backend"] == "openai" and rec["model_id"] == "org/fake"
    assert rec["request_rate"] == "inf" and rec["max_concurrency"] == 1  # vLLM's spelling
    assert rec["num_prompts"] == rec["completed"] == 4
    assert rec["total_output_tokens"] == 16 and rec["output_lens"] == [4] * 4
    assert rec["total_input_tokens"] == sum(rec["input_lens"]) > 0
    assert rec["errors"] == [""] * 4 and len(rec["ttfts"]) == 4
    assert [len(x) for x in rec["itls"]] == [3] * 4  # 4 chunks: 3 gaps each
    assert rec["median_ttft_ms"] <= rec["p99_ttft_ms"] and rec["std_e2el_ms"] >= 0
    assert rec["output_throughput"] == pytest.approx(16 / rec["duration"])
    assert rec["request_goodput"] == pytest.approx(rec["request_throughput"])
    assert rec["slo_e2el_ms"] == 60000.0
    assert "accept_length" not in rec  # unknown: this fake has no /metrics
    assert re.fullmatch(r"\d{8}-\d{6}", rec["date"])
    assert not [p for p in path.parent.iterdir() if p.name != "run.json"]  # no temp file


def test_save_result_default_name_and_compare(server, tmp_path, capsys):
    running, fake = server
    fake.reset()
    assert _run(running.url, "--num-prompts", "2", "--max-tokens", "4", "--result-dir",
                str(tmp_path), "--request-rate", "500", "--max-concurrency", "2",
                "--compare", running.url) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2, names
    assert re.fullmatch(r"openai-500qps-concurrency2-fake-\d{8}-\d{6}-compare\.json", names[0])
    assert re.fullmatch(r"openai-500qps-concurrency2-fake-\d{8}-\d{6}\.json", names[1])
    a, b = (_strict_json((tmp_path / n).read_text()) for n in names[::-1])
    assert a["request_rate"] == 500.0 and a["completed"] == b["completed"] == 2
    assert a["date"] == b["date"]


def test_write_json_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')
    with pytest.raises(TypeError):
        write_json(path, {"completed": 3, "bad": object()})  # fails mid-dump
    assert path.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_vllm_record_of_a_failed_run_is_valid_json():
    res = summarize([RequestResult(ok=False, error="HTTP 500: x")], 1.0,
                    {"model": None, "num_prompts": 1, "request_rate": 2.0})
    rec = vllm_record(res, date="20250101-000000")
    assert rec["errors"] == ["HTTP 500: x"] and rec["output_lens"] == [0]
    assert rec["mean_ttft_ms"] is None and rec["request_rate"] == 2.0
    _strict_json(json.dumps(rec))


# -- accept length from /metrics --------------------------------------------------------


def test_parse_prometheus_sums_label_sets():
    text = "\n".join([
        "# HELP x_total a counter", "# TYPE x_total counter",
        'x_total{a="1"} 2', 'x_total{a="2",b="}{"} 3.5', "y 7 1700000000000",
        'z{a="1"} NaN', "broken{", "w{} not-a-number", "", "  v   4  ", "t\t2"])
    assert parse_prometheus(text) == {"x_total": 5.5, "y": 7.0, "v": 4.0, "t": 2.0}


def test_metrics_accept_length_from_deltas():
    before = {"vllm:spec_decode_num_drafts_total": 10.0,
              "vllm:spec_decode_num_accepted_tokens_total": 4.0}
    after = {"vllm:spec_decode_num_drafts_total": 30.0,
             "vllm:spec_decode_num_accepted_tokens_total": 34.0}
    got = metrics_accept_length(before, after)
    assert got == {"prefix": "vllm:", "drafts": 20.0, "accepted_tokens": 30.0,
                   "accept_length": 2.5}
    # series absent before the run (a labelled counter not yet incremented): from 0
    assert metrics_accept_length({}, after)["accept_length"] == pytest.approx(1 + 34 / 30)
    assert metrics_accept_length(before, before) is None  # no drafts during the run
    assert metrics_accept_length(None, after) is None and metrics_accept_length({}, {}) is None
    own = {"specscope:spec_decode_num_drafts_total": 4.0,
           "specscope:spec_decode_num_accepted_tokens_total": 2.0}
    assert metrics_accept_length({}, own)["prefix"] == "specscope:"
    # nothing accepted yet: the accepted series may not be exposed at all
    drafts_only = {"vllm:spec_decode_num_drafts_total": 8.0}
    assert metrics_accept_length({}, drafts_only)["accept_length"] == 1.0
    # vLLM's first: a server exposing both families is read through vllm:
    assert metrics_accept_length({}, {**own, **after})["prefix"] == "vllm:"


@pytest.mark.parametrize("prefix", ["vllm:", "specscope:"])
def test_accept_length_from_the_servers_metrics(server, prefix, capsys):
    running, fake = server
    fake.reset(metrics_prefix=prefix)
    res = asyncio.run(run_bench(running.url, model=None, prompts=["a", "b", "c", "d"],
                                max_tokens=4, max_concurrency=2, progress=False))
    assert res["completed"] == 4, res["error_messages"]
    assert res["spec_metrics"]["prefix"] == prefix
    assert res["spec_metrics"]["drafts"] == 4 * DRAFTS_PER_REQUEST  # the run's delta only
    assert res["accept_length"] == pytest.approx(1 + ACCEPTED_PER_REQUEST / DRAFTS_PER_REQUEST)
    assert res["accept_length_source"] == "metrics"
    assert "2.500   (from metrics)" in format_table(res)
    rec = vllm_record(res)
    assert rec["accept_length"] == pytest.approx(2.5)


def test_no_metrics_endpoint_means_no_accept_length(server):
    running, fake = server
    fake.reset(metrics_prefix=None)
    res = asyncio.run(run_bench(running.url, model=None, prompts=["a"], max_tokens=2,
                                progress=False))
    assert res["completed"] == 1 and res["accept_length"] is None
    assert res["spec_metrics"] is None and res["accept_length_source"] is None
