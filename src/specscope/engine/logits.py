"""The per-sequence device state behind the logits adjustments (penalties, logit_bias,
min_tokens), and the batch's `LogitsAdjustment` built from it each step.

A sequence that asks for an adjustment gets a `TokenState` at admission, built once from its
host tokens: its generated-token counts [V] (the penalties), its prompt's tokens [V] (the
repetition penalty), its bias [V] and its min_tokens stop set [V]. The counts are then kept
current on the device: after every step the tokens it emitted are added by one scatter
(`count_emitted`, from the step's device tensors, before the step's one read), so nothing
is read back or uploaded per token. Sequences without adjustments have no state and never
enter the batch's adjustment rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.engine.sequence import Sequence
from specscope.kvcache.paged import upload
from specscope.sampling import LogitsAdjustment


@dataclass
class TokenState:
    """A sequence's adjustment inputs on the device, over the target's vocabulary V.

    counts [V] int32: how often each token was generated (None: no penalty). prompt [V]
    bool: the prompt's tokens (None: no repetition penalty). bias [V] fp32 (None: no
    logit_bias). stop [V] bool: EOS (unless ignore_eos) and stop_token_ids, masked while
    fewer than min_tokens are generated (None: no min_tokens)."""

    counts: torch.Tensor | None = None
    prompt: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    stop: torch.Tensor | None = None


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device; on CUDA through pinned memory, without a stream sync
    (sequences are admitted between steps, while the previous step's work may still run)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def token_state(seq: Sequence, vocab: int, eos: frozenset[int],
                device: torch.device) -> TokenState | None:
    """The state a sequence's params need (None when they adjust nothing), from its host
    tokens: also right for a sequence carried over from another engine mid-generation."""
    p = seq.params
    if not p.adjusts_logits:
        return None
    st = TokenState()
    if p.counts_tokens:
        st.counts = _to(torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long),
                                       minlength=vocab).to(torch.int32), device)
        if p.repetition_penalty != 1:
            st.prompt = torch.zeros(vocab, dtype=torch.bool)
            st.prompt[torch.tensor(seq.prompt_ids, dtype=torch.long)] = True
            st.prompt = _to(st.prompt, device)
    if p.logit_bias:
        st.bias = torch.zeros(vocab)
        ids, vals = zip(*p.logit_bias, strict=True)
        st.bias[torch.tensor(ids)] = torch.tensor(vals)
        st.bias = _to(st.bias, device)
    if p.min_tokens > 0:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        st.stop = torch.zeros(vocab, dtype=torch.bool)
        st.stop[torch.tensor(sorted(t for t in stops if t < vocab), dtype=torch.long)] = True
        st.stop = _to(st.stop, device)
    return st


def _needs(seq: Sequence) -> bool:
    """Whether the sequence's next tokens are adjusted (min_tokens alone stops mattering
    once that many are generated)."""
    st, p = seq.logits_state, seq.params
    if st is None:
        return False
    return (st.counts is not None or st.bias is not None
            or (st.stop is not None and len(seq.output_ids) < p.min_tokens))


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Whether each sequence's next token is just the argmax of the target's raw logits:
    greedy, no adjustments, no grammar, no logprobs asked (the head's greedy_ids serves)."""
    return all(s.params.greedy and s.grammar is None and s.params.logprobs is None
               and not _needs(s) for s in seqs)


def adjustment(seqs: list[Sequence], device: torch.device) -> LogitsAdjustment | None:
    """The batch's adjustment over the rows of `seqs` (one row each) that have any; None
    when none has (the batch's logits then go to sampling and verification untouched)."""
    rows = [r for r, s in enumerate(seqs) if _needs(s)]
    if not rows:
        return None
    sel = [seqs[r] for r in rows]
    states = [s.logits_state for s in sel]
    V = next(t.shape[0] for st in states for t in (st.counts, st.prompt, st.bias, st.stop)
             if t is not None)

    def stack(name: str, dtype: torch.dtype) -> torch.Tensor | None:
        ts = [getattr(st, name) for st in states]
        if all(t is None for t in ts):
            return None
        zero = torch.zeros(V, dtype=dtype, device=device)
        return torch.stack([zero if t is None else t for t in ts])  # [R, V]

    coef = upload([[s.params.presence_penalty, s.params.frequency_penalty,
                    s.params.repetition_penalty] for s in sel], torch.float32, device)
    left = [s.params.min_tokens - len(s.output_ids) for s in sel]
    in_force = any(x > 0 for x in left)
    return LogitsAdjustment(
        rows=None if len(rows) == len(seqs) else upload(rows, torch.long, device),
        counts=stack("counts", torch.int32), prompt=stack("prompt", torch.bool), coef=coef,
        bias=stack("bias", torch.float32),
        stop=stack("stop", torch.bool) if in_force else None,
        min_left=upload(left, torch.long, device) if in_force else None)


def count_emitted(seqs: list[Sequence], tokens: torch.Tensor) -> None:
    """Add each sequence's emitted tokens to its counts, on the device: tokens [len(seqs),
    W] int64, -1 past a row's last (a verify's emitted tokens; a sample's, W = 1). Tokens
    a stop later cuts off are counted too, harmlessly: the sequence has finished."""
    for r, seq in enumerate(seqs):
        st = seq.logits_state
        if st is None or st.counts is None:
            continue
        row = tokens[r]  # [W]
        st.counts.scatter_add_(0, row.clamp_min(0), (row >= 0).to(torch.int32))
