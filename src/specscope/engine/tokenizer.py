"""Tokenizer access: encoding, chat templates, stop ids, and incremental detokenisation."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("specscope.tokenizer")

Messages = list[dict[str, Any]]


class Tokenizer:
    """A thin wrapper over a HF tokenizer loaded from a model directory."""

    def __init__(self, model_dir: Path | str, extra_eos_ids: tuple[int, ...] = ()) -> None:
        from transformers import AutoTokenizer  # tokenizers only; never modeling code

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            raise ValueError(f"could not load a tokenizer from {model_dir}: {e}") from e
        eos = set(extra_eos_ids)
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Encode a raw prompt, adding the special tokens (BOS) the model expects."""
        return list(self.hf(text)["input_ids"])

    def apply_chat_template(self, messages: Messages) -> list[int]:
        """Render `messages` with the model's chat template and an assistant turn opened."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass a plain "
                             "prompt instead of messages (or drop --chat)")
        validate_messages(messages)
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already holds any BOS it wants; adding special tokens would double it.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


class IdTokenizer:
    """For models without a tokenizer (random weights of a real shape, in benchmarks): the
    text of a token is its id in angle brackets; there is no EOS and no chat template."""

    eos_token_ids: frozenset[int] = frozenset()
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]

    def apply_chat_template(self, messages: Messages) -> list[int]:
        raise ValueError("this model has no tokenizer and no chat template")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def validate_messages(messages: Any) -> None:
    """Check the OpenAI message shape, naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError(f"messages[{i}] has unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a multi-byte character.

    Decoding token by token breaks characters that span several byte-level tokens (emoji,
    CJK) and drops the spaces that some tokenizers attach by context. So we decode a short
    window: the text of tokens[prefix:read] is already emitted, and the text of
    tokens[prefix:] minus that is the new delta — held back while it ends in U+FFFD, the
    replacement character a partial UTF-8 sequence decodes to.
    """

    # How many already-emitted tokens give context to the next decode.
    CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full_text = self.tok.decode(self.ids[self.prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            # Everything is emitted now; keep CONTEXT tokens of history so decodes stay O(1).
            self.ids = self.ids[max(len(self.ids) - self.CONTEXT, 0):]
            self.prefix = 0
            self.read = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: emit whatever is left, even a lone partial character."""
        full_text = self.tok.decode(self.ids[self.prefix:])
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self.read = len(self.ids)
        self.text += delta
        return delta
