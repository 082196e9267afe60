"""The async benchmark client against a real uvicorn server serving the tiny random Llama."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


from specscope.bench.client import main_bench, run_bench  # noqa: E402
from specscope.bench.results import compare, format_table  # noqa: E402
from specscope.config import ServerConfig  # noqa: E402
from specscope.engine.llm import LLM  # noqa: E402
from specscope.server import create_app  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

PROMPTS = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(4)] \
    + ["def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    running = BackgroundServer(create_app(LLM(str(tiny_model_dir), dtype="fp32", device="cpu"),
                                          ServerConfig(served_model_name="tiny")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def result(srv):
    return asyncio.run(run_bench(srv.url, model=None, prompts=PROMPTS, concurrency=3,
                                 max_tokens=8, progress=False))


def _sane(stats: dict) -> None:
    assert stats["p50"] is not None
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert stats["mean"] > 0


def test_run_bench(result):
    assert result["completed"] == 6 and result["errors"] == 0, result["error_messages"]
    assert result["output_tok_s"] > 0 and result["request_throughput"] > 0
    assert 0 < result["total_completion_tokens"] <= 6 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        _sane(result[key])
    assert result["accept_length"] is None and result["spec_metrics"] is None  # no draft
    # prompt tokens from each response's usage: every request reported them
    lens = result["per_request"]["input_lens"]
    assert len(lens) == 6 and all(n > 0 for n in lens)
    assert result["total_input_tokens"] == sum(lens)
    assert result["config"]["model"] == "tiny"  # looked up from /v1/models
    assert result["config"]["concurrency"] == 3
    json.loads(json.dumps(result))
    table = format_table(result)
    assert "TTFT" in table and "TPOT" in table and "tok/s" in table


def test_accept_length_from_spec_server(tiny_model_dir):
    from specscope.config import SpecConfig

    spec_llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
                   spec=SpecConfig(draft="random", num_steps=3))
    running = BackgroundServer(create_app(spec_llm, ServerConfig(served_model_name="tiny")))
    try:
        res = asyncio.run(run_bench(running.url, model="tiny", prompts=PROMPTS[:3],
                                    concurrency=2, max_tokens=8, progress=False))
    finally:
        running.stop()
    assert res["completed"] == 3 and res["errors"] == 0, res["error_messages"]
    assert res["accept_length"] is not None and res["accept_length"] >= 1.0
    assert res["spec_requests"] == 3 and res["accept_length_source"] == "responses"
    # the same run seen through the server's own /metrics counters (specscope: prefix)
    spec = res["spec_metrics"]
    assert spec is not None and spec["prefix"] == "specscope:" and spec["drafts"] > 0
    assert res["metrics_accept_length"] == pytest.approx(1 + spec["accepted_tokens"]
                                                         / spec["drafts"])


def test_unreachable_server_counts_errors():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    res = asyncio.run(run_bench(f"http://127.0.0.1:{port}", model=None, prompts=PROMPTS,
                                concurrency=3, max_tokens=8, timeout=5, progress=False))
    assert res["errors"] == len(PROMPTS) and res["completed"] == 0
    assert res["error_messages"] and res["output_tok_s"] == 0
    assert res["ttft_ms"]["p50"] is None
    json.dumps(res)
    format_table(res)


def test_http_error_is_recorded(srv):
    res = asyncio.run(run_bench(srv.url, model="no-such-model", prompts=PROMPTS[:2],
                                concurrency=2, max_tokens=4, progress=False))
    assert res["errors"] == 2 and "HTTP 404" in res["error_messages"][0]


def test_compare(result):
    other = json.loads(json.dumps(result))
    other["output_tok_s"] = result["output_tok_s"] * 2
    other["config"]["url"] = "http://other"
    text = compare(result, other)
    assert "2.000x" in text and "TTFT" in text and "TPOT" in text and "B/A" in text


def test_main_bench_writes_json(srv, tmp_path, capsys):
    out = tmp_path / "sub" / "result.json"
    args = argparse.Namespace(url=srv.url, model=None, dataset="mt_bench", num_prompts=3,
                              concurrency=2, max_tokens=4, temperature=0.0, out=str(out),
                              compare=srv.url, no_progress=True, timeout=60.0)
    assert main_bench(args) == 0
    data = json.loads(out.read_text())
    assert data["a"]["completed"] == 3 and data["b"]["completed"] == 3
    assert data["a"]["config"]["dataset"] == "mt_bench"
    printed = capsys.readouterr().out
    assert "B/A" in printed and "TTFT" in printed
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_spec_stats_sglang_style():
    from specscope.bench.client import _spec_stats

    chunk = {"choices": [], "usage": {"completion_tokens": 12},
             "meta_info": {"spec_verify_ct": 4}}
    assert _spec_stats(chunk, 12) == (3.0, 4)
    chunk = {"choices": [], "meta_info": {"spec_accept_length": 2.5, "spec_verify_ct": 2}}
    assert _spec_stats(chunk, 5) == (2.5, 2)
    assert _spec_stats({"choices": [], "usage": {"completion_tokens": 3}}, 3) == (None, None)
    spec = {"usage": {"completion_tokens": 9, "spec": {"cycles": 3, "accept_length": 3.0}}}
    assert _spec_stats(spec, 9) == (3.0, 3)
