"""Prompt workloads: the built-in evaluation sets, or any JSONL of prompts or conversations.

Accepted rows: OpenAI `messages` lists, ShareGPT `conversations` ({"from", "value"}),
MT-bench `turns` (the first turn is used), or a plain `prompt` / `question` / `text` field.
Chat-style rows become a single-turn conversation (the chat template applies); HumanEval
`prompt`s stay raw completion prompts (code continues the given function).

`specscope bench` also has two workloads of `vllm bench serve` (see `load_samples`), each a
list of `Sample`s, a prompt with its own output length:

- sharegpt: a ShareGPT JSON array (or JSONL) of {"conversations": [{"from", "value"}]}; the
  first human turn is the prompt, in file order. The output length is --sharegpt-output-len,
  else --max-tokens, else the first gpt answer's length estimated without a tokenizer as
  round(1.3 x its whitespace words) (English averages ~1.3 tokens a word).
- random: prompts of words drawn from a fixed vocabulary by `random.Random(seed)`, one word
  per token roughly (each is a common short word, one token with its leading space in the
  usual BPE vocabularies), sent as raw completion prompts; input and output lengths uniform
  in [L*(1-R), L*(1+R)].
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
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


# -- the bench's workloads: prompts with their own output lengths -------------------------

# Common short English words, each one token after a space in the usual BPE vocabularies
# (Llama, GPT-2, Qwen), so N of them make a prompt of about N tokens without a tokenizer.
_WORD_TEXT = """the of and to in is you that it he was for on are as with his they at be this
have from or one had by word but not what all were we when your can said there use an each
which she do how their if will up other about out many then them these so some her would
make like him into time has look two more write go see number no way could people my than
first water been call who its now find long down day did get come made may part"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Sample:
    """One benchmark request: the prompt and, when the workload sets it, its output length
    (the request's max_tokens; None: the run's --max-tokens)."""

    prompt: Prompt
    output_len: int | None = None


def check_count(available: int, num_prompts: int | None, name: str) -> None:
    """A workload shorter than --num-prompts is an error, not a smaller run: a result
    labelled with N prompts must have measured N."""
    if num_prompts is not None and available < num_prompts:
        raise ValueError(f"--num-prompts {num_prompts} is more than the {available} prompts "
                         f"{name} holds")


def estimate_tokens(text: str) -> int:
    """Tokens in `text` without its tokenizer: 1.3 per whitespace-separated word, at least 1."""
    return max(1, round(len(text.split()) * 1.3))


def _sharegpt_rows(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):  # not a JSON array: one conversation per line
        return list(jsonl_objects(text, str(path)))
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return [(f"{path}[{i}]", row) for i, row in enumerate(rows)]


def _sharegpt_turns(row: Any, where: str) -> tuple[str, str | None] | None:
    """(the first human turn, the first gpt answer after it or None); None when the first
    human turn is missing or empty (ShareGPT dumps hold such rows: they are skipped)."""
    if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
        raise ValueError(f'{where}: not a ShareGPT row (an object with a "conversations" list)')
    prompt = None
    for turn in row["conversations"]:
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        role = _ROLES.get(role) if isinstance(role, str) else None
        value = turn.get("value", turn.get("content"))
        if prompt is None and role == "user":
            if not isinstance(value, str) or not value.strip():
                return None
            prompt = value
        elif prompt is not None and role == "assistant":
            return prompt, value if isinstance(value, str) and value.strip() else None
    return None if prompt is None else (prompt, None)


def load_sharegpt(path: str | Path, num_prompts: int | None,
                  output_len: int | None = None) -> list[Sample]:
    """The first `num_prompts` usable conversations of a ShareGPT JSON array or JSONL, in file
    order. Output length: `output_len`, else the answer's `estimate_tokens`, else None (the
    run's default) for a conversation without an answer."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    samples: list[Sample] = []
    skipped = 0
    for where, row in _sharegpt_rows(path):
        turns = _sharegpt_turns(row, where)
        if turns is None:
            skipped += 1
            continue
        prompt, answer = turns
        n = output_len if output_len is not None else \
            (estimate_tokens(answer) if answer else None)
        samples.append(Sample([{"role": "user", "content": prompt}], n))
        if num_prompts is not None and len(samples) >= num_prompts:
            return samples
    if not samples:
        raise ValueError(f"{path}: no conversation with a human turn")
    check_count(len(samples), num_prompts,
                f"{path} ({skipped} rows without a human turn skipped)" if skipped else path)
    return samples


def _uniform_lens(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    # Integers uniform in [L(1-R), L(1+R)], vLLM's range; the epsilon keeps float noise
    # (100 * 1.1 = 110.00000000000001) from widening it by one.
    lo = max(1, math.floor(length * (1 - ratio) + 1e-9))
    hi = max(lo, math.ceil(length * (1 + ratio) - 1e-9))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_samples(num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[Sample]:
    """`num_prompts` raw prompts of about `input_len` tokens (that many words from WORDS),
    each asking for `output_len` tokens, both lengths drawn per request uniformly in
    [L*(1-R), L*(1+R)]; all from `random.Random(seed)`, so a seed gives the same workload."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"random input and output lengths must be >= 1, got {input_len} and "
                         f"{output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    ins = _uniform_lens(rng, num_prompts, input_len, range_ratio)
    outs = _uniform_lens(rng, num_prompts, output_len, range_ratio)
    return [Sample(" ".join(rng.choices(WORDS, k=i)), o) for i, o in zip(ins, outs, strict=True)]


def _check_dataset_flags(dataset: str, flags: dict[str, Any]) -> None:
    """A flag of another dataset than the chosen one is an error, so a mistyped command
    fails instead of measuring a workload nobody asked for."""
    owner = {"--dataset-path": "sharegpt", "--sharegpt-output-len": "sharegpt",
             "--random-input-len": "random", "--random-output-len": "random",
             "--random-range-ratio": "random"}
    stray = [f for f, v in flags.items() if v is not None and owner[f] != dataset]
    if stray:
        hint = " (a JSONL of prompts goes in --dataset FILE)" if "--dataset-path" in stray \
            else ""
        raise ValueError(f"{', '.join(stray)} apply only to --dataset "
                         f"{owner[stray[0]]}, not {dataset}{hint}")
    if dataset == "sharegpt" and flags["--dataset-path"] is None:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT JSON array "
                         "or JSONL)")


def load_samples(dataset: str, num_prompts: int, *, dataset_path: str | None = None,
                 max_tokens: int | None = None, sharegpt_output_len: int | None = None,
                 random_input_len: int | None = None, random_output_len: int | None = None,
                 random_range_ratio: float | None = None, seed: int = 0) -> list[Sample]:
    """`specscope bench`'s workload: exactly `num_prompts` samples of `dataset` (sharegpt,
    random, a built-in set or a JSONL path; fewer available is an error). `max_tokens` is
    None when --max-tokens was not given (sharegpt then estimates the output lengths)."""
    _check_dataset_flags(dataset, {
        "--dataset-path": dataset_path, "--sharegpt-output-len": sharegpt_output_len,
        "--random-input-len": random_input_len, "--random-output-len": random_output_len,
        "--random-range-ratio": random_range_ratio})
    if dataset == "sharegpt":
        fixed = sharegpt_output_len if sharegpt_output_len is not None else max_tokens
        return load_sharegpt(dataset_path, num_prompts, fixed)
    if dataset == "random":
        if max_tokens is not None:
            raise ValueError("--max-tokens does not apply to --dataset random: its output "
                             "length is --random-output-len")
        return random_samples(num_prompts,
                              1024 if random_input_len is None else random_input_len,
                              128 if random_output_len is None else random_output_len,
                              random_range_ratio or 0.0, seed)
    prompts = load_prompts(dataset, num_prompts)
    check_count(len(prompts), num_prompts, dataset)
    return [Sample(p) for p in prompts]
