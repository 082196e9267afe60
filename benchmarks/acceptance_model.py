"""The acceptance model's predicted accept length against the engine's measured one, for
every configuration of a `benchmarks/tune.py` grid log (same prompts, same model and draft).

    python benchmarks/tune.py --dtype bf16 --num-prompts 4 --max-tokens 128 --out LOG
    python benchmarks/acceptance_model.py --log LOG --dtype bf16 --num-prompts 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

from specscope import LLM
from specscope.bench.datasets import load_prompts
from specscope.config import SamplingParams, SpecConfig
from specscope.doctor.probe import target_probe_data
from specscope.draft.loader import load_draft
from specscope.tune.acceptance import measure_acceptance


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True, help="a benchmarks/tune.py output with grid lines")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--spec-text", default=None, metavar="S,K,N",
                    help="also measure the model on the text this speculative configuration "
                         "produces (in bf16 it can part from plain decoding's at a near-tie)")
    args = ap.parse_args()
    llm = LLM(None, dtype=args.dtype, device="cpu", spec=None)
    prompts = load_prompts(args.dataset, args.num_prompts)
    ids = [llm.encode_prompt(p) for p in prompts]
    # The engine's own greedy outputs, as the tuner measures them.
    params = SamplingParams(max_tokens=args.max_tokens)
    answers = [llm.generate(p, params)[0].token_ids for p in prompts]
    data = target_probe_data(llm.model, ids, args.max_tokens, answers=answers)
    draft = load_draft(args.draft, llm.model_config, dtype=llm.dtype, device=llm.device).model
    draft.attach_target(llm.model)
    t0 = time.perf_counter()
    model = measure_acceptance(draft, data, 10)
    print(f"acceptance model measured in {time.perf_counter() - t0:.1f} s "
          f"(trees of topk 2-8 unrolled)")
    # The same ranks with the trees left out: the path-borrowed approximation (_beam_terms),
    # which is what a simulated profile uses.
    approx = dataclasses.replace(model, trees={}, _terms=None)
    rows = dict.fromkeys(re.findall(r"grid \((\d+), (\d+), (\d+)\)\s+[\d.]+ tok/s\s+tau ([\d.]+)",
                                    Path(args.log).read_text()))
    errs: dict[str, list[float]] = {"chain": [], "tree": [], "tree (approximate)": []}
    for s, k, n, t in rows:
        cfg, measured = (int(s), int(k), int(n)), float(t)
        pred, pred_a = model.tau(*cfg), approx.tau(*cfg)
        errs["chain" if cfg[1] == 1 else "tree"].append(pred / measured - 1)
        if cfg[1] > 1:
            errs["tree (approximate)"].append(pred_a / measured - 1)
        print(f"{str(cfg):<12} measured {measured:.2f} predicted {pred:.2f} "
              f"({pred / measured - 1:+.1%}); approximate {pred_a:.2f} "
              f"({pred_a / measured - 1:+.1%})")
    for kind, e in errs.items():
        if e:
            print(f"{kind}s: mean |error| {sum(map(abs, e)) / len(e):.1%}, worst "
                  f"{max(e, key=abs):+.1%} over {len(e)}")
    if args.spec_text:
        spec_text(llm, draft, prompts, ids, answers, rows, args)


def spec_text(llm: LLM, draft, prompts: list, ids: list, answers: list, rows: dict,
              args: argparse.Namespace) -> None:
    """The acceptance model on the plain text against the one on a speculative run's text."""
    s, k, n = (int(x) for x in args.spec_text.split(","))
    llm.set_spec(SpecConfig(draft=args.draft, num_steps=s, topk=k, num_draft_tokens=n))
    outs = [llm.generate(p, SamplingParams(max_tokens=args.max_tokens))[0] for p in prompts]
    for a, o in zip(answers, outs, strict=True):
        pairs = zip(a, o.token_ids, strict=False)
        same = next((i for i, (x, y) in enumerate(pairs) if x != y),
                    min(len(a), len(o.token_ids)))
        print(f"speculative {(s, k, n)} text: the first {same} of {len(o.token_ids)} tokens "
              f"equal plain decoding's; accept length {o.spec['accept_length']:.2f}")
    spec = measure_acceptance(draft, target_probe_data(llm.model, ids, args.max_tokens,
                                                       answers=[o.token_ids for o in outs]), 10)
    plain = measure_acceptance(draft, target_probe_data(llm.model, ids, args.max_tokens,
                                                        answers=answers), 10)
    errs: dict[str, list[float]] = {"chain": [], "tree": []}
    for s2, k2, n2, t in rows:
        cfg = (int(s2), int(k2), int(n2))
        errs["chain" if cfg[1] == 1 else "tree"].append(spec.tau(*cfg) / float(t) - 1)
        print(f"{str(cfg):<12} grid {float(t):.2f}: on the plain text {plain.tau(*cfg):.2f}, "
              f"on {(s, k, n)}'s text {spec.tau(*cfg):.2f}")
    for kind, e in errs.items():
        if e:
            print(f"on {(s, k, n)}'s text, {kind}s: mean |error| "
                  f"{sum(map(abs, e)) / len(e):.1%}, worst {max(e, key=abs):+.1%} over {len(e)}")

if __name__ == "__main__":
    main()
