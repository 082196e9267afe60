"""Every field of the official `openai` package's chat and completion request types is
honoured or refused with a 400 naming it, never silently ignored; vLLM's extensions
(stop_token_ids, ignore_eos, top_k) are honoured; the utility routes (/tokenize,
/detokenize, /version, /ping) answer as vLLM's do."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

from specscope.config import ServerConfig  # noqa: E402
from specscope.engine.llm import LLM  # noqa: E402
from specscope.server import create_app  # noqa: E402
from specscope.server.background import BackgroundServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

NAME = "tiny"
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
# Honoured: the request's own content and the sampling specscope implements.
# Structured output and tools are honoured too: test_structured_and_tool_fields.
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
            "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# Accepted and asking for nothing generation-wise: end-user ids, metadata, a routing hint
# (prefix caching is automatic).
METADATA = {"user": "u1", "safety_identifier": "s1", "metadata": {"k": "v"},
            "prompt_cache_key": "k"}
# Not implemented yet: a value that asks for the behaviour (refused by name), and the no-op
# value a client sending defaults sends (accepted).
NOT_YET = {
    "presence_penalty": (0.5, 0), "frequency_penalty": (0.5, 0.0),
    "logit_bias": ({"1": 5}, {}), "top_logprobs": (2, 0), "best_of": (2, 1),
    "echo": (True, False), "suffix": ("end", ""), "store": (True, False),
    "functions": ([{"name": "f"}], []),
    "function_call": ("auto", "none"), "modalities": (["text", "audio"], ["text"]),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "reasoning_effort": ("low", None), "verbosity": ("low", None),
    "web_search_options": ({}, None), "service_tier": ("flex", "auto"),
    "prompt_cache_retention": ("24h", None), "prompt_cache_options": ({}, None),
    "moderation": ({}, None),
}


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    s = BackgroundServer(create_app(llm, ServerConfig(served_model_name=NAME,
                                                      api_keys=("k",))))
    yield s, llm
    s.stop()


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, timeout=60,
                      headers={"Authorization": "Bearer k"})


def _fields(params) -> set[str]:
    return set(params.CompletionCreateParamsBase.__annotations__)


@pytest.mark.parametrize("path,base,params", [
    ("/v1/chat/completions", CHAT, chat_params),
    ("/v1/completions", COMPLETION, completion_params)])
def test_every_openai_field_is_honoured_or_refused(srv, path, base, params):
    s, _ = srv
    refused = []
    for field in sorted(_fields(params) - HONOURED):
        if field in METADATA:
            r = _post(s, path, {**base, field: METADATA[field]})
            assert r.status_code == 200, (field, r.text)
            continue
        bad, noop = NOT_YET.get(field, ("x", None))  # a field we never heard of: "x"
        if field == "logprobs":
            bad, noop = (True, False) if path.endswith("chat/completions") else (1, None)
        r = _post(s, path, {**base, field: bad})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
        refused.append(field)
        if field in NOT_YET or field == "logprobs":  # its no-op value passes
            r = _post(s, path, {**base, field: noop})
            assert r.status_code == 200, (field, noop, r.text)
    assert "presence_penalty" in refused and "logprobs" in refused
    r = _post(s, path, {**base, "n": 2})  # n is honoured at 1 only for now: refused above 1
    assert r.status_code == 400 and "n" in r.json()["error"]["param"]


def test_unknown_fields_are_named(srv):
    s, _ = srv
    r = _post(s, "/v1/completions", {**COMPLETION, "frobnicate": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "frobnicate" and "not supported" in err["message"]


def test_stop_token_ids_are_honoured(srv):
    s, llm = srv
    body = {**COMPLETION, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = llm.generate("Hi", llm_params(8))[0].token_ids
    r = _post(s, "/v1/completions", {**body, "stop_token_ids": [full[2]]})
    out = r.json()["choices"][0]
    assert r.status_code == 200 and out["finish_reason"] == "stop", r.text
    assert r.json()["usage"]["completion_tokens"] == full.index(full[2]) + 1
    bad = _post(s, "/v1/completions", {**body, "stop_token_ids": [-1]})
    assert bad.status_code == 400 and "stop_token_ids" in bad.text


def llm_params(n: int):
    from specscope.config import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_tokenize_detokenize_version_ping(srv):
    s, llm = srv
    r = _post(s, "/tokenize", {"model": NAME, "prompt": "Hello there"})
    assert r.status_code == 200
    tok = r.json()
    assert tok["tokens"] == llm.encode_prompt("Hello there")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == llm.max_model_len
    chat = _post(s, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == llm.encode_prompt([{"role": "user", "content": "Hi"}], chat=True)
    back = _post(s, "/detokenize", {"model": NAME, "tokens": tok["tokens"]}).json()
    assert "Hello there" in back["prompt"]
    assert _post(s, "/tokenize", {"prompt": "a", "messages": [
        {"role": "user", "content": "b"}]}).status_code == 400
    assert _post(s, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(s, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    v = httpx.get(f"{s.url}/version", headers={"Authorization": "Bearer k"}).json()
    from specscope import __version__

    assert v == {"version": __version__}
    assert httpx.get(f"{s.url}/version").status_code == 401  # behind the API key
    assert httpx.get(f"{s.url}/ping").status_code == 200  # a probe: no key needed
    assert httpx.post(f"{s.url}/ping", json={}).status_code == 200


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [TOOL]}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [TOOL, TOOL], "tool_choice": "none"}, "get_weather"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_structured_and_tool_fields_are_refused_by_name(srv, body, field):
    pytest.importorskip("llguidance")
    r = _post(srv[0], "/v1/chat/completions", {**CHAT, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": TOOL["function"]["parameters"], "strict": True}}},
    {"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False},
    {"tools": [TOOL], "tool_choice": "required"},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"guided_json": {"type": "object"}},
])
def test_structured_and_tool_fields_are_honoured(srv, body):
    pytest.importorskip("llguidance")
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        if "tools" in body and path == "/v1/completions":
            continue  # tools are a chat field
        r = _post(srv[0], path, {**base, **body, "max_tokens": 4})
        assert r.status_code == 200, (path, body, r.text)
