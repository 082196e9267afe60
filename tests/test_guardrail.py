"""The goodput guardrail: the window's verdicts (sustained shortfall, blips, margin), its
actions on a server (warn, off-when-slower), the plain calibration, and `serve --auto-tune`
end to end."""

from __future__ import annotations

import logging

import pytest

from specscope.config import SamplingParams, ServerConfig, SpecConfig
from specscope.engine.request import RequestMetrics, RequestOutput
from specscope.server.guardrail import OK, SLOWER, WARMING_UP, GoodputWindow, Guardrail

pytestmark = pytest.mark.usefixtures("single_thread")


def feed(w: GoodputWindow, samples: list[tuple[int, float]], config=None) -> list[str]:
    return [w.observe(t, s, config) for t, s in samples]


# -- the window (pure) --------------------------------------------------------------------


def test_sustained_shortfall_triggers_once_the_window_is_full():
    w = GoodputWindow(100.0, window_tokens=512, min_requests=3, margin=0.05)
    # 80 tok/s, 128 tokens a request: full at the 4th request (512 tokens), below all along.
    assert feed(w, [(128, 1.6)] * 4) == [WARMING_UP] * 3 + [SLOWER]
    assert w.tok_per_s == pytest.approx(80.0) and w.tokens == 512 and w.requests == 4
    # Full windows slide: the oldest samples go once the rest still cover 512 tokens.
    feed(w, [(256, 3.2)] * 3)
    assert w.requests == 3 and w.tokens == 768
    # Few tokens per request: min_requests alone does not fill it, tokens must too.
    w2 = GoodputWindow(100.0, window_tokens=512, min_requests=3)
    assert feed(w2, [(10, 1.0)] * 10) == [WARMING_UP] * 10


def test_a_short_blip_does_not_trigger():
    w = GoodputWindow(100.0, window_tokens=512, min_requests=3, margin=0.05)
    assert feed(w, [(200, 1.6)] * 3)[-1] == OK  # 125 tok/s
    # One very slow request drags the window's rate below the threshold (600 tokens in
    # 13.2 s = 45 tok/s) while it is in the window, but it decoded a third of its tokens.
    assert w.observe(200, 10.0) == OK and w.tok_per_s < w.threshold
    assert w.slow_share == pytest.approx(1 / 3)
    assert feed(w, [(200, 1.6)] * 3) == [OK] * 3  # it slides out
    assert w.tok_per_s == pytest.approx(125.0)
    # A slowdown that lasts for most of a window does trigger.
    assert feed(w, [(200, 10.0)] * 3) == [OK, SLOWER, SLOWER]
    # So does a shortfall spread over every request, with no single slow outlier.
    w2 = GoodputWindow(100.0, window_tokens=512, min_requests=3, margin=0.05)
    assert feed(w2, [(200, 2.2)] * 3)[-1] == SLOWER and w2.slow_share == 1.0


@pytest.mark.parametrize("rate,verdict", [(96.0, OK), (95.5, OK), (94.0, SLOWER),
                                          (50.0, SLOWER), (150.0, OK)])
def test_margin_is_respected(rate, verdict):
    w = GoodputWindow(100.0, window_tokens=100, min_requests=2, margin=0.05)
    assert feed(w, [(100, 100 / rate)] * 3)[-1] == verdict
    w0 = GoodputWindow(100.0, window_tokens=100, min_requests=2, margin=0.0)
    assert feed(w0, [(100, 100 / 99.0)] * 3)[-1] == SLOWER


def test_a_new_configuration_starts_a_new_window():
    w = GoodputWindow(100.0, window_tokens=100, min_requests=2)
    assert feed(w, [(100, 2.0)] * 2, config="a")[-1] == SLOWER
    assert w.observe(100, 2.0, "b") == WARMING_UP and w.requests == 1
    assert w.observe(0, 0.0, "b") == WARMING_UP and w.requests == 1  # no decode time: skipped
    for bad in [dict(plain_tok_per_s=0.0), dict(plain_tok_per_s=1.0, margin=1.0),
                dict(plain_tok_per_s=1.0, window_tokens=0)]:
        with pytest.raises(ValueError):
            GoodputWindow(**bad)
    with pytest.raises(ValueError, match="mode"):
        Guardrail(1.0, "test", mode="sometimes")


# -- the guardrail's actions, on a stand-in engine ----------------------------------------


class FakeLLM:
    def __init__(self, spec: SpecConfig | None) -> None:
        self.spec = spec

    def set_spec(self, spec: SpecConfig | None) -> None:
        self.spec = spec


def output(tokens: int, seconds: float, spec: bool = True) -> RequestOutput:
    m = RequestMetrics(prompt_tokens=5, completion_tokens=tokens + 1, decode_s=seconds)
    return RequestOutput("r", [1], "", [0] * (tokens + 1), "length", m,
                         {"cycles": 1} if spec else None)


@pytest.mark.parametrize("mode", ["warn", "off-when-slower", "off"])
def test_modes_warn_switch_off_or_do_nothing(mode, caplog):
    spec = SpecConfig(draft="random", num_steps=3)
    llm = FakeLLM(spec)
    g = Guardrail(100.0, "injected", mode=mode, window_tokens=100, min_requests=2)
    with caplog.at_level(logging.INFO, logger="specscope.server.guardrail"):
        for _ in range(3):
            g.after_request(llm, output(60, 1.0))  # 60 tok/s against 100 predicted
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if mode == "off":
        assert not warnings and llm.spec is spec and g.state()["window_requests"] == 0
        return
    assert len(warnings) == 1, caplog.text  # on the transition only, not every request
    msg = warnings[0].getMessage()
    assert "60.0 tok/s" in msg and "100.0 tok/s predicted" in msg and "injected" in msg
    st = g.state()
    assert st["last_trigger"]["window_tok_per_s"] == pytest.approx(60.0)
    if mode == "warn":
        assert llm.spec is spec and st["verdict"] == SLOWER and not st["switched_off"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specscope.server.guardrail"):
            for _ in range(3):
                g.after_request(llm, output(60, 0.4))  # 150 tok/s: recovered
        assert g.state()["verdict"] == OK and "recovered" in caplog.text
    else:
        assert llm.spec is None and st["switched_off"] and st["switch_offs"] == 1
        g.after_request(llm, output(60, 1.0, spec=False))  # plain requests are not judged
        assert g.state()["window_requests"] == 0
        llm.set_spec(spec)  # switched back on (POST /admin/spec): judged afresh
        g.after_request(llm, output(60, 1.0))
        st = g.state()
        assert not st["switched_off"] and st["verdict"] == WARMING_UP and llm.spec is spec


# -- on a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    from specscope import LLM

    return LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
               spec=SpecConfig(draft="random", num_steps=3))


@pytest.fixture(scope="module")
def plain_ref(tiny_model_dir):
    from specscope import LLM

    plain = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    return lambda prompt: plain.generate(prompt, SamplingParams(max_tokens=24,
                                                                ignore_eos=True))[0].text


@pytest.mark.parametrize("mode", ["off-when-slower", "warn"])
def test_server_guardrail_with_an_unbeatable_plain_prediction(spec_llm, plain_ref, mode,
                                                              caplog):
    """A plain prediction of 1e9 tok/s: after a window of 3 requests speculation counts as
    slower. off-when-slower switches it off (the 4th request runs plain), warn only logs;
    greedy outputs stay the plain ones throughout; /admin/guardrail and /metrics say so."""
    import httpx

    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    spec = spec_llm.spec
    g = Guardrail(1e9, "injected", mode=mode, window_tokens=40, min_requests=3)
    admin = ServerConfig(served_model_name="x", api_keys=("k",), enable_admin=True)
    srv = BackgroundServer(create_app(spec_llm, admin, guardrail=g))
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello there"]
    try:
        with httpx.Client(base_url=srv.url, timeout=60,
                          headers={"Authorization": "Bearer k"}) as c, \
                caplog.at_level(logging.WARNING, logger="specscope.server.guardrail"):
            assert c.get("/admin/guardrail").json()["verdict"] == WARMING_UP
            for i, p in enumerate(prompts):
                out = c.post("/v1/completions", json={"model": "x", "prompt": p,
                                                      "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}).json()
                assert out["choices"][0]["text"] == plain_ref(p), (i, mode)
                speculative = "spec" in out["usage"]
                assert speculative == (i < 3 or mode == "warn"), (i, mode)
            state = c.get("/admin/guardrail").json()
            enabled = c.get("/admin/spec").json()["enabled"]
            metrics = c.get("/metrics").text
        assert state["plain_source"] == "injected" and state["last_trigger"] is not None
        assert 0 < state["last_trigger"]["window_tok_per_s"] < 1e9
        assert "guardrail" in caplog.text and "1000000000.0 tok/s predicted" in caplog.text
        assert 'specscope_guardrail_plain_tok_per_s{model="x"} 1e+09' in metrics
        if mode == "warn":
            assert enabled and not state["switched_off"] and state["verdict"] == SLOWER
            assert 'specscope_guardrail_slower{model="x"} 1' in metrics
            assert "speculation stays on" in caplog.text
        else:
            assert not enabled and state["switched_off"] and state["switch_offs"] == 1
            assert 'specscope_guardrail_switch_offs_total{model="x"} 1' in metrics
            assert "switching speculation off" in caplog.text
    finally:
        srv.stop()
        spec_llm.set_spec(spec)


def test_plain_calibration_restores_the_configuration(spec_llm):
    from specscope.server.guardrail import calibrate_plain

    spec = spec_llm.spec
    assert calibrate_plain(spec_llm, "Count to ten:", max_tokens=16) > 0
    assert spec_llm.spec == spec


# -- serve: flags and --auto-tune ---------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["serve", "--auto-tune"], "--auto-tune tunes a draft checkpoint"),
    (["serve", "--auto-tune", "--draft", "random"], "--auto-tune tunes a draft checkpoint"),
    (["serve", "--guardrail", "warn"], "give --draft"),
    (["serve", "--draft", "default", "--guardrail-margin", "1.5"], "--guardrail-margin"),
])
def test_serve_flags_are_checked_before_the_model_loads(argv, message, capsys):
    from specscope.cli import main

    assert main(argv + ["--model", "/nonexistent/model"]) == 2
    assert message in capsys.readouterr().err


def test_serve_auto_tune_end_to_end(tiny_model_dir, tmp_path, plain_ref, monkeypatch,
                                    capsys):
    """`specscope serve --auto-tune` (in process, uvicorn on a free port instead of the
    command's own): it tunes before accepting requests, prints the table and
    recommendation, keeps the cost model's plain prediction for the guardrail, and serves
    the plain greedy output."""
    import httpx
    import torch

    from specscope.cli import main
    from specscope.draft.eagle3 import random_draft
    from specscope.draft.formats import save_draft
    from specscope.models.loader import read_config
    from specscope.server.background import BackgroundServer

    cfg = read_config(tiny_model_dir)
    draft = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=1000, seed=1)
    d = save_draft(draft, draft.config, tmp_path / "draft", "sglang")
    seen: dict = {}

    def serve(app, **kwargs) -> int:
        seen["tuned"] = app.state.llm.spec  # set before any request could arrive
        srv = BackgroundServer(app)
        try:
            with httpx.Client(base_url=srv.url, timeout=60,
                              headers={"Authorization": "Bearer k"}) as c:
                seen["guardrail"] = c.get("/admin/guardrail").json()
                out = c.post("/v1/completions", json={
                    "model": "x", "prompt": "Hello there", "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}).json()
                seen["text"] = out["choices"][0]["text"]
                # Whatever the tuner chose, the draft stays known: speculation can go on.
                seen["enable"] = c.post("/admin/spec", json={"enabled": True}).json()
        finally:
            srv.stop()
        return 0

    monkeypatch.setattr("specscope.server.serve.serve", serve)
    assert main(["serve", str(tiny_model_dir), "--dtype", "fp32", "--device", "cpu",
                 "--served-model-name", "x", "--draft", str(d), "--auto-tune",
                 "--enable-admin", "--api-key", "k", "--port", "0",
                 "--auto-tune-prompts", "1", "--auto-tune-max-tokens", "16",
                 "--auto-tune-budget-seconds", "1", "--guardrail", "off-when-slower"]) == 0
    err = capsys.readouterr().err
    assert "[auto-tune]" in err and "recommendation:" in err and "meas tok/s" in err, err
    assert "[guardrail] off-when-slower" in err and "--auto-tune cost model" in err, err
    g = seen["guardrail"]
    assert g["mode"] == "off-when-slower" and g["plain_tok_per_s"] > 0
    assert g["plain_source"] == "the --auto-tune cost model"
    assert seen["tuned"] is None or seen["tuned"].draft == str(d)
    assert seen["text"] == plain_ref("Hello there")
    assert seen["enable"]["enabled"] and seen["enable"]["draft"] == str(d)


def test_serve_calibrates_plain_decoding_without_auto_tune(tiny_model_dir, monkeypatch,
                                                           capsys):
    """Without --auto-tune the guardrail's prediction is a plain calibration at start-up,
    said on stderr and in /admin/guardrail; the server then speculates with the given
    configuration, and the profiler (if on) holds serving only."""
    from specscope.cli import main

    seen: dict = {}

    def serve(app, **kwargs) -> int:
        llm, g = app.state.llm, app.state.guardrail
        seen.update(spec=llm.spec, state=g.state(), summaries=llm.profile_summary())
        return 0

    monkeypatch.setattr("specscope.server.serve.serve", serve)
    assert main(["serve", str(tiny_model_dir), "--dtype", "fp32", "--device", "cpu",
                 "--draft", "random", "--num-steps", "2", "--profile", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert "[guardrail] warn: plain decoding predicted at" in err, err
    assert "plain calibration at start-up" in seen["state"]["plain_source"]
    assert seen["state"]["mode"] == "warn" and seen["state"]["plain_tok_per_s"] > 0
    assert seen["spec"].draft == "random" and seen["spec"].num_steps == 2
    assert seen["summaries"] == [], seen["summaries"]  # no calibration runs in it
