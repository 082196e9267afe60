"""Tensor parallelism in the engine loop: rank 0 schedules, every rank runs the step.

Rank 0's Scheduler plans each step as ever; `PlanSender` turns the plan into a
`StepMessage` and sends it on the control channel (parallel/channel.py), one broadcast per
step: per scheduled sequence its share of the step, its computed lengths, its length and
pending draft inputs (a divergence check), and the blocks its tables gained since the last
message; a sequence the ranks have not seen comes whole (tokens, sampling params, the
generator's state). Every other rank's engine holds a `MirrorScheduler`, which applies the
message to its copies of the sequences and returns the same StepPlan. From there each rank
runs the same step: the same block tables into its own paged KV (its heads only), the same
gathered logits, the same generators, hence the same tokens, which each rank appends
itself. Nothing comes back: rank 0's engine is the only one whose outputs reach a caller.

Rank 0 decides everything a step depends on that is not computed (admission, preemption,
prefix-cache hits, the policy's configuration, cancels); the message carries its results,
so the mirrors never schedule, allocate or hash anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specscope.config import SamplingParams, SpecConfig
from specscope.engine.scheduler import Scheduled, Scheduler, StepPlan
from specscope.engine.sequence import Sequence, SequenceStatus
from specscope.parallel.channel import Channel


@dataclass
class NewSeq:
    """A sequence the other ranks have not seen (or not since it was carried over)."""

    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    generator: torch.Tensor | None  # its state (a CPU byte tensor), None when greedy


@dataclass
class SeqPlan:
    seq_id: str
    num_tokens: int  # target tokens this step
    speculative: bool
    num_computed: int
    draft_computed: int
    length: int  # tokens the sequence holds on rank 0
    last: int  # its last token there (with length: a rank that sampled otherwise is caught)
    taps_rows: int  # pending draft-extend inputs on rank 0 (-1: none)
    tables: list[tuple[int, list[int]]]  # per pool: (entries kept, blocks appended)
    new: NewSeq | None = None


@dataclass
class StepMessage:
    items: list[SeqPlan]
    spec: SpecConfig | None  # the configuration this step runs (a policy's pick)
    dropped: list[str]  # sequences rank 0 ended since the last message


def _taps_rows(seq: Sequence) -> int:
    return -1 if seq.spec is None or seq.spec.taps is None else int(seq.spec.taps.shape[0])


class PlanSender:
    """Rank 0: each step's plan to the other ranks."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        # seq id -> per pool (the table list last described, its length then)
        self.sent: dict[str, list[tuple[list[int], int]]] = {}

    def send(self, plan: StepPlan, spec: SpecConfig | None, scheduler: Scheduler) -> None:
        live = {s.seq_id for s in scheduler.running}
        live.update(s.seq_id for s in scheduler.waiting)
        dropped = [sid for sid in self.sent if sid not in live]
        for sid in dropped:
            del self.sent[sid]
        items = [self._item(it) for it in plan.scheduled]
        self.channel.send(StepMessage(items, spec, dropped))

    def _item(self, it: Scheduled) -> SeqPlan:
        seq = it.seq
        prev = self.sent.get(seq.seq_id)
        new = None
        if prev is None:
            state = None if seq.generator is None else seq.generator.get_state()
            new = NewSeq(list(seq.prompt_ids), list(seq.output_ids), seq.params, state)
        tables = []
        for i, table in enumerate(seq.block_tables):
            # A table only grows until it is released, which replaces the list: the same
            # list means only its tail is new.
            same = prev is not None and i < len(prev) and prev[i][0] is table
            keep = prev[i][1] if same else 0
            tables.append((keep, table[keep:]))
        self.sent[seq.seq_id] = [(t, len(t)) for t in seq.block_tables]
        return SeqPlan(seq.seq_id, it.num_tokens, it.speculative, seq.num_computed,
                       seq.draft_computed, seq.num_tokens, seq.last_token, _taps_rows(seq),
                       tables, new)


class MirrorScheduler(Scheduler):
    """A rank other than 0: the plans rank 0 sends, applied to copies of its sequences.
    `incoming` is set by the rank's loop (engine/tp_worker.py) before each step."""

    def __init__(self, *args, rank: int, device: torch.device,
                 prepare: Callable[[Sequence], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank, self.device = rank, device
        # The engine's per-sequence device state (the logits adjustments' token counts),
        # built for a new copy as rank 0's engine built it at admission.
        self.prepare = prepare
        self.incoming: StepMessage | None = None
        self.spec: SpecConfig | None = None
        self.seqs: dict[str, Sequence] = {}

    def schedule(self) -> StepPlan:
        msg, self.incoming = self.incoming, None
        if msg is None:
            raise RuntimeError("a tensor-parallel rank stepped without rank 0's plan")
        for sid in msg.dropped:
            self.seqs.pop(sid, None)
        self.spec = msg.spec
        self.spec_tokens = msg.spec.num_draft_tokens if msg.spec is not None else 0
        plan = StepPlan([Scheduled(self._apply(it), it.num_tokens, it.speculative)
                         for it in msg.items])
        self.running = [s.seq for s in plan.scheduled]
        return plan

    def _apply(self, it: SeqPlan) -> Sequence:
        seq = self.seqs.get(it.seq_id)
        if seq is None:
            if it.new is None:
                raise RuntimeError(f"tensor-parallel rank {self.rank}: rank 0 scheduled "
                                   f"sequence {it.seq_id}, which this rank never saw")
            seq = self._create(it.seq_id, it.new)
        seq.block_tables = [(seq.block_tables[i][:keep] if i < len(seq.block_tables) else [])
                            + added for i, (keep, added) in enumerate(it.tables)]
        seq.num_computed, seq.draft_computed = it.num_computed, it.draft_computed
        seq.status = SequenceStatus.RUNNING
        here = _taps_rows(seq)
        if (seq.num_tokens, seq.last_token) != (it.length, it.last) or \
                (it.taps_rows >= 0 and here != it.taps_rows):
            raise RuntimeError(
                f"tensor-parallel rank {self.rank} diverged from rank 0: sequence "
                f"{it.seq_id} holds {seq.num_tokens} tokens (the last {seq.last_token}) and "
                f"{here} pending draft inputs here, {it.length} (the last {it.last}) and "
                f"{it.taps_rows} on rank 0")
        if it.taps_rows < 0 and seq.spec is not None:
            seq.spec.taps = None  # preempted or re-admitted on rank 0: recomputed
        return seq

    def _create(self, seq_id: str, new: NewSeq) -> Sequence:
        dev = self.device
        gen = None
        if new.generator is not None:
            gen = torch.Generator(device=dev)
            gen.set_state(new.generator)
        seq = Sequence(seq_id, list(new.prompt_ids), new.params, gen)
        seq.output_ids = list(new.output_ids)
        if self.prepare is not None:
            self.prepare(seq)
        self.seqs[seq_id] = seq
        return seq

    def add(self, seq: Sequence) -> None:
        raise RuntimeError("requests join on rank 0; its plans bring them to the others")

    def computed(self, seq: Sequence, target: int, draft: int | None = None) -> None:
        seq.num_computed += target
        seq.draft_computed += target if draft is None else draft

    def finish(self, seq: Sequence, reason: str) -> None:
        self.seqs.pop(seq.seq_id, None)
        if seq.spec is not None:
            seq.spec.taps = None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def drain(self) -> list[Sequence]:
        """Nothing to carry: rank 0 carries its sequences into the new engine, and they
        come here again whole."""
        self.seqs.clear()
        self.running = []
        return []
