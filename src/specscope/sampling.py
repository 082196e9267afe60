"""Token sampling without host syncs: temperature, top-k, top-p, seeded, greedy fast path.

Sampling from p uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks
i with probability p_i (the same law as torch.multinomial), but it is a pure device op:
no `multinomial` rejection loop, no `.item()`, so a decode step stays capturable and the
engine's single device->host read stays the only one. Filters follow vLLM's order:
temperature, then min-p, then top-k, then top-p.

Before them, the logits adjustments that change even a greedy pick (`adjust_logits`, in
vLLM v1's order): logit_bias, the min_tokens mask of stop tokens, then the repetition,
frequency and presence penalties. They are batch-first tensor functions over per-row state
held on the device (`LogitsAdjustment`): a speculative step applies them to every draft
node with the counts of the node's own path, so a verify sees exactly the distribution
plain decoding would use at that prefix. `adjust_logits_reference` is the per-token
reference they are tested against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from specscope.config import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator: a given seed always gives the same tokens on a device."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept). [B, V] -> [B, V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches p. [B, V] -> [B, V].

    A token is dropped when the tokens strictly above it already hold mass >= p (they are
    the nucleus without it), so the most likely token always survives.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_above = probs.cumsum(-1) - probs  # [B, V]
    drop_sorted = mass_above >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's. [B, V] -> [B, V].
    The top token always survives."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled, min-p, top-k and top-p filtered logits [B, V] (fp32). Not for
    greedy. The logits adjustments (`adjust_logits`) come before, where a sequence has any."""
    x = logits.float() / params.temperature
    x = apply_min_p(x, params.min_p)
    x = apply_top_k(x, params.top_k)
    return apply_top_p(x, params.top_p)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row. logits [B, V] -> tokens [B] int64, on the logits' device."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = processed_logits(logits, params).softmax(-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN and argmax favours NaN.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)


# -- logits adjustments: bias, min_tokens, penalties -------------------------------------------


def adjust_logits(logits: torch.Tensor, counts: torch.Tensor | None,
                  seen: torch.Tensor | None, coef: torch.Tensor,
                  bias: torch.Tensor | None, banned: torch.Tensor | None) -> torch.Tensor:
    """vLLM v1's adjustments, in its order, of logits [R, Q, V] (Q draft nodes or 1).

    counts [R, Q, V] (or broadcastable): generated-token counts each row has seen; seen
    [R, Q, V] bool: tokens of the prompt or the output (repetition); coef [R, 3]: presence,
    frequency and repetition penalties; bias [R, 1, V]; banned [R, Q, V] bool: the stop
    tokens min_tokens masks. Returns fp32 logits of the same shape."""
    x = logits.float()
    if bias is not None:
        x = x + bias
    if banned is not None:
        x = x.masked_fill(banned, float("-inf"))
    if counts is not None:
        presence, frequency, rep = (c[:, None, None] for c in coef.unbind(-1))  # [R, 1, 1]
        if seen is not None:
            # HF/vLLM: a seen token's logit is divided by the penalty when positive and
            # multiplied by it when negative (both lower it for a penalty > 1).
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - frequency * counts - presence * (counts > 0)
    return x


def path_counts(tokens: torch.Tensor, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, N, V] int32: per tree node, how often each token occurs on its path from the root
    (the node included, the root not: the root is already among the sequence's tokens).
    tokens [R, N]; ancestors [R, N, N] bool (DraftTree.ancestor_mask)."""
    R, N = tokens.shape
    below_root = torch.arange(N, device=tokens.device) > 0  # [N]
    w = (ancestors & below_root).to(torch.int32)  # [R, N, N]
    return torch.zeros(R, N, vocab, dtype=torch.int32, device=tokens.device).scatter_add_(
        2, tokens[:, None, :].expand(R, N, N), w)


@dataclass
class LogitsAdjustment:
    """The adjustments of the rows of a batch that ask for any (the others pass through
    untouched and pay nothing), as device tensors over one vocabulary of size V.

    rows [R] int64: the batch rows adjusted, or None for every row. counts [R, V] int32:
    each row's generated-token counts so far (None: no penalty in the batch). prompt [R, V]
    bool: its prompt's tokens (None: no repetition penalty). coef [R, 3]: presence,
    frequency, repetition. bias [R, V] (None: no logit_bias). stop [R, V] bool: the tokens
    min_tokens masks (EOS unless ignored, stop_token_ids); min_left [R] int64: how many more
    tokens must come before they are allowed (None: no min_tokens in force)."""

    rows: torch.Tensor | None
    counts: torch.Tensor | None
    prompt: torch.Tensor | None
    coef: torch.Tensor
    bias: torch.Tensor | None
    stop: torch.Tensor | None
    min_left: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        """R, the rows adjusted."""
        return self.coef.shape[0]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The adjusted rows of a batch tensor [B, ...] -> [R, ...]."""
        return t if self.rows is None else t.index_select(0, self.rows)

    def apply(self, logits: torch.Tensor, extra: torch.Tensor | None = None,
              depth: torch.Tensor | None = None) -> torch.Tensor:
        """Adjusted logits [B, Q, V] (fp32; a new tensor, the input is left as it was).

        extra [R, Q, V] int32: tokens on each node's path past the sequence's own (its
        draft ancestors: `path_counts`); depth [R, Q] int64: each node's depth, the tokens
        it comes after beyond the sequence's (min_tokens counts them). None: Q = 1 nodes
        right after the sequence's last token."""
        x = self.take(logits)
        R, Q, _ = x.shape
        counts = seen = banned = bias = None
        if self.counts is not None:
            counts = self.counts[:, None]  # [R, 1, V]
            if extra is not None:
                counts = counts + extra  # [R, Q, V]
            if self.prompt is not None:
                seen = self.prompt[:, None] | (counts > 0)
        if self.bias is not None:
            bias = self.bias[:, None]
        if self.stop is not None:
            d = torch.zeros(R, Q, dtype=torch.long, device=x.device) if depth is None else depth
            active = d < self.min_left[:, None]  # [R, Q]: still short of min_tokens there
            banned = self.stop[:, None] & active[..., None]  # [R, Q, V]
        out = adjust_logits(x, counts, seen, self.coef, bias, banned)
        if self.rows is None:
            return out
        return logits.float().index_copy(0, self.rows, out)

    def in_vocab(self, ids: torch.Tensor) -> LogitsAdjustment:
        """The same adjustments over a sub-vocabulary: ids [Vd] are its tokens' ids in this
        one (a draft's vocabulary mapped into the target's)."""
        def sub(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(1, ids)

        return replace(self, counts=sub(self.counts), prompt=sub(self.prompt),
                       bias=sub(self.bias), stop=sub(self.stop))


def adjust_logits_reference(logits: torch.Tensor, prompt: list[int], output: list[int],
                            params: SamplingParams, stop_ids: set[int]) -> torch.Tensor:
    """The slow reference of `adjust_logits` for one row [V]: a token at a time, after
    `prompt` and the generated tokens `output`; stop_ids: the tokens min_tokens masks."""
    x = logits.double().clone()
    for t, b in params.logit_bias:
        if t < x.shape[0]:
            x[t] += b
    if len(output) < params.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x.float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's chosen token under the raw distribution log_softmax(logits), packed for
    the step's one read: [R, 2 + 2k] fp64 = (its log-probability, its rank, the k top
    log-probabilities, their token ids). logits [R, V]; tokens [R] int64. The rank is vLLM's:
    the tokens at least as likely as the chosen one (1 for the top token)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens[:, None])  # [R, 1]
    rank = (lp >= chosen).sum(-1, keepdim=True)  # [R, 1]
    top = lp.topk(k, dim=-1) if k > 0 else None
    parts = [chosen.double(), rank.double()]
    if top is not None:
        parts += [top.values.double(), top.indices.double()]
    return torch.cat(parts, -1)
