"""Chat messages: their shape, and where each user string lies in a template's rendering.

`Tokenizer.apply_chat_template` renders messages twice, once as they are and once with each
user string replaced by a numbered marker; `user_spans` then finds the strings' character
spans in the real rendering, so that control tokens written by users can be told apart from
the template's own.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterator
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any) -> None:
    """Check the OpenAI message shape, naming what is wrong.

    Content is a string; an assistant message may have None (or no) content beside its
    tool_calls. `name`, `tool_calls` and `tool_call_id` are passed to the chat template,
    which may render them. All text must be valid Unicode (no lone surrogates)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        role = m["role"]
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has unknown role {role!r}")
        if m.get("content") is None and role == "assistant":
            pass  # e.g. beside tool_calls; rendered as ""
        elif "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        elif not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string (only an assistant "
                             f"message may have null content, beside tool_calls)")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list)
                                  or not all(isinstance(c, dict) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls must be a list of objects")
        _check_strings(m, f"messages[{i}]")


def check_unicode(text: str, where: str) -> None:
    """Refuse text that has no UTF-8 form: a lone UTF-16 surrogate, which JSON such as
    "\\ud800" decodes to and which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}; send valid Unicode") from None


def _check_strings(value: Any, path: str) -> None:
    if isinstance(value, str):
        check_unicode(value, path)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                check_unicode(k, f"{path} (a key)")
            _check_strings(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_strings(v, f"{path}[{j}]")


MARK_START, MARK_END = "\ue000", "\ue001"  # private-use characters no template alters
MARK_RE = re.compile(f"{MARK_START}([0-9]+){MARK_END}")


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message may have no content (beside tool_calls): render it as "". Keys
    set to None are dropped, as transformers 5 does, so every version renders the same."""
    out = {k: v for k, v in message.items() if v is not None}
    out.setdefault("content", "")
    return out


def mark(value: Any, path: str, leaves: list[tuple[str, str]]) -> Any:
    """`value` with each non-empty string replaced by a numbered marker, recorded in `leaves`.
    (An empty string cannot hold a control token, and templates test `if content`.)"""
    if isinstance(value, str):
        if not value:
            return value
        leaves.append((path, value))
        return f"{MARK_START}{len(leaves) - 1}{MARK_END}"
    if isinstance(value, dict):
        return {k: mark(v, f"{path}.{k}", leaves) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark(v, f"{path}[{j}]", leaves) for j, v in enumerate(value)]
    return value


def dict_keys(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every dict key in `value`, with the path of the dict holding it."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, str(k)
            yield from dict_keys(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from dict_keys(v, f"{path}[{j}]")


def user_spans(marked_text: str, leaves: list[tuple[str, str]],
               text: str) -> list[tuple[int, int]] | None:
    """Where the user strings lie in `text`, or None if the template altered them."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = last = 0
    for m in MARK_RE.finditer(marked_text):
        k = int(m.group(1))
        if k >= len(leaves):
            return None
        pieces.append(marked_text[last:m.start()])
        pos += m.start() - last
        value = leaves[k][1]
        pieces.append(value)
        spans.append((pos, pos + len(value)))
        pos += len(value)
        last = m.end()
    pieces.append(marked_text[last:])
    return spans if "".join(pieces) == text else None


def overlaps(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) overlaps one of `spans` (sorted, disjoint, non-empty)."""
    i = max(bisect.bisect_right(spans, (start, math.inf)) - 1, 0)
    while i < len(spans) and spans[i][0] < end:
        if spans[i][1] > start:
            return True
        i += 1
    return False
