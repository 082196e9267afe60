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

Logits are adjusted (penalties, logit_bias, min_tokens) in one place, `_process`, before
sampling and before verification alike; in a verify every tree node gets the adjustment of
its own prefix (the sequence's tokens and its path's), so speculative output has exactly
plain decoding's law. Log-probabilities are the target's raw distribution (the logits'
log_softmax before any adjustment or filter, as vLLM's default `raw_logprobs`), read with
the tokens.

The step's one device->host read is `_read`: the sampled tokens, the accepted lengths, the
emitted tokens, any log-probabilities and, with a MoE target, each MoE layer's count of
distinct experts the forward activated, in one tensor. Everything per request lives in its
`Sequence`.

Under tensor parallelism (`tp`) every rank runs this loop over its shard of the model: rank
0 schedules and sends each step's plan; the others replay it (engine/step_broadcast.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.config import SamplingParams, SpecConfig, SpecPolicy
from specscope.draft.eagle3 import Eagle3Draft
from specscope.engine.draft_runner import DraftRunner, draft_slots
from specscope.engine.grammar import constrain_rows, constrain_trees, draft_constraint
from specscope.engine.logits import adjustment, count_emitted, plain_greedy, token_state
from specscope.engine.logprobs import (
    LogprobRows,
    TokenLogprobs,
    logprob_rows,
    prompt_logprob_rows,
    unpack_logprobs,
)
from specscope.engine.machine import inductor_cache_for_capability, resolve_confidence_stop
from specscope.engine.scheduler import Pool, Scheduled, Scheduler, StepPlan
from specscope.engine.sequence import Sequence, SpecState
from specscope.engine.step_broadcast import MirrorScheduler, PlanSender
from specscope.kvcache.block_pool import BlockPool
from specscope.kvcache.paged import (
    BatchMeta,
    accepted_path_slots,
    block_tables,
    chain_meta,
    chain_meta_host,
    long_tiles_available,
    tree_meta,
    upload,
    with_pieces,
)
from specscope.parallel.launch import TPRuntime
from specscope.profiler import Phase, Profiler
from specscope.sampling import (
    LogitsAdjustment,
    make_generator,
    path_counts,
    processed_logits,
    sample,
)
from specscope.spec.simulate import simulated_paths
from specscope.spec.tree import DraftTree
from specscope.spec.verify import (
    emitted_tokens_batch,
    verify_greedy_batch,
    verify_greedy_ids,
    verify_sampling,
)


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
    accepted: draft tokens accepted, for a speculative step (None for a plain one);
    drafted: the draft positions it verified (num_steps, or fewer where the confidence stop
    ended its chain). logprobs: one entry per new token when its params ask for logprobs
    (else None)."""

    seq: Sequence
    new_tokens: list[int]
    finished: bool
    accepted: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    drafted: int | None = None


@dataclass
class StepStats:
    """What one step carried (the profiler records it per step)."""

    num_seqs: int = 0
    num_speculating: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    verify_tokens: int = 0
    # MoE targets: distinct experts the step's target forward activated, mean over the MoE
    # layers (read with the step's one device->host read); None for a dense target.
    experts_active: float | None = None


@dataclass
class _TargetBatch:
    """The target forward's flattened batch: causal pieces (prefill chunks, plain decode
    tokens) first, then the trees. pieces: (item index, first row, rows) per causal piece;
    last_rows / sampling: the rows and item indices that sample a token."""

    ids: torch.Tensor
    rope: torch.Tensor
    meta: BatchMeta
    pieces: list[tuple[int, int, int]]
    last_rows: torch.Tensor  # [rows that sample] on the device
    sampling: list[int]
    tree_base: int
    # Prompt log-probabilities: the rows predicting prompt tokens, those tokens (device),
    # and per sequence how many (host).
    prompt_rows: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    prompt_seqs: list[tuple[Sequence, int]] | None = None


@dataclass
class _Verdicts:
    """The speculating sequences' verification: path [S, k + 1], accepted [S], emitted
    [S, k + 1] (-1 padded), and the taps of the accepted path [S, k + 1, n_taps]."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    path_taps: torch.Tensor
    logprobs: LogprobRows | None = None
    drafted: list[int] | None = None  # each chain's own length (DraftTree.lengths)


def end_profiled_cycle(prof: Profiler, stats: StepStats, outs: list[StepOutput]) -> None:
    """Close the profiler's cycle of one engine step: a decode/verify cycle with the step's
    counts, or, for a prefill-only step, a request phase (not a decode cycle)."""
    if stats.decode_tokens == 0 and stats.verify_tokens == 0:
        prof.end_as_request_phase()
        return
    spec = [o for o in outs if o.accepted is not None]
    prof.end_cycle(sum(len(o.new_tokens) for o in outs),
                   spec[0].accepted if len(spec) == 1 else None,
                   batch=stats.num_seqs, speculating=stats.num_speculating,
                   prefill_tokens=stats.prefill_tokens, decode_tokens=stats.decode_tokens,
                   verify_tokens=stats.verify_tokens,
                   accepted_all=tuple(o.accepted for o in spec),
                   drafted_all=tuple(o.drafted for o in spec),
                   experts_active=stats.experts_active)


class Engine:
    """A target model (and optionally an EAGLE-3 draft) served in batches over paged KV."""

    def __init__(self, model: torch.nn.Module, config: BatchConfig,
                 eos_token_ids: frozenset[int] = frozenset(), draft: Eagle3Draft | None = None,
                 spec: SpecConfig | None = None, policy: SpecPolicy | None = None,
                 tp: TPRuntime | None = None) -> None:
        if (draft is None) != (spec is None):
            raise ValueError("speculative decoding needs both a draft and its SpecConfig")
        if policy is not None and spec is None:
            raise ValueError("a speculation policy needs a draft and its SpecConfig")
        dev = model.device
        dtype = model.dtype
        self.model, self.config, self.device, self.dtype = model, config, dev, dtype
        self.eos = eos_token_ids
        bs, nb = config.block_size, config.num_blocks
        self.pool = BlockPool(nb, bs, config.enable_prefix_caching)
        # One block past the pool's: the scratch block CUDA-graph padding rows write into.
        self.kv = model.paged_kv(nb + 1, bs, dtype, dev)
        self.kv.scratch_block = nb
        # Prefill chunks in the fast attention's long tiles where this GPU holds them.
        self._long_tiles = long_tiles_available(model.config.head_dim, self.kv.k[0].dtype,
                                                dev)
        # MoE targets: the per-layer distinct-expert counts of the last forward (device).
        self._experts = getattr(model, "expert_activity", None)
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
        sizes = dict(max_num_batched_tokens=config.max_num_batched_tokens,
                     max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                     spec_tokens=tree)
        self.tp, self.sender = tp, None
        for c in configs:  # a confidence stop the ranks cannot share fails here, not mid-run
            resolve_confidence_stop(c, dev, tp.size if tp is not None else 1)
        if tp is not None and not tp.is_driver:
            self.scheduler: Scheduler = MirrorScheduler(pools, rank=tp.rank, device=dev,
                                                        prepare=self._prepare, **sizes)
        else:
            self.scheduler = Scheduler(pools, **sizes)
            self.sender = PlanSender(tp.channel) if tp is not None else None
        model.ensure_rope(config.max_model_len)
        self.timer: Profiler | None = None
        self.last_stats = StepStats()
        # The target's forward, compiled with dynamic shapes (the batch is ragged) or eager.
        if config.compile and dev.type == "cpu":
            inductor_cache_for_capability()
        self._target = torch.compile(model, dynamic=True) if config.compile else model
        self.graphs = self.spec_graphs = None
        if dev.type == "cuda" and config.cuda_graphs:
            self._make_graphs(capture=True)

    def retarget(self, spec: SpecConfig, policy: SpecPolicy | None = None) -> None:
        """Switch to another configuration (or policy) of this engine's draft between
        steps, keeping the KV pools, the requests in flight with their KV, and every captured
        graph (kept per configuration and bucket: switching back replays it). A tuner runs
        dozens of configurations; a new engine for each re-allocates every KV pool and
        re-captures every graph (0.8 s a switch on a 2-core CPU)."""
        if self.draft is None:
            raise ValueError("retarget: this engine has no draft; build one with the draft")
        configs = (policy.configs if policy is not None else []) or [spec]
        tree = max(c.num_draft_tokens for c in configs)
        if tree > self.config.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) "
                             f"must cover the tree size ({tree})")
        # Each configuration keeps its own simulated-acceptance stream, begun at the seed on
        # its first use as a new engine's would be: configurations compared in turn (a
        # tuner's confirmation, prompt by prompt) then draw the same numbers at the same
        # points of their runs, and none of them a stream restarted at every prompt.
        self._sim_streams[self.spec_base] = self.sim_gen.get_state()
        self.spec = self.spec_base = spec
        self.policy = policy
        for p in self.scheduler.pools:
            if p.draft:
                p.spec_lookahead = max(draft_slots(c) for c in configs)
        self.scheduler.spec_tokens = tree
        state = self._sim_streams.get(spec)
        if state is None:
            self.sim_gen.manual_seed(spec.simulate_seed)
        else:
            self.sim_gen.set_state(state)

    def _make_graphs(self, capture: bool) -> None:
        """The CUDA-graph steps (engine/cuda_graph.py): plain decode, and with a draft the
        pure speculative step. capture=False runs their static-shape functions eagerly
        (tests, on any device)."""
        from specscope.engine.cuda_graph import BatchGraphs, SpecGraphs

        c, mc, d = self.config, self.model.config, self.drafter
        max_blocks = -(-c.max_model_len // c.block_size)
        X = len(self.model.tap_layer_ids) * mc.hidden_size if d is not None else 0
        self.graphs = BatchGraphs(
            self._target, self.kv, c.block_size, max_blocks, c.max_model_len, c.num_blocks,
            self.device, c.max_num_seqs, None if d is None else d.extend_static, X,
            0 if d is None else d.scratch_block, capture)
        if d is not None:
            self.spec_graphs = SpecGraphs(
                self._draft_static, self._verify_static, c.block_size, max_blocks,
                c.max_model_len, c.num_blocks, d.scratch_block, X, self.dtype, self.device,
                c.max_num_seqs, capture)

    @property
    def sim_rates(self) -> torch.Tensor | None:
        """The active configuration's simulated acceptance rates (None: real acceptance)."""
        if self.spec not in self._sim_rates:
            rates = self.spec.acceptance_rates()
            self._sim_rates[self.spec] = None if rates is None else torch.tensor(
                rates, device=self.device)
        return self._sim_rates[self.spec]

    def reset_simulation(self) -> None:
        """Restart the simulated-acceptance random stream, every configuration's (identical
        accept decisions on identical workloads)."""
        if self.spec_base is not None:
            self._sim_streams: dict[SpecConfig, torch.Tensor] = {}
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
        self._prepare(seq)
        self.scheduler.add(seq)

    def _prepare(self, seq: Sequence) -> None:
        """A new sequence's device state. Built from the host tokens: also right for a
        sequence carried from another engine, or a tensor-parallel rank's copy."""
        seq.logits_state = token_state(seq, self.model.config.vocab_size, self.eos,
                                       self.device)

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

    def _plan(self) -> StepPlan:
        """This step's plan: scheduled here (and sent to the other tensor-parallel ranks),
        or, on a rank other than 0, rank 0's."""
        if isinstance(self.scheduler, MirrorScheduler):
            plan = self.scheduler.schedule()
            self.spec = self.scheduler.spec
            return plan
        self._choose_spec()
        plan = self.scheduler.schedule()
        if self.sender is not None and not plan.empty:
            self.sender.send(plan, self.spec, self.scheduler)
        return plan

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        plan = self._plan()
        self.last_stats = StepStats()
        if plan.empty:
            return []
        items = plan.scheduled
        spec_idx = [i for i, it in enumerate(items) if it.speculative]
        self.last_stats = self._stats(items)
        if self._spec_graphable(items, spec_idx):
            return self._graph_spec(items)
        if self._graphable(items):
            return self._graph_decode(plan)
        tree = adjust = None
        if self.draft is not None:
            self._mark(Phase.DRAFT_EXTEND)
            heads = self.drafter.extend(items, spec_idx, self.scheduler)
            if spec_idx:
                # Built once: the draft and the verify adjust by the same state.
                seqs = [items[i].seq for i in spec_idx]
                adjust = adjustment(seqs, self.device)
                tree = self._draft_trees(seqs, *heads, adjust)
                # What the verify takes: the confidence stop may have cut the chains short.
                self.last_stats.verify_tokens -= len(spec_idx) * (self.spec.num_draft_tokens
                                                                  - tree.size)
        prefill = any(it.num_tokens > 1 and not it.speculative for it in items)
        # The target forward's phase includes building its batch (ids, rope rows, the
        # paged cache's metadata): the forward's own input, not unnamed host time.
        self._mark(Phase.VERIFY if spec_idx else Phase.PREFILL if prefill else Phase.DECODE)
        batch = self._target_batch(items, spec_idx, tree)
        hidden, taps = self._target(batch.ids[None], batch.rope[None], self.kv,
                                    batch=batch.meta, return_taps=self.draft is not None)
        if spec_idx:
            self._mark(Phase.ACCEPT)
        seqs = [items[i].seq for i in batch.sampling]
        if seqs and plain_greedy(seqs):  # the head's argmax, no logits to process
            sampled, lps = self.model.greedy_ids(hidden[0, batch.last_rows]), None
            count_emitted(seqs, sampled[:, None])
        elif seqs:
            sampled, lps = self._sample_processed(
                self.model.compute_logits(hidden[0, batch.last_rows]), seqs)
        else:  # only verifies: no row samples, and a head over no rows still costs a call
            sampled, lps = batch.last_rows, None
        prompt_lps = self._prompt_logprobs(hidden[0], batch)
        verdicts = None
        if spec_idx:
            verdicts = self._verify(items, spec_idx, tree, adjust, hidden[0, batch.tree_base:],
                                    taps[0, batch.tree_base:])
        counts, emitted, logprobs = self._read(sampled, verdicts, lps, prompt_lps)
        if self.timer is not None:
            self.timer.stop()
        return self._update(items, batch.pieces, dict(zip(batch.sampling, counts, strict=True)),
                            spec_idx, emitted, taps, verdicts, logprobs)

    def _graphable(self, items: list[Scheduled]) -> bool:
        """A step of plain decode tokens only, within the captured buckets; with a draft,
        each sequence has one pending pair (its previous step was a decode step too)."""
        if self.graphs is None or len(items) > self.graphs.max_batch:
            return False
        if not all(it.num_tokens == 1 == it.seq.num_uncomputed and not it.speculative
                   for it in items):
            return False
        return self.draft is None or all(it.seq.spec is not None and
                                         it.seq.spec.taps is not None and
                                         it.seq.spec.taps.shape[0] == 1 for it in items)

    def _graph_decode(self, plan: StepPlan) -> list[StepOutput]:
        items = plan.scheduled
        seqs = [it.seq for it in items]
        self._mark(Phase.DECODE)
        draft = self.draft is not None
        pending = [s.spec.taps for s in seqs] if draft else None
        logits, taps = self.graphs.run(
            [s.last_token for s in seqs], [s.num_computed for s in seqs],
            [s.block_tables[0] for s in seqs],
            [s.block_tables[1] for s in seqs] if draft else None, pending)
        if draft:
            taps = taps.clone()  # the next replay overwrites the graph's output
            for seq in seqs:
                seq.spec.taps = None
                self.scheduler.computed(seq, 0, 1)
        sampled, lps = self._sample_processed(logits, seqs)
        tokens, _, logprobs = self._read(sampled, None, lps)
        if self.timer is not None:
            self.timer.stop()
        out = []
        for r, (s, t) in enumerate(zip(seqs, tokens, strict=True)):
            if draft:
                self._pend(s, taps[r:r + 1])
            out.append(self._advance(s, [t], 1, None, logprobs.get(s.seq_id)))
        return out

    def _spec_graphable(self, items: list[Scheduled], spec_idx: list[int]) -> bool:
        """A step of speculating greedy sequences only, each with at most a verify's worth of
        pending draft pairs (not the first step after a prefill), within the buckets. A
        sequence with logits adjustments or logprobs runs eagerly: the captured step has
        neither (the plain decode graph returns its logits, so there they apply after it)."""
        g = self.spec_graphs
        if g is None or not spec_idx or len(spec_idx) < len(items) or len(items) > g.max_batch:
            return False
        if self._confidence_stop():  # chains of any length: not the captured shapes
            return False
        width = self.spec.num_steps + 1
        # Constrained, adjusted and logprob sequences need work between draft steps or
        # around the verify that the captured step does not do: eager.
        return all(it.seq.params.greedy and it.seq.spec.taps.shape[0] <= width
                   and it.seq.logits_state is None and it.seq.params.logprobs is None
                   and it.seq.grammar is None for it in items)

    def _graph_spec(self, items: list[Scheduled]) -> list[StepOutput]:
        """A pure speculative step as two replays (engine/cuda_graph.py SpecGraphs): the
        draft segment (extend and draft steps), then the verify segment (target forward,
        accept, commit); each is one profiler phase."""
        seqs = [it.seq for it in items]
        S = len(seqs)
        self._mark(Phase.DRAFT)
        g = self.spec_graphs
        entry = g.entry(self.spec, S, self.sim_rates is not None)
        taps = [s.spec.taps for s in seqs]
        g.load(entry, seqs, taps, None if self.sim_rates is None else self._sim_uniforms(S))
        for seq, t in zip(seqs, taps, strict=True):
            seq.spec.taps = None
            self.scheduler.computed(seq, 0, t.shape[0])
        g.draft()
        self._mark(Phase.VERIFY_COMMIT)
        v = g.verify()
        # The next replay overwrites the graph's outputs: keep this step's path taps.
        verdicts = _Verdicts(v.accepted[:S], v.emitted[:S], v.path_taps[:S].clone())
        _, emitted, _ = self._read(v.accepted.new_empty(0), verdicts, None)
        if self.timer is not None:
            self.timer.stop()
        return self._update(items, [], {}, list(range(S)), emitted, None, verdicts, {})

    def _draft_static(self, ids: torch.Tensor, pos: torch.Tensor, count: torch.Tensor,
                      taps: torch.Tensor, tables: torch.Tensor, n: torch.Tensor,
                      root: torch.Tensor, plans: dict) -> DraftTree:
        """The draft segment of the CUDA-graph step at static shapes (b rows, pending pairs
        padded to num_steps + 1): the extend, then the draft steps of every row."""
        L, b = self.config.max_model_len, n.shape[0]
        h0, normed0 = self.drafter.extend_static(ids, pos, count, taps, tables, L, plans)
        return self.drafter.steps(tables, n, root, h0, normed0, self.spec,
                                  [SamplingParams()] * b, [None] * b, [L] * b, None, plans)

    def _verify_static(self, tree: DraftTree, n: torch.Tensor, tables: torch.Tensor,
                       u: torch.Tensor | None, plans: dict) -> _Verdicts:
        """The verify segment of the CUDA-graph step at static shapes: b trees in one
        target forward, greedy or simulated verdicts, the commit and the path's taps."""
        b, N = tree.tokens.shape
        L, mc = self.config.max_model_len, self.model.config
        rope = n[:, None] + tree.depth  # [b, N]
        meta = self._verify_meta(tree, tables, n, rope, mc.sliding_window, L)
        meta = with_pieces(meta, [(N, s, L) for s in range(b)], *self.model.local_heads,
                           self.device, plans)
        hidden, taps = self._target(tree.tokens.reshape(1, -1), rope.reshape(1, -1), self.kv,
                                    batch=meta, return_taps=True)
        y = self.model.greedy_ids(hidden[0]).view(b, N)  # the target's pick after each node
        if u is None:
            path, a, bonus = verify_greedy_ids(tree.tokens, tree.parents, tree.depth, y,
                                               self.spec.num_steps, tree.chain)
        else:
            path, a = self._simulate(tree, u)
            bonus = y.gather(1, path.gather(1, a[:, None]))[:, 0]
        return self._commit_paths(tree, path, a, bonus, taps[0], tables, n)

    def _verify_meta(self, tree: DraftTree, tables: torch.Tensor, n: torch.Tensor,
                     rope: torch.Tensor, window: int | None, max_len: int,
                     rows: torch.Tensor | None = None) -> BatchMeta:
        """The verify trees' attention metadata: a chain's in the causal form (chain_meta),
        which reads no tree mask, a tree's through its ancestor mask."""
        if tree.chain:
            return chain_meta(tables, n, tree.tokens.shape[1], self.config.block_size,
                              rows=rows, sliding_window=window, max_len=max_len)
        return tree_meta(tables, n, tree.ancestor_mask(self.spec.num_steps),
                         self.config.block_size, rows=rows, rope=rope,
                         sliding_window=window, max_len=max_len)

    def _commit_paths(self, tree: DraftTree, path: torch.Tensor, a: torch.Tensor,
                      bonus: torch.Tensor, taps: torch.Tensor, tables: torch.Tensor | None,
                      n: torch.Tensor | None) -> _Verdicts:
        """Move every accepted path into place (a chain's nodes already are) and gather
        the path's taps [S, k + 1, n_taps] and the emitted tokens. taps [S * N, n_taps].
        Past each path's accepted nodes the taps rows are unspecified (a chain's are its
        later nodes', a tree's its root's): only the first num_accepted + 1 are read."""
        S, N, k = tree.tokens.shape[0], tree.size, path.shape[1] - 1
        if tree.chain and k + 1 == N:  # node i is at depth i: the taps are in path order
            path_taps = taps.view(S, N, -1)
        else:
            if not tree.chain:
                self.kv.commit(*accepted_path_slots(tables, n, path, self.config.block_size))
            node = path.clamp_min(0)[..., None].expand(S, k + 1, taps.shape[-1])
            path_taps = taps.view(S, N, -1).gather(1, node)
        return _Verdicts(a, emitted_tokens_batch(tree.tokens, path, a, bonus), path_taps)

    def _draft_trees(self, seqs: list[Sequence], h0: torch.Tensor, normed0: torch.Tensor,
                     adjust: LogitsAdjustment | None) -> DraftTree:
        """Every speculating sequence's chain or tree (the seam tests replace), its draft
        distributions adjusted as the target's will be at each node, and constrained
        sequences' draft steps masked by their grammars."""
        mask = draft_constraint([s.grammar for s in seqs], self.drafter.target_ids)
        return self.drafter.trees(seqs, h0, normed0, self.spec, self.timer, adjust, mask,
                                  self._confidence_stop())

    def _confidence_stop(self) -> float:
        """The chains' confidence stop this step (0: every chain drafts num_steps)."""
        return resolve_confidence_stop(self.spec, self.device,
                                       self.tp.size if self.tp is not None else 1)

    def _depth(self, tree: DraftTree) -> int:
        """The deepest node a verified tree may hold: a chain's length (which the
        confidence stop may have cut short of num_steps), else num_steps."""
        return tree.size - 1 if tree.chain else self.spec.num_steps

    # -- 3. the target forward ----------------------------------------------------------------

    def _target_batch(self, items: list[Scheduled], spec_idx: list[int],
                      tree: DraftTree | None) -> _TargetBatch:
        dev, bs = self.device, self.config.block_size
        window = self.model.config.sliding_window
        ids, pos, rows, pieces, last, sampling = [], [], [], [], [], []
        p_rows, p_tokens, p_seqs = [], [], []
        for i, item in enumerate(items):
            if item.speculative:
                continue
            seq, m = item.seq, item.num_tokens
            a = seq.num_computed
            if seq.wants_prompt_logprobs:
                # Row j (position) predicts prompt token j + 1; those not yet recorded.
                lo, hi = max(a, len(seq.prompt_lp)), min(a + m, len(seq.prompt_ids) - 1)
                if hi > lo:
                    p_rows += range(len(ids) + lo - a, len(ids) + hi - a)
                    p_tokens += seq.prompt_ids[lo + 1:hi + 1]
                    p_seqs.append((seq, hi - lo))
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
            trees, tree_rope, n_host = self._trees_meta(items, spec_idx, tree, tables, window)
            metas.append(trees)
            ids_t = torch.cat([ids_t, tree.tokens.reshape(-1)]) if ids else \
                tree.tokens.reshape(-1)
            rope = torch.cat([rope, tree_rope]) if pos else tree_rope
        parts = [(m, i, items[i].seq.num_computed + m) for i, _, m in pieces]
        if spec_idx:
            parts += [(tree.size, i, n + tree.size) for i, n in zip(spec_idx, n_host,
                                                                    strict=True)]
        meta = with_pieces(BatchMeta.cat(metas), parts, *self.model.local_heads, self.device,
                           long_tiles=self._long_tiles)
        out = _TargetBatch(ids_t, rope, meta, pieces, upload(last, torch.long, dev), sampling,
                           base)
        if p_seqs:
            out.prompt_rows = upload(p_rows, torch.long, dev)
            out.prompt_tokens = upload(p_tokens, torch.long, dev)
            out.prompt_seqs = p_seqs
        return out

    def _trees_meta(self, items: list[Scheduled], spec_idx: list[int], tree: DraftTree,
                    tables: torch.Tensor, window: int | None
                    ) -> tuple[BatchMeta, torch.Tensor, list[int]]:
        """The verify trees' attention metadata, their nodes' rope positions [S * N] and
        each root's position (host). A chain's, in the causal form, comes from host lists
        in one upload (chain_meta_host: every position and slot is host-known); a tree's
        through its ancestor mask on the device."""
        dev = self.device
        n_host = [items[i].seq.num_computed for i in spec_idx]
        max_len = max(n_host) + tree.size
        if tree.chain:
            meta, rope = chain_meta_host(
                tables, [items[i].seq.block_tables[0] for i in spec_idx], spec_idx, n_host,
                tree.size, self.config.block_size, window, max_len)
            return meta, rope, n_host
        n = upload(n_host, torch.long, dev)
        rope = n[:, None] + tree.depth  # [S, N]
        meta = self._verify_meta(tree, tables, n, rope, window, max_len,
                                 upload(spec_idx, torch.long, dev))
        return meta, rope.reshape(-1), n_host

    # -- 4. sample and verify -----------------------------------------------------------------

    def _process(self, logits: torch.Tensor, seqs: list[Sequence],
                 tree: DraftTree | None = None, adj: LogitsAdjustment | None = None
                 ) -> torch.Tensor:
        """The one place a batch's target logits are adjusted before sampling or verify
        (penalties, logit_bias, min_tokens; rows without any pass as they were). logits
        [B, V], one row per sequence sampling; or [S, N, V] with `tree`: node i of tree s
        adjusted for its own prefix, the sequence's tokens then the path to i (its counts,
        and its depth for min_tokens), exactly what plain decoding uses there. adj: the
        batch's adjustment when the caller has it (a verify: the draft's), else built."""
        if tree is None:
            adj = adjustment(seqs, self.device)
        if adj is None:
            return logits
        if tree is None:
            return adj.apply(logits[:, None])[:, 0]
        anc = tree.ancestor_mask(self._depth(tree))  # [S, N, N]
        extra = path_counts(adj.take(tree.tokens), adj.take(anc), logits.shape[-1])
        return adj.apply(logits, extra, adj.take(tree.depth))

    def _sample_processed(self, logits: torch.Tensor, seqs: list[Sequence]
                          ) -> tuple[torch.Tensor, LogprobRows | None]:
        """Tokens [B] from the adjusted logits [B, V]; the log-probabilities of the rows that
        ask, from the raw ones; the tokens counted into their sequences' penalty state."""
        sampled = self._sample(self._process(logits, seqs), seqs)
        count_emitted(seqs, sampled[:, None])
        return sampled, self._logprobs(logits[:, None], sampled[:, None], seqs)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
                  ) -> LogprobRows | None:
        """The raw log-probabilities of tokens [B, W] under logits [B, W, V] for the rows
        whose params ask for logprobs (None: no row does)."""
        return logprob_rows(raw, tokens, seqs, self.device)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: _TargetBatch
                         ) -> LogprobRows | None:
        """The prompt tokens' raw log-probabilities at the rows of this step's prefill
        chunks that predict them (SamplingParams.prompt_logprobs). hidden [T, H]."""
        if batch.prompt_seqs is None:
            return None
        return prompt_logprob_rows(self.model, hidden, batch.prompt_rows, batch.prompt_tokens,
                                   batch.prompt_seqs)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row, each with its sequence's params and generator; greedy rows in
        one argmax. Constrained rows are masked by their grammars first."""
        logits = constrain_rows(logits, [s.grammar for s in seqs])
        out = logits.argmax(-1)
        for r, seq in enumerate(seqs):
            if not seq.params.greedy:
                out[r] = sample(logits[r:r + 1], seq.params, seq.generator)[0]
        return out

    def _verify(self, items: list[Scheduled], spec_idx: list[int], tree: DraftTree,
                adjust: LogitsAdjustment | None, hidden: torch.Tensor, taps: torch.Tensor
                ) -> _Verdicts:
        """Verify every tree, commit the accepted paths, gather their taps."""
        seqs = [items[i].seq for i in spec_idx]
        S, N = len(seqs), tree.size
        raw = None
        if adjust is None and self.sim_rates is None and plain_greedy(seqs):
            y = self.model.greedy_ids(hidden).view(S, N)  # the target's pick after each node
            path, a, bonus = verify_greedy_ids(tree.tokens, tree.parents, tree.depth, y,
                                               self._depth(tree), tree.chain)
        else:
            raw = self.model.compute_logits(hidden).view(S, N, -1)
            # Adjusted per node by its own prefix, then masked by its path's grammar state.
            logits = constrain_trees(self._process(raw, seqs, tree, adjust), tree.tokens,
                                     tree.parents, [s.grammar for s in seqs])
            path, a, bonus = self._accept(seqs, tree, logits)
        self._mark(Phase.KV_COMMIT)
        tables = n = None  # a chain's accepted nodes already sit in place: nothing to upload
        if not tree.chain:
            tables = self._tables(seqs, 0)
            n = upload([s.num_computed for s in seqs], torch.long, self.device)
        v = self._commit_paths(tree, path, a, bonus, taps, tables, n)
        v.drafted = tree.lengths
        count_emitted(seqs, v.emitted)
        if raw is not None and any(s.params.logprobs is not None for s in seqs):
            # Emitted token j comes after path node j: its row of the target's raw logits.
            node = path.clamp_min(0)[..., None].expand(-1, -1, raw.shape[-1])  # [S, k+1, V]
            v.logprobs = self._logprobs(raw.gather(1, node), v.emitted, seqs)
        return v

    def _accept(self, seqs: list[Sequence], tree: DraftTree, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """path [S, k + 1], accepted [S], bonus [S]: greedy rows in one batched verify,
        sampled rows by lossless rejection with their own generator, or all rows by
        simulated acceptance (one batched walk; sampled rows then draw their bonus)."""
        spec, k = self.spec, self._depth(tree)
        greedy = all(s.params.greedy for s in seqs)
        if self.sim_rates is not None:
            path, a = self._simulate(tree, self._sim_uniforms(len(seqs)))
            end = path.gather(1, a[:, None])  # [S, 1]
            bonus = logits.gather(1, end[..., None].expand(-1, 1, logits.shape[-1]))[:, 0] \
                .argmax(-1)
            end = end[:, 0]
            for r, seq in enumerate(seqs):
                if not seq.params.greedy:
                    # index_select: indexing by a 0-d device tensor reads it to the host
                    row = logits[r].index_select(0, end[r:r + 1])  # [1, V]
                    p = processed_logits(row, seq.params).softmax(-1)[0]
                    race = torch.empty_like(p).exponential_(generator=seq.generator)
                    bonus[r] = (p / race.clamp_min_(torch.finfo(p.dtype).tiny)).argmax(-1)
            return path, a, bonus
        if greedy:
            return verify_greedy_batch(tree.tokens, tree.parents, tree.depth, logits, k,
                                       tree.chain)
        verdicts = []
        for r, seq in enumerate(seqs):
            p, g, row = seq.params, seq.generator, tree.row(r)
            kr, rows = row.size - 1 if tree.chain else k, logits[r, :row.size]
            if p.greedy:
                path, a, b = verify_greedy_batch(row.tokens[None], row.parents[None],
                                                 row.depth[None], rows[None], kr, tree.chain)
                path, a, b = path[0], a[0], b[0]
            else:
                probs = processed_logits(rows, p).softmax(-1)
                v = verify_sampling(row, probs, kr, spec.topk, g)
                path, a, b = v.path, v.num_accepted, v.bonus
            if kr < k:  # a chain shorter than the batch's (its own stop): -1 past its end
                path = torch.cat([path, path.new_full((k - kr,), -1)])
            verdicts.append((path, a, b))
        return tuple(torch.stack(x) for x in zip(*verdicts, strict=True))

    def _sim_uniforms(self, S: int) -> torch.Tensor:
        """The simulated walk's uniforms for S sequences [S, k, C] (C: the ranks a draw
        covers), from the engine's simulation stream."""
        spec = self.spec
        cols = spec.topk if spec.simulate_sibling > 0 and spec.topk > 1 else 1
        return torch.rand(S, spec.num_steps, cols, generator=self.sim_gen, device=self.device)

    def _simulate(self, tree: DraftTree, u: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Simulated verdicts of every tree: path [S, k + 1], accepted [S]; the caller takes
        the bonus token at the path's end (device ops only: the CUDA-graph step runs it
        too)."""
        spec = self.spec
        return simulated_paths(tree.parents, self.sim_rates, u, spec.num_steps, spec.topk,
                               spec.simulate_sibling)

    def _read(self, sampled: torch.Tensor, verdicts: _Verdicts | None,
              lps: LogprobRows | None, prompt_lps: LogprobRows | None = None
              ) -> tuple[list[int], list[list[int]], dict[str, list[TokenLogprobs]]]:
        """The step's one device->host read: the sampled tokens, then each speculating
        sequence's accepted length and emitted tokens, then (MoE) each MoE layer's distinct
        experts, whose mean goes to last_stats.experts_active, then the log-probabilities
        (the sampled rows', the verified rows', by sequence id; the prompt rows' go straight
        to their sequences' prompt_lp). With log-probabilities in the step everything goes
        as fp64 (exact for token ids and counts), else as int64."""
        if self.timer is not None:  # the read waits for the device: the profiler's work now
            self.timer.idle()
        ints = [sampled] if verdicts is None else [sampled, verdicts.accepted,
                                                   verdicts.emitted.reshape(-1)]
        experts = self._experts() if self._experts is not None else None
        if experts is not None:
            ints.append(experts)
        packs = [x for x in (lps, verdicts.logprobs if verdicts else None, prompt_lps)
                 if x is not None]
        if packs:
            flat = torch.cat([t.double() for t in ints]
                             + [x.values.reshape(-1) for x in packs]).tolist()
            n_int = sum(t.numel() for t in ints)
            flat, floats = [int(x) for x in flat[:n_int]], flat[n_int:]
        else:
            flat = torch.cat(ints).tolist() if len(ints) > 1 else sampled.tolist()
            floats = []
        if experts is not None:
            n = experts.shape[0]
            flat, layers = flat[:-n], flat[-n:]
            self.last_stats.experts_active = sum(layers) / n
        P = sampled.shape[0]
        emitted: list[list[int]] = []
        if verdicts is not None:
            S = verdicts.accepted.shape[0]
            counts, rest = flat[P:P + S], flat[P + S:]
            width = verdicts.emitted.shape[1]
            emitted = [rest[r * width:r * width + a + 1] for r, a in enumerate(counts)]
        return flat[:P], emitted, unpack_logprobs(packs, floats)

    # -- 5. host bookkeeping ------------------------------------------------------------------

    def _update(self, items: list[Scheduled], pieces: list[tuple[int, int, int]],
                tokens_at: dict[int, int], spec_idx: list[int], emitted: list[list[int]],
                taps: torch.Tensor | None, verdicts: _Verdicts | None,
                logprobs: dict[str, list[TokenLogprobs]]) -> list[StepOutput]:
        """Every scheduled sequence's tokens and pending taps. pieces: the causal pieces
        (item, first row, rows); tokens_at: the token sampled per item; logprobs: per
        sequence id, one entry per emitted token (or more: cut to what is kept)."""
        out: dict[int, StepOutput] = {}
        for i, start, m in pieces:
            seq = items[i].seq
            if taps is not None:
                self._pend(seq, taps[0, start:start + m])
            new = [tokens_at[i]] if i in tokens_at else []
            out[i] = self._advance(seq, new, m, None, logprobs.get(seq.seq_id))
        depth = verdicts.emitted.shape[1] - 1 if verdicts is not None else 0
        for r, i in enumerate(spec_idx):
            seq, new = items[i].seq, emitted[r]
            a = len(new) - 1
            drafted = depth if verdicts.drafted is None else verdicts.drafted[r]
            seq.spec.accepted.append(a)
            seq.spec.drafted.append(drafted)
            self._pend(seq, verdicts.path_taps[r, :a + 1])
            out[i] = self._advance(seq, new, a + 1, a, logprobs.get(seq.seq_id))
            out[i].drafted = drafted
        return [out[i] for i in range(len(items))]

    @staticmethod
    def _pend(seq: Sequence, taps: torch.Tensor) -> None:
        """Taps [P, n_taps] at the positions the target just computed: the next extend's."""
        if seq.spec is None:
            seq.spec = SpecState()
        seq.spec.taps = taps

    def _advance(self, seq: Sequence, new: list[int], computed: int, accepted: int | None,
                 logprobs: list[TokenLogprobs] | None = None) -> StepOutput:
        """Append the step's tokens up to the first stop; register the computed positions,
        or end the sequence (its blocks are free for the next step)."""
        kept = []
        for t in new:
            seq.output_ids.append(t)
            kept.append(t)
            if self._stops(seq):
                self.scheduler.finish(seq, seq.finish_reason)
                return StepOutput(seq, kept, True, accepted,
                                  None if logprobs is None else logprobs[:len(kept)])
        self.scheduler.computed(seq, computed, 0 if self.draft is not None else None)
        return StepOutput(seq, kept, False, accepted,
                          None if logprobs is None else logprobs[:len(kept)])

    def _stops(self, seq: Sequence) -> bool:
        t = seq.output_ids[-1]
        p: SamplingParams = seq.params
        if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
            seq.finish_reason = "stop"
            return True
        if seq.grammar is not None and seq.grammar.advance(t):  # the grammar is complete
            seq.finish_reason = "stop"
            return True
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _tables(self, seqs: list[Sequence], pool: int) -> torch.Tensor:
        return block_tables([q.block_tables[pool] for q in seqs], self.device)
