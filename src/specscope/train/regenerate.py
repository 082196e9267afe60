"""Regenerate the assistant turns of training conversations with the target itself.

A draft must learn the target's own distribution, not whoever wrote the dataset's answers,
so every assistant turn is replaced by the target's answer to the same history (the user
turns are kept). Generation is batched over conversations with one KV cache per batch:
prompts are right-padded and each row writes its keys at its own positions, so pad slots
are overwritten before any query can see them (causal by position).

Output is JSONL in the OpenAI `messages` format, one line per finished conversation with its
input index. It is appended in chunks, each fsynced; a run killed mid-write leaves at most a
truncated last line, which `read_regenerated` drops, and a rerun continues after the last
whole chunk with the same per-chunk seeds (so a resumed file equals an uninterrupted one).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specscope.config import SamplingParams
from specscope.engine.cuda_graph import DecodeGraphs
from specscope.kvcache import KVCache
from specscope.models.llama import CausalLM
from specscope.sampling import make_generator, sample
from specscope.train.data import Messages

log = logging.getLogger("specscope.train")


class _Rows:
    """Rows [r0, r1) of a KVCache as a cache of their own (views: writes land in place)."""

    def __init__(self, cache: KVCache, r0: int, r1: int) -> None:
        self.k = [t[r0:r1] for t in cache.k]
        self.v = [t[r0:r1] for t in cache.v]
        self.capacity = cache.capacity
        self.batch = r1 - r0


class BatchGenerator:
    """Batched generation over one reused KV cache [batch, capacity].

    Prompts are right-padded; row b writes its keys at its own positions, so a query at
    position p only ever sees slots <= p, all written by this batch (pads and stale slots
    beyond p are masked by position). That makes any KV window >= the longest row valid, so
    decode steps run over windows rounded up to `window` slots: static shapes, which on CUDA
    are captured once per window as CUDA graphs and replayed for every batch (a batched
    decode step is hundreds of small kernels; launching them from Python dominated).
    Prefill runs in groups of `prefill_rows` rows to bound its attention memory.
    """

    def __init__(self, model: CausalLM, batch: int, capacity: int, *, window: int = 128,
                 graphs: bool | None = None, prefill_rows: int = 64) -> None:
        cfg = model.config
        w = model.model.embed_tokens.weight
        self.model, self.batch, self.capacity = model, batch, capacity
        self.window, self.prefill_rows = window, prefill_rows
        self.device = w.device
        model.ensure_rope(capacity)
        self.cache = KVCache(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim,
                             w.dtype, w.device)
        use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self.graphs = DecodeGraphs(self._step, self.device, batch=batch) if use_graphs \
            else None

    def _step(self, token: torch.Tensor, position: torch.Tensor, kv_len: int) -> torch.Tensor:
        hidden, _ = self.model(token, position, self.cache, kv_len=kv_len)
        return self.model.compute_logits(hidden[:, -1])  # [B, V]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
                 eos_ids: frozenset[int] | set[int], generator: torch.Generator | None
                 ) -> list[list[int]]:
        """Continue each prompt until an EOS id or max_new_tokens; the new ids per row
        (without the EOS). At most `batch` prompts; missing rows are idle padding."""
        n, B, dev = len(prompts), self.batch, self.device
        if not 0 < n <= B:
            raise ValueError(f"BatchGenerator: {n} prompts for a batch of {B}")
        Tp = max(len(p) for p in prompts)
        if Tp + max_new_tokens > self.capacity:
            raise ValueError(f"prompt of {Tp} tokens + {max_new_tokens} new exceeds the "
                             f"generator's capacity {self.capacity}")
        rows = prompts + [[0]] * (B - n)
        lens = torch.tensor([len(p) for p in rows], device=dev)
        ids = torch.zeros(B, Tp, dtype=torch.int64)
        for b, p in enumerate(rows):
            ids[b, :len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        logits = torch.empty(B, self.model.config.vocab_size, device=dev)
        for r0 in range(0, B, self.prefill_rows):
            r1 = min(B, r0 + self.prefill_rows)
            pos = torch.arange(Tp, device=dev).expand(r1 - r0, Tp)
            hidden, _ = self.model(ids[r0:r1], pos, _Rows(self.cache, r0, r1), kv_len=Tp)
            last = hidden[torch.arange(r1 - r0, device=dev), lens[r0:r1] - 1]  # [rows, H]
            logits[r0:r1] = self.model.compute_logits(last)
        eos = torch.tensor(sorted(eos_ids) or [-1], device=dev)
        out = torch.zeros(B, max_new_tokens, dtype=torch.int64, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        done[n:] = True
        steps = 0
        for s in range(max_new_tokens):
            tok = sample(logits, params, generator)  # [B]
            out[:, s] = tok
            steps = s + 1
            done |= torch.isin(tok, eos)
            # A host check every 8 steps: rows that finished early idle a few steps at most.
            if s + 1 == max_new_tokens or (s % 8 == 7 and bool(done.all())):
                break
            kv = min(self.capacity, -(-(Tp + s + 1) // self.window) * self.window)
            position = (lens + s)[:, None]
            if self.graphs is not None:
                logits = self.graphs.run(self.cache, tok[:, None], position, kv)
            else:
                logits = self._step(tok[:, None], position, kv)
        result = []
        for row in out[:n, :steps].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
            result.append(row[:cut])
        return result


def generate_batch(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                   params: SamplingParams, eos_ids: frozenset[int] | set[int],
                   generator: torch.Generator | None) -> list[list[int]]:
    """One-off batched generation (a BatchGenerator sized to these prompts)."""
    cap = max(len(p) for p in prompts) + max_new_tokens
    gen = BatchGenerator(model, len(prompts), cap, window=cap)
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


def regenerate(model: CausalLM, tokenizer: Any, conversations: list[Messages], out_path: Path,
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
    dev = model.model.embed_tokens.weight.device
    todo_all = list(range(len(conversations)))
    generator: BatchGenerator | None = None  # built on first use: one cache for all batches
    skipped = 0
    t0 = time.perf_counter()
    new_tokens = 0
    for c0 in range(0, len(todo_all), chunk):
        ids = [i for i in todo_all[c0:c0 + chunk] if i not in done]
        if not ids:
            continue
        gen = make_generator(seed * 1_000_003 + c0, dev) if not params.greedy else None
        hist = {i: [] for i in ids}
        users = {}
        for i in ids:
            kept, n_user = _user_rounds(conversations[i])
            users[i] = (kept, n_user)
        rounds = max(n for _, n in users.values())
        alive = set(ids)
        for r in range(rounds):
            prompts = {}
            for i in sorted(alive):
                kept, n_user = users[i]
                if r >= n_user:
                    continue
                # history so far + everything up to and including user turn r
                seen = 0
                prefix: Messages = []
                for m in kept:
                    if m["role"] == "user":
                        if seen == r:
                            prefix.append(m)
                            break
                        seen += 1
                    prefix.append(m)
                msgs = _interleave(prefix, hist[i])
                p_ids = tokenizer.apply_chat_template(msgs)
                if len(p_ids) > max_prompt_len:
                    alive.discard(i)
                    skipped += 1
                    continue
                prompts[i] = (msgs, p_ids)
            order = sorted(prompts, key=lambda i: len(prompts[i][1]))
            for b0 in range(0, len(order), batch_size):
                rows = order[b0:b0 + batch_size]
                if generator is None:
                    generator = BatchGenerator(model, batch_size,
                                               max_prompt_len + max_new_tokens)
                outs = generator.generate([prompts[i][1] for i in rows], max_new_tokens,
                                          params, tokenizer.eos_token_ids, gen)
                for i, o in zip(rows, outs, strict=True):
                    hist[i].append(tokenizer.decode(o, skip_special_tokens=True))
                    new_tokens += len(o)
        lines = []
        for i in ids:
            if i not in alive:
                continue
            kept, _ = users[i]
            msgs = _interleave(kept, hist[i])
            done[i] = msgs
            lines.append(json.dumps({"id": i, "messages": msgs}, ensure_ascii=False) + "\n")
        with out_path.open("a", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        if progress:
            dt = time.perf_counter() - t0
            print(f"\rregenerate: {len(done)}/{len(conversations)} conversations, "
                  f"{new_tokens} new tokens, {new_tokens / max(dt, 1e-9):.0f} tok/s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    if skipped:
        log.warning("regenerate: skipped %d conversations whose prompt exceeds %d tokens",
                    skipped, max_prompt_len)
    return [done[i] for i in sorted(done)]


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
