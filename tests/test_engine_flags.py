"""vLLM's and SGLang's spellings of the serving flags: several served model names,
--speculative-algorithm, --speculative-config, --chat-template and the engine --seed."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from specscope.cli import build_parser
from specscope.cli_args import spec_from_args
from specscope.config import SamplingParams, ServerConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--model", "m", *flags])


def test_speculative_config_json_sets_the_draft_and_chain():
    args = _serve_args("--speculative-config", json.dumps(
        {"method": "eagle3", "model": "random", "num_speculative_tokens": 4}))
    spec = spec_from_args(args)
    assert (spec.draft, spec.num_steps, spec.topk, spec.num_draft_tokens) == ("random", 4, 1, 5)
    args = _serve_args("--speculative-algorithm", "EAGLE3",
                       "--speculative-draft-model-path", "random",
                       "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                       "--speculative-num-draft-tokens", "6")
    spec = spec_from_args(args)
    assert (spec.draft, spec.num_steps, spec.topk, spec.num_draft_tokens) == ("random", 3, 2, 6)


def test_confidence_stop_flag():
    assert spec_from_args(_serve_args("--draft", "random")).confidence_stop is None
    spec = spec_from_args(_serve_args("--draft", "random", "--confidence-stop", "0.2"))
    assert spec.confidence_stop == 0.2
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            _serve_args("--draft", "random", "--confidence-stop", bad)
    with pytest.raises(ValueError, match="chains"):
        spec_from_args(_serve_args("--draft", "random", "--topk", "2", "--confidence-stop",
                                   "0.2"))


def test_prefix_caching_off_in_every_spelling():
    for flag in ("--no-prefix-caching", "--no-enable-prefix-caching", "--disable-radix-cache"):
        assert _serve_args(flag).enable_prefix_caching is False
    assert _serve_args().enable_prefix_caching is True


@pytest.mark.parametrize("flags,match", [
    (["--speculative-config", "{nope"], "not valid JSON"),
    (["--speculative-config", "[1]"], "JSON object"),
    (["--speculative-config", '{"method": "ngram", "model": "random"}'], "EAGLE-3"),
    (["--speculative-config", '{"model": "random", "prompt_lookup_max": 3}'],
     "unsupported key.*prompt_lookup_max"),
    (["--speculative-config", '{"model": "random", "num_speculative_tokens": 0}'],
     "num_speculative_tokens"),
    (["--speculative-config", '{"model": "random", "draft_tensor_parallel_size": 8}'],
     "draft_tensor_parallel_size"),
    (["--speculative-config", '{"num_speculative_tokens": 3}'], "needs \"model\""),
    (["--draft", "random", "--speculative-config", '{"model": "other"}'], "two drafts"),
    (["--speculative-algorithm", "NEXTN", "--draft", "random"], "EAGLE-3 drafts only"),
    (["--speculative-algorithm", "EAGLE3"], "needs the draft"),
])
def test_bad_speculative_flags_name_the_problem(flags, match):
    with pytest.raises(ValueError, match=match):
        spec_from_args(_serve_args(*flags))


def test_several_served_model_names(tiny_model_dir):
    from specscope import LLM
    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    args = _serve_args("--served-model-name", "first", "second")
    assert args.served_model_name == ["first", "second"]
    with pytest.raises(ValueError, match="non-empty"):
        ServerConfig(served_model_name=("a", ""))
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    srv = BackgroundServer(create_app(llm, ServerConfig(served_model_name=("first", "second"))))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            models = c.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["first", "second"]
            assert all(m["created"] > 0 and m["owned_by"] == "specscope" for m in models)
            out = c.post("/v1/completions", json={"model": "second", "prompt": "Hi",
                                                  "max_tokens": 3}).json()
            assert out["model"] == "first"
            bad = c.post("/v1/completions", json={"model": "third", "prompt": "Hi"})
            assert bad.status_code == 404 and "'first' or 'second'" in bad.text
    finally:
        srv.stop()


def test_chat_template_flag(tiny_model_dir, tmp_path):
    from specscope import LLM
    from specscope.engine.tokenizer import load_chat_template

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}ANSWER:"
    f = tmp_path / "t.jinja"
    f.write_text(template)
    assert load_chat_template(str(f)) == template and load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no-such-file.jinja")
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", chat_template=str(f))
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert llm.tokenizer.decode(ids) == "<<hello>>ANSWER:"
    with pytest.raises(ValueError, match="does not parse"):
        LLM(str(tiny_model_dir), dtype="fp32", device="cpu", chat_template="{% for %}")


def test_engine_seed_repeats_unseeded_sampling(tiny_model_dir):
    from specscope import LLM

    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def run(seed):
        llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", seed=seed)
        return [o.token_ids for o in llm.generate(["one", "two"], params)]

    a, b = run(7), run(7)
    assert a == b and a[0] != a[1]  # each request its own stream
    assert run(8) != a


def test_tensor_parallel_flags_in_every_spelling():
    for flags in (["--tensor-parallel-size", "2"], ["--tp-size", "2"], ["-tp", "2"]):
        assert _serve_args(*flags).tensor_parallel_size == 2
    args = _serve_args("--tp-size", "2", "--draft", "random", "--draft-tp-size", "2")
    assert spec_from_args(args).draft_tensor_parallel_size == 2
    args = _serve_args("--tp-size", "4", "--speculative-config",
                       '{"model": "random", "draft_tensor_parallel_size": 1}')
    assert spec_from_args(args).draft_tensor_parallel_size == 1
    args = _serve_args("--tp-size", "4", "--speculative-config",
                       '{"model": "random", "draft_tensor_parallel_size": 4}')
    assert spec_from_args(args).draft_tensor_parallel_size == 4
    with pytest.raises(ValueError, match="draft_tensor_parallel_size.*1.*or the tensor"):
        spec_from_args(_serve_args("--tp-size", "4", "--draft", "random",
                                   "--draft-tp-size", "2"))
    assert _serve_args().dist_timeout == 600.0
