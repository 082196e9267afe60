"""Engine-walk accept length of a draft on the built-in evaluation sets (fast, no engine run):
the target answers each prompt greedily, the draft is unrolled along the answers as the
engine runs it, and the engine's cycle walk is replayed (tune/acceptance.py). For a chain
this is the accept length `specscope profile` measures on the same tokens.

    python recipes/default_draft/walk_tau.py --draft DIR [--target GGUF] [--device cuda]
        [--by-category]   # one line per category of a set whose rows have one (mt_bench)
        [--by-answer-position]  # chain-of-5 accept length of the cycles in each stretch
                                # of the answers (tokens 0-15, 16-31, 32-63, ...)
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

from specscope import LLM
from specscope.bench.datasets import BUILTIN, jsonl_objects, load_prompts
from specscope.doctor.probe import target_probe_data
from specscope.draft.loader import _resolve_dir, load_draft
from specscope.tune.acceptance import AcceptanceModel, measure_acceptance

EDGES = (0, 16, 32, 64, 128, 192, 256, 384, 512)  # answer-token stretches (--by-answer-position)


def stretch_counts(model: AcceptanceModel, num_steps: int = 5) -> dict[int, list[int]]:
    """{stretch: [accepted draft tokens, cycles]} of the chain's walk, by where in its answer
    each cycle starts (EDGES); stretch k covers answer tokens EDGES[k] to EDGES[k + 1] - 1."""
    a = model.accepted_depths(num_steps, 1).tolist()
    out: dict[int, list[int]] = {}
    for b, (s, e) in enumerate(zip(model.starts, model.ends, strict=True)):
        t = s
        while t + 1 < e:  # train/ttt.py walk_cycles' walk, keeping each cycle's start
            acc = min(a[b][t], max(0, e - t - 2))
            k = max(i for i in range(len(EDGES)) if EDGES[i] <= t - s)
            out.setdefault(k, [0, 0])
            out[k][0] += acc
            out[k][1] += 1
            t += acc + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval")
    ap.add_argument("--by-category", action="store_true",
                    help="also report each category of the set (mt_bench: writing, roleplay, ...)")
    ap.add_argument("--by-answer-position", action="store_true",
                    help="also report the chain-of-5 accept length by stretch of the answers")
    args = ap.parse_args()
    llm = LLM(args.target, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    draft = load_draft(_resolve_dir(args.draft), llm.model_config, dtype=llm.dtype,
                       device=llm.device).model
    draft.attach_target(llm.runner.model)
    for name in args.datasets.split(","):
        t = time.perf_counter()
        prompts = load_prompts(name, args.num_prompts)
        groups = {"all": list(range(len(prompts)))}
        if args.by_category and name in BUILTIN:
            text = resources.files("specscope.data").joinpath(BUILTIN[name]).read_text()
            cats = [row.get("category") for _, row in jsonl_objects(text, name)][:len(prompts)]
            for i, c in enumerate(cats):
                if c is not None:
                    groups.setdefault(c, []).append(i)
        ids = [llm.encode_prompt(p) for p in prompts]
        per_prompt: list[dict[int, tuple[int, int]]] = []
        stretches: dict[int, list[int]] = {}
        for i in range(0, len(ids), 16):  # batches of 16 prompts bound the probe's memory
            data = target_probe_data(llm.runner.model, ids[i:i + 16], args.max_tokens)
            model = measure_acceptance(draft, data, depth=6)
            for k, (acc, n) in stretch_counts(model).items():
                stretches.setdefault(k, [0, 0])
                stretches[k][0] += acc
                stretches[k][1] += n
            for j in range(len(model.starts)):  # one answer at a time, so groups can add up
                one = AcceptanceModel(ranks=model.ranks[j:j + 1], starts=model.starts[j:j + 1],
                                      ends=model.ends[j:j + 1])
                per_prompt.append({k: (sum(c), len(c)) for k in (1, 3, 5, 6)
                                   for c in [one.cycles(k, 1)]})
        for group, members in groups.items():
            taus = {k: [sum(per_prompt[m][k][0] for m in members),
                        sum(per_prompt[m][k][1] for m in members)] for k in (1, 3, 5, 6)}
            line = " ".join(f"tau({k},1)={1 + a / max(n, 1):.3f}" for k, (a, n) in taus.items())
            label = name if group == "all" else f"  {group}"
            print(f"{label:12s} {len(members)} prompts x {args.max_tokens} tokens: {line} "
                  f"({time.perf_counter() - t:.0f} s, {llm.dtype}, {llm.device})", flush=True)
        if args.by_answer_position:
            for k in sorted(stretches):
                acc, n = stretches[k]
                hi = f"{EDGES[k + 1] - 1}" if k + 1 < len(EDGES) else ""
                print(f"  answer tokens {EDGES[k]:3d}-{hi:3s} {n:6d} cycles  "
                      f"tau(5,1)={1 + acc / max(n, 1):.3f}", flush=True)


if __name__ == "__main__":
    main()
