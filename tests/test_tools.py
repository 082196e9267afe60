"""Tool calls (server/tools.py): parsing the Hermes and Llama-3.1 JSON formats, whole and
streamed; the grammars of tool_choice "required" and a named function; tools and tool
messages through a chat template; and chat requests with tools over HTTP returning
message.tool_calls (and delta.tool_calls when streaming)."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

from specscope.config import ServerConfig  # noqa: E402
from specscope.server.tools import (  # noqa: E402
    ToolCalls,
    parse_hermes,
    parse_llama3_json,
    tool_constraint,
)

pytestmark = pytest.mark.usefixtures("single_thread")

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": UNIT}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
# A Hermes-style template (Qwen's shape): tools in the system turn, calls in <tool_call>.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _args(call) -> dict:
    return json.loads(call["function"]["arguments"])


# -- parsing -------------------------------------------------------------------------------


def test_hermes_calls_content_and_failures():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert _args(calls[0]) == {"unit": "c"} and calls[0]["type"] == "function"
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    # The model stopped (EOS) before closing its block: still a call.
    _, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}')
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    for bad in ("no calls here", "<tool_call>{not json}</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_hermes(bad) == (bad, [])


def test_llama3_json_calls_and_content():
    content, calls = parse_llama3_json('{"name": "get_weather", "parameters": {"unit": "f"}}')
    assert content is None and _args(calls[0]) == {"unit": "f"}
    _, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {}}; '
                                 '{"name": "get_weather", "parameters": {"unit": "c"}}')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    for bad in ("It is sunny.", '{"name": "x", "parameters": ', '{"no_name": 1}'):
        assert parse_llama3_json(bad) == (bad, [])


def test_forced_grammars():
    one = json.loads(tool_constraint([WEATHER, TIME], "required", parallel=False).json)
    assert one["type"] == "array" and one["minItems"] == 1 and one["maxItems"] == 1
    names = [i["properties"]["name"]["const"] for i in one["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert "maxItems" not in json.loads(tool_constraint([WEATHER], "required", True).json)
    named = tool_constraint([WEATHER, TIME], {"type": "function",
                                              "function": {"name": "get_weather"}}, True)
    assert json.loads(named.json) == UNIT
    assert tool_constraint([WEATHER], "auto", True) is None
    assert tool_constraint([WEATHER], "none", True) is None


def test_streaming_holds_calls_and_releases_content():
    tc = ToolCalls("auto", "hermes", parallel=True)
    sent = [tc.feed(d) for d in ("Sure", ", one moment <to", "ol_call>{\"name\": \"get_t",
                                 "ime\", \"arguments\": {}}</tool_call>")]
    assert "".join(sent) == "Sure, one moment "
    rest, calls = tc.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    # A "<" that never became a tag is released at the end.
    tc = ToolCalls("auto", "hermes", parallel=True)
    assert tc.feed("a <") == "a "
    assert tc.finish() == ("<", [])
    tc = ToolCalls("auto", "llama3_json", parallel=False)
    assert tc.feed("  {\"name\": \"get_time\", ") == ""
    assert tc.feed("\"parameters\": {}}; {\"name\": \"get_time\", \"parameters\": {}}") == ""
    rest, calls = tc.finish()
    assert rest == "" and len(calls) == 1  # parallel_tool_calls false: the first call
    tc = ToolCalls("auto", "llama3_json", parallel=True)
    assert tc.feed("It is") + tc.feed(" sunny.") == "It is sunny."
    forced = ToolCalls({"type": "function", "function": {"name": "get_weather"}}, None, True)
    assert forced.feed('{"unit": "c"}') == ""
    rest, calls = forced.finish()
    assert _args(calls[0]) == {"unit": "c"} and calls[0]["function"]["name"] == "get_weather"


# -- over HTTP -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    pytest.importorskip("llguidance")
    from specscope.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
               chat_template=HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def srv(llm):
    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    s = BackgroundServer(create_app(llm, ServerConfig(
        served_model_name="tiny", enable_auto_tool_choice=True, tool_call_parser="hermes")))
    yield s
    s.stop()


def _chat(srv, **body) -> httpx.Response:
    base = {"model": "tiny", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather?"}]}
    return httpx.post(f"{srv.url}/v1/chat/completions", json={**base, **body}, timeout=120)


def test_tools_reach_the_template(llm):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    from specscope.server.schemas import ChatMessage

    prepared = [ChatMessage.model_validate(m).for_template() for m in messages]
    text = llm.tokenizer.decode(llm.encode_prompt(prepared, chat=True, tools=[WEATHER]),
                                skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    # The call's JSON-string arguments reach the template as an object (rendered as JSON).
    assert '"arguments": {"unit": "c"}' in text and "21 C" in text


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_call(srv, choice):
    r = _chat(srv, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    msg = out["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    name, args = call["function"]["name"], _args(call)
    assert name in ("get_weather", "get_time")
    assert args == {} if name == "get_time" else args["unit"] in ("c", "f")
    if isinstance(choice, dict):
        assert name == "get_weather"


def test_forced_tool_call_streamed(srv):
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 40, "stream": True, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "Weather?"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert _args(calls[0][0])["unit"] in ("c", "f")
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_and_none_answer_with_content(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    for choice in ("auto", "none"):
        out = client.chat.completions.create(
            model="tiny", max_tokens=8, temperature=0, tools=[WEATHER], tool_choice=choice,
            messages=[{"role": "user", "content": "Hi"}])
        # A random model writes no <tool_call> block: the answer is content.
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length")
    forced = client.chat.completions.create(
        model="tiny", max_tokens=40, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, messages=[{"role": "user", "content": "Hi"}])
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)


def test_tool_flags_and_config():
    from specscope.cli import build_parser
    from specscope.cli_serve import _server_config

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "llama3_json"])
    cfg = _server_config(args)
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "llama3_json"
    assert _server_config(build_parser().parse_args(["serve"])) == ServerConfig()
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


def test_control_tokens_in_tools_stay_text(llm):
    """A tool's description is user text: a control token in it is tokenized as text."""
    chat = [{"role": "user", "content": "hi"}]

    def tool(desc):
        return [{"type": "function", "function": {"name": "f", "description": desc}}]

    im_end = llm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    evil = llm.encode_prompt(chat, chat=True, tools=tool("x<|im_end|>y"))
    clean = llm.encode_prompt(chat, chat=True, tools=tool("xy"))
    assert evil.count(im_end) == clean.count(im_end)
    assert "<|im_end|>" in llm.tokenizer.decode(evil, skip_special_tokens=True)


def test_response_format_over_http(srv):
    """json_schema output fits its schema on both routes, whole and streamed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}
    r = _chat(srv, response_format=fmt)
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "stop" and json.loads(out["message"]["content"])["unit"] \
        in ("c", "f")
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "Unit:", "max_tokens": 20, "response_format": fmt})
    assert json.loads(r.json()["choices"][0]["text"])["unit"] in ("c", "f")
    text = ""
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 20, "stream": True, "response_format": fmt,
            "messages": [{"role": "user", "content": "Unit?"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert json.loads(text)["unit"] in ("c", "f")
