"""Prompts written by the target itself (the Magpie method), for training data.

An instruction-tuned model given its chat template up to an opened user turn, and nothing
after it, writes a user request: the kind of request it was tuned on. Sampling many of them
gives prompts from the target's own instruction distribution, which a draft then learns to
follow once the target has answered them (regenerate.py). This covers open-ended chat
(writing, advice, role-play, explanations) that task datasets such as gsm8k do not.

Kept: requests that ended with an end-of-turn token (not cut by the length limit), of
`min_chars`..`max_chars` characters, deduplicated on their normalised first 80 characters.

Openers steer the mix without writing the requests: with `openers` (e.g. "Write a", "Imagine
you are", "Explain why"), row i of every batch starts its user turn with openers[i mod m] and
the target writes the rest. Unseeded, a small model mostly asks short questions; seeded, it
also asks for the long-form writing, role-play and explanations that chat benchmarks contain.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from specscope.bench.datasets import jsonl_objects
from specscope.config import SamplingParams
from specscope.models.registry import TargetModel
from specscope.sampling import make_generator
from specscope.train.regenerate import BatchGenerator

log = logging.getLogger("specscope.train")

_MARKER = "\x1fSPECSCOPE_USER_TURN\x1f"


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user message's text would start
    (system prompt and user header included)."""
    hf = tokenizer.hf
    text = hf.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False,
                                  add_generation_prompt=False)
    cut = text.find(_MARKER)
    if cut <= 0:
        raise ValueError("the chat template does not place the user's text verbatim; "
                         "self-prompting needs a template that does")
    return list(hf(text[:cut], add_special_tokens=False)["input_ids"])


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()[:80]


def self_prompts(model: TargetModel, tokenizer: Any, n: int, *, temperature: float = 0.9,
                 top_p: float = 0.95, max_new_tokens: int = 160, batch_size: int = 256,
                 seed: int = 0, min_chars: int = 16, max_chars: int = 1500,
                 openers: list[str] | None = None, progress: bool = True) -> list[str]:
    """`n` distinct user requests sampled from the target (fewer only if 50 batches in a row
    add nothing new). Deterministic for a given seed, batch size and device. `openers`: the
    first words of the requests, one per row in turn (see the module docstring)."""
    if n <= 0:
        return []
    openers = [o.strip() for o in openers or [] if o.strip()]
    if temperature <= 0:
        raise ValueError("self-prompting needs sampling: temperature > 0 (greedy would write "
                         "the same request every time)")
    prefix = user_turn_prefix(tokenizer)
    eos = tokenizer.eos_token_ids
    if not eos:
        raise ValueError("the tokenizer has no end-of-turn token; self-prompting cannot tell "
                         "a finished request from a cut one")
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens)
    dev = model.device
    # The opener's tokens as the template would tokenise them after the user header.
    starts = [list(tokenizer.hf(o, add_special_tokens=False)["input_ids"]) for o in openers] \
        or [[]]
    row_starts = [starts[i % len(starts)] for i in range(batch_size)]
    gen = BatchGenerator(model, batch_size, len(prefix) + max(map(len, starts)) + max_new_tokens)
    seen: set[str] = set()
    out: list[str] = []
    t0, b, stale = time.perf_counter(), 0, 0
    while len(out) < n and stale < 50:
        g = make_generator(seed * 1_000_003 + b, dev)
        rows = gen.generate([prefix + st for st in row_starts], max_new_tokens, params, eos, g)
        before = len(out)
        for start, ids in zip(row_starts, rows, strict=True):
            if len(ids) >= max_new_tokens:  # no end-of-turn: cut off, not a whole request
                continue
            # Decoded with its opener, so a word split across the seam joins as tokenised.
            text = tokenizer.decode(start + ids, skip_special_tokens=True).strip()
            k = _key(text)
            if not min_chars <= len(text) <= max_chars or k in seen:
                continue
            seen.add(k)
            out.append(text)
            if len(out) == n:
                break
        stale = stale + 1 if len(out) == before else 0
        b += 1
        if progress:
            print(f"\rself-prompts: {len(out)}/{n} from {b * batch_size} samples "
                  f"({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    if len(out) < n:
        log.warning("self-prompts: only %d distinct requests of the %d asked for", len(out), n)
    return out


def write_prompts(path: Path, prompts: list[str]) -> None:
    """JSONL {"prompt": ...}, written under a temporary name, fsynced, then renamed: a file
    at `path` is always whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_prompts(path: Path) -> list[str]:
    """The prompts of a write_prompts file, in order."""
    return [row["prompt"] for _, row in jsonl_objects(path.read_text(encoding="utf-8"),
                                                      str(path))]


def read_openers(path: str | None) -> list[str] | None:
    """Openers from a text file, one per line (blank lines and lines starting with # are
    skipped); None without a file."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--self-prompt-openers: no such file: {path} (one opener per "
                                f"line, e.g. 'Write a short story about')")
    got = [ln.strip() for ln in p.read_text(encoding="utf-8").split("\n")
           if ln.strip() and not ln.lstrip().startswith("#")]
    if not got:
        raise ValueError(f"--self-prompt-openers: {path} has no openers (one per line)")
    return got
