"""Batched regeneration throughput on the GPU with a random-weight SmolLM2-135M-shaped target
(no weights needed): new tokens/s of train/regenerate.py's BatchGenerator, CUDA graphs on/off.

    python recipes/default_draft/regen_throughput.py [--batch 512] [--new 256]
"""

from __future__ import annotations

import argparse
import time

import torch

from specscope.config import ModelConfig, SamplingParams
from specscope.models.loader import random_model
from specscope.train.regenerate import BatchGenerator

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    model = random_model(ModelConfig.from_hf(SMOLLM2_135M), torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    for batch in args.batch:
        prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist()
                   for n in torch.randint(30, 200, (batch,), generator=g)]
        for graphs in (True, False) if batch == args.batch[0] else (True,):
            gen = BatchGenerator(model, batch, 1024 + 512, graphs=graphs)
            gen.generate(prompts[:batch], 16, params, set(), None)  # capture / warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = gen.generate(prompts, args.new, params, set(), None)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            n = sum(len(o) for o in out)
            print(f"batch {batch} graphs {graphs}: {n} new tokens in {dt:.1f} s = "
                  f"{n / dt:,.0f} tok/s ({dt / args.new * 1e3:.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
