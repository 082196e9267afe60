"""Log-probabilities on their way from a step's logits to the host: packed on the device per
sequence that asks (`LogprobRows`), carried in the step's one device->host read with the
tokens (engine.py `_read`), and unpacked there into one entry per token.

Values are the target's raw distribution, log_softmax of its logits before any adjustment
or filter (vLLM's default `raw_logprobs`): for an emitted token, the logits row that
predicted it (a sample's row; in a verify, the path node before it, the same prefix plain
decoding has); for a prompt token (SamplingParams.prompt_logprobs), its prefill row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.engine.sequence import Sequence
from specscope.kvcache.paged import upload
from specscope.sampling import token_logprobs

# One token's log-probabilities: (its log-probability, its rank, the top (token id,
# log-probability) pairs, most likely first), all under the target's raw logits.
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]

# Prompt rows whose logits one slice computes: bounds the [rows, V] logits of a long
# prefill chunk.
PROMPT_LOGITS_ROWS = 256


@dataclass
class LogprobRows:
    """Log-probabilities of the sequences that ask for them, on the device until the read:
    values [T, 2 + 2k] (sampling.token_logprobs), counts[i] consecutive rows for seqs[i]
    (its emitted tokens, or with prompt=True its prompt tokens computed this step)."""

    seqs: list[Sequence]
    values: torch.Tensor
    counts: list[int]
    k: int
    prompt: bool = False


def logprob_rows(raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence],
                 device: torch.device) -> LogprobRows | None:
    """The raw log-probabilities of tokens [B, W] (-1 padding allowed) under logits
    [B, W, V] for the rows whose params ask for logprobs (None: no row does)."""
    rows = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    k = max(seqs[r].params.logprobs for r in rows)
    if len(rows) < len(seqs):
        sel = upload(rows, torch.long, device)
        raw, tokens = raw.index_select(0, sel), tokens.index_select(0, sel)
    R, W, V = raw.shape
    vals = token_logprobs(raw.reshape(R * W, V), tokens.reshape(-1).clamp_min(0), k)
    return LogprobRows([seqs[r] for r in rows], vals, [W] * R, k)


def prompt_logprob_rows(model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor,
                        tokens: torch.Tensor, seqs: list[tuple[Sequence, int]]
                        ) -> LogprobRows:
    """Prompt tokens [T] under the logits of the rows [T] of hidden [rows, H] that predict
    them; seqs: (sequence, how many of the T are its), in order."""
    k = max(s.params.prompt_logprobs for s, _ in seqs)
    step = PROMPT_LOGITS_ROWS
    vals = [token_logprobs(model.compute_logits(hidden[rows[i:i + step]]),
                           tokens[i:i + step], k) for i in range(0, rows.shape[0], step)]
    order, counts = zip(*seqs, strict=True)
    return LogprobRows(list(order), torch.cat(vals), list(counts), k, prompt=True)


def unpack_logprobs(packs: list[LogprobRows], floats: list[float]
                    ) -> dict[str, list[TokenLogprobs]]:
    """The read's log-probabilities (each pack's values [T, 2 + 2k], flattened in order)
    as per-sequence lists of entries, each with its own number of top tokens. A prompt
    pack's entries are appended to their sequences' prompt_lp instead."""
    out: dict[str, list[TokenLogprobs]] = {}
    at = 0
    for pack in packs:
        C, k = pack.values.shape[-1], pack.k
        for seq, count in zip(pack.seqs, pack.counts, strict=True):
            mine = seq.params.prompt_logprobs if pack.prompt else seq.params.logprobs
            entries = []
            for _ in range(count):
                v = floats[at:at + C]
                at += C
                top = [(int(i), lp) for lp, i in zip(v[2:2 + mine], v[2 + k:2 + k + mine],
                                                     strict=True)]
                entries.append((v[0], int(v[1]), top))
            if pack.prompt:
                seq.prompt_lp.extend(entries)
            else:
                out.setdefault(seq.seq_id, []).extend(entries)
    return out
