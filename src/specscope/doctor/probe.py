"""The empirical wiring probe: how well does the draft predict the target under each plausible
wiring of its taps?

The target answers a handful of prompts greedily. One forward over prompt + answer yields the
embedding output and every layer's output, and the target's own greedy token at each position.
The draft is then unrolled (train/ttt.py, the engine's chain) on the answer tokens with the
taps gathered for each candidate wiring:

    configured          the ids the engine would use
    shifted +1 / -1     every id off by one
    other convention    the configured ids read in the other convention (output-of-layer vs
                        input-to-layer): the same as one of the shifts, named for its cause
    embedding first     the embedding output in place of the first tap
    default             EAGLE-3's default ids for this target
    embedding replaced  (when a configured tap is the embedding) a layer in its place

For each: top-1 agreement with the target at the first position, acceptance by position (given
all earlier accepted) and the accept length of a greedy chain of `steps` (the engine's
definitions). Identical wirings are measured once and carry every name that applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specscope.config import SamplingParams
from specscope.draft.eagle3 import OUTPUT_OF_LAYER, Eagle3Draft, default_layer_ids
from specscope.models.registry import TargetModel
from specscope.train.regenerate import BatchGenerator
from specscope.train.ttt import TTTBatch, acceptance, predicted_accept_length, ttt_loss


@dataclass
class Wiring:
    ids: tuple[int, ...]  # output-of-layer, -1 = embedding output
    names: list[str] = field(default_factory=list)
    top1: float = 0.0
    loss: float = 0.0  # cross-entropy against the target at the first position (nats)
    token_loss: torch.Tensor | None = field(default=None, repr=False)  # [n] per label
    token_run: torch.Tensor | None = field(default=None, repr=False)  # [n] accepted run
    acceptance: list[float] = field(default_factory=list)
    accept_length: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "names": self.names, "top1": round(self.top1, 4),
                "loss": round(self.loss, 4),
                "acceptance_by_position": [round(a, 4) for a in self.acceptance],
                "accept_length": round(self.accept_length, 3)}


@dataclass
class ProbeData:
    """What the target computed for the probe: reusable across drafts and wirings."""

    input_ids: torch.Tensor  # [B, T]
    label_mask: torch.Tensor  # [B, T] bool: answer tokens
    layers: torch.Tensor  # [B, T, L + 1, H]: embedding output, then every layer's output
    logits: torch.Tensor  # [B, T, V] fp32
    answer_tokens: int

    def taps(self, ids: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The target's taps [B, T, len(ids) * H] for output-of-layer ids (-1: embedding)."""
        B, T = self.input_ids.shape
        cols = torch.tensor([i + 1 for i in ids], device=self.layers.device)
        return self.layers.index_select(2, cols).reshape(B, T, -1).to(dtype)


@torch.inference_mode()
def target_probe_data(target: TargetModel, prompts: list[list[int]], max_new_tokens: int = 64,
                      answers: list[list[int]] | None = None) -> ProbeData:
    """Greedy answers of the target to `prompts`, and its activations over them.

    `answers`: the answers to teacher-force instead of generating them here. The tuner passes
    the engine's own greedy outputs: in bf16 a batched generation can part from the engine's
    text within a few tokens (a near-tie decided the other way), and acceptance measured on
    another text predicted the engine's accept length 15-20 % low on the CPU."""
    if answers is None:
        cap = max(len(p) for p in prompts) + max_new_tokens
        gen = BatchGenerator(target, len(prompts), cap)
        answers = gen.generate(prompts, max_new_tokens,
                               SamplingParams(max_tokens=max_new_tokens), set(), None)
    elif len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts")
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    T = max(len(s) for s in seqs)
    dev = target.device
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, len(p):len(s)] = True
    ids, mask = ids.to(dev), mask.to(dev)
    L = target.config.num_layers
    before = target.tap_layer_ids
    try:
        target.set_taps(tuple(range(-1, L)))
        pos = torch.arange(T, device=dev).expand(len(seqs), T)
        hidden, taps = target(ids, pos, return_taps=True)  # taps [B, T, (L+1) H]
    finally:
        target.set_taps(before)
    H = target.config.hidden_size
    return ProbeData(input_ids=ids, label_mask=mask,
                     layers=taps.view(len(seqs), T, L + 1, H),
                     logits=target.compute_logits(hidden),
                     answer_tokens=int(mask.sum()))


def candidate_wirings(configured: tuple[int, ...], convention: str, num_layers: int
                      ) -> list[Wiring]:
    """The configured wiring first, then each plausible mistake (deduplicated by ids)."""
    L = num_layers
    c = tuple(configured)
    other = tuple(i - 1 for i in c) if convention == OUTPUT_OF_LAYER else tuple(i + 1 for i in c)
    cands = [
        ("configured", c),
        ("shifted +1", tuple(i + 1 for i in c)),
        ("shifted -1", tuple(i - 1 for i in c)),
        ("other convention", other),
        ("embedding first", (-1,) + c[1:]),
        ("default", default_layer_ids(L)),
    ]
    if -1 in c:  # the embedding tapped where a layer was meant: try the default's first layer
        first = default_layer_ids(L)[0]
        cands.append(("embedding replaced", tuple(sorted(first if i == -1 else i for i in c))))
    out: dict[tuple[int, ...], Wiring] = {}
    for name, ids in cands:
        if not all(-1 <= i < L for i in ids):
            continue
        out.setdefault(ids, Wiring(ids=ids)).names.append(name)
    return list(out.values())


@torch.inference_mode()
def measure_wirings(draft: Eagle3Draft, data: ProbeData, wirings: list[Wiring],
                    steps: int = 5) -> list[Wiring]:
    """Fill in top1 / acceptance / accept_length of each wiring (in place; returned)."""
    draft_ids = draft.to_target(torch.arange(draft.config.draft_vocab_size,
                                             device=data.logits.device))
    logp = torch.log_softmax(data.logits[..., draft_ids], dim=-1)
    top = data.logits.argmax(-1)
    draft.ensure_rope(data.input_ids.shape[1] + steps + 1)
    for w in wirings:
        taps = data.taps(w.ids, draft.dtype)
        batch = TTTBatch(input_ids=data.input_ids, label_mask=data.label_mask, taps=taps,
                         target_logp=logp, target_top=top)
        _, losses, m = ttt_loss(draft, batch, steps)
        w.loss = float(losses[0])
        w.token_loss = m.first_ce
        if m.accepted is not None and m.valid0 is not None:
            # Draft tokens a greedy chain would accept from each label: the paired sample
            # behind accept_length's significance.
            w.token_run = m.accepted.sum(0)[m.valid0].double()
        w.acceptance = acceptance(m.chain, m.reached)
        w.top1 = float(m.correct[0] / m.count[0].clamp_min(1))
        w.accept_length = predicted_accept_length(w.acceptance, steps)
    return wirings
