"""One train-draft step, timed by part: the target's pass (taps and distribution over the draft
vocabulary), the unrolled TTT loss forward and backward, and the optimizer; for each
--ttt-attention mode, with peak memory. Random weights of a real shape, random tokens.

    python benchmarks/ttt_step.py --device cuda --shape smollm2-135m --batch-tokens 16384
    python benchmarks/ttt_step.py --device cpu --shape tiny --batch-tokens 512 --seq 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (benchmarks/ is not a package)

from specscope.config import ModelConfig  # noqa: E402
from specscope.draft.eagle3 import random_draft  # noqa: E402
from specscope.models.loader import random_model  # noqa: E402
from specscope.train.data import Example  # noqa: E402
from specscope.train.tap_cache import target_batch  # noqa: E402
from specscope.train.ttt import ATTENTION, ttt_loss  # noqa: E402

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="smollm2-135m",
                    choices=["smollm2-135m", *sorted(SHAPES)])
    ap.add_argument("--draft-vocab", type=int, default=12288)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (the longest)")
    ap.add_argument("--fixed-length", action="store_true",
                    help="every step the same length (default: a new length per step, as the "
                         "trainer's padded batches have, so per-shape host costs show)")
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(ATTENTION))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    hf = dict(SMOLLM2 if args.shape == "smollm2-135m" else SHAPES[args.shape])
    cfg = ModelConfig.from_hf(hf, name=args.shape)
    tdtype = torch.bfloat16 if cuda else torch.float32
    target = random_model(cfg, tdtype, dev)
    layer_ids = (1, cfg.num_layers // 2 - 1, cfg.num_layers - 4) if cfg.num_layers >= 8 else \
        tuple(range(min(3, cfg.num_layers)))
    target.set_taps(layer_ids)
    g = torch.Generator().manual_seed(0)
    B = max(1, args.batch_tokens // args.seq)
    n_iter = args.warmup + args.iters
    # Step i's length: the longest, less 3 % per step (distinct lengths unless --fixed-length).
    # Each mode gets lengths of its own (one token shorter per mode): with shared lengths the
    # first mode alone paid the per-shape set-up of the target's forward (84 against 34 ms a
    # step on the H200), which made the second mode look faster than its TTT part is.
    def lengths_for(k: int) -> list[int]:
        return [args.seq if args.fixed_length else
                max(8, args.seq - i * max(1, args.seq // 32) - k) for i in range(n_iter)]

    def batches_for(lengths: list[int], gen: torch.Generator = g) -> list[list[Example]]:
        batches = []
        for n in lengths:
            examples = []
            for _ in range(B):
                ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
                cut = n // 8  # a prompt, then the answer the loss is on
                examples.append(Example(ids=ids, mask=[False] * cut + [True] * (n - cut)))
            batches.append(examples)
        return batches

    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[:args.draft_vocab].sort().values
    # One batch every mode scores before its first step, with the same weights: the modes must
    # agree on its loss. Its length is none of the timed ones, so it warms none of their shapes.
    check = batches_for([max(8, args.seq // 2 + 1)], torch.Generator().manual_seed(1))[0]
    results = {}
    for k, mode in enumerate(args.modes.split(",")):
        lengths = lengths_for(k)
        batches = batches_for(lengths)
        draft = random_draft(cfg, torch.float32, dev, layer_ids=layer_ids,
                             draft_vocab_size=args.draft_vocab, seed=1)
        draft.attach_target(target)
        draft.ensure_rope(args.seq + args.ttt_length + 2)
        draft.requires_grad_(True).train()
        opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        parts = {"target": 0.0, "ttt": 0.0, "optimizer": 0.0}
        with torch.no_grad(), autocast:
            check_loss = float(ttt_loss(draft, target_batch(target, check, draft_ids.to(dev), dev),
                                        args.ttt_length, attention=mode)[0])

        def now() -> float:
            if cuda:
                torch.cuda.synchronize(dev)
            return time.perf_counter()

        for it in range(n_iter):
            t0 = now()
            with torch.no_grad():
                batch = target_batch(target, batches[it], draft_ids.to(dev), dev)
            t1 = now()
            with autocast:
                loss, _, _ = ttt_loss(draft, batch, args.ttt_length, attention=mode)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = now()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()
            t3 = now()
            if it >= args.warmup:
                parts["target"] += (t1 - t0) / args.iters * 1e3
                parts["ttt"] += (t2 - t1) / args.iters * 1e3
                parts["optimizer"] += (t3 - t2) / args.iters * 1e3
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
        tokens = B * sum(lengths[args.warmup:]) / args.iters  # per timed step, on average
        step = sum(parts.values())
        results[mode] = {"step_ms": round(step, 2), **{k: round(v, 2) for k, v in parts.items()},
                         "tokens_per_s": round(tokens / step * 1e3),
                         "peak_gib": round(peak, 2) if peak is not None else None,
                         "loss": round(float(loss.detach()), 4),
                         "check_loss": round(check_loss, 4)}
        print(f"{mode:6s} step {step:8.2f} ms  (target {parts['target']:.2f}, TTT fwd+bwd "
              f"{parts['ttt']:.2f}, optimizer {parts['optimizer']:.2f})  "
              f"{tokens / step * 1e3:,.0f} tokens/s"
              + (f"  peak {peak:.2f} GiB" if peak is not None else ""), flush=True)
        del draft, opt, batch
    first = lengths_for(0)
    meta = {"device": str(dev), "shape": args.shape, "batch": B, "seq": args.seq,
            "lengths": "fixed" if args.fixed_length else
            f"{first[0]}..{first[-1]}, less 1 per mode",
            "ttt_length": args.ttt_length, "draft_vocab": args.draft_vocab}
    text = json.dumps({"meta": meta, "results": results}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
