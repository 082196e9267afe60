"""Each configuration's segments under the tuner's interleaved confirmation, as the cost
model reads them: mean / median / 90th percentile ms per cycle of the draft and verify
segments and of the host time between them ("other"), round after round.

    python benchmarks/host_other.py --device cuda --shape smollm2-135m

A random-weight target of a real shape and a random draft; SIMULATED acceptance (rates per
position), then the random draft's own greedy acceptance (tau ~ 1). A mean far above its
median is a few long cycles, not a steady cost: this found the profiler's batched
resolution (a ~50 ms pause every ~800 cycles) charged to one configuration's host time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

from specscope import LLM  # noqa: E402
from specscope.config import SamplingParams, SpecConfig  # noqa: E402
from specscope.models.loader import random_model  # noqa: E402
from specscope.models.registry import config_from_hf  # noqa: E402
from specscope.tune.tuner import measure_interleaved  # noqa: E402

RATES = (0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.4, 0.4, 0.4)


def show(tag: str, measured: list) -> None:
    for m in measured:
        modes = m.summary["modes"]
        seg = modes.get("segments", {})
        rows = ", ".join(f"{n} {p['mean_ms']:.3f}/{p['p50_ms']:.3f}/{p['p90_ms']:.3f}"
                         for n, p in seg.get("phases", {}).items())
        print(f"{tag} {m.config} {m.tok_per_s:.1f} tok/s, eager cycles "
              f"{modes.get('phases', {}).get('cycles', 0)}, graph cycles {seg.get('cycles')}: "
              f"{rows}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = config_from_hf(SHAPES[args.shape], name=args.shape)
    cuda = dev.type == "cuda"
    llm = LLM.from_model(random_model(cfg, torch.bfloat16 if cuda else torch.float32, dev),
                         name=args.shape, max_model_len=4096, cuda_graphs=cuda,
                         **({"gpu_memory_utilization": 0.5} if cuda else {}))
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()))
               for n in (20, 45, 80, 120, 33, 150, 60, 200)]
    configs = [(5, 1, 6), (4, 5, 21), (6, 1, 7)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for name, base in (("SIMULATED", SpecConfig(draft="random", simulate_acceptance=RATES)),
                       ("random draft's own acceptance", SpecConfig(draft="random"))):
        for r in range(args.rounds):
            t = time.perf_counter()
            got = measure_interleaved(llm, configs, "random", prompts, params, base, 8)
            show(f"{name}, round {r} ({time.perf_counter() - t:.1f} s)", got)


if __name__ == "__main__":
    main()
