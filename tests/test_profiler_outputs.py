"""Chrome-trace export and HTML report of profiled cycles, on synthetic records (CPU, fast)."""

from __future__ import annotations

import json
import os
import random
import statistics
from collections import Counter, defaultdict
from html.parser import HTMLParser

import pytest

from specscope.profiler.report import render_report, write_report
from specscope.profiler.trace import CycleRecord, chrome_trace, write_chrome_trace

PLAIN, SPEC = "plain", "spec steps=3 topk=1 ndt=4"
SPEC_PHASES = ["draft_extend", "draft_step[1]", "draft_step[2]", "draft_step[3]", "verify",
               "accept", "kv_commit"]
ACCEPTANCE = [0.825, 0.6, 0.375]


def make_records(n: int = 50, spec_label: str = SPEC) -> list[CycleRecord]:
    """`n` plain cycles, then `n` speculative cycles, back to back on one clock."""
    rng, t, out = random.Random(0), 0.0, []
    for config, names in ((PLAIN, ["decode"]), (spec_label, SPEC_PHASES)):
        for i in range(n):
            start, phases = t, []
            for name in names:
                dur = rng.uniform(0.05, 2.0)
                phases.append((name, t, dur))
                t += dur
            t += rng.uniform(0.0, 0.1)  # unattributed time: "other"
            accepted = None if config == PLAIN else rng.randint(0, 3)
            tokens = 1 if accepted is None else accepted + 1
            out.append(CycleRecord(i, config, start, t - start, phases, tokens, accepted))
            t += rng.uniform(0.0, 0.05)  # gap between cycles
    return out


def summarise(records: list[CycleRecord], simulated: bool = True) -> list[dict]:
    by_config: dict[str, list[CycleRecord]] = defaultdict(list)
    for r in records:
        by_config[r.config].append(r)
    out = []
    for config, rs in by_config.items():
        wall, tokens = sum(r.wall_ms for r in rs), sum(r.tokens for r in rs)
        times: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            for name, _, dur in r.phases:
                times[name].append(dur)
            times["other"].append(r.other_ms)
        phases = {
            name: {"mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v),
                   "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))], "share": sum(v) / wall}
            for name, v in times.items()
        }
        spec = rs[0].accepted is not None
        out.append({
            "config": config, "cycles": len(rs), "tokens": tokens, "wall_ms": wall,
            "tok_per_s": tokens / wall * 1000, "cycles_per_s": len(rs) / wall * 1000,
            "accept_length": tokens / len(rs) if spec else None,
            "acceptance_by_position": ACCEPTANCE if spec else None,
            "simulated": simulated and spec, "phases": phases,
            "attributed": 1 - phases["other"]["share"],
        })
    return out


def slices(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


# --- CycleRecord ---------------------------------------------------------------------------


def test_other_ms_is_wall_minus_phases_and_not_clamped():
    r = CycleRecord(0, PLAIN, 0.0, 3.0, [("decode", 0.0, 2.0), ("accept", 2.0, 0.5)], 1)
    assert r.other_ms == pytest.approx(0.5)
    r.wall_ms = 2.4  # phases exceed wall: the error must show, not be hidden
    assert r.other_ms == pytest.approx(-0.1)


# --- Chrome trace ----------------------------------------------------------------------------


def test_trace_round_trips_through_json_with_required_keys():
    trace = json.loads(json.dumps(chrome_trace(make_records())))
    assert trace["displayTimeUnit"] == "ms"
    required = {"X": {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"},
                "M": {"name", "ph", "pid", "tid", "args"}}
    for e in trace["traceEvents"]:
        assert e["ph"] in required, e
        assert required[e["ph"]] <= e.keys(), e
        assert e["pid"] == 1
    cycle_args = {"config", "index", "tokens", "accepted", "other_ms"}
    assert all(cycle_args <= e["args"].keys() for e in slices(trace) if e["name"] == "cycle")
    assert all(e["cat"] == "phase" for e in slices(trace) if e["name"] != "cycle")


def test_trace_names_process_and_one_lane_per_config():
    trace = chrome_trace(make_records())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["specscope"]
    lanes = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert set(lanes) == {PLAIN, SPEC} and len(set(lanes.values())) == 2
    for e in slices(trace):
        if e["name"] == "cycle":
            assert lanes[e["args"]["config"]] == e["tid"]


def test_trace_has_one_slice_per_phase_per_cycle():
    records = make_records()
    trace = chrome_trace(records)
    tid_config = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                  if e["name"] == "thread_name"}
    counts = Counter()
    for e in slices(trace):
        cycle = e["args"]["index"] if e["name"] == "cycle" else e["args"]["cycle"]
        counts[(tid_config[e["tid"]], cycle, e["name"])] += 1
    expected = Counter()
    for r in records:
        expected[(r.config, r.index, "cycle")] += 1
        for name, _, _ in r.phases:
            expected[(r.config, r.index, name)] += 1
    assert counts == expected
    assert all(v == 1 for v in counts.values())
    assert len(slices(trace)) == sum(1 + len(r.phases) for r in records)


def test_trace_ts_monotone_within_lane_and_phases_nest_in_cycle():
    trace = chrome_trace(make_records())
    by_lane: dict[int, list[dict]] = defaultdict(list)
    for e in slices(trace):
        by_lane[e["tid"]].append(e)
    for lane in by_lane.values():
        ts = [e["ts"] for e in lane]
        assert ts == sorted(ts)
        cycle = None
        for e in lane:
            if e["name"] == "cycle":
                cycle = e
                continue
            assert cycle is not None and cycle["args"]["index"] == e["args"]["cycle"]
            assert cycle["ts"] <= e["ts"]
            assert e["ts"] + e["dur"] <= cycle["ts"] + cycle["dur"] + 1e-6


def test_trace_times_are_microseconds():
    records = make_records(5)
    trace = chrome_trace(records)
    cycles = {(e["args"]["config"], e["args"]["index"]): e for e in slices(trace)
              if e["name"] == "cycle"}
    phase_events = {(e["tid"], e["args"]["cycle"], e["name"]): e for e in slices(trace)
                    if e["name"] != "cycle"}
    for r in records:
        c = cycles[(r.config, r.index)]
        assert c["ts"] == pytest.approx(r.start_ms * 1000)
        assert c["dur"] == pytest.approx(r.wall_ms * 1000)
        assert c["args"]["other_ms"] == pytest.approx(r.other_ms)
        for name, start, dur in r.phases:
            e = phase_events[(c["tid"], r.index, name)]
            assert e["ts"] == pytest.approx(start * 1000)
            assert e["dur"] == pytest.approx(dur * 1000)


@pytest.mark.parametrize("last, kept", [(None, 50), (10, 10), (1, 1), (0, 0), (500, 50)])
def test_trace_last_keeps_last_n_cycles_per_config(last, kept):
    trace = chrome_trace(make_records(50), last=last)
    indices = defaultdict(list)
    for e in slices(trace):
        if e["name"] == "cycle":
            indices[e["args"]["config"]].append(e["args"]["index"])
    for config in (PLAIN, SPEC):
        assert indices.get(config, []) == list(range(50 - kept, 50))


def test_trace_rejects_negative_last():
    with pytest.raises(ValueError):
        chrome_trace(make_records(2), last=-1)


def test_write_chrome_trace_is_atomic(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text("old")
    assert write_chrome_trace(make_records(), path, last=20) == path
    assert json.loads(path.read_text()) == json.loads(json.dumps(chrome_trace(make_records(), 20)))
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_failed_write_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text("old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_chrome_trace(make_records(3), path)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


# --- HTML report ----------------------------------------------------------------------------


class _TagChecker(HTMLParser):
    """Fails on mismatched or unclosed tags (void elements and `<x/>` excepted)."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: Counter = Counter()

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] += 1

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def parse(text: str) -> _TagChecker:
    checker = _TagChecker()
    checker.feed(text)
    checker.close()
    assert checker.errors == [] and checker.stack == [], (checker.errors, checker.stack)
    return checker


def test_report_is_well_formed_and_has_every_section(tmp_path):
    records = make_records()
    path = write_report(summarise(records), records, tmp_path / "report.html", title="Run A")
    text = path.read_text()
    tags = parse(text).tags
    assert tags["svg"] >= 3 and tags["table"] >= 3 and tags["script"] == 0
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no network
    for label in (PLAIN, SPEC, "Run A", "draft_step[2]", "kv_commit", "other"):
        assert label in text
    for v in ACCEPTANCE:
        assert f"{100 * v:.1f}%" in text
    assert "SIMULATED acceptance" in text


def test_report_badge_only_when_simulated():
    records = make_records(10)
    assert "SIMULATED" not in render_report(summarise(records, simulated=False), records)
    assert "SIMULATED" in render_report(summarise(records, simulated=True), records)


def test_report_timeline_shows_last_30_cycles():
    records = make_records(50)
    text = render_report(summarise(records), records)
    assert "cycle 49:" in text and "cycle 20:" in text and "cycle 19:" not in text


def test_report_escapes_labels():
    evil = '<script>alert("x")</script>'
    records = make_records(5, spec_label=evil)
    text = render_report(summarise(records), records, title=evil)
    parse(text)
    assert "<script" not in text
    assert "&lt;script&gt;" in text


def test_report_with_no_data_still_renders(tmp_path):
    parse(write_report([], [], tmp_path / "empty.html").read_text())


def test_write_report_is_atomic(tmp_path):
    records = make_records(5)
    path = tmp_path / "report.html"
    write_report(summarise(records), records, path)
    write_report(summarise(records), records, path)  # overwrite in place
    bad = summarise(records)
    del bad[0]["tok_per_s"]
    with pytest.raises(KeyError):
        write_report(bad, records, path)  # fails while rendering: old file stays whole
    parse(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_report_names_the_run_and_what_tok_s_counts(tmp_path):
    records = make_records(5)
    meta = {"model": "SmolLM2-135M", "dtype": "bfloat16", "device": "cpu",
            "dataset": "mt_bench", "num_prompts": 3, "date": "2026-12-01T20:00:00+00:00"}
    text = write_report(summarise(records), records, tmp_path / "r.html", meta=meta).read_text()
    parse(text)
    for part in ("model: SmolLM2-135M", "dtype: bfloat16", "device: cpu", "dataset: mt_bench",
                 "date: 2026-12-01T20:00:00+00:00", "prefill excluded"):
        assert part in text, part


def test_outputs_get_the_mode_of_any_new_file(tmp_path):
    """Atomic writes go through a private temp file; the result still has the mode every
    other output of the run gets (0666 less the umask), not 0600."""
    import os

    from specscope.bench.results import write_json
    from specscope.profiler.trace import current_umask

    want = 0o666 & ~current_umask()
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    report = write_report([], [], tmp_path / "r.html")
    write_json(tmp_path / "b.json", {"a": 1})
    for p in (plain, report, tmp_path / "b.json"):
        assert os.stat(p).st_mode & 0o777 == want, p
