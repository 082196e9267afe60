"""Reference computations the engine tests compare against (not a test module)."""

from __future__ import annotations

import contextlib
import random

import torch

from specscope.spec.tree import DraftTree


@torch.inference_mode()
def solo_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by a full forward per token, no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        h, _ = model(torch.tensor(ids)[None], torch.arange(len(ids))[None])
        ids.append(int(model.compute_logits(h[0, -1]).argmax()))
    return ids[len(prompt):]


def patch_oracle_drafts(monkeypatch, engine, truth: dict, noise: float, seed: int,
                        vocab: int) -> None:
    """Replace an engine's drafts: they propose each sequence's true continuation
    (truth[seq_id]: its prompt and output), each token corrupted with probability `noise`,
    the correct child at a random rank among wrong siblings."""
    rng = random.Random(seed)
    spec = engine.spec

    def wrong(t):
        return (t + 1 + rng.randrange(vocab - 1)) % vocab

    def one(seq):
        full = truth[seq.seq_id]
        n = seq.num_computed

        def at(i):
            return full[i] if i < len(full) else 0

        tokens, parents, depth = [at(n)], [-1], [0]
        cur, budget = 0, spec.num_draft_tokens - 1
        for d in range(1, spec.num_steps + 1):
            siblings = max(1, min(spec.topk, budget - (spec.num_steps - d)))
            right, nxt = rng.randrange(siblings), cur
            for r in range(siblings):
                t = at(n + d)
                if r != right or rng.random() < noise:
                    t = wrong(t)
                tokens.append(t)
                parents.append(cur)
                depth.append(d)
                if r == right:
                    nxt = len(tokens) - 1
                budget -= 1
            cur = nxt
        while len(tokens) < spec.num_draft_tokens:
            tokens.append(wrong(at(n + 1)))
            parents.append(0)
            depth.append(1)
        return tokens, parents, depth

    def fake(seqs, h0, normed0, adjust=None):
        rows = [one(s) for s in seqs]
        t = torch.tensor
        return DraftTree(tokens=t([r[0] for r in rows]), parents=t([r[1] for r in rows]),
                         depth=t([r[2] for r in rows]), chain=spec.topk == 1)

    monkeypatch.setattr(engine, "_draft_trees", fake)


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads (the native kernels' OpenMP workers too) set to n inside the
    block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
