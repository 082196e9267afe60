"""The batched engine loop: schedule -> draft -> one target forward over the flattened batch
-> sample / verify -> commit -> append -> free.

`Engine.step()` runs one step for every sequence the scheduler packs. With a draft:

1. **draft extend**: one draft forward over every scheduled sequence's pending pairs (the
   target's taps at positions it computed since the draft last caught up, each with the
   token after it: a prefill chunk's, a plain step's, or a verify's accepted path);
2. **draft steps** for the speculating sequences, all in one batch per step: a chain, or an
   EAGLE-2 tree (spec/drafter.py);
3. **one target forward**: prefill chunks and plain decode tokens (causal) beside the
   speculating sequences' trees (tree mask), with taps;
4. one sample per plain sequence whose piece reaches its last token, and per speculating
   sequence a verification (greedy, lossless sampling, or simulated acceptance) giving its
   ragged accepted length and bonus token, each with its own sampling params and generator;
5. the **commit** of every accepted tree path into place (kvcache/paged.py); the path's
   taps become the next extend's pending pairs.

The step's one device->host read is `_read`: the sampled tokens, the accepted lengths and
the emitted tokens, in one tensor. Everything per request lives in its `Sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.config import SamplingParams, SpecConfig, SpecPolicy
from specscope.draft.eagle3 import Eagle3Draft
from specscope.engine.draft_runner import DraftRunner, draft_slots
from specscope.engine.scheduler import Pool, Scheduled, Scheduler, StepPlan
from specscope.engine.sequence import Sequence, SpecState
from specscope.kvcache.block_pool import BlockPool
from specscope.kvcache.paged import (
    BatchMeta,
    PagedKV,
    accepted_path_slots,
    block_tables,
    fast_backend_available,
    tree_meta,
    upload,
    with_pieces,
)
from specscope.profiler import Phase, Profiler
from specscope.sampling import make_generator, processed_logits, sample
from specscope.spec.simulate import simulated_verdict
from specscope.spec.tree import DraftTree
from specscope.spec.verify import emitted_tokens_batch, verify_greedy_batch, verify_sampling


@dataclass
class BatchConfig:
    """The batched engine's sizes: its KV pools (num_blocks of block_size tokens, in each
    model's pool) and the scheduler's budgets."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # replay plain decode steps as graphs per batch-size bucket
    compile: bool = False  # torch.compile the target's forward


@dataclass
class StepOutput:
    """What one step produced for one sequence: its new tokens and whether it finished.
    accepted: draft tokens accepted, for a speculative step (None for a plain one)."""

    seq: Sequence
    new_tokens: list[int]
    finished: bool
    accepted: int | None = None


@dataclass
class StepStats:
    """What one step carried (the profiler records it per step)."""

    num_seqs: int = 0
    num_speculating: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    verify_tokens: int = 0


@dataclass
class _TargetBatch:
    """The target forward's flattened batch: causal pieces (prefill chunks, plain decode
    tokens) first, then the trees. pieces: (item index, first row, rows) per causal piece;
    last_rows / sampling: the rows and item indices that sample a token."""

    ids: torch.Tensor
    rope: torch.Tensor
    meta: BatchMeta
    pieces: list[tuple[int, int, int]]
    last_rows: list[int]
    sampling: list[int]
    tree_base: int


@dataclass
class _Verdicts:
    """The speculating sequences' verification: path [S, k + 1], accepted [S], emitted
    [S, k + 1] (-1 padded), and the taps of the accepted path [S, k + 1, n_taps]."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    path_taps: torch.Tensor


class Engine:
    """A target model (and optionally an EAGLE-3 draft) served in batches over paged KV."""

    def __init__(self, model: torch.nn.Module, config: BatchConfig,
                 eos_token_ids: frozenset[int] = frozenset(), draft: Eagle3Draft | None = None,
                 spec: SpecConfig | None = None, policy: SpecPolicy | None = None) -> None:
        if (draft is None) != (spec is None):
            raise ValueError("speculative decoding needs both a draft and its SpecConfig")
        if policy is not None and spec is None:
            raise ValueError("a speculation policy needs a draft and its SpecConfig")
        mc = model.config
        dev = model.model.embed_tokens.weight.device
        dtype = model.model.embed_tokens.weight.dtype
        self.model, self.config, self.device, self.dtype = model, config, dev, dtype
        self.eos = eos_token_ids
        bs, nb = config.block_size, config.num_blocks
        self.pool = BlockPool(nb, bs, config.enable_prefix_caching)
        # One block past the pool's: the scratch block CUDA-graph padding rows write into.
        self.kv = PagedKV(mc.num_layers, nb + 1, bs, mc.num_kv_heads, mc.head_dim, dtype, dev)
        pools = [Pool(self.pool)]
        # spec: the configuration of the step being run (a policy picks one per step by
        # batch size; None: plain steps, the draft still kept up to date).
        self.draft, self.spec, self.spec_base, self.policy = draft, spec, spec, policy
        self.drafter: DraftRunner | None = None
        self.draft_pool: BlockPool | None = None
        configs = ([] if spec is None else policy.configs if policy is not None else [spec])
        if draft is not None:
            self.drafter = DraftRunner(draft, nb, bs, config.enable_prefix_caching,
                                       config.max_model_len, dtype, dev)
            self.draft_pool = self.drafter.pool
            reach = max([draft_slots(c) for c in configs] or [1])
            pools.append(Pool(self.draft_pool, draft=True, spec_lookahead=reach))
            model.set_taps(draft.config.aux_layer_ids)
            self._sim_rates: dict[SpecConfig, torch.Tensor | None] = {}
            self.sim_gen = torch.Generator(device=dev)
            self.reset_simulation()
        tree = max([c.num_draft_tokens for c in configs] or [0])
        self.scheduler = Scheduler(pools, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs,
                                   max_model_len=config.max_model_len, spec_tokens=tree)
        model.ensure_rope(config.max_model_len)
        self.timer: Profiler | None = None
        self.last_stats = StepStats()
        # The target's forward, compiled with dynamic shapes (the batch is ragged) or eager.
        self._target = torch.compile(model, dynamic=True) if config.compile else model
        self.graphs = None
        if dev.type == "cuda" and config.cuda_graphs and draft is None:
            from specscope.engine.cuda_graph import BatchGraphs

            def plan(lens: list[int]) -> object:
                from specscope.kvcache.triton_attention import build_tiles

                return build_tiles(lens, mc.num_heads, mc.num_kv_heads, dev)

            self.graphs = BatchGraphs(self._target, self.kv, bs, -(-config.max_model_len // bs),
                                      config.max_model_len, nb, dev, config.max_num_seqs,
                                      plan if fast_backend_available() else None)

    @property
    def sim_rates(self) -> torch.Tensor | None:
        """The active configuration's simulated acceptance rates (None: real acceptance)."""
        if self.spec not in self._sim_rates:
            rates = self.spec.acceptance_rates()
            self._sim_rates[self.spec] = None if rates is None else torch.tensor(
                rates, device=self.device)
        return self._sim_rates[self.spec]

    def reset_simulation(self) -> None:
        """Restart the simulated-acceptance random stream (identical accept decisions on
        identical workloads)."""
        if self.spec_base is not None:
            self.sim_gen.manual_seed(self.spec_base.simulate_seed)

    def _choose_spec(self) -> None:
        """The policy's configuration for this step's batch (the running sequences)."""
        if self.policy is None:
            return
        self.spec = self.policy.for_batch(max(len(self.scheduler.running), 1))
        self.scheduler.spec_tokens = self.spec.num_draft_tokens if self.spec else 0

    def add(self, seq: Sequence) -> None:
        if seq.generator is None and not seq.params.greedy:
            seq.generator = make_generator(seq.params.seed, self.device)
        self.scheduler.add(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (client gone, cancelled): its blocks are free for the next step."""
        self.scheduler.finish(seq, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def state(self) -> dict:
        """Queues, KV blocks and the prefix cache now (read from any thread: counters)."""
        sch, st = self.scheduler, self.pool.stats()
        return {"running": len(sch.running), "waiting": len(sch.waiting),
                "preemptions": sch.num_preemptions, "kv_blocks": st.num_blocks,
                "kv_blocks_in_use": st.in_use, "kv_blocks_cached": st.cached,
                "block_size": self.config.block_size,
                "prefix_queries": st.prefix_queries, "prefix_hits": st.prefix_hits}

    @staticmethod
    def _stats(items: list[Scheduled]) -> StepStats:
        st = StepStats(num_seqs=len(items))
        for it in items:
            if it.speculative:
                st.num_speculating += 1
                st.verify_tokens += it.num_tokens
            elif it.seq.num_uncomputed == 1:
                st.decode_tokens += 1
            else:
                st.prefill_tokens += it.num_tokens
        return st

    def _mark(self, phase: Phase, step: int | None = None) -> None:
        if self.timer is not None:
            self.timer.mark(phase, step)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self._choose_spec()
        plan = self.scheduler.schedule()
        self.last_stats = StepStats()
        if plan.empty:
            return []
        items = plan.scheduled
        spec_idx = [i for i, it in enumerate(items) if it.speculative]
        self.last_stats = self._stats(items)
        tree = None
        if self.draft is not None:
            self._mark(Phase.DRAFT_EXTEND)
            heads = self.drafter.extend(items, spec_idx, self.scheduler)
            if spec_idx:
                tree = self._draft_trees([items[i].seq for i in spec_idx], *heads)
        if self._graphable(items):
            return self._graph_decode(plan)
        batch = self._target_batch(items, spec_idx, tree)
        prefill = any(it.num_tokens > 1 and not it.speculative for it in items)
        self._mark(Phase.VERIFY if spec_idx else Phase.PREFILL if prefill else Phase.DECODE)
        hidden, taps = self._target(batch.ids[None], batch.rope[None], self.kv,
                                    batch=batch.meta, return_taps=self.draft is not None)
        if spec_idx:
            self._mark(Phase.ACCEPT)
        logits = self.model.compute_logits(hidden[0, batch.last_rows])
        sampled = self._sample(logits, [items[i].seq for i in batch.sampling])
        verdicts = None
        if spec_idx:
            verdicts = self._verify(items, spec_idx, tree, hidden[0, batch.tree_base:],
                                    taps[0, batch.tree_base:])
        counts, emitted = self._read(sampled, verdicts)
        if self.timer is not None:
            self.timer.stop()
        return self._update(plan, batch, spec_idx, counts, emitted, taps, verdicts)

    def _graphable(self, items: list[Scheduled]) -> bool:
        """A step of plain decode tokens only, within the captured buckets."""
        return (self.graphs is not None and len(items) <= self.graphs.max_batch and
                all(it.num_tokens == 1 == it.seq.num_uncomputed for it in items))

    def _graph_decode(self, plan: StepPlan) -> list[StepOutput]:
        items = plan.scheduled
        seqs = [it.seq for it in items]
        self._mark(Phase.DECODE)
        logits = self.graphs.run([s.last_token for s in seqs], [s.num_computed for s in seqs],
                                 [s.block_tables[0] for s in seqs])
        tokens, _ = self._read(self._sample(logits, seqs), None)
        if self.timer is not None:
            self.timer.stop()
        return [self._advance(s, [t], 1, None) for s, t in zip(seqs, tokens, strict=True)]

    def _draft_trees(self, seqs: list[Sequence], h0: torch.Tensor,
                     logits0: torch.Tensor) -> DraftTree:
        """Every speculating sequence's chain or tree (the seam tests replace)."""
        return self.drafter.trees(seqs, h0, logits0, self.spec, self.timer)

    # -- 3. the target forward ----------------------------------------------------------------

    def _target_batch(self, items: list[Scheduled], spec_idx: list[int],
                      tree: DraftTree | None) -> _TargetBatch:
        dev, bs = self.device, self.config.block_size
        window = self.model.config.sliding_window
        ids, pos, rows, pieces, last, sampling = [], [], [], [], [], []
        for i, item in enumerate(items):
            if item.speculative:
                continue
            seq, m = item.seq, item.num_tokens
            a = seq.num_computed
            pieces.append((i, len(ids), m))
            ids += seq.tokens(a, a + m)
            pos += range(a, a + m)
            rows += [i] * m
            if m == seq.num_uncomputed:
                last.append(len(ids) - 1)
                sampling.append(i)
        tables = self._tables([it.seq for it in items], 0)
        metas, base = [], len(ids)
        ids_t = upload(ids, torch.long, dev)
        rope = upload(pos, torch.long, dev)
        if pieces:
            metas.append(BatchMeta.causal(tables, upload(rows, torch.long, dev), rope, bs,
                                          window, max_len=max(pos) + 1))
        if spec_idx:
            n_host = [items[i].seq.num_computed for i in spec_idx]
            n = upload(n_host, torch.long, dev)
            tree_rope = n[:, None] + tree.depth  # [S, N]
            metas.append(tree_meta(tables, n, tree.ancestor_mask(self.spec.num_steps), bs,
                                   rows=upload(spec_idx, torch.long, dev), rope=tree_rope,
                                   sliding_window=window, max_len=max(n_host) + tree.size))
            ids_t = torch.cat([ids_t, tree.tokens.reshape(-1)])
            rope = torch.cat([rope, tree_rope.reshape(-1)])
        parts = [(m, i, items[i].seq.num_computed + m) for i, _, m in pieces]
        if spec_idx:
            parts += [(tree.size, i, n + tree.size) for i, n in zip(spec_idx, n_host,
                                                                    strict=True)]
        mc = self.model.config
        meta = with_pieces(BatchMeta.cat(metas), parts, mc.num_heads, mc.num_kv_heads,
                           self.device)
        return _TargetBatch(ids_t, rope, meta, pieces, last, sampling, base)

    # -- 4. sample and verify -----------------------------------------------------------------

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row, each with its sequence's params and generator; greedy rows in
        one argmax."""
        out = logits.argmax(-1)
        for r, seq in enumerate(seqs):
            if not seq.params.greedy:
                out[r] = sample(logits[r:r + 1], seq.params, seq.generator)[0]
        return out

    def _verify(self, items: list[Scheduled], spec_idx: list[int], tree: DraftTree,
                hidden: torch.Tensor, taps: torch.Tensor) -> _Verdicts:
        """Verify every tree, commit the accepted paths, gather their taps."""
        seqs = [items[i].seq for i in spec_idx]
        S, N, k = len(seqs), tree.size, self.spec.num_steps
        logits = self.model.compute_logits(hidden).view(S, N, -1)
        path, a, bonus = self._accept(seqs, tree, logits)
        self._mark(Phase.KV_COMMIT)
        if not tree.chain:  # a chain's accepted nodes already sit where they belong
            tables = self._tables(seqs, 0)
            n = upload([s.num_computed for s in seqs], torch.long, self.device)
            self.kv.commit(*accepted_path_slots(tables, n, path, self.config.block_size))
        node = path.clamp_min(0)[..., None].expand(S, k + 1, taps.shape[-1])
        path_taps = taps.view(S, N, -1).gather(1, node)
        return _Verdicts(a, emitted_tokens_batch(tree.tokens, path, a, bonus), path_taps)

    def _accept(self, seqs: list[Sequence], tree: DraftTree, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """path [S, k + 1], accepted [S], bonus [S]: greedy rows in one batched verify,
        sampled rows by lossless rejection with their own generator, or all rows by
        simulated acceptance."""
        spec, k = self.spec, self.spec.num_steps
        S = len(seqs)
        if self.sim_rates is None and all(s.params.greedy for s in seqs):
            return verify_greedy_batch(tree.tokens, tree.parents, tree.depth, logits, k,
                                       tree.chain)
        verdicts = []
        cols = spec.topk if spec.simulate_sibling > 0 and spec.topk > 1 else 1
        u = None if self.sim_rates is None else torch.rand(
            S, k, cols, generator=self.sim_gen, device=self.device)
        for r, seq in enumerate(seqs):
            p, g = seq.params, seq.generator
            probs = None if p.greedy else processed_logits(logits[r], p).softmax(-1)
            if u is not None:
                v = simulated_verdict(tree.row(r), logits[r], probs, self.sim_rates, u[r], k,
                                      spec.topk, g, spec.simulate_sibling)
            elif p.greedy:
                path, a, b = verify_greedy_batch(tree.tokens[r:r + 1], tree.parents[r:r + 1],
                                                 tree.depth[r:r + 1], logits[r:r + 1], k,
                                                 tree.chain)
                verdicts.append((path[0], a[0], b[0]))
                continue
            else:
                v = verify_sampling(tree.row(r), probs, k, spec.topk, g)
            verdicts.append((v.path, v.num_accepted, v.bonus))
        return tuple(torch.stack(x) for x in zip(*verdicts, strict=True))

    @staticmethod
    def _read(sampled: torch.Tensor, verdicts: _Verdicts | None
              ) -> tuple[list[int], list[list[int]]]:
        """The step's one device->host read: the sampled tokens, then each speculating
        sequence's accepted length and emitted tokens."""
        if verdicts is None:
            return sampled.tolist(), []
        S = verdicts.accepted.shape[0]
        flat = torch.cat([sampled, verdicts.accepted, verdicts.emitted.reshape(-1)]).tolist()
        P = sampled.shape[0]
        counts, rest = flat[P:P + S], flat[P + S:]
        width = verdicts.emitted.shape[1]
        emitted = [rest[r * width:r * width + a + 1] for r, a in enumerate(counts)]
        return flat[:P], emitted

    # -- 5. host bookkeeping ------------------------------------------------------------------

    def _update(self, plan: StepPlan, batch: _TargetBatch, spec_idx: list[int],
                sampled: list[int], emitted: list[list[int]], taps: torch.Tensor | None,
                verdicts: _Verdicts | None) -> list[StepOutput]:
        items = plan.scheduled
        out: dict[int, StepOutput] = {}
        tokens_at = dict(zip(batch.sampling, sampled, strict=True))
        for i, start, m in batch.pieces:
            seq = items[i].seq
            if taps is not None:
                self._pend(seq, taps[0, start:start + m])
            new = [tokens_at[i]] if i in tokens_at else []
            out[i] = self._advance(seq, new, m, None)
        for r, i in enumerate(spec_idx):
            seq, new = items[i].seq, emitted[r]
            a = len(new) - 1
            seq.spec.accepted.append(a)
            self._pend(seq, verdicts.path_taps[r, :a + 1])
            out[i] = self._advance(seq, new, a + 1, a)
        return [out[i] for i in range(len(items))]

    @staticmethod
    def _pend(seq: Sequence, taps: torch.Tensor) -> None:
        """Taps [P, n_taps] at the positions the target just computed: the next extend's."""
        if seq.spec is None:
            seq.spec = SpecState()
        seq.spec.taps = taps

    def _advance(self, seq: Sequence, new: list[int], computed: int,
                 accepted: int | None) -> StepOutput:
        """Append the step's tokens up to the first stop; register the computed positions,
        or end the sequence (its blocks are free for the next step)."""
        kept = []
        for t in new:
            seq.output_ids.append(t)
            kept.append(t)
            if self._stops(seq):
                self.scheduler.finish(seq, seq.finish_reason)
                return StepOutput(seq, kept, True, accepted)
        self.scheduler.computed(seq, computed, 0 if self.draft is not None else None)
        return StepOutput(seq, kept, False, accepted)

    def _stops(self, seq: Sequence) -> bool:
        t = seq.output_ids[-1]
        p: SamplingParams = seq.params
        if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
            seq.finish_reason = "stop"
            return True
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _tables(self, seqs: list[Sequence], pool: int) -> torch.Tensor:
        return block_tables([q.block_tables[pool] for q in seqs], self.device)
