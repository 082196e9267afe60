"""The scheduler: which sequences run in the next step, with how many tokens, in which KV
blocks.

Every step packs, under `max_num_batched_tokens` and `max_num_seqs`:
- the running sequences first, oldest first: a decoding one feeds its last token, or, when it
  speculates, its whole draft tree (root + num_draft_tokens - 1 nodes, all verified in one
  forward); one still prefilling feeds its next chunk;
- then waiting sequences, oldest first (preempted ones at the front), each admitted with its
  prompt's cached prefix taken from the prefix cache and its first chunk scheduled.

KV blocks are reserved for every position a step may write, in every pool (the target's and
the draft's) at once, all or nothing. When they run out, the newest running sequence is
preempted: its blocks are released and it waits at the front of the queue, to be prefilled
again (prompt and output so far) when blocks free up. Nothing it produced is lost.

Prefix keys per pool (`block_key`): the target's K/V at position p depend on tokens 0..p;
the draft's, on tokens 0..p + 1. A sequence admitted with a cached prefix takes the shortest
hit over the pools, and never its last prompt token (the step must compute something to
sample from).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specscope.engine.sequence import Sequence, SequenceStatus
from specscope.kvcache.block_pool import ROOT_HASH, BlockPool, block_hash
from specscope.profiler.profiler import BATCH_BUCKETS


def block_key(parent: bytes, tokens: Seq[int], j: int, block_size: int, draft: bool) -> bytes:
    """The prefix-cache key of block j of a sequence, chained on its parent's key. A target
    block's K/V depend on its tokens and all before; a draft block's also on the token after
    it (the draft extend at position p takes token p + 1), so its key takes bs + 1 tokens."""
    end = (j + 1) * block_size + (1 if draft else 0)
    return block_hash(parent, tokens[j * block_size:end], b"draft" if draft else b"")


def block_keys(tokens: Seq[int], block_size: int, draft: bool, start: int = 0,
               parent: bytes = ROOT_HASH) -> list[bytes]:
    """Keys of blocks start, start + 1, ... up to the last whose key the tokens determine
    (`parent`: block start - 1's key)."""
    n = (len(tokens) - (1 if draft else 0)) // block_size
    out = []
    for j in range(start, n):
        parent = block_key(parent, tokens, j, block_size, draft)
        out.append(parent)
    return out


@dataclass
class Pool:
    """One model's blocks as the scheduler sees them: the pool, whether it holds the
    draft's K/V (keyed one token further, `block_key`), and the positions a speculative step
    writes from the sequence's computed length on (the target: the tree it verifies, which
    the scheduler counts anyway; the draft: its tree slots plus the extend's lag of one)."""

    blocks: BlockPool
    draft: bool = False
    spec_lookahead: int = 0


@dataclass
class Scheduled:
    """One sequence's share of a step. num_tokens: target tokens fed (a prefill chunk, 1 for
    a plain decode, the tree's size for a verify)."""

    seq: Sequence
    num_tokens: int
    speculative: bool = False


@dataclass
class StepPlan:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one or more block pools (target first).

    spec_tokens: the tree size (root included) a speculating sequence verifies per step, 0
    for plain decoding; a sequence speculates only when the whole tree and every pool's
    lookahead fit under max_model_len, otherwise it takes a plain step."""

    def __init__(self, pools: list[Pool], *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, spec_tokens: int = 0, chunked_prefill: bool = True) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max(max_num_seqs, spec_tokens, 1):
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must cover one step of "
                f"every sequence: at least max_num_seqs ({max_num_seqs}) and the tree size "
                f"({spec_tokens})")
        sizes = {p.blocks.block_size for p in pools}
        if len(sizes) != 1:
            raise ValueError(f"every pool must use one block size, got {sorted(sizes)}")
        self.pools = pools
        self.block_size = sizes.pop()
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len, self.spec_tokens = max_model_len, spec_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start

    # -- queues ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens + 1 > self.max_model_len:
            raise ValueError(f"sequence {seq.seq_id}: {seq.num_tokens} tokens leave no room "
                             f"under max_model_len {self.max_model_len}")
        need = -(-self.max_model_len // self.block_size)
        small = min(p.blocks.num_blocks for p in self.pools)
        if -(-(seq.num_tokens + 1) // self.block_size) > small:
            raise ValueError(f"sequence {seq.seq_id} needs more KV blocks than the pool holds "
                             f"({small}); raise the KV budget (a full context takes {need})")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, cancelled, disconnected): its blocks are released
        now, so the next step can use them."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        if seq.spec is not None:
            seq.spec.taps = None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        trees = self.max_trees()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            item = self._plan_running(seq, budget, trees > 0)
            trees -= item.speculative
            while not self._reserve(seq, item):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it was the newest: every later one is preempted too
            plan.scheduled.append(item)
            budget -= item.num_tokens
            i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        return plan

    def max_trees(self) -> int:
        """Trees one step may verify: as many as fit the token budget once padded to their
        batch-size bucket. A CUDA-graph verify runs the bucket's trees whole and computes
        every padded row's logits, the vocabulary wide; the activation reserve
        (kvcache/budget.py) holds the budget's rows of them, not twice that."""
        if self.spec_tokens <= 1:
            return 0
        fit = self.max_num_batched_tokens // self.spec_tokens
        if fit >= BATCH_BUCKETS[-1]:
            return fit
        return max((b for b in BATCH_BUCKETS if b <= fit), default=0)

    def _plan_running(self, seq: Sequence, budget: int, may_speculate: bool) -> Scheduled:
        if may_speculate and seq.num_uncomputed == 1 and self._can_speculate(seq) \
                and budget >= self.spec_tokens:
            return Scheduled(seq, self.spec_tokens, speculative=True)
        return Scheduled(seq, min(seq.num_uncomputed, budget))

    def _can_speculate(self, seq: Sequence) -> bool:
        if self.spec_tokens <= 1:
            return False
        reach = seq.num_computed + max(self.spec_tokens,
                                       max(p.spec_lookahead for p in self.pools))
        return reach <= self.max_model_len

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed == 0:
                self._take_cached_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.chunked_prefill:
                break
            item = Scheduled(seq, n)
            if not self._reserve(seq, item):
                # Wait for blocks, holding none: cached blocks pinned by a waiting sequence
                # would starve the running ones. The lookup is repeated next time.
                self._forget(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(item)
            budget -= n

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Take the longest prefix every pool has cached, below the sequence's last token."""
        self._ensure_tables(seq)
        if any(seq.block_tables) or not all(p.blocks.enable_prefix_caching for p in self.pools):
            return
        if seq.wants_prompt_logprobs:  # every prompt position's logits are needed
            return
        limit = (seq.num_tokens - 1) // self.block_size
        tokens = seq.token_ids
        hashes = [block_keys(tokens, self.block_size, p.draft)[:limit] for p in self.pools]
        hits = [p.blocks.lookup(h) for p, h in zip(self.pools, hashes, strict=True)]
        n = min(len(h) for h in hits)
        for p, h in zip(self.pools, hits, strict=True):
            p.blocks.release(h[n:])
        seq.block_tables = [h[:n] for h in hits]
        seq.block_hashes = [h[:n] for h in hashes]
        seq.registered = [n] * len(self.pools)
        seq.num_computed = seq.draft_computed = seq.num_cached = n * self.block_size

    def _ensure_tables(self, seq: Sequence) -> None:
        """Empty per-pool block tables and prefix keys for a sequence that holds none."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.pools]
            seq.registered = [0] * len(self.pools)
            seq.block_hashes = [[] for _ in self.pools]

    def _reserve(self, seq: Sequence, item: Scheduled) -> bool:
        """Blocks for every position this step may write, in every pool, or none at all."""
        self._ensure_tables(seq)
        need = []
        for p, table in zip(self.pools, seq.block_tables, strict=True):
            extra = p.spec_lookahead if item.speculative else 0
            end = seq.num_computed + max(item.num_tokens, extra)
            need.append(max(0, -(-end // self.block_size) - len(table)))
        if any(n > p.blocks.num_available for p, n in zip(self.pools, need, strict=True)):
            return False
        for p, table, n in zip(self.pools, seq.block_tables, need, strict=True):
            table.extend(p.blocks.allocate(n))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._forget(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def drain(self) -> list[Sequence]:
        """Take every unfinished sequence out, its blocks released and its KV to be
        recomputed (as after a preemption), in arrival order: to carry them into another
        engine (a new speculative configuration)."""
        seqs = sorted(self.running + list(self.waiting), key=lambda s: s.arrival)
        for seq in seqs:
            self._forget(seq)
            seq.status = SequenceStatus.WAITING
        self.running, self.waiting = [], deque()
        return seqs

    def _forget(self, seq: Sequence) -> None:
        """Release a sequence's blocks: its K/V (and the pending draft inputs computed from
        them) are to be computed again; its tokens and accept stats are kept."""
        self._release(seq)
        seq.num_computed = seq.draft_computed = seq.num_cached = 0
        if seq.spec is not None:
            seq.spec.taps = None

    def _release(self, seq: Sequence) -> None:
        for p, table in zip(self.pools, seq.block_tables, strict=False):
            p.blocks.release(table)
        seq.block_tables, seq.registered, seq.block_hashes = [], [], []

    # -- after the step -------------------------------------------------------------------------

    def computed(self, seq: Sequence, target: int, draft: int | None = None) -> None:
        """The step wrote `target` more positions of the sequence's target K/V (and `draft`
        of its draft K/V; default: the same as the target's). Blocks now full join the
        prefix cache. Call after the step's tokens are appended (a key needs its tokens)."""
        seq.num_computed += target
        seq.draft_computed += target if draft is None else draft
        for i, p in enumerate(self.pools):
            if not p.blocks.enable_prefix_caching:
                continue
            done = seq.draft_computed if p.draft else seq.num_computed
            full = min(done // self.block_size, len(seq.block_tables[i]))
            have = seq.registered[i]
            if full <= have:
                continue
            parent = seq.block_hashes[i][-1] if seq.block_hashes[i] else ROOT_HASH
            # Only when a block fills (once per block_size tokens): the key needs the prefix.
            keys = block_keys(seq.tokens(0, full * self.block_size + (1 if p.draft else 0)),
                              self.block_size, p.draft, have, parent)
            for j, key in enumerate(keys, start=have):
                p.blocks.register(seq.block_tables[i][j], key)
            seq.block_hashes[i].extend(keys)
            seq.registered[i] = have + len(keys)
