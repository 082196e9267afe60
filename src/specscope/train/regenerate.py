"""Regenerate the assistant turns of training conversations with the target itself.

A draft must learn the target's own distribution, not whoever wrote the dataset's answers,
so every assistant turn is replaced by the target's answer to the same history (the user
turns are kept). Generation is batched over conversations on the engine loop, over one
paged KV pool reused for every batch.

Output is JSONL in the OpenAI `messages` format, one line per finished conversation with its
input index. It is appended in chunks, each fsynced; a run killed mid-write leaves at most a
truncated last line, which `read_regenerated` drops, and a rerun continues after the last
whole chunk with the same per-chunk seeds (so a resumed file equals an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specscope.config import SamplingParams
from specscope.engine.engine import BatchConfig, Engine
from specscope.engine.sequence import Sequence
from specscope.models.registry import TargetModel
from specscope.sampling import make_generator
from specscope.train.data import Messages

log = logging.getLogger("specscope.train")


class BatchGenerator:
    """Batched generation on the engine loop (engine/engine.py), over one reused paged KV pool
    sized for `batch` sequences of `capacity` tokens: up to `batch` prompts per call, each
    continued until an EOS id or max_new_tokens. Prompts sharing a prefix (a system prompt)
    prefill it once, through the prefix cache."""

    def __init__(self, model: TargetModel, batch: int, capacity: int, *,
                 graphs: bool | None = None) -> None:
        dev = model.device
        bs = 16
        self.batch, self.capacity, self.device = batch, capacity, dev
        cfg = BatchConfig(num_blocks=batch * -(-(capacity + 1) // bs) + 1, block_size=bs,
                          max_num_batched_tokens=max(2048, batch), max_num_seqs=batch,
                          max_model_len=capacity + 1,
                          cuda_graphs=dev.type == "cuda" if graphs is None else graphs)
        self.engine = Engine(model, cfg)
        self._count = 0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
                 eos_ids: frozenset[int] | set[int], generator: torch.Generator | None
                 ) -> list[list[int]]:
        """The new ids per prompt (without the EOS). Sampled rows all draw from
        `generator`."""
        n = len(prompts)
        if not 0 < n <= self.batch:
            raise ValueError(f"BatchGenerator: {n} prompts for a batch of {self.batch}")
        Tp = max(len(p) for p in prompts)
        if Tp + max_new_tokens > self.capacity:
            raise ValueError(f"prompt of {Tp} tokens + {max_new_tokens} new exceeds the "
                             f"generator's capacity {self.capacity}")
        self.engine.eos = frozenset(eos_ids)
        p = dataclasses.replace(params, max_tokens=max_new_tokens, ignore_eos=False)
        seqs = []
        for prompt in prompts:
            self._count += 1
            seqs.append(Sequence(f"g{self._count}", list(prompt), p, generator))
            self.engine.add(seqs[-1])
        while self.engine.has_work:
            self.engine.step()
        return [s.output_ids[:-1] if s.output_ids and s.output_ids[-1] in eos_ids
                else s.output_ids for s in seqs]


def generate_batch(model: TargetModel, prompts: list[list[int]], max_new_tokens: int,
                   params: SamplingParams, eos_ids: frozenset[int] | set[int],
                   generator: torch.Generator | None) -> list[list[int]]:
    """One-off batched generation (a BatchGenerator sized to these prompts)."""
    cap = max(len(p) for p in prompts) + max_new_tokens
    gen = BatchGenerator(model, len(prompts), cap)
    return gen.generate(prompts, max_new_tokens, params, eos_ids, generator)


def read_regenerated(path: Path) -> dict[int, Messages]:
    """The whole lines of a (possibly interrupted) regeneration file, by input index.
    A truncated or unparsable last line is cut off the file so appends continue cleanly."""
    done: dict[int, Messages] = {}
    if not path.exists():
        return done
    raw = path.read_bytes()
    good = 0
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            obj = json.loads(line)
            done[int(obj["id"])] = obj["messages"]
        except (ValueError, KeyError, TypeError):
            break
        good += len(line)
    if good < len(raw):
        log.warning("%s: dropping %d bytes of an interrupted write", path, len(raw) - good)
        with path.open("r+b") as f:
            f.truncate(good)
    return done


def _user_rounds(conv: Messages) -> tuple[list[dict[str, Any]], int]:
    """The conversation without assistant turns, and how many user turns it has."""
    kept = [m for m in conv if m["role"] != "assistant"]
    return kept, sum(1 for m in kept if m["role"] == "user")


def regenerate(model: TargetModel, tokenizer: Any, conversations: list[Messages], out_path: Path,
               *, batch_size: int = 64, max_new_tokens: int = 512, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, max_prompt_len: int = 2048,
               chunk: int | None = None, progress: bool = True) -> list[Messages]:
    """Answer every user turn of every conversation with the target; returns the regenerated
    conversations in input order (skipping those whose prompt exceeds max_prompt_len).

    tokenizer: specscope Tokenizer (chat template, EOS ids). Resumes from `out_path`.
    """
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_regenerated(out_path)
    if done:
        log.info("regenerate: resuming, %d of %d conversations already in %s", len(done),
                 len(conversations), out_path)
    chunk = chunk or batch_size * 8
    dev = model.device
    todo_all = list(range(len(conversations)))
    answerer = _Answerer(model, tokenizer, params, batch_size, max_new_tokens, max_prompt_len)
    t0 = time.perf_counter()
    for c0 in range(0, len(todo_all), chunk):
        ids = [i for i in todo_all[c0:c0 + chunk] if i not in done]
        if not ids:
            continue
        # Per-chunk seeds: a resumed run draws what an uninterrupted one would have.
        gen = make_generator(seed * 1_000_003 + c0, dev) if not params.greedy else None
        finished = answerer.answer_chunk(conversations, ids, gen)
        done.update(finished)
        _append_chunk(out_path, finished)
        if progress:
            dt = time.perf_counter() - t0
            print(f"\rregenerate: {len(done)}/{len(conversations)} conversations, "
                  f"{answerer.new_tokens} new tokens, "
                  f"{answerer.new_tokens / max(dt, 1e-9):.0f} tok/s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    if answerer.skipped:
        log.warning("regenerate: skipped %d conversations whose prompt exceeds %d tokens",
                    answerer.skipped, max_prompt_len)
    return [done[i] for i in sorted(done)]


@dataclasses.dataclass
class _Answerer:
    """Answers the user turns of a chunk of conversations, round by round (every
    conversation's first user turn, then every second one, ...), in batches of similar
    prompt length over one BatchGenerator built on first use (one KV cache for all
    batches). Counts the conversations skipped for a too long prompt and the new tokens."""

    model: TargetModel
    tokenizer: Any
    params: SamplingParams
    batch_size: int
    max_new_tokens: int
    max_prompt_len: int
    generator: BatchGenerator | None = None
    skipped: int = 0
    new_tokens: int = 0

    def answer_chunk(self, conversations: list[Messages], ids: list[int],
                     gen: torch.Generator | None) -> dict[int, Messages]:
        """The regenerated conversations `ids` (in that order), less the skipped ones."""
        hist: dict[int, list[str]] = {i: [] for i in ids}
        users = {}
        for i in ids:
            kept, n_user = _user_rounds(conversations[i])
            users[i] = (kept, n_user)
        rounds = max(n for _, n in users.values())
        alive = set(ids)
        for r in range(rounds):
            prompts = self._round_prompts(r, users, hist, alive)
            self._answer(prompts, hist, gen)
        return {i: _interleave(users[i][0], hist[i]) for i in ids if i in alive}

    def _round_prompts(self, r: int, users: dict[int, tuple[Messages, int]],
                       hist: dict[int, list[str]], alive: set[int]
                       ) -> dict[int, tuple[Messages, list[int]]]:
        """Round r's prompts, (messages, token ids) by conversation: the conversation up to
        and including its user turn r, with the answers so far. A conversation whose prompt
        exceeds max_prompt_len is dropped from `alive` (and counted as skipped)."""
        prompts = {}
        for i in sorted(alive):
            kept, n_user = users[i]
            if r >= n_user:
                continue
            msgs = _interleave(_through_user_turn(kept, r), hist[i])
            p_ids = self.tokenizer.apply_chat_template(msgs)
            if len(p_ids) > self.max_prompt_len:
                alive.discard(i)
                self.skipped += 1
                continue
            prompts[i] = (msgs, p_ids)
        return prompts

    def _answer(self, prompts: dict[int, tuple[Messages, list[int]]],
                hist: dict[int, list[str]], gen: torch.Generator | None) -> None:
        """Generate an answer to every prompt, shortest first in batches of batch_size
        (similar lengths pad least), appending each decoded answer to its history."""
        order = sorted(prompts, key=lambda i: len(prompts[i][1]))
        for b0 in range(0, len(order), self.batch_size):
            rows = order[b0:b0 + self.batch_size]
            if self.generator is None:
                self.generator = BatchGenerator(self.model, self.batch_size,
                                                self.max_prompt_len + self.max_new_tokens)
            outs = self.generator.generate([prompts[i][1] for i in rows], self.max_new_tokens,
                                           self.params, self.tokenizer.eos_token_ids, gen)
            for i, o in zip(rows, outs, strict=True):
                hist[i].append(self.tokenizer.decode(o, skip_special_tokens=True))
                self.new_tokens += len(o)


def _through_user_turn(kept: Messages, r: int) -> Messages:
    """The messages of `kept` (a conversation without assistant turns) up to and including
    its user turn r (counted from 0)."""
    seen = 0
    prefix: Messages = []
    for m in kept:
        if m["role"] == "user":
            if seen == r:
                prefix.append(m)
                break
            seen += 1
        prefix.append(m)
    return prefix


def _append_chunk(out_path: Path, finished: dict[int, Messages]) -> None:
    """Append the chunk's conversations, one JSON line each with its input index, fsynced:
    a kill can leave at most a truncated last line, which read_regenerated drops."""
    lines = [json.dumps({"id": i, "messages": msgs}, ensure_ascii=False) + "\n"
             for i, msgs in finished.items()]
    with out_path.open("a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def _interleave(kept: Messages, answers: list[str]) -> Messages:
    """Insert answers[k] after the k-th user turn of `kept` (as many as there are answers)."""
    out: Messages = []
    k = 0
    for m in kept:
        out.append(m)
        if m["role"] == "user" and k < len(answers):
            out.append({"role": "assistant", "content": answers[k]})
            k += 1
    return out
