"""The native CPU decoder (native/decoder.c: every layer in one C call) against the layers
one by one (the same kernels, each called from Python), in one process, alternating.

    python benchmarks/cpu_decoder.py [--rounds 4 --num-prompts 4 --max-tokens 128]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_decoder.py

The default model on its GGUF's 4-bit codes (`--quantization int4-gguf`, the activations in
the dtype `auto` picks), plain decoding and the shipped draft's chain of 5, MT-Bench first
turns with the chat template, greedy. Each round runs both paths on every prompt; the figure
is decode tok/s (tokens after the first over the time after the first), medians over the
rounds with the per-round ratios. The outputs of the two paths must be equal token for
token (the script fails otherwise); prefix caching is off, so that both prefill every prompt
whole (a cached prefix would leave the second a short prefill, whose attention runs another
kernel). A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specscope import LLM, SamplingParams
from specscope.bench.datasets import load_prompts
from specscope.config import SpecConfig


def decode_rate(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s over the prompts (the first token of each, the prefill's, left out)."""
    tokens, seconds, outs = 0, 0.0, []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        start, ids = None, []
        for d in llm.stream(p, params, chat=True):
            ids += d.token_ids
            if start is None and ids:
                start, first = time.perf_counter(), len(ids)
        seconds += time.perf_counter() - start
        tokens += len(ids) - first
        outs.append(ids)
    return tokens / seconds, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    prompts = load_prompts("mt_bench", args.num_prompts)
    cases = {"plain": None, "chain of 5": SpecConfig(draft="default", num_steps=5, topk=1,
                                                     num_draft_tokens=6)}
    rows = []
    print(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    for name, spec in cases.items():
        llm = LLM(None, quantization="int4-gguf", spec=spec, enable_prefix_caching=False)
        decode_rate(llm, prompts[:1], 16)  # builds the native library, warms the caches
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            outs = {}
            for on in (True, False):
                llm.model.native_decoder_enabled = on
                rate, outs[on] = decode_rate(llm, prompts, args.max_tokens)
                rates[on].append(rate)
            if outs[True] != outs[False]:
                raise SystemExit(f"{name}: the native decoder's output differs")
        ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
        row = {"case": name, "native": statistics.median(rates[True]),
               "layers": statistics.median(rates[False]),
               "ratio_median": statistics.median(ratios), "ratios": ratios,
               "dtype": str(llm.dtype)}
        rows.append(row)
        print(f"{name:11s} native decoder {row['native']:7.1f} tok/s   layers one by one "
              f"{row['layers']:7.1f} tok/s   ratio {row['ratio_median']:.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}), outputs equal")
    print(json.dumps({"bench": "cpu_decoder", "rounds": args.rounds,
                      "capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}))


if __name__ == "__main__":
    main()
