"""The batched engine loop: schedule -> one forward over the flattened batch -> sample ->
append -> free.

`Engine.step()` runs one step for every sequence the scheduler packs: prefill chunks and
decode tokens side by side in one forward over the paged KV cache, then one sample per
sequence whose piece reaches its last token, each with its own sampling params and
generator. The step's one device->host read is `_read`.

This is the plain-decoding half of the batched engine; the batched speculative cycle (draft
extend, draft steps and one verify for every speculating sequence) and the switch of `LLM`
and the server onto this loop are still to come (issue 19), so nothing drives it yet but its
tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.engine.scheduler import Pool, Scheduler, StepPlan
from specscope.engine.sequence import Sequence
from specscope.kvcache.block_pool import BlockPool
from specscope.kvcache.paged import BatchMeta, PagedKV
from specscope.sampling import make_generator, sample


@dataclass
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enable_prefix_caching: bool = True


@dataclass
class StepOutput:
    """What one step produced for one sequence: its new tokens and whether it finished."""

    seq: Sequence
    new_tokens: list[int]
    finished: bool


class Engine:
    """A target model served in batches over one paged KV pool."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        mc = model.config
        dev = model.model.embed_tokens.weight.device
        dtype = model.model.embed_tokens.weight.dtype
        self.model, self.config, self.device = model, config, dev
        self.eos = eos_token_ids
        self.pool = BlockPool(config.num_blocks, config.block_size,
                              config.enable_prefix_caching)
        self.kv = PagedKV(mc.num_layers, config.num_blocks, config.block_size,
                          mc.num_kv_heads, mc.head_dim, dtype, dev)
        self.scheduler = Scheduler([Pool(self.pool)],
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs,
                                   max_model_len=config.max_model_len)
        model.ensure_rope(config.max_model_len)

    def add(self, seq: Sequence) -> None:
        if seq.generator is None and not seq.params.greedy:
            seq.generator = make_generator(seq.params.seed, self.device)
        self.scheduler.add(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        logits, sampling = self._forward(plan)
        tokens = self._read(self._sample(logits, [plan.scheduled[i].seq for i in sampling]))
        out = []
        done_at = dict(zip(sampling, tokens, strict=True))
        for i, item in enumerate(plan.scheduled):
            seq = item.seq
            new = [done_at[i]] if i in done_at else []
            seq.output_ids += new
            self.scheduler.computed(seq, item.num_tokens)
            finished = bool(new) and self._stops(seq)
            if finished:
                self.scheduler.finish(seq, seq.finish_reason or "stop")
            out.append(StepOutput(seq, new, finished))
        return out

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """The flattened batch's forward; logits [S, V] at the last token of the S pieces
        that complete their sequence's uncomputed tokens (those sample), and their indices."""
        bs = self.config.block_size
        ids, pos, seq_idx, last, sampling = [], [], [], [], []
        width = max(len(it.seq.block_tables[0]) for it in plan.scheduled)
        tables = torch.zeros(len(plan.scheduled), width, dtype=torch.long)
        n = 0
        for i, item in enumerate(plan.scheduled):
            seq = item.seq
            a = seq.num_computed
            ids += seq.token_ids[a:a + item.num_tokens]
            pos += range(a, a + item.num_tokens)
            seq_idx += [i] * item.num_tokens
            tables[i, :len(seq.block_tables[0])] = torch.tensor(seq.block_tables[0])
            n += item.num_tokens
            if item.num_tokens == seq.num_uncomputed:
                last.append(n - 1)
                sampling.append(i)
        dev = self.device
        positions = torch.tensor(pos, device=dev)
        meta = BatchMeta.causal(tables.to(dev), torch.tensor(seq_idx, device=dev), positions,
                                bs, self.model.config.sliding_window)
        hidden, _ = self.model(torch.tensor(ids, device=dev)[None], positions[None], self.kv,
                               batch=meta)
        rows = hidden[0, torch.tensor(last, dtype=torch.long, device=dev)]
        return self.model.compute_logits(rows), sampling

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row, each with its sequence's params and generator; greedy rows in
        one argmax."""
        out = logits.argmax(-1)
        for r, seq in enumerate(seqs):
            if not seq.params.greedy:
                out[r] = sample(logits[r:r + 1], seq.params, seq.generator)[0]
        return out

    @staticmethod
    def _read(tokens: torch.Tensor) -> list[int]:
        """The step's one device->host read: the sampled token ids."""
        return tokens.tolist()

    def _stops(self, seq: Sequence) -> bool:
        t = seq.output_ids[-1]
        if (t in self.eos and not seq.params.ignore_eos) or t in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
            return True
        if len(seq.output_ids) >= seq.params.max_tokens or \
                seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"
            return True
        return False
