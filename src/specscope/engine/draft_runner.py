"""The draft side of the batched engine: the EAGLE-3 draft, its paged KV pool, the draft
extend over every scheduled sequence's pending taps, and the batched draft steps.

Draft position p holds the pair (the target's taps at p, the token at p + 1), so the draft
lags the target by one position; a sequence's pending taps (`Sequence.spec.taps`) are the
target's at the positions it computed since the draft caught up. A step extends every
scheduled sequence over them in one forward, then runs the speculating sequences' draft
steps, one forward per step for all of them (spec/drafter.py, through a DraftStep over this
pool).
"""

from __future__ import annotations

import torch

from specscope.config import SpecConfig
from specscope.draft.eagle3 import Eagle3Draft
from specscope.engine.scheduler import Scheduled, Scheduler
from specscope.engine.sequence import Sequence
from specscope.kvcache.block_pool import BlockPool
from specscope.kvcache.paged import (
    BatchMeta,
    PagedKV,
    block_tables,
    padded_rows,
    tree_meta,
    upload,
    with_pieces,
)
from specscope.native.decoder import (
    NativeDraftChain,
    native_draft_chain,
    native_draft_extend,
    native_extend,
)
from specscope.profiler import Phase, Profiler
from specscope.sampling import LogitsAdjustment
from specscope.spec.drafter import DraftMask, chain_tree, draft_chain, draft_tree, greedy_only
from specscope.spec.tree import DraftTree


def draft_slots(spec: SpecConfig) -> int:
    """Draft positions a speculative step writes past the committed length: the chain's
    draft steps, or every tree step's beams (num_steps - 1 steps of topk slots)."""
    return max(spec.num_steps - 1, 1) * (1 if spec.topk == 1 else spec.topk)


class DraftRunner:
    """A draft over its own paged KV pool (pool index 1 of every sequence's block tables)."""

    def __init__(self, draft: Eagle3Draft, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool, max_model_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        dc = draft.config
        self.draft, self.device, self.block_size = draft, device, block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # One block past the pool's: the scratch block CUDA-graph padding rows write into.
        # Its KV heads on this rank (all of them unless the draft is sharded).
        self.kv = PagedKV(dc.num_layers, num_blocks + 1, block_size, draft.local_heads[1],
                          dc.head_dim, dtype, device)
        self.scratch_block = num_blocks
        self._target_ids: torch.Tensor | None = None
        draft.ensure_rope(max_model_len)

    def _pieces(self, meta: BatchMeta, pieces: list[tuple[int, int, int]],
                plans: dict | None = None) -> BatchMeta:
        return with_pieces(meta, pieces, *self.draft.local_heads, self.device, plans)

    def extend(self, items: list[Scheduled], spec_idx: list[int], scheduler: Scheduler
               ) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
        """One draft forward over every scheduled sequence's pending pairs: pair p is the
        target's taps at position p and the token at p + 1. Returns the draft's output at
        the last pair of each speculating sequence (h0, normed0 [S, Hd]: the pre-norm and
        normed hidden), whose logits predict its first draft token."""
        work = [it.seq for it in items if it.seq.spec is not None and
                it.seq.spec.taps is not None]
        if not work:
            assert not spec_idx, "a speculating sequence always has pending pairs"
            return ()
        ids, pos, rows, taps, last = [], [], [], [], {}
        for r, seq in enumerate(work):
            dc, P = seq.draft_computed, seq.spec.taps.shape[0]
            ids += seq.tokens(dc + 1, dc + 1 + P)
            pos += range(dc, dc + P)
            rows += [r] * P
            taps.append(seq.spec.taps)
            last[seq.seq_id] = len(pos) - 1
        dev = self.device
        taps_t = torch.cat(taps)
        nd = native_draft_extend(self.draft, taps_t, self.kv, max(pos) + 1)
        if nd is not None:  # the CPU's: one native call
            sel = [last[items[i].seq.seq_id] for i in spec_idx]
            heads = native_extend(nd, self.draft, self.kv, [s.block_tables[1] for s in work],
                                  ids, pos, rows, sel, taps_t)
            self._computed(work, scheduler)
            return heads if spec_idx else ()
        pos_t = upload(pos, torch.long, dev)
        meta = BatchMeta.causal(block_tables([s.block_tables[1] for s in work], dev),
                                upload(rows, torch.long, dev), pos_t, self.block_size,
                                max_len=max(pos) + 1)
        meta = self._pieces(meta, [(s.spec.taps.shape[0], r, s.draft_computed +
                                    s.spec.taps.shape[0]) for r, s in enumerate(work)])
        h, normed = self.draft(upload(ids, torch.long, dev)[None],
                               self.draft.project(taps_t[None]), pos_t[None], self.kv,
                               batch=meta)
        self._computed(work, scheduler)
        if not spec_idx:
            return ()
        sel = upload([last[items[i].seq.seq_id] for i in spec_idx], torch.long, dev)
        return h[0, sel], normed[0, sel]

    @staticmethod
    def _computed(work: list[Sequence], scheduler: Scheduler) -> None:
        """The extended sequences' pending pairs are in the draft's cache now."""
        for seq in work:
            P = seq.spec.taps.shape[0]
            seq.spec.taps = None
            scheduler.computed(seq, 0, P)

    def extend_static(self, ids: torch.Tensor, pos: torch.Tensor, count: torch.Tensor,
                      taps: torch.Tensor, tables: torch.Tensor, max_len: int,
                      plans: dict | None = None, heads: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The extend of b sequences at a fixed width W (the CUDA-graph step's): row s
        holds count[s] pending pairs, then padding. ids, pos [b, W] (the tokens after the
        pairs' positions, and the positions); taps [b * W, n_taps * H]; tables [b, blocks].
        Padding rows write their K/V into the scratch block, so only real pairs land in
        the cache. Returns h0 and normed0 [b, Hd] at each row's last pair (heads;
        else None: a plain step only keeps the draft's K/V current)."""
        b, W = ids.shape
        dev = ids.device
        rows = torch.arange(b, device=dev).repeat_interleave(W)
        meta = BatchMeta.causal(tables, rows, pos.reshape(-1), self.block_size,
                                max_len=max_len)
        real = (torch.arange(W, device=dev) < count[:, None]).reshape(-1)  # [b * W]
        meta.slots = torch.where(real, meta.slots, self.scratch_block * self.block_size)
        meta = self._pieces(meta, [(W, s, max_len) for s in range(b)], plans)
        h, normed = self.draft(ids.reshape(1, -1), self.draft.project(taps[None]),
                               pos.reshape(1, -1), self.kv, batch=meta)
        if not heads:
            return None
        last = torch.arange(b, device=dev) * W + count - 1  # [b]
        return h[0, last], normed[0, last]

    def trees(self, seqs: list[Sequence], h0: torch.Tensor, normed0: torch.Tensor,
              spec: SpecConfig, timer: Profiler | None = None,
              adjust: LogitsAdjustment | None = None, mask: DraftMask | None = None,
              stop: float = 0.0) -> DraftTree:
        """Every speculating sequence's chain or tree, each draft step one batched forward
        over the draft's paged KV. adjust: the sequences' logits adjustments over the
        target's vocabulary (None: none), applied to the draft's as to the target's; mask:
        the structured-output constraint, if any; stop: a chain's confidence stop
        (draft_chain; 0: off), which may end the chains before num_steps tokens."""
        dev = self.device
        n_host = [s.num_computed for s in seqs]  # each root's position
        slots = draft_slots(spec)
        if adjust is not None:
            adjust = adjust.in_vocab(self.target_ids)
        padded, width = padded_rows([s.block_tables[1] for s in seqs])
        S = len(seqs)
        # One upload for the tables, the roots' positions and the roots.
        flat = upload(padded + n_host + [s.last_token for s in seqs], torch.long, dev)
        return self.steps(flat[:S * width].view(S, width), flat[S * width:S * (width + 1)],
                          flat[S * (width + 1):], h0, normed0,
                          spec, [s.params for s in seqs], [s.generator for s in seqs],
                          [x + slots for x in n_host], timer, adjust=adjust, mask=mask,
                          stop=stop)

    @property
    def target_ids(self) -> torch.Tensor:
        """[Vd] int64: the target-vocabulary id of every draft-vocabulary token."""
        if self._target_ids is None:
            vd = self.draft.d2t.shape[0]
            self._target_ids = self.draft.to_target(torch.arange(vd, device=self.device))
        return self._target_ids

    def steps(self, tables: torch.Tensor, n: torch.Tensor, root: torch.Tensor,
              h0: torch.Tensor, normed0: torch.Tensor, spec: SpecConfig, params: list,
              generators: list, keys: list[int], timer: Profiler | None = None,
              plans: dict | None = None, adjust: LogitsAdjustment | None = None,
              mask: DraftMask | None = None, stop: float = 0.0) -> DraftTree:
        """The draft steps of S sequences: roots root [S] at positions n [S], their draft
        block tables [S, blocks], and keys[s] a host-known bound on the positions sequence
        s sees (a CUDA-graph step passes the context limit for every row). adjust: over
        the draft's vocabulary."""
        dev, bs = self.device, self.block_size
        S = n.shape[0]
        rows = torch.arange(S, device=dev)
        reach = max(keys)

        def step(tokens, hidden, rope, query_slots, ancestors):
            Q = tokens.shape[1]
            if query_slots is None:
                meta = BatchMeta.causal(tables, rows.repeat_interleave(Q), rope.reshape(-1),
                                        bs, max_len=reach)
            else:
                meta = tree_meta(tables, n, ancestors, bs, query_slots=query_slots,
                                 max_len=reach)
            meta = self._pieces(meta, [(Q, s, keys[s]) for s in range(S)], plans)
            h, normed = self.draft(tokens.reshape(1, -1), hidden.reshape(1, S * Q, -1),
                                   rope.reshape(1, -1), self.kv, batch=meta)
            return h.view(S, Q, -1), normed.view(S, Q, -1)

        if spec.topk == 1:
            nd = native_draft_chain(self.draft, h0, self.kv, reach) \
                if greedy_only(params, adjust, mask) else None
            if nd is not None:
                chain = NativeDraftChain(nd, self.draft, self.kv, tables, n, reach, h0,
                                         normed0, root, spec.num_steps, stop)
                return self._native_chain(chain, timer)
            return draft_chain(step, self.draft, h0, normed0, root, n, spec.num_steps, params,
                               generators, timer, adjust, mask, stop)
        return draft_tree(step, self.draft, h0, normed0, root, n, spec.num_steps, spec.topk,
                          spec.num_draft_tokens, params, timer, adjust, mask)

    @staticmethod
    def _native_chain(chain: NativeDraftChain, timer: Profiler | None) -> DraftTree:
        """Greedy chains' draft steps in one native call each (draft_chain's greedy path,
        bit-equal), marked per step as draft_chain marks them; the chains end early where
        the confidence stop ends them."""
        kept = chain.num_steps
        for j in range(1, chain.num_steps + 1):
            if timer:
                timer.mark(Phase.DRAFT_STEP, step=j)
            if not chain.step(j):
                kept = j - 1
                break
        if timer:
            timer.mark(Phase.TREE_BUILD)
        return chain_tree(chain.tokens[:, :kept + 1])
