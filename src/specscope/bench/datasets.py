"""Prompt workloads: the built-in evaluation sets, or any JSONL of prompts or conversations.

Accepted rows: OpenAI `messages` lists, ShareGPT `conversations` ({"from", "value"}),
MT-bench `turns` (the first turn is used), or a plain `prompt` / `question` / `text` field.
Chat-style rows become a single-turn conversation (the chat template applies); HumanEval
`prompt`s stay raw completion prompts (code continues the given function).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

BUILTIN = {"mt_bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl",
           "gsm8k": "gsm8k_test.jsonl"}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}

Prompt = str | list[dict[str, str]]


def _row_prompt(row: dict[str, Any], where: str) -> Prompt:
    if isinstance(row.get("messages"), list):
        msgs = [m for m in row["messages"] if m.get("role") != "assistant"]
        return msgs[: max(1, next((i + 1 for i, m in enumerate(msgs) if m["role"] == "user"),
                                  1))]
    if isinstance(row.get("conversations"), list):
        for turn in row["conversations"]:
            if _ROLES.get(turn.get("from", turn.get("role", ""))) == "user":
                return [{"role": "user", "content": turn.get("value", turn.get("content"))}]
    if isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": row["turns"][0]}]
    if "task_id" in row and isinstance(row.get("prompt"), str):  # HumanEval: raw code prompt
        return row["prompt"]
    for key in ("prompt", "question", "text", "instruction"):
        if isinstance(row.get(key), str) and row[key]:
            return [{"role": "user", "content": row[key]}]
    raise ValueError(f"{where}: no prompt found (expected messages, conversations, turns, "
                     f"prompt, question or text)")


def jsonl_objects(text: str, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each non-blank line of a JSONL text; errors name `name`:line.

    Lines end at "\n" alone: str.splitlines would also split at U+2028, U+0085 and the like,
    which JSON writers (ensure_ascii=False) leave raw inside strings."""
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{name}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        yield where, row


def load_prompts(dataset: str, num_prompts: int | None = None) -> list[Prompt]:
    """Prompts from a built-in set (mt_bench, humaneval, gsm8k) or a JSONL file path."""
    if dataset in BUILTIN:
        text = resources.files("specscope.data").joinpath(BUILTIN[dataset]).read_text()
        name = dataset
    else:
        path = Path(dataset).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset {dataset!r} is neither a built-in set "
                                    f"({', '.join(BUILTIN)}) nor a file")
        text, name = path.read_text(), str(path)
    prompts = []
    for where, row in jsonl_objects(text, name):
        prompts.append(_row_prompt(row, where))
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
    if not prompts:
        raise ValueError(f"{name}: no prompts")
    return prompts
