"""Pricing the other draft placement under tensor parallelism (docs/tensor-parallel.md).

The EAGLE-3 draft runs whole on every rank (draft TP 1: its steps need no collective) or
sharded like the target (draft TP N: a rank streams 1/N of its weights, and every draft
forward pays its collectives). A cost model fitted under one placement (tune/cost.py keeps
the draft's compute and its collectives apart) predicts the other:

    compute(d) = compute(m) * m / d        the measured placement m, the other d: decoding
                                           is memory-bound, a rank's draft time scales with
                                           the weights it streams (launch overheads do not
                                           shrink, so this flatters d > m at small shapes)
    comm(d)    = 0 for d = 1, else per forward n * alpha + bytes * beta

with alpha and beta the cost of a collective fitted on every collective the calibration
ran (mostly the target's), and n, bytes a sharded draft forward's: an all-reduce after each
layer's attention and MLP and after the (vocab-parallel) embedding, and the all-gather of
its logits. The benchmark (benchmarks/tensor_parallel.py) prints the prediction next to the
measurement of both placements, which is the check this model needs on real GPUs.
"""

from __future__ import annotations

import dataclasses

from specscope.draft.eagle3 import DraftConfig
from specscope.tune.cost import DRAFT_TERMS, CostModel


def draft_forward_collectives(cfg: DraftConfig, tp: int, rows: int, elem_bytes: int
                              ) -> tuple[int, float]:
    """Collectives of one sharded draft forward over `rows` tokens: (count, bytes). The
    all-reduces carry [rows, H]; the logits' all-gather [rows, Vd] in all."""
    reduces = 2 * cfg.num_layers + 1  # attention and MLP per layer, the embedding
    per_rank_vocab = -(-cfg.draft_vocab_size // tp)
    nbytes = rows * elem_bytes * (reduces * cfg.hidden_size + tp * per_rank_vocab)
    return reduces + 1, float(nbytes)


def with_draft_placement(cost: CostModel, draft_tp: int, cfg: DraftConfig, elem_bytes: int,
                         batch: int = 1, extend_rows: float = 4.0, topk: int = 1
                         ) -> CostModel:
    """The cost model of the same run with the draft at `draft_tp` (1 or cost.tp).

    batch sequences; extend_rows pending pairs each per extend (about tau); a draft step
    feeds `topk` rows per sequence."""
    if draft_tp not in (1, cost.tp):
        raise ValueError(f"a draft runs replicated (1) or sharded over the group "
                         f"({cost.tp}), not over {draft_tp}")
    scale = cost.draft_tp / draft_tp
    terms = {t: getattr(cost, t) * scale for t in DRAFT_TERMS}
    a = b = 0.0
    if draft_tp > 1:
        def price(rows: float) -> float:
            n, nbytes = draft_forward_collectives(cfg, draft_tp, max(int(rows), 1),
                                                  elem_bytes)
            return n * cost.comm_alpha_ms + nbytes / 1e6 * cost.comm_beta_ms_per_mb

        a, b = price(batch * extend_rows), price(batch * topk)
    return dataclasses.replace(cost, **terms, a_draft_comm=a, b_step_comm=b,
                               draft_tp=draft_tp)
