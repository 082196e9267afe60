"""Training data for drafts: conversations in, token ids with an assistant-only loss mask out.

Accepted JSONL lines (one conversation each):
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}  (OpenAI)
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}  (ShareGPT)
    {"prompt": ...} | {"question": ...} | {"instruction": ..., "input": ...}  (a single prompt)
A prompt-only line becomes one user turn; regeneration (regenerate.py) adds the answer.

The mask comes from rendering the chat template twice per assistant turn: the conversation up
to that turn with the assistant header opened, and with the turn included. The tokens in
between (the answer and its end-of-turn marker) are the assistant's; everything else (system
prompt, user turns, template headers) is masked out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specscope.bench.datasets import jsonl_objects

Messages = list[dict[str, str]]

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                   "system": "system"}
_PROMPT_KEYS = ("prompt", "question", "instruction")


def parse_conversation(obj: Any, where: str) -> Messages:
    """One JSONL object -> OpenAI-style messages; raises naming `where` when it is neither."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: messages[{i}] must be {{'role': system|user|"
                                 f"assistant, 'content': str}}, got {str(m)[:80]}")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'conversations' must be a non-empty list")
        out = []
        for i, t in enumerate(turns):
            role = _SHAREGPT_ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) \
                else None
            if role is None or not isinstance(t.get("value"), str):
                raise ValueError(f"{where}: conversations[{i}] must be {{'from': human|gpt|"
                                 f"system, 'value': str}}, got {str(t)[:80]}")
            out.append({"role": role, "content": t["value"]})
        return out
    for key in _PROMPT_KEYS:
        if isinstance(obj.get(key), str) and obj[key].strip():
            text = obj[key]
            extra = obj.get("input")
            if key == "instruction" and isinstance(extra, str) and extra.strip():
                text = f"{text}\n\n{extra}"
            return [{"role": "user", "content": text}]
    raise ValueError(f"{where}: no 'messages', 'conversations' or prompt field "
                     f"({', '.join(_PROMPT_KEYS)}); keys are {sorted(obj)[:8]}")


def read_conversations(paths: list[str | Path]) -> list[Messages]:
    """Every conversation of every JSONL file, in order. Errors name file and line."""
    convs: list[Messages] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"training data {p} not found")
        for where, obj in jsonl_objects(p.read_text(encoding="utf-8"), str(p)):
            convs.append(parse_conversation(obj, where))
    if paths and not convs:
        raise ValueError(f"no conversations in {', '.join(str(p) for p in paths)}")
    return convs


@dataclass
class Example:
    """One tokenized conversation: ids and, per token, whether it is an assistant token."""

    ids: list[int]
    mask: list[bool]


def _assistant_texts(hf_tok: Any, messages: Messages) -> list[str]:
    """The chat-template texts tokenize_conversation needs: before and after each assistant
    turn, or the whole prompt when there is none."""
    texts = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            for part, open_turn in ((messages[:i], True), (messages[:i + 1], False)):
                texts.append(hf_tok.apply_chat_template(part, tokenize=False,
                                                        add_generation_prompt=open_turn))
    return texts or [hf_tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)]


def _example(renders: list[list[int]], max_len: int | None) -> Example:
    """An Example from the token ids of _assistant_texts' texts: (before, after) pairs, or
    the one prompt rendering of a conversation without an assistant turn."""
    if len(renders) == 1:  # nothing to learn, but keep the rendering for counting
        ids = list(renders[0])
        mask = [False] * len(ids)
    else:
        ids, mask = [], []
        for before, after in zip(renders[::2], renders[1::2], strict=True):
            if after[:len(before)] != before or before[:len(ids)] != ids:
                raise ValueError("the chat template is not prefix-stable, so assistant tokens "
                                 "cannot be located; train on plain prompts instead")
            mask += [False] * (len(before) - len(ids)) + [True] * (len(after) - len(before))
            ids = list(after)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return Example(ids=ids, mask=mask)


def tokenize_conversation(hf_tok: Any, messages: Messages, max_len: int | None = None
                          ) -> Example:
    """Chat-template ids of a whole conversation and its assistant-only loss mask (the
    reference path of tokenize_conversations).

    Raises if the template is not prefix-stable (a later render does not start with the
    earlier one), since the mask would then be wrong.
    """
    texts = _assistant_texts(hf_tok, messages)
    renders = [list(hf_tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return _example(renders, max_len)


def tokenize_conversations(hf_tok: Any, convs: list[Messages], max_len: int | None = None,
                           chunk: int = 2048) -> list[Example]:
    """tokenize_conversation over many conversations, the same Examples, faster: the texts of
    `chunk` conversations go to the tokenizer in one batched call, which a fast (Rust)
    tokenizer spreads over its threads; 120 k conversations took minutes one at a time."""
    out: list[Example] = []
    for start in range(0, len(convs), chunk):
        part = convs[start:start + chunk]
        texts = [_assistant_texts(hf_tok, m) for m in part]
        flat = [t for ts in texts for t in ts]
        ids = hf_tok(flat, add_special_tokens=False)["input_ids"] if flat else []
        k = 0
        for ts in texts:
            out.append(_example(ids[k:k + len(ts)], max_len))
            k += len(ts)
    return out


def check_answer_cap(n: int) -> int:
    """`n` if it is a valid --max-answer-tokens, else a ValueError saying so."""
    if n < 1:
        raise ValueError(f"--max-answer-tokens must be >= 1, got {n}")
    return n


def cap_answer_tokens(ex: Example, n: int) -> Example:
    """The example cut after its n-th assistant token (all assistant turns counted together).
    An engine that serves answers of about n tokens meets only their first n; training on
    the rest spends steps where it never drafts."""
    check_answer_cap(n)
    seen = 0
    for t, m in enumerate(ex.mask):
        seen += m
        if seen == n:
            return Example(ids=ex.ids[:t + 1], mask=ex.mask[:t + 1])
    return ex


def token_counts(examples: list[Example], vocab_size: int, chunk: int = 4096) -> torch.Tensor:
    """How often each target id appears as an assistant token. [V] int64"""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for start in range(0, len(examples), chunk):  # one bincount per chunk, not per example
        part = examples[start:start + chunk]
        sel = torch.tensor([t for ex in part for t, m in zip(ex.ids, ex.mask, strict=True)
                            if m], dtype=torch.int64)
        if sel.numel() and int(sel.max()) >= vocab_size:
            raise ValueError(f"token id {int(sel.max())} is outside the target's vocabulary "
                             f"({vocab_size}); the tokenizer does not match the model")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def split_examples(examples: list[Example], eval_fraction: float, seed: int,
                   max_eval: int = 256) -> tuple[list[Example], list[Example]]:
    """(train, held-out eval), a seeded random split."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = min(max_eval, int(round(len(examples) * eval_fraction)))
    if eval_fraction > 0 and len(examples) > 1:
        n_eval = max(n_eval, 1)
    held = set(order[:n_eval])
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [examples[i] for i in sorted(held)]


def token_batches(examples: list[Example], batch_tokens: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Indices grouped into batches of at most `batch_tokens` padded tokens.

    Sequences are shuffled by (seed, epoch), then sorted by length inside windows of 64
    batches' worth so padding stays small while batch order stays random; the same
    (seed, epoch) always gives the same batches (resume depends on it).
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    lengths = [len(e.ids) for e in examples]
    mean_len = max(1, sum(lengths) // max(1, len(lengths)))
    window = max(1, 64 * max(1, batch_tokens // mean_len))
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = lengths[i]
            if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids [B, T] int64, mask [B, T] bool); padding is never a label."""
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(examples), T), dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        mask[b, :len(e.mask)] = torch.tensor(e.mask)
    return ids, mask
