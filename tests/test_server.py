"""The OpenAI-compatible server, end to end: a real uvicorn server on a free local port
serving the tiny random Llama, driven by the official `openai` client and by httpx."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


from specscope.config import SamplingParams, ServerConfig  # noqa: E402
from specscope.engine.llm import LLM  # noqa: E402
from specscope.server import create_app  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

NAME = "tiny"
GREEDY = {"temperature": 0}


class Running(BackgroundServer):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="fp32", device="cpu", profile=True)


@pytest.fixture(scope="module")
def srv(llm):
    running = Running(create_app(llm, ServerConfig(served_model_name=NAME)))
    yield running
    running.stop()


def ref(llm: LLM, prompt, max_tokens: int, chat: bool, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return llm.generate(prompt, params, chat=chat)[0]


def slow_stream(monkeypatch, llm: LLM, delay: float, produced: list):
    """Make each engine step take `delay` seconds longer (and record its deltas)."""
    orig = llm.step

    def step():
        deltas = orig()
        produced.extend(deltas)
        time.sleep(delay)
        return deltas

    monkeypatch.setattr(llm, "step", step)


# -- basic endpoints ----------------------------------------------------------------------


def test_health_and_models(srv, llm):
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    r = httpx.get(f"{srv.url}/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_connections_have_tcp_nodelay(srv):
    """Without TCP_NODELAY, Nagle holds a stream's first chunk after the headers until
    the client's delayed ACK (~40 ms per request on a kept-alive connection)."""
    with httpx.Client() as c:
        assert c.get(f"{srv.url}/health").status_code == 200
        conns = list(srv.server.server_state.connections)
        assert conns
        for conn in conns:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_chat_matches_generate(srv, llm):
    prompt = "Tell me about the sea."
    want = ref(llm, prompt, 20, chat=True)
    resp = srv.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=20, **GREEDY)
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == want.finish_reason
    u = resp.usage
    assert u.prompt_tokens == len(want.prompt_token_ids) == want.metrics.prompt_tokens
    assert u.completion_tokens == want.metrics.completion_tokens == len(want.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # content as a list of text parts is the same message
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": NAME, "max_tokens": 20, "temperature": 0, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "Tell me "}, {"type": "text",
                                                         "text": "about the sea."}]}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
    # max_completion_tokens is the same limit
    resp2 = srv.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=20, **GREEDY)
    assert resp2.choices[0].message.content == want.text


def test_completion_matches_generate(srv, llm):
    prompt = "The capital of France is"
    want = ref(llm, prompt, 16, chat=False, ignore_eos=True)
    resp = srv.client().completions.create(model=NAME, prompt=prompt, max_tokens=16,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.choices[0].text == want.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    # token-id prompts give the same result
    r = httpx.post(f"{srv.url}/v1/completions", json={
        "model": NAME, "prompt": want.prompt_token_ids, "max_tokens": 16, "ignore_eos": True,
        "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


def test_chat_stream_with_usage(srv, llm):
    prompt = "Write a haiku about rain."
    want = ref(llm, prompt, 24, chat=True)
    stream = srv.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=24,
        stream=True, stream_options={"include_usage": True}, **GREEDY)
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        d = chunk.choices[0].delta
        if d.role:
            roles.append(d.role)
        text += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == want.text and finish == want.finish_reason
    assert roles == ["assistant"]
    assert usage is not None and usage.completion_tokens == want.metrics.completion_tokens
    assert usage.prompt_tokens == want.metrics.prompt_tokens


def test_completion_stream_raw_sse(srv, llm):
    prompt = "Once upon a time"
    want = ref(llm, prompt, 12, chat=False, ignore_eos=True)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # include_usage not asked for


def test_stop_and_seeded_sampling(srv, llm):
    prompt = "List some colours:"
    params = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=0.8, seed=7,
                  extra_body={"top_k": 50})
    a = srv.client().completions.create(**params).choices[0].text
    b = srv.client().completions.create(**params).choices[0].text
    assert a == b  # a seed makes sampling reproducible
    want = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=7,
                                               top_k=50))[0]
    assert a == want.text
    full = ref(llm, prompt, 20, chat=False, ignore_eos=True).text
    if len(full.strip()) > 4:
        stop = full.strip()[2:4]
        got = srv.client().completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                              stop=[stop], extra_body={"ignore_eos": True},
                                              **GREEDY)
        assert got.choices[0].finish_reason == "stop"
        assert stop not in got.choices[0].text
        assert full.startswith(got.choices[0].text)


# -- bad input ----------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("chat", "{not json", 400, None),
    ("chat", "[1, 2]", 400, None),
    ("chat", "[" * 100000, 400, None),
    ("chat", {"model": NAME}, 400, "messages"),
    ("chat", {"model": NAME, "messages": []}, 400, "messages"),
    ("chat", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("chat", {"model": NAME, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"model": NAME, "messages": "hello"}, 400, "messages"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat", {"model": NAME, "messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("chat", {"model": NAME, "messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("chat", {"model": NAME, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"model": NAME, "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("chat", {"model": NAME, "messages": MSG, "temperature": True}, 400, "temperature"),
    ("chat", {"model": NAME, "messages": MSG, "seed": 2**70}, 400, "seed"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content"),
    ("chat", {"model": NAME, "messages": MSG, "stream_options": 3}, 400, "stream_options"),
    ("chat", {"model": NAME, "messages": MSG, "top_k": -5}, 400, "top_k"),
    ("chat", {"model": NAME, "messages": MSG, "seed": -1}, 400, "seed"),
    ("chat", {"model": NAME, "messages": MSG, "stop": 5}, 400, "stop"),
    ("chat", {"model": NAME, "messages": MSG, "stop": [""]}, 400, "stop"),
    ("chat", {"model": NAME, "messages": MSG, "n": 0}, 400, "n"),
    ("chat", {"model": NAME, "messages": MSG, "stream": "yes please"}, 400, "stream"),
    ("chat", {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "messages"),
    ("chat", {"model": NAME, "messages": MSG, "max_tokens": 250}, 400, "max_tokens"),
    ("cmpl", {"model": NAME}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": ["a", 5]}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": ["a", "word " * 400]}, 400, "prompt[1]"),
    ("cmpl", {"model": NAME, "prompt": [1, 10**9]}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": 42}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": "word " * 400}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    # Found by a hostile-client pass (issue 17): each was a 200, a misleading message or a
    # crash in the tokenizer.
    ("chat", {"model": NAME, "messages": MSG, "stop": ""}, 400, "stop"),
    ("chat", {"model": NAME, "messages": MSG, "stream": 1}, 400, "stream"),
    ("chat", {"model": NAME, "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("chat", {"model": NAME, "messages": MSG, "ignore_eos": "x"}, 400, "ignore_eos"),
    ("chat", {"model": NAME, "messages": MSG, "stream": True,
              "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ("chat", {"model": NAME, "messages": MSG, "stop": ["x"] * 17}, 400, "stop"),
    ("chat", {"model": NAME, "messages": MSG, "stop": ["x" * 257]}, 400, "stop"),
    ("chat", {"model": NAME, "messages": MSG, "n": 10**6}, 400, "n"),
    ("chat", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
             '"temperature": NaN}', 400, None),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages[0].content"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     400, "messages[0].content"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
     "messages"),
    ("cmpl", {"model": NAME, "prompt": "a\udc00"}, 400, "prompt"),
    ("cmpl", {"model": NAME, "prompt": "x", "stop": ""}, 400, "stop"),
    ("cmpl", {"model": NAME, "prompt": "x" * 300_000}, 400, "prompt"),
    ("chat", {"model": NAME, "messages": MSG, "stop": {"a": 1}}, 400, "stop"),
    ("cmpl", '{"model": "tiny", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", 400, None),
    # A check across fields, and a vLLM alias, name the field the client sent.
    ("chat", {"model": NAME, "messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {"model": NAME, "messages": MSG, "guided_choice": []}, 400, "guided_choice"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD)
def test_bad_input(srv, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{srv.url}{path}", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if body == {"model": "gpt-9", "messages": MSG}:
        assert err["code"] == "model_not_found"
    if isinstance(body, dict) and body.get("n") == 2:
        assert "n > 1 is not supported" in err["message"]
    if "image_url" in content:
        assert "images" in err["message"] and "not supported" in err["message"]
    if "stop" in content and err["param"] == "stop":
        assert "(" not in err["message"].split(":", 1)[-1][:3], err  # no Python tuple


def test_nulls_mean_defaults_and_completions_default_to_16_tokens(srv):
    """An explicit null is the field's default (OpenAI types n, stream and echo "or null");
    /v1/completions without max_tokens writes at most 16 tokens, as OpenAI's and vLLM's."""
    r = httpx.post(f"{srv.url}/v1/completions", json={
        "model": NAME, "prompt": "Once upon a time", "n": None, "stream": None, "echo": None,
        "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={
        "model": NAME, "messages": MSG, "n": None, "stream": None, "logprobs": None,
        "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


# -- concurrency, disconnects, back-pressure -----------------------------------------------


@pytest.mark.parametrize("n", [16, 64])
def test_concurrent_streams_match_references(srv, llm, n):
    """n streaming clients released together, batched by the engine step by step (their
    streams interleave): each gets exactly the engine's output for its own prompt alone,
    nothing lost or mixed."""
    prompts = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(n)]
    wants = [ref(llm, p, 8 + i, chat=True).text for i, p in enumerate(prompts)]
    assert len(set(wants)) == n  # distinct outputs, so a mix-up cannot go unnoticed
    started = threading.Barrier(n)

    def one(i: int) -> tuple[str, str | None]:
        client = srv.client()
        started.wait(timeout=30)
        stream = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=8 + i, stream=True, **GREEDY)
        text, finish = "", None
        for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, range(n)))
    assert [t for t, _ in got] == wants
    assert srv.app.state.worker.peak_running > 1  # really served side by side
    assert all(f is not None for _, f in got)
    _wait_idle(srv)


def test_job_hands_over_batches():
    """Items pushed while the handler is busy arrive together in one take(); a waiting
    take() is woken by a push from the engine thread."""
    import asyncio

    from specscope.server.worker import _Job

    async def main() -> None:
        job = _Job(asyncio.get_running_loop())
        pusher = threading.Thread(target=lambda: [job.push(i) for i in range(5)])
        pusher.start()
        pusher.join()
        assert await job.take() == [0, 1, 2, 3, 4]
        threading.Timer(0.05, job.push, args=("x",)).start()
        assert await asyncio.wait_for(job.take(), 5) == ["x"]

    asyncio.run(main())


def _wait_idle(srv, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while srv.app.state.worker.inflight:
        assert time.time() < deadline, "the engine was not freed"
        time.sleep(0.01)


def test_disconnect_frees_engine(srv, llm, monkeypatch):
    produced: list = []
    slow_stream(monkeypatch, llm, 0.02, produced)
    body = {"model": NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(ln.startswith("data: ") for ln in got)
    t0 = time.time()
    _wait_idle(srv)
    assert time.time() - t0 < 2.0
    assert len(produced) < 100  # stopped well before its 200 tokens
    monkeypatch.undo()
    want = ref(llm, "Count:", 10, chat=False, ignore_eos=True)
    resp = srv.client().completions.create(model=NAME, prompt="Count:", max_tokens=10,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.choices[0].text == want.text
    assert "specscope:requests_cancelled_total" in httpx.get(f"{srv.url}/metrics").text


def test_non_streaming_disconnect_frees_engine(srv, llm, monkeypatch):
    produced: list = []
    slow_stream(monkeypatch, llm, 0.02, produced)
    body = {"model": NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.3)
    _wait_idle(srv, timeout=3.0)
    assert len(produced) < 100
    monkeypatch.undo()
    resp = srv.client().completions.create(model=NAME, prompt="Count:", max_tokens=4,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.choices[0].text == ref(llm, "Count:", 4, chat=False, ignore_eos=True).text


def test_speculative_usage_has_spec(tiny_model_dir, llm):
    from specscope.config import SpecConfig

    spec_llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
                   spec=SpecConfig(draft="random", num_steps=3))
    spec_srv = Running(create_app(spec_llm, ServerConfig(served_model_name=NAME)))
    try:
        prompt = "Speculate about the weather."
        want = ref(llm, prompt, 20, chat=True)  # plain greedy: the speculative output equals it
        resp = spec_srv.client().chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=20,
            **GREEDY)
        assert resp.choices[0].message.content == want.text
        spec = resp.model_dump()["usage"]["spec"]
        assert spec["cycles"] >= 1 and spec["accept_length"] >= 1.0
        assert "acceptance_by_position" in spec
        text = httpx.get(f"{spec_srv.url}/metrics").text
        # vLLM's counters: drafts = cycles, accepted tokens = tau - 1 summed, and by position
        accepted = spec["accepted_per_cycle"]
        assert _metric(text, "specscope:spec_decode_num_drafts_total") == spec["cycles"]
        assert _metric(text, "specscope:spec_decode_num_draft_tokens_total") \
            == 3 * spec["cycles"]
        assert _metric(text, "specscope:spec_decode_num_accepted_tokens_total") \
            == sum(accepted) == pytest.approx((spec["accept_length"] - 1) * spec["cycles"])
        for pos in range(3):
            assert _metric(text, "specscope:spec_decode_num_accepted_tokens_per_pos_total",
                           position=str(pos)) == sum(1 for a in accepted if a > pos)
    finally:
        spec_srv.stop()


def test_queue_full_gives_503(tiny_model_dir, monkeypatch):
    """max_num_seqs run at once, max_queue more wait; past that, 503."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", max_num_seqs=1)
    produced: list = []
    slow_stream(monkeypatch, llm, 0.02, produced)
    small = Running(create_app(llm, ServerConfig(served_model_name=NAME, max_queue=0)))
    try:
        body = {"model": NAME, "prompt": "Count:", "max_tokens": 100, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{small.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # (dropping this iterator would close the connection)
            next(lines)  # the first request is running
            busy = httpx.post(f"{small.url}/v1/completions", timeout=30,
                              json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            assert busy.status_code == 503
            assert busy.headers["retry-after"]
            assert busy.json()["error"]["code"] == "queue_full"
        _wait_idle(small)
        ok = httpx.post(f"{small.url}/v1/completions", timeout=30,
                        json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        small.stop()


# -- metrics and profile ------------------------------------------------------------------


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_move(srv):
    before = httpx.get(f"{srv.url}/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    srv.client().completions.create(model=NAME, prompt="Hello", max_tokens=5,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": "x", "n": 0})
    after = httpx.get(f"{srv.url}/metrics").text
    ok = dict(endpoint="/v1/completions", status="200")
    bad = dict(endpoint="/v1/completions", status="400")
    req = "specscope:http_requests_total"
    assert _metric(after, req, **ok) == _metric(before.text, req, **ok) + 1
    assert _metric(after, req, **bad) == _metric(before.text, req, **bad) + 1
    assert _metric(after, "specscope:generation_tokens_total") \
        == _metric(before.text, "specscope:generation_tokens_total") + 5
    assert _metric(after, "specscope:prompt_tokens_total") \
        > _metric(before.text, "specscope:prompt_tokens_total")
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "time_per_output_token_seconds"):
        assert _metric(after, f"specscope:{hist}_count") \
            == _metric(before.text, f"specscope:{hist}_count") + 1, hist
    # 5 tokens: 4 gaps between outputs (plain decoding: one token per step)
    assert _metric(after, "specscope:inter_token_latency_seconds_count") \
        == _metric(before.text, "specscope:inter_token_latency_seconds_count") + 4
    assert _metric(after, "specscope:request_success_total", finished_reason="length") \
        == _metric(before.text, "specscope:request_success_total",
                   finished_reason="length") + 1
    for name in ("specscope:spec_decode_num_drafts", "specscope:queue_depth",
                 "specscope:num_preemptions_total", "specscope:kv_cache_usage_perc"):
        assert name in after
    for line in after.splitlines():  # every sample line is `name{labels} value`
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_metrics_show_the_engine(srv, llm):
    """Queues, KV blocks and the prefix cache: a second request with the same long prompt
    hits the cache (its shared blocks are not prefilled again)."""
    prompt = "A shared system prompt that is long enough to fill several KV blocks. " * 4

    def figures():
        text = httpx.get(f"{srv.url}/metrics").text
        return {k: _metric(text, "specscope:" + k) for k in (
            "kv_cache_blocks", "num_requests_running", "num_requests_waiting",
            "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_cache_blocks_in_use")}

    before = figures()
    for _ in range(2):
        srv.client().completions.create(model=NAME, prompt=prompt, max_tokens=3, **GREEDY)
    after = figures()
    assert after["kv_cache_blocks"] > 0
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    assert after["prefix_cache_queries_total"] > before["prefix_cache_queries_total"]
    # in tokens, as vLLM counts them: the second request's full blocks of 16
    assert after["prefix_cache_hits_total"] >= before["prefix_cache_hits_total"] + 2 * 16
    _wait_idle(srv)


def test_profile_endpoints(srv, llm):
    srv.client().completions.create(model=NAME, prompt="Profile me", max_tokens=8,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    r = httpx.get(f"{srv.url}/profile")
    assert r.status_code == 200, r.text
    summaries = r.json()["summaries"]
    assert isinstance(summaries, list) and summaries
    t = httpx.get(f"{srv.url}/profile/trace", params={"cycles": 3})
    assert t.status_code == 200
    events = t.json()["traceEvents"] if "traceEvents" in t.json() else t.json()
    assert any(e.get("name") == "cycle" for e in events)
    assert httpx.get(f"{srv.url}/profile/trace", params={"cycles": "abc"}).status_code == 400
    timer = llm.timer
    try:
        llm.enable_profiling(False)
        off = httpx.get(f"{srv.url}/profile")
        assert off.status_code == 404
        assert off.json()["error"]["code"] == "profiling_off"
        assert httpx.get(f"{srv.url}/profile/trace").status_code == 404
    finally:
        llm.timer = timer
        llm.engine.timer = timer


# -- graceful shutdown of `specscope serve` -----------------------------------------------


def test_shutdown_stops_running_and_refuses_queued(llm, monkeypatch):
    """After the grace period the running stream ends cleanly with finish_reason "abort"
    and an error event, a queued request gets 503 (never started), and new requests get
    503."""
    produced: list = []
    slow_stream(monkeypatch, llm, 0.02, produced)
    closing = Running(create_app(llm, ServerConfig(served_model_name=NAME)))
    try:
        body = {"model": NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{closing.url}/v1/completions", json=body,
                          timeout=30) as r, ThreadPoolExecutor(1) as pool:
            lines = r.iter_lines()
            got = [next(lines)]  # running
            queued = pool.submit(httpx.post, f"{closing.url}/v1/completions", timeout=30,
                                 json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            while closing.app.state.worker.inflight < 2:
                time.sleep(0.01)
            closing.app.state.worker.begin_shutdown(0.0)
            got += [ln for ln in lines if ln]
            refused = queued.result()
        events = _sse_events(got)
        assert events[-1]["error"]["code"] == "server_shutting_down"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert len(produced) < 100
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_shutting_down"
        new = httpx.post(f"{closing.url}/v1/completions", timeout=30,
                         json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert new.status_code == 503
        assert new.json()["error"]["code"] == "server_shutting_down"
    finally:
        closing.stop()


def _sse_events(lines: list[str]) -> list:
    assert all(ln.startswith("data: ") for ln in lines), lines[:3]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(ln[6:]) for ln in lines[:-1]]


@pytest.mark.parametrize("grace", [0.0, 30.0])
def test_sigterm_mid_stream_shuts_down_cleanly(long_tiny_dir, tmp_path, grace):
    """`specscope serve` as a real process gets SIGTERM while a stream runs. With no grace
    the stream is stopped at its next cycle and ends cleanly (an error event, then
    [DONE]); with grace it completes. Either way no 5xx, and the process exits 0 within
    seconds, without a traceback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specscope.cli", "serve", str(long_tiny_dir), "--dtype", "fp32",
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
         NAME, "--shutdown-timeout", str(grace), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"serve exited early:\n{log.seek(0) or log.read()}"
            assert time.time() < deadline, "serve did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        max_tokens = 2000 if grace == 0 else 300
        body = {"model": NAME, "prompt": "Count:", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines)]
            proc.send_signal(signal.SIGTERM)
            got += [ln for ln in lines if ln]
        ended = time.time()
        events = _sse_events(got)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        if grace == 0:  # stopped at the next cycle: "abort", then an error event
            err = events[-1]["error"]
            assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
            assert all("error" not in e for e in events[:-1])
            assert text and events[-2]["choices"][0]["finish_reason"] == "abort"
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
            assert len(events) < max_tokens // 2  # well before the end
        else:  # the grace period let it finish
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        rc = proc.wait(timeout=15)
        assert rc == 0
        assert time.time() - ended < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    out = log.read()
    assert "Traceback" not in out and "ERROR" not in out, out
    assert "shutting down: 1 request(s) in flight" in out, out


# -- limits, access rules, the guard (issue 17) -------------------------------------------


def _post(url: str, path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **headers})


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_body_limits_and_content_type(llm):
    """413 past --max-request-bytes (by Content-Length, and for a chunked body while it
    arrives); 415 for a POST that is not application/json (a browser's cross-site simple
    request); HEAD /health; /docs and /openapi.json off by default."""
    small = Running(create_app(llm, ServerConfig(served_model_name=NAME,
                                                 max_request_bytes=4096)))
    try:
        big = {"model": NAME, "prompt": "x" * 5000, "max_tokens": 1}
        _error(_post(small.url, "/v1/completions", big), 413, "request_too_large")

        def chunks():
            for _ in range(10):
                yield b"x" * 1000

        r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        _error(r, 413, "request_too_large")
        ok = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
            r = httpx.post(f"{small.url}/v1/completions", content=json.dumps(ok), timeout=30,
                           headers={"content-type": ctype})
            _error(r, 415, "unsupported_media_type")
        assert _post(small.url, "/v1/completions", ok,
                     **{"content-type": "application/json; charset=utf-8"}).status_code == 200
        assert httpx.head(f"{small.url}/health").status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):
            _error(httpx.get(f"{small.url}{path}"), 404)
        _error(httpx.get(f"{small.url}/admin/spec"), 404, "admin_disabled")
        _error(_post(small.url, "/admin/spec", {"num_steps": 3}), 404, "admin_disabled")
    finally:
        small.stop()


def test_api_key_and_allowed_hosts(llm):
    """With --api-key every route but /health needs the key (401 otherwise); admin routes
    with --enable-admin need it too; a Host not in --allowed-hosts is refused (DNS
    rebinding); /docs comes back with --enable-docs."""
    cfg = ServerConfig(served_model_name=NAME, api_keys=("s3cret", "other"), enable_admin=True,
                       allowed_hosts=("127.0.0.1", "localhost"), enable_docs=True)
    guarded = Running(create_app(llm, cfg))
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    try:
        url = guarded.url
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}, {"authorization": "Bearer"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", "/v1/completions"), ("GET", "/admin/spec"),
                                 ("POST", "/admin/spec"), ("GET", "/profile"),
                                 ("GET", "/openapi.json")):
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                err = _error(r, 401, "invalid_api_key")
                assert err["type"] == "authentication_error"
        for key in ("s3cret", "other"):
            auth = {"authorization": f"Bearer {key}"}
            assert _post(url, "/v1/completions", body, **auth).status_code == 200
            assert httpx.get(f"{url}/admin/spec", headers=auth).status_code == 200
            assert httpx.get(f"{url}/openapi.json", headers=auth).status_code == 200
        auth = {"authorization": "Bearer s3cret"}
        r = _post(url, "/v1/completions", body, host="evil.example", **auth)
        _error(r, 400, "invalid_host")
        assert _post(url, "/v1/completions", body, host="localhost:8000",
                     **auth).status_code == 200
        r = httpx.post(f"{url}/admin/spec", content='{"num_steps": 2}', headers={
            **auth, "content-type": "text/plain", "origin": "http://evil.example"})
        _error(r, 415)
    finally:
        guarded.stop()


def test_enable_admin_needs_a_key():
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(enable_admin=True)


def test_slow_body_times_out_and_leaves_the_server_free(llm):
    """A client that promises a body and stalls gets 408 after --request-read-timeout (it
    held its connection forever); one that leaves mid-body is dropped without a traceback;
    meanwhile /health answers at once."""
    srv = Running(create_app(llm, ServerConfig(served_model_name=NAME,
                                               request_read_timeout=0.5)))
    try:
        socks = []
        for stall in (True, False):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mod")
            socks.append((s, stall))
        t0 = time.perf_counter()
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        assert time.perf_counter() - t0 < 1.0
        socks[1][0].close()  # leaves mid-body
        s = socks[0][0]
        s.settimeout(10)
        chunks = []  # until the server closes: the body may come in a later segment
        while chunk := s.recv(65536):
            chunks.append(chunk)
        reply = b"".join(chunks).decode()
        s.close()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert '"request_timeout"' in reply
    finally:
        srv.stop()


def test_long_prompt_refused_before_tokenization(llm, monkeypatch):
    """A prompt too long to fit whatever its tokens are is refused from its length, without
    being tokenized; tokenization of what is tokenized runs off the event loop."""
    srv = Running(create_app(llm, ServerConfig(served_model_name=NAME)))
    calls: list[int] = []
    orig = llm.encode_prompt

    def encode(prompt, chat=False):
        calls.append(threading.get_ident())
        return orig(prompt, chat)

    monkeypatch.setattr(llm, "encode_prompt", encode)
    try:
        text = "x" * 200_000
        err = _error(_post(srv.url, "/v1/completions", {"model": NAME, "prompt": text}), 400,
                     "context_length_exceeded")
        assert "characters" in err["message"]
        err = _error(_post(srv.url, "/v1/chat/completions", {
            "model": NAME, "messages": [{"role": "user", "content": text}]}), 400,
            "context_length_exceeded")
        many = [{"role": "user", "content": "a"}] * 20_000  # tiny messages, many tokens
        err = _error(_post(srv.url, "/v1/chat/completions", {"model": NAME, "messages": many}),
                     400, "context_length_exceeded")
        assert "20000 messages" in err["message"]
        assert calls == []
        assert _post(srv.url, "/v1/completions", {"model": NAME, "prompt": "hi",
                                                  "max_tokens": 1}).status_code == 200
        assert calls and calls[0] != threading.main_thread().ident
    finally:
        srv.stop()


def test_max_prompt_tokens(llm):
    srv = Running(create_app(llm, ServerConfig(served_model_name=NAME, max_prompt_tokens=8)))
    try:
        r = _post(srv.url, "/v1/completions", {"model": NAME, "prompt": list(range(9)),
                                               "max_tokens": 1})
        assert "--max-prompt-tokens" in _error(r, 400, "context_length_exceeded")["message"]
        r = _post(srv.url, "/v1/completions", {"model": NAME, "prompt": list(range(8)),
                                               "max_tokens": 1})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_assistant_tool_calls_with_null_content(srv):
    """An assistant turn that called a tool has content null; the conversation is valid."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}
    r = _post(srv.url, "/v1/chat/completions", {"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert r.status_code == 200, r.text


def test_health_stays_fast_while_a_big_prompt_is_tokenized(llm):
    """A prompt just inside the limits takes a while to tokenize and render: that happens on
    a thread, so /health keeps answering (it took 30 s behind a 10 MB prompt)."""
    srv = Running(create_app(llm, ServerConfig(served_model_name=NAME,
                                               max_request_bytes=64 * 2**20,
                                               max_prompt_tokens=10**7)))
    try:
        words = " ".join(f"w{i}" for i in range(300_000))  # ~2.4 MB, ~600k tokens
        done = threading.Event()

        def big() -> None:
            try:
                _post(srv.url, "/v1/completions", {"model": NAME, "prompt": words})
            finally:
                done.set()

        threading.Thread(target=big, daemon=True).start()
        worst = 0.0
        while not done.is_set():
            t0 = time.perf_counter()
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
        assert worst < 1.0, worst
    finally:
        srv.stop()
