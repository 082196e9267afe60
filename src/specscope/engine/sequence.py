"""A sequence: everything one request owns while the batched engine serves it.

The scheduler, the runner and the speculative cycle read and update sequences; none of them
keeps per-request state of its own. Host-side fields are plain Python (the engine knows every
length it fed, so no length is read back from the device); the speculative state between
cycles holds device tensors (the next draft extend's inputs), which a batched step gathers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from specscope.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted (its KV freed, to be recomputed)
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"  # done (stop, length, cancelled); its blocks are released


@dataclass
class SpecState:
    """A speculating sequence's draft-side state (all of it per request, none in the engine).

    taps [P, n_taps]: the pending draft-extend inputs, the target's taps at the P positions
    draft_computed .. num_computed - 1 (a prefill chunk's, a plain step's, or the accepted
    path of the last verify); the next step's extend pairs each with the token after it.
    accepted: draft tokens accepted per speculative step, drafted: the draft positions each
    step verified (accept length and acceptance by position come from them)."""

    taps: torch.Tensor | None = None
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)


@dataclass
class Sequence:
    """One request. `block_tables[i]` lists its blocks in pool i (0: the target's, 1: the
    draft's when there is one), in position order."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose target K/V are written (or taken from the cache)
    draft_computed: int = 0  # positions whose draft K/V are written (the extend lags by one)
    num_cached: int = 0  # of num_computed, from the prefix cache at its last admission
    block_tables: list[list[int]] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)  # per pool: leading blocks registered
    block_hashes: list[list[bytes]] = field(default_factory=list)  # per pool: their keys
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    spec: SpecState | None = None
    num_preemptions: int = 0
    # Structured output: an engine/grammar.py Grammar at the committed output (None: free).
    grammar: Any = None
    # The logits adjustments' device state (engine/logits.py TokenState); None: none asked.
    logits_state: object | None = None
    # With params.prompt_logprobs: the engine's entries (engine.TokenLogprobs) of prompt
    # tokens 1, 2, ... so far, each under the prompt before it (kept across preemptions).
    prompt_lp: list = field(default_factory=list)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet (its
        prompt is then computed in full: cached blocks would skip positions)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_lp) < len(self.prompt_ids) - 1)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a step's hot path reads a
        few tokens of a long sequence)."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P:end - P]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the target before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than the last token is uncomputed: the prompt (or, after a preemption, the
        prompt and the output so far) is being prefilled."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
