"""Draft-vocabulary maps: d2t (draft id -> target id offset) and t2d (target ids in the draft).

EAGLE-3 drafts predict over a reduced vocabulary: draft id i is target id i + d2t[i], and
t2d[t] marks target ids the draft can propose. The pair is consistent when the draft
vocabulary, as ascending target ids, is exactly nonzero(t2d) == d2t + arange(Vd).
"""

from __future__ import annotations

import torch


def vocab_maps(draft_to_target_ids: torch.Tensor, vocab_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) for a draft vocabulary given as target ids."""
    ids = torch.as_tensor(draft_to_target_ids, dtype=torch.int64).sort().values
    if ids.numel() and (ids[0] < 0 or ids[-1] >= vocab_size or (ids[1:] == ids[:-1]).any()):
        raise ValueError("draft vocabulary ids must be distinct target ids in [0, V)")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int,
                     draft_vocab_size: int) -> None:
    """Raise naming d2t/t2d unless nonzero(t2d) == d2t + arange(Vd) (sorted, distinct ids)."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}] "
                         f"(draft_vocab_size)")
    if tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"t2d has shape {list(t2d.shape)}, expected [{vocab_size}] "
                         f"(target vocab_size)")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must hold integers, got {d2t.dtype}")
    target_ids = d2t.long().cpu() + torch.arange(draft_vocab_size)
    selected = torch.nonzero(t2d.cpu().bool()).flatten()
    if selected.numel() != draft_vocab_size or not torch.equal(selected, target_ids):
        raise ValueError(
            f"d2t/t2d are inconsistent: nonzero(t2d) ({selected.numel()} ids) must equal "
            f"d2t + arange({draft_vocab_size}) (the draft vocabulary as ascending target ids)")


def frequent_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties and unseen ids: lowest id first), ascending.

    counts [V]: how often each target id occurs in the draft's training labels.
    """
    V = counts.numel()
    if not 0 < size <= V:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {V}] (the target vocab)")
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return order[:size].sort().values


def vocab_coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Fraction of the counted label tokens that the draft vocabulary `ids` can propose."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0
