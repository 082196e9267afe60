"""The server's throughput log line and the two definitions of acceptance by position."""

from __future__ import annotations

import logging

import pytest

from specscope.engine.llm import StepRecord
from specscope.engine.speculative import acceptance_by_position
from specscope.server.stats_log import StatsLog


def test_both_acceptance_definitions():
    """The issue's example: cycles accepting [1, 0, 2, 3, 2]. Conditional (given all earlier
    accepted, ours) and per draft (over all drafts, vLLM's)."""
    cond, per = acceptance_by_position([1, 0, 2, 3, 2], 5)
    assert cond == pytest.approx([0.8, 0.75, 1 / 3, 0.0, 0.0])
    assert per == pytest.approx([0.8, 0.6, 0.2, 0.0, 0.0])
    assert acceptance_by_position([], 2) == ([0.0, 0.0], [0.0, 0.0])


def test_acceptance_counts_only_the_positions_a_cycle_drafted():
    """A cycle the confidence stop ended after d draft tokens, all accepted, never offered
    position d + 1: no rejection there (the third cycle below); per draft is unchanged."""
    cond, per = acceptance_by_position([1, 0, 2, 3, 2], 5, [5, 5, 2, 5, 5])
    assert cond == pytest.approx([0.8, 0.75, 0.5, 0.0, 0.0])
    assert per == pytest.approx([0.8, 0.6, 0.2, 0.0, 0.0])
    cond, _ = acceptance_by_position([0, 0, 1], 3, [0, 1, 1])  # none drafted at all, once
    assert cond == pytest.approx([0.5, 0.0, 0.0])


def _stats_log(running: int, waiting: int, blocks: int, in_use: int, queries: int = 0,
               hits: int = 0) -> tuple[StatsLog, list[float]]:
    """A StatsLog of a 10 s interval over that engine state, and the clock it reads."""
    now = [0.0]
    state = {"running": running, "waiting": waiting, "kv_blocks": blocks,
             "kv_blocks_in_use": in_use, "prefix_queries": queries, "prefix_hits": hits}
    return StatsLog(lambda: state, interval=10.0, clock=lambda: now[0]), now


def test_one_line_per_interval_with_traffic(caplog):
    log, now = _stats_log(3, 1, 200, 50, 10, 4)
    with caplog.at_level(logging.INFO, logger="specscope.server.stats"):
        log.record(StepRecord(3, 0, 100, 0, 0.1))  # a prefill step
        now[0] = 5.0
        log.record(StepRecord(3, 3, 0, 9, 0.1, drafted=9, accepted=(2, 1, 3), depth=3))
        assert not caplog.records  # the interval has not passed
        now[0] = 10.0
        log.record(StepRecord(3, 3, 0, 6, 0.1, drafted=9, accepted=(0, 3, 0), depth=3))
        now[0] = 25.0
        log.record(StepRecord(0, 0, 0, 0, 0.0))  # no traffic in this interval: no line
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "prompt 10.0 tok/s, generation 1.5 tok/s, running 3, waiting 1" in line
    assert "KV cache 25.0 % of 200 blocks, prefix-cache hit rate 40.0 %" in line
    assert "6 drafts, mean accept length 2.50, accepted 9 of 18 draft tokens (50.0 %)" in line
    # accepted (2, 1, 3, 0, 3, 0): conditional 4/6, 3/4, 2/3; per draft 4/6, 3/6, 2/6
    assert "(conditional) 0.67, 0.75, 0.67, (per draft) 0.67, 0.50, 0.33" in line


def test_the_log_line_counts_positions_the_confidence_stop_left_out(caplog):
    log, now = _stats_log(2, 0, 100, 10)
    with caplog.at_level(logging.INFO, logger="specscope.server.stats"):
        log.record(StepRecord(2, 2, 0, 5, 0.1, drafted=4, accepted=(1, 2), depth=3,
                              positions=(1, 3)))
        now[0] = 10.0
        log.record(StepRecord(2, 2, 0, 2, 0.1, drafted=6, accepted=(0, 0), depth=3,
                              positions=(3, 3)))
    line = caplog.records[0].getMessage()
    assert "4 drafts, mean accept length 1.75, accepted 3 of 10 draft tokens (30.0 %)" in line
    # position 2: the first cycle accepted its one draft token but never offered a second,
    # so only the second cycle reached position 2, and took it (0.50 if counted as refused)
    assert "(conditional) 0.50, 1.00, 0.00, (per draft) 0.50, 0.25, 0.00" in line


def test_llm_describes_itself_at_start_up(tiny_model_dir):
    from specscope import LLM
    from specscope.config import SpecConfig

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
              spec=SpecConfig(draft="random", num_steps=3))
    text = llm.describe()
    assert "LlamaForCausalLM" in text and "float32 on cpu" in text and "KV cache:" in text
    assert "max 256 sequences" in text or "sequences," in text
    assert "EAGLE-3 draft random tapping target layers [" in text and "steps=3" in text


def test_requests_and_profiles_report_both_definitions(tiny_model_dir):
    from specscope import LLM, SamplingParams
    from specscope.config import SpecConfig
    from specscope.profiler.profiler import format_summary

    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", profile=True,
              spec=SpecConfig(draft="random", num_steps=3, simulate_acceptance=2.5))
    out = llm.generate("one two three", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    st = out.spec
    cond, per = acceptance_by_position(st["accepted_per_cycle"], 3)
    assert st["acceptance_by_position"] == pytest.approx(cond, abs=1e-4)
    assert st["acceptance_per_draft_by_position"] == pytest.approx(per, abs=1e-4)
    assert sum(per) == pytest.approx(st["accept_length"] - 1, abs=1e-3)
    s = llm.profile_summary()[0]
    assert s["acceptance_per_draft_by_position"] == pytest.approx(per)
    text = format_summary(s)
    assert "(conditional)" in text and "(per draft)" in text
    assert s["drafted_per_cycle"] == pytest.approx(3.0) and "3.00 drafted a cycle" in text
    assert st["drafted_per_cycle"] == [3] * st["cycles"]
