"""Where the host's time goes inside one engine step on CUDA (batch 1, CUDA graphs).

    python benchmarks/host_timeline.py --shape llama-3.1-8b

Wraps the engine's own methods (the plan, the graph inputs' load, each graph replay's
launch, the step's one device->host read, the update) with host-clock marks, runs one
request's plain decoding and then a chain of 7 with SIMULATED acceptance, and prints the
median time between consecutive marks over the steps of the commonest pattern. The GPU
idles from a read's return to the next replay's launch; the read itself waits for the GPU.
No torch.profiler in the process (it slows later graph launches).
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


def timeline(llm: LLM, prompt: list[int], spec: bool, tokens: int) -> None:
    """Print the median host time between the step's marks."""
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
        for e in g.entries.values():
            e.segments = [(_marked(r, f"replay{i}", marks), out)
                          for i, (r, out) in enumerate(e.segments)]
    else:
        g = eng.graphs
        _wrap(g, "run", marks)
        g.graphs = {b: (_marked(r, "replay", marks), out) for b, (r, out) in g.graphs.items()}
    for _ in llm.stream(None, params, prompt_ids=prompt):
        marks.append(("yield", time.perf_counter()))
    for obj in (eng, g):  # the engine's own methods again
        for name in [n for n in vars(obj) if getattr(vars(obj)[n], "__name__", "") == "timed"]:
            del obj.__dict__[name]
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
    key, rows = max(by_pattern.items(), key=lambda kv: len(kv[1]))
    print(f"{'speculative cycle' if spec else 'plain step'}: median of {len(rows)} steps")
    total = 0.0
    for j in range(len(key) - 1):
        us = sorted(r[j] for r in rows)[len(rows) // 2] * 1e6
        total += us
        print(f"  {key[j]:>22} -> {key[j + 1]:<22}{us:9.1f} us")
    print(f"  {'sum of the medians':>48}{total:9.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_timeline.py needs CUDA")
    cfg = config_from_hf(SHAPES[args.shape], name=args.shape)
    llm = LLM.from_model(random_model(cfg, torch.bfloat16, torch.device("cuda")),
                         name=args.shape, max_model_len=4096, cuda_graphs=True,
                         gpu_memory_utilization=0.5)
    prompt = torch.randint(0, cfg.vocab_size, (128,)).tolist()
    timeline(llm, prompt, False, args.tokens)
    llm.set_spec(SpecConfig(draft="random", num_steps=7, topk=1, num_draft_tokens=8,
                            simulate_acceptance=3.9))
    timeline(llm, prompt, True, args.tokens)


if __name__ == "__main__":
    main()
