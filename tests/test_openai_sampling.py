"""The sampling fields of the OpenAI routes take effect, end to end on a real server (the
tiny random Llama): penalties, logit_bias, min_tokens, min_p and repetition_penalty give
what `LLM.generate` gives with the same SamplingParams; logprobs (chat and completions
shapes, streaming too) carry the engine's values; n choices and list prompts are indexed
across prompts x n with usage summed; echo prepends the prompt; every body and chunk has
the server's system_fingerprint."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from specscope.config import SamplingParams, ServerConfig  # noqa: E402
from specscope.engine.llm import LLM  # noqa: E402
from specscope.server import create_app  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

NAME = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    s = BackgroundServer(create_app(llm, ServerConfig(served_model_name=NAME)))
    yield s, llm
    s.stop()


def _post(s, path: str, body: dict) -> dict:
    r = httpx.post(f"{s.url}{path}", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(s, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{s.url}{path}", json={"model": NAME, "stream": True, **body},
                      timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _want(llm: LLM, prompt, n: int, chat: bool = False, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                               **kw), chat=chat)[0]


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.2}, {"repetition_penalty": 1.8},
    {"min_p": 0.3, "temperature": 0.8, "seed": 3}, {"min_tokens": 6, "stop_token_ids": [0]},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7, "logit_bias": {"42": 3.5}},
])
def test_adjustments_are_honoured(srv, fields):
    s, llm = srv
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}
    got = _post(s, "/v1/completions", body)["choices"][0]["text"]
    kw = {k: v for k, v in fields.items() if k != "temperature"}
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    kw["temperature"] = fields.get("temperature", 0.0)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, **kw))[0]
    assert got == want.text  # (that they change answers: test_logits_adjust.py)


def test_logit_bias_forces_and_bans(srv):
    s, llm = srv
    t = llm.encode_prompt(" Paris")[0]
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    forced = _post(s, "/v1/completions", {**body, "logit_bias": {str(t): 100}})
    assert forced["choices"][0]["text"] == llm.tokenizer.decode([t] * 5)
    plain = _want(llm, PROMPT, 5)
    banned = {str(plain.token_ids[0]): -100}
    out = _post(s, "/v1/completions", {**body, "logit_bias": banned, "logprobs": 0})
    first = out["choices"][0]["logprobs"]["tokens"][0]
    assert first != llm.tokenizer.decode([plain.token_ids[0]])


def test_chat_logprobs_and_streaming(srv):
    s, llm = srv
    msgs = [{"role": "user", "content": "Hi"}]
    want = llm.generate(msgs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                             logprobs=3))[0]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    full = _post(s, "/v1/chat/completions", body)
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 == full["usage"]["completion_tokens"]
    for item, entry, t in zip(content, want.outputs[0].logprobs, want.token_ids, strict=True):
        assert abs(item["logprob"] - entry[t].logprob) < 1e-5
        assert len(item["top_logprobs"]) == 3
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][-1]["logprob"]
        assert item["bytes"] == list(item["token"].encode())
    chunks = _stream(s, "/v1/chat/completions", body)
    streamed = [c for ch in chunks for choice in ch["choices"]
                if choice["logprobs"] for c in choice["logprobs"]["content"]]
    assert [c["logprob"] for c in streamed] == [c["logprob"] for c in content]
    # The official client reads them.
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == 4
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    assert r.system_fingerprint


def test_completion_logprobs_shape(srv):
    s, llm = srv
    body = {"prompt": PROMPT, "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    choice = _post(s, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 7
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                           strict=True):
        assert 2 <= len(top) <= 3 and top[tok] == v  # the top 2 and the chosen one
    chunks = _stream(s, "/v1/completions", body)
    tokens = [t for ch in chunks for c in ch["choices"] if c["logprobs"]
              for t in c["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]


def test_n_choices(srv):
    s, llm = srv
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 9, "n": 3,
            "ignore_eos": True}
    out = _post(s, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 15
    assert out["usage"]["prompt_tokens"] == len(llm.encode_prompt(PROMPT))
    for i, c in enumerate(out["choices"]):  # choice i is the request seeded seed + i
        single = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=1.0,
                                                     seed=9 + i, ignore_eos=True))[0]
        assert c["text"] == single.text
    chunks = _stream(s, "/v1/completions", body)
    texts = {i: "" for i in range(3)}
    finishes = {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in out["choices"]]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    chat = _post(s, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
        "temperature": 1.0, "seed": 1})
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])


def test_list_prompts_and_echo(srv):
    s, llm = srv
    prompts = ["Hello", "One two three"]
    ids = llm.encode_prompt("Bonjour")
    body = {"prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "n": 2}
    out = _post(s, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        want = _want(llm, prompt, 4).text
        assert out["choices"][2 * p]["text"] == out["choices"][2 * p + 1]["text"] == want
    assert out["usage"]["prompt_tokens"] == sum(len(llm.encode_prompt(p)) for p in prompts)
    assert out["usage"]["completion_tokens"] == 16
    by_ids = _post(s, "/v1/completions", {**body, "prompt": [ids, ids[:2]], "n": 1})
    assert by_ids["choices"][0]["text"] == _want(llm, "Bonjour", 4).text
    one = _post(s, "/v1/completions", {**body, "prompt": ids, "n": 1})
    assert len(one["choices"]) == 1
    echo = _post(s, "/v1/completions", {**body, "prompt": prompts, "n": 1, "echo": True})
    assert echo["choices"][1]["text"] == prompts[1] + _want(llm, prompts[1], 4).text
    chunks = _stream(s, "/v1/completions", {**body, "prompt": "Hello", "n": 1, "echo": True})
    assert chunks[0]["choices"][0]["text"] == "Hello"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        "Hello" + _want(llm, "Hello", 4).text
    r = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt": ["a", 5]})
    assert r.status_code == 400
    V = llm.model_config.vocab_size
    r = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt": [ids, [1, V]], "n": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert "outside the model's vocabulary" in r.json()["error"]["message"]


def test_echo_with_logprobs(srv):
    """The echoed prompt's tokens come with their log-probabilities (computed at
    prefill), the first one's null; then the generated tokens'."""
    s, llm = srv
    prompt = "Hello there, how are"
    ids = llm.encode_prompt(prompt)
    want = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                               logprobs=1, prompt_logprobs=1))[0]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    choice = _post(s, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt + want.text
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, t, entry in zip(lp["token_logprobs"][1:len(ids)], ids[1:],
                             want.prompt_logprobs[1:], strict=True):
        assert abs(got - entry[t].logprob) < 1e-5
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][len(ids)] == len(prompt)
    chunks = _stream(s, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    streamed = [t for ch in chunks for c in ch["choices"] if c["logprobs"]
                for t in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_system_fingerprint_everywhere(srv):
    s, _ = srv
    body = {"prompt": PROMPT, "max_tokens": 3}
    fp = _post(s, "/v1/completions", body)["system_fingerprint"]
    assert fp.startswith("specscope-")
    assert _post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": 2})["system_fingerprint"] == fp
    chunks = _stream(s, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["system_fingerprint"] == fp for c in chunks)
