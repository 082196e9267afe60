"""The soak and fault test's short form (tests/soak.py): `specscope serve` with the default
model as a real process, every guard on, through the bad-input matrix, 64 concurrent
clients and a SIGTERM mid-load. The tests run in file order against one module-scoped
server: the matrix first, then the load, then the signal, then the log."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import soak as sk  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.slow

# 8 distinct requests (4 prompts, chat and completion) keep the solo runs short.
PLAN = sk.LoadPlan(clients=64, rounds=1, max_tokens=12, distinct=8)
SIGTERM_STREAMS = 4


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory, specscope_cache_dir: pathlib.Path,
         default_model_dir: pathlib.Path) -> Iterator[sk.Soak]:
    """Both servers, started together; default_model_dir has already converted the
    default model into the cache both of them read."""
    running = sk.start_soak(tmp_path_factory.mktemp("soak"), cache_dir=str(specscope_cache_dir))
    yield running
    running.close()


@pytest.mark.parametrize("case", sk.MATRIX, ids=[c.name for c in sk.MATRIX])
def test_bad_input(soak: sk.Soak, case: sk.Case) -> None:
    problems = sk.run_case(soak.server, case, soak.tally)
    assert not problems, "\n".join(problems)


def test_matrix_is_large_enough() -> None:
    assert len(sk.MATRIX) >= 135


@pytest.mark.parametrize("case", sk.DEFAULTS_MATRIX, ids=[c.name for c in sk.DEFAULTS_MATRIX])
def test_defaults(soak: sk.Soak, case: sk.Case) -> None:
    assert soak.defaults is not None
    problems = sk.run_case(soak.defaults, case, soak.tally)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chat_messages", [False, True], ids=["one text", "many messages"])
def test_defaults_4mb_prompt_refused_quickly(soak: sk.Soak, chat_messages: bool) -> None:
    """A prompt just under the default 4 MiB body limit: a quick 400, /health unaffected."""
    assert soak.defaults is not None
    got = sk.big_prompt_probe(soak.defaults, chat_messages=chat_messages)
    soak.tally.status(got["status"])
    assert not got["problems"] and not got["health_failures"], got
    assert got["seconds"] < 5 and got["health_max_s"] < sk.HEALTH_LIMIT_S, got


def test_defaults_server_stops_cleanly(soak: sk.Soak) -> None:
    """Idle, it exits 0 on SIGTERM with a clean log (and no longer shares the CPU)."""
    assert soak.defaults is not None
    assert sk.stop_server(soak.defaults) == 0
    assert not sk.log_problems(soak.defaults.log())


def test_load(soak: sk.Soak) -> None:
    """64 concurrent clients: every completed stream equals its solo run, the shares that
    disconnect, send oversized or slow bodies get what they should, nothing is left."""
    before = len(soak.tally.problems)
    figures = soak.load(PLAN)
    problems = soak.tally.problems[before:]
    assert not problems, "\n".join(problems[:40])
    assert figures["streams_compared"] == figures["streams_equal"] > 0
    assert figures["queue_depth_end"] == 0
    assert figures.get("slow_hangs", 0) == 0


def test_sigterm_mid_load(soak: sk.Soak) -> None:
    before = len(soak.tally.problems)
    s = soak.sigterm(SIGTERM_STREAMS, PLAN.max_tokens)
    problems = soak.tally.problems[before:]
    assert not problems, "\n".join(problems)
    assert s["all_in_flight_at_signal"]
    assert s["complete"] == s["equal"] == SIGTERM_STREAMS
    # while streams still run a new request is answered 503; once drained it may be refused
    assert s["after_signal"] == "503" or (s["after_signal"] == "refused"
                                          and not s["streams_ran_after_it"])
    assert s["exit_code"] == 0


def test_health_answered_within_a_second(soak: sk.Soak) -> None:
    """Throughout the matrix, the load and the drain after SIGTERM (until the streams
    ended)."""
    soak.probe.stop()
    assert len(soak.probe.latencies) > 50
    assert not sk.health_problems(soak)


def test_no_5xx_and_clean_log(soak: sk.Soak) -> None:
    """After every phase: no 5xx anywhere and no traceback, ERROR or 500 in the log."""
    if soak.server.proc.poll() is None:  # run alone (-k): end the server first
        sk.stop_server(soak.server)
    figures = soak.figures()
    print(figures)  # the soak figures, for the record (pytest -s)
    five_xx = [p for p in soak.tally.problems if "5xx" in p or " got 5" in p]
    assert figures["5xx"] == 0, "\n".join(five_xx) or figures["statuses"]
    log = soak.server.log()
    lines = sk.log_problems(log)
    assert not lines, "\n".join(lines[:20]) + "\n" + log[log.find("Traceback"):][:3000]
