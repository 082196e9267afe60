"""The goodput guardrail: the window's verdicts (sustained shortfall, blips, margin), its
actions per batch-size bucket on a server (warn, off-when-slower for that bucket only), the
plain calibration, and `serve --auto-tune` end to end."""

from __future__ import annotations

import logging

import pytest

from specscope.config import SamplingParams, ServerConfig, SpecConfig, SpecPolicy
from specscope.engine.llm import StepRecord
from specscope.server.guardrail import (
    OK,
    SLOWER,
    WARMING_UP,
    GoodputWindow,
    Guardrail,
    policy_without,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def feed(w: GoodputWindow, samples: list[tuple[int, float]], config=None) -> list[str]:
    return [w.observe(t, s, config) for t, s in samples]


# -- the window (pure) --------------------------------------------------------------------


def test_sustained_shortfall_triggers_once_the_window_is_full():
    w = GoodputWindow(100.0, window_tokens=512, min_samples=3, margin=0.05)
    # 80 tok/s, 128 tokens a request: full at the 4th request (512 tokens), below all along.
    assert feed(w, [(128, 1.6)] * 4) == [WARMING_UP] * 3 + [SLOWER]
    assert w.tok_per_s == pytest.approx(80.0) and w.tokens == 512 and w.samples == 4
    # Full windows slide: the oldest samples go once the rest still cover 512 tokens.
    feed(w, [(256, 3.2)] * 3)
    assert w.samples == 3 and w.tokens == 768
    # Few tokens per sample: min_samples alone does not fill it, tokens must too.
    w2 = GoodputWindow(100.0, window_tokens=512, min_samples=3)
    assert feed(w2, [(10, 1.0)] * 10) == [WARMING_UP] * 10


def test_a_short_blip_does_not_trigger():
    w = GoodputWindow(100.0, window_tokens=512, min_samples=3, margin=0.05)
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
    w2 = GoodputWindow(100.0, window_tokens=512, min_samples=3, margin=0.05)
    assert feed(w2, [(200, 2.2)] * 3)[-1] == SLOWER and w2.slow_share == 1.0


@pytest.mark.parametrize("rate,verdict", [(96.0, OK), (95.5, OK), (94.0, SLOWER),
                                          (50.0, SLOWER), (150.0, OK)])
def test_margin_is_respected(rate, verdict):
    w = GoodputWindow(100.0, window_tokens=100, min_samples=2, margin=0.05)
    assert feed(w, [(100, 100 / rate)] * 3)[-1] == verdict
    w0 = GoodputWindow(100.0, window_tokens=100, min_samples=2, margin=0.0)
    assert feed(w0, [(100, 100 / 99.0)] * 3)[-1] == SLOWER


def test_a_new_configuration_starts_a_new_window():
    w = GoodputWindow(100.0, window_tokens=100, min_samples=2)
    assert feed(w, [(100, 2.0)] * 2, config="a")[-1] == SLOWER
    assert w.observe(100, 2.0, "b") == WARMING_UP and w.samples == 1
    assert w.observe(0, 0.0, "b") == WARMING_UP and w.samples == 1  # no decode time: skipped
    for bad in [dict(plain_tok_per_s=0.0), dict(plain_tok_per_s=1.0, margin=1.0),
                dict(plain_tok_per_s=1.0, window_tokens=0)]:
        with pytest.raises(ValueError):
            GoodputWindow(**bad)
    with pytest.raises(ValueError, match="mode"):
        Guardrail(1.0, "test", mode="sometimes")


# -- the guardrail's actions, on a stand-in engine ----------------------------------------


class FakeLLM:
    """What the guardrail reads of an LLM: the configuration in force (spec, spec_policy),
    the configuration of the last step (engine.spec), and set_spec."""

    def __init__(self, spec: SpecConfig | None, policy: SpecPolicy | None = None) -> None:
        self.spec, self.spec_policy = spec, policy
        self.engine = type("E", (), {"spec": spec})()

    def set_spec(self, spec: SpecConfig | None, policy: SpecPolicy | None = None) -> None:
        self.spec, self.spec_policy = spec, policy

    def at(self, batch: int) -> FakeLLM:
        """The engine ran a step of `batch` sequences: the policy's configuration."""
        p = self.spec_policy
        self.engine.spec = p.for_batch(batch) if p is not None else self.spec
        return self


def step(tokens: int, seconds: float, batch: int = 1, speculating: int | None = None,
         prefill: int = 0) -> StepRecord:
    return StepRecord(batch, batch if speculating is None else speculating, prefill, tokens,
                      seconds)


@pytest.mark.parametrize("mode", ["warn", "off-when-slower", "off"])
def test_modes_warn_switch_off_or_do_nothing(mode, caplog):
    spec = SpecConfig(draft="random", num_steps=3)
    llm = FakeLLM(spec)
    g = Guardrail(100.0, "injected", mode=mode, window_tokens=100, min_samples=2)
    with caplog.at_level(logging.INFO, logger="specscope.server.guardrail"):
        for _ in range(3):
            g.after_step(llm.at(1), step(60, 1.0))  # 60 tok/s against 100 predicted
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if mode == "off":
        assert not warnings and llm.spec_policy is None and \
            g.state()["buckets"][0]["window_steps"] == 0
        return
    assert len(warnings) == 1, caplog.text  # on the transition only, not every step
    msg = warnings[0].getMessage()
    assert "60.0 tok/s" in msg and "100.0 tok/s predicted" in msg and "injected" in msg
    st = g.state()
    assert st["last_trigger"]["window_tok_per_s"] == pytest.approx(60.0)
    assert st["last_trigger"]["bucket"] == 1
    if mode == "warn":
        assert llm.spec_policy is None and st["verdict"] == SLOWER and not st["switched_off"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specscope.server.guardrail"):
            for _ in range(3):
                g.after_step(llm.at(1), step(60, 0.4))  # 150 tok/s: recovered
        assert g.state()["verdict"] == OK and "recovered" in caplog.text
    else:
        # Off at batch 1 only: a batch of 2 or more still speculates.
        assert llm.spec is spec and llm.spec_policy.for_batch(1) is None
        assert llm.spec_policy.for_batch(2) == spec and llm.spec_policy.for_batch(999) == spec
        assert st["switched_off"] == [1] and st["switch_offs"] == 1
        g.after_step(llm.at(1), step(60, 1.0, speculating=0))  # plain steps are not judged
        assert g.state()["buckets"][0]["window_steps"] == 0
        llm.set_spec(spec)  # switched back on (POST /admin/spec): judged afresh
        g.after_step(llm.at(1), step(60, 1.0))
        st = g.state()
        assert not st["switched_off"] and st["verdict"] == WARMING_UP


def test_each_bucket_is_judged_on_its_own():
    """Per batch-size bucket predictions: a batch of 16 at 900 tok/s is slower than its
    1,000 predicted while batch 1 at 150 tok/s beats its 100; only bucket 16 goes off.
    Mixed and prefilling steps are not samples; a bucket without a prediction is not
    judged."""
    spec = SpecConfig(draft="random", num_steps=3)
    llm = FakeLLM(spec)
    g = Guardrail({1: 100.0, 16: 1000.0}, "injected", mode="off-when-slower",
                  window_tokens=100, min_samples=2)
    for _ in range(3):
        g.after_step(llm.at(1), step(150, 1.0))
        g.after_step(llm.at(12), step(900, 1.0, batch=12))  # bucket 16
        g.after_step(llm.at(12), step(10, 1.0, batch=12, speculating=11))  # mixed: skipped
        g.after_step(llm.at(12), step(10, 1.0, batch=12, prefill=30))  # prefill: skipped
        g.after_step(llm.at(40), step(10, 1.0, batch=40))  # bucket 64: no prediction
    st = g.state()
    by = {b["bucket"]: b for b in st["buckets"]}
    assert set(by) == {1, 16} and by[1]["verdict"] == OK and st["switched_off"] == [16]
    assert by[16]["switched_off"] and st["verdict"] == OK  # its window restarted
    p = llm.spec_policy
    assert [p.for_batch(n) for n in (1, 8, 9, 16, 17, 64)] == [spec, spec, None, None, spec,
                                                              spec]
    # An existing policy keeps its own entries elsewhere.
    other = SpecConfig(draft="random", num_steps=5)
    base = SpecPolicy(((1, other), (8, spec), (32, None)))
    q = policy_without(spec, base, 4)  # bucket 4: batches 3 and 4
    assert [q.for_batch(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [
        other, spec, None, None, spec, spec, None, None]
    with pytest.raises(ValueError, match="buckets"):
        Guardrail({3: 10.0}, "x")


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
    """A plain prediction of 1e9 tok/s at batch 1: once the window fills (30 tokens, in
    the second request) speculation counts as slower. off-when-slower switches it off at
    batch 1 (the later requests run plain), warn only logs; greedy outputs stay the plain
    ones throughout; /admin/guardrail, /admin/spec and /metrics say so."""
    import httpx

    from specscope.server import create_app
    from specscope.server.background import BackgroundServer

    spec = spec_llm.spec
    g = Guardrail(1e9, "injected", mode=mode, window_tokens=30, min_samples=1)
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
                speculative = out["usage"].get("spec", {}).get("cycles", 0) > 0
                assert speculative == (i < 2 or mode == "warn"), (i, mode)
            state = c.get("/admin/guardrail").json()
            served = c.get("/admin/spec").json()
            metrics = c.get("/metrics").text
        assert state["plain_source"] == "injected" and state["last_trigger"] is not None
        assert 0 < state["last_trigger"]["window_tok_per_s"] < 1e9
        assert "guardrail" in caplog.text and "1000000000.0 tok/s predicted" in caplog.text
        assert 'specscope:guardrail_plain_tok_per_s{bucket="1",model_name="x"} 1e+09' in metrics
        assert served["confidence_stop"] == 0.0  # a random draft's chains are not cut
        if mode == "warn":
            assert served["policy"] is None and not state["switched_off"]
            assert state["verdict"] == SLOWER
            assert 'specscope:guardrail_slower{bucket="1",model_name="x"} 1.0' in metrics
            assert "speculation stays on" in caplog.text
        else:
            assert served["enabled"] and served["policy"].startswith("1:off;")
            assert state["switched_off"] == [1] and state["switch_offs"] == 1
            assert 'specscope:guardrail_switch_offs_total{model_name="x"} 1.0' in metrics
            assert "switching speculation off at batch <= 1" in caplog.text
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
    assert g["mode"] == "off-when-slower" and g["buckets"][0]["plain_tok_per_s"] > 0
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
    assert seen["state"]["mode"] == "warn"
    assert [b["bucket"] for b in seen["state"]["buckets"]] == [1]
    assert seen["state"]["buckets"][0]["plain_tok_per_s"] > 0
    assert seen["spec"].draft == "random" and seen["spec"].num_steps == 2
    assert seen["summaries"] == [], seen["summaries"]  # no calibration runs in it
