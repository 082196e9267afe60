"""Where the host's time goes inside one engine step on CUDA (batch 1, CUDA graphs).

    python benchmarks/host_timeline.py --shape llama-3.1-8b

Wraps the engine's own methods (the plan, the graph inputs' load, each graph replay's
launch, the step's one device->host read, the update) with host-clock marks, runs one
request's plain decoding and then a chain of 7 with SIMULATED acceptance, and prints the
median time between consecutive marks over the steps of the commonest pattern, then the
same step's graphs replayed back to back (the GPU's time alone): the difference is the
host's share. The GPU idles from a read's return to the next replay's launch; the read
itself waits for the GPU. Run it without torch.profiler earlier in the process (that slows
later graph launches: step_floor.py's host section, which runs after its profile, reads
high).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

from specscope import LLM  # noqa: E402
from specscope.config import SamplingParams, SpecConfig  # noqa: E402
from specscope.models.loader import random_model  # noqa: E402
from specscope.models.registry import config_from_hf  # noqa: E402


def _wrap(obj, name: str, marks: list) -> None:
    real = getattr(obj, name)

    def timed(*a, **k):
        marks.append((name + ">", time.perf_counter()))
        out = real(*a, **k)
        marks.append((name + "<", time.perf_counter()))
        return out
    setattr(obj, name, timed)


def _marked(replay, label: str, marks: list):
    """A graph replay that marks its launch as `label`."""
    def run():
        marks.append((label + ">", time.perf_counter()))
        replay()
        marks.append((label + "<", time.perf_counter()))
    return run


def _steps(marks: list[tuple[str, float]]) -> tuple[tuple[str, ...], list[list[float]]]:
    """The commonest pattern of marks between consecutive steps' "yield" marks, and for
    each step of that pattern the seconds between its consecutive marks."""
    steps, cur = [], []
    for m in marks:
        cur.append(m)
        if m[0] == "yield":
            steps.append(cur)
            cur = []
    by_pattern = defaultdict(list)
    for prev, now in zip(steps, steps[1:], strict=False):
        seq = prev[-1:] + now
        by_pattern[tuple(m[0] for m in seq)].append(
            [b[1] - a[1] for a, b in zip(seq, seq[1:], strict=False)])
    return max(by_pattern.items(), key=lambda kv: len(kv[1]))


def timeline(llm: LLM, prompt: list[int], spec: bool, tokens: int) -> dict:
    """One request's decoding with the step's marks; prints the median host time between
    consecutive marks and returns {"step_us": their sum, "steps": steps measured}. The
    engine's methods and graph replays are its own again afterwards."""
    eng = llm.engine
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in llm.stream(None, params, prompt_ids=prompt):  # warm-up: captures the graphs
        pass
    marks: list[tuple[str, float]] = []
    for name in ("_plan", "_stats", "_sample_processed", "_read", "_update"):
        _wrap(eng, name, marks)
    if spec:
        g = eng.spec_graphs
        for name in ("entry", "load"):
            _wrap(g, name, marks)
        saved = {k: list(e.segments) for k, e in g.entries.items()}
        for e in g.entries.values():
            e.segments = [(_marked(r, f"replay{i}", marks), out)
                          for i, (r, out) in enumerate(e.segments)]
    else:
        g = eng.graphs
        _wrap(g, "run", marks)
        saved = dict(g.graphs)
        g.graphs = {b: (_marked(r, "replay", marks), out) for b, (r, out) in g.graphs.items()}
    try:
        for _ in llm.stream(None, params, prompt_ids=prompt):
            marks.append(("yield", time.perf_counter()))
    finally:
        for obj in (eng, g):
            for name in [n for n in vars(obj)
                         if getattr(vars(obj)[n], "__name__", "") == "timed"]:
                del obj.__dict__[name]
        if spec:
            for k, segs in saved.items():
                g.entries[k].segments = segs
        else:
            g.graphs = saved
    key, rows = _steps(marks)
    print(f"{'speculative cycle' if spec else 'plain step'}: median of {len(rows)} steps")
    total = 0.0
    for j in range(len(key) - 1):
        us = sorted(r[j] for r in rows)[len(rows) // 2] * 1e6
        total += us
        print(f"  {key[j]:>22} -> {key[j + 1]:<22}{us:9.1f} us")
    print(f"  {'sum of the medians':>48}{total:9.0f} us")
    return {"step_us": total, "steps": len(rows)}


def replay_us(replays: list, iters: int = 100) -> float:
    """GPU microseconds of one step made of these graph replays, run back to back (each
    replay of a captured step rewrites what it reads, so repeating it is idempotent)."""
    for r in replays:
        r()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for r in replays:
            r()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def host_gap(llm: LLM, prompt: list[int], tokens: int, spec: bool) -> dict[str, float]:
    """The engine's step (timeline) against its batch-1 graphs replayed back to back: the
    difference is the time the host keeps the GPU waiting."""
    r = timeline(llm, prompt, spec, tokens)
    eng = llm.engine
    if spec:
        e = eng.spec_graphs.current  # the configuration just run (the engine keeps others')
        gpu = replay_us([seg[0] for seg in e.segments])
    else:
        # The batch-1 graph of the key window the request ran in (the shortest).
        graphs = eng.graphs.graphs
        gpu = replay_us([graphs[min(key for key in graphs if key[0] == 1)][0]])
    step = r["step_us"]
    print(f"  engine {step:.0f} us, its graphs back to back {gpu:.0f} us: host "
          f"{step - gpu:.0f} us ({1 - gpu / step:.1%})")
    return {**r, "replay_us": gpu, "host_us": step - gpu}


def segments(llm: LLM, prompt: list[int], tokens: int) -> None:
    """The profiler's graph-replay segments of one request (ms per cycle): what the tuner's
    cost model reads as draft, verify and other."""
    prof = llm.enable_profiling(True, interval=None)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in range(2):  # the first request warms the profiler's event pool
        prof.reset()
        for _ in llm.stream(None, params, prompt_ids=prompt):
            pass
    s = prof.summary(prof.config)
    seg = s.get("modes", {}).get("segments")
    rows = (seg or s)["phases"]
    print("  profiled, ms per cycle (mean/p50/p90): " + ", ".join(
        f"{name} {p['mean_ms']:.3f}/{p['p50_ms']:.3f}/{p['p90_ms']:.3f}"
        for name, p in rows.items())
        + f" ({(seg or s).get('cycles', '?')} cycles)")
    llm.enable_profiling(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--spec", action="append", default=None,
                    help="a speculative configuration steps,topk,tokens (repeatable; "
                         "default 7,1,8)")
    ap.add_argument("--simulate", type=float, default=3.9, help="SIMULATED tau")
    ap.add_argument("--phases", action="store_true",
                    help="also each configuration's profiled segments (draft, verify, the "
                         "host time between them) over one request")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_timeline.py needs CUDA")
    cfg = config_from_hf(SHAPES[args.shape], name=args.shape)
    llm = LLM.from_model(random_model(cfg, torch.bfloat16, torch.device("cuda")),
                         name=args.shape, max_model_len=4096, cuda_graphs=True,
                         gpu_memory_utilization=0.5)
    prompt = torch.randint(0, cfg.vocab_size, (128,)).tolist()
    host_gap(llm, prompt, args.tokens, spec=False)
    for text in args.spec or ["7,1,8"]:
        k, topk, n = (int(x) for x in text.split(","))
        llm.set_spec(SpecConfig(draft="random", num_steps=k, topk=topk, num_draft_tokens=n,
                                simulate_acceptance=args.simulate))
        print(f"({k}, {topk}, {n}), SIMULATED tau {args.simulate}")
        host_gap(llm, prompt, args.tokens, spec=True)
        if args.phases:
            segments(llm, prompt, args.tokens)


if __name__ == "__main__":
    main()
