"""Tokenizer access: encoding, chat templates, stop ids, and incremental detokenisation."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

from specscope.engine.messages import (
    check_unicode,
    dict_keys,
    for_template,
    mark,
    overlaps,
    user_spans,
    validate_messages,
)

log = logging.getLogger("specscope.tokenizer")

__all__ = ["IdTokenizer", "IncrementalDetokenizer", "Messages", "Tokenizer", "check_unicode",
           "validate_messages"]

Messages = list[dict[str, Any]]


class Tokenizer:
    """A thin wrapper over a HF tokenizer loaded from a model directory.

    User text (message contents, raw prompts) never becomes a control token: "<|im_end|>"
    typed by a user is encoded as the characters it is made of, while the chat template's
    own control tokens stay special (see `apply_chat_template`). Token-id prompts are the
    way to send control tokens on purpose.
    """

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
        self.control_tokens = _control_tokens(self.hf)
        self._control_ids = frozenset(self.control_tokens.values())
        longest_first = sorted(self.control_tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        self._plain, self._split = _backends(self.hf, model_dir, self.control_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja, the HF chat-template format) instead of the model's; it is
        compiled now, so a broken one fails at start-up, not on the first chat request."""
        check_chat_template(template)
        self.hf.chat_template = template

    def encode(self, text: str) -> list[int]:
        """Encode a raw prompt as plain text, adding the special tokens (BOS) the model expects.

        Control-token strings in `text` are split into ordinary tokens."""
        check_unicode(text, "prompt")
        return self._split.encode(text, add_special_tokens=True).ids

    def apply_chat_template(self, messages: Messages,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render `messages` (and the `tools` offered, OpenAI's shape) with the model's chat
        template and an assistant turn opened.

        The ids are those of tokenizing the rendered text, except that a control token
        lying in a message's or a tool's text is re-tokenized as plain text (see
        `_sanitize`)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass a plain "
                             "prompt instead of messages (or drop --chat)")
        validate_messages(messages)
        prepared = [for_template(m) for m in messages]
        self._check_keys(prepared)
        if tools:
            self._check_keys(tools, "tools")
        text = self._render(prepared, tools)
        # The template already holds any BOS it wants; adding special tokens would double it.
        enc = self._plain.encode(text, add_special_tokens=False)
        if not any(t in self._control_ids for t in enc.ids):
            return list(enc.ids)
        return self._sanitize(prepared, tools, text, list(enc.ids), enc.offsets)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _render(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                               add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"the model's chat template refused these messages: {e}") from None

    def _check_keys(self, value: Any, where: str = "messages") -> None:
        """Dict keys are rendered verbatim by some templates and cannot be marked (below), so
        a control token in one is refused outright."""
        for path, key in dict_keys(value, where):
            if (tok := self._control_in(key)) is not None:
                raise ValueError(f"{path} has a key holding the special token {tok!r}; "
                                 f"remove it")

    def _may_touch_control(self, text: str) -> bool:
        """Whether `text`, placed in the template, could be all or part of a control token:
        it holds one, lies inside one, or starts with the end / ends with the start of one."""
        if self._control_in(text) is not None:
            return True
        return any(text in c or any(text.startswith(c[k:]) or text.endswith(c[:k])
                                    for k in range(1, len(c)))
                   for c in self.control_tokens)

    def _control_in(self, text: str) -> str | None:
        """The first control-token string in `text`, if any."""
        found = self._control_re.search(text)
        return found.group(0) if found else None

    def _sanitize(self, messages: Messages, tools: list[dict[str, Any]] | None, text: str,
                  ids: list[int], offsets: list[tuple[int, int]]) -> list[int]:
        """Find the control tokens that came from user text and re-tokenize them as text.

        The template is rendered a second time with every user string replaced by a marker;
        substituting the strings back must give `text` exactly, which tells where each user
        string lies in it. A control token overlapping one of those spans is injected: the
        run between the template's own control tokens around it is re-tokenized with all
        control tokens split. Runs without an injected token keep their ids, so a
        conversation without injection gets the ids of tokenizing `text` as a whole.
        """
        leaves: list[tuple[str, str]] = []
        marked = [{k: v if k == "role" else mark(v, f"messages[{i}].{k}", leaves)
                   for k, v in m.items()} for i, m in enumerate(messages)]
        marked_tools = mark(tools, "tools", leaves) if tools else None  # user text too
        if not any(self._may_touch_control(v) for _, v in leaves):
            return ids  # no user string can be part of a control token: no second rendering
        try:
            marked_text = self._render(marked, marked_tools)
        except ValueError:
            marked_text = None  # e.g. a template that checks the length of a tool-call id
        spans = user_spans(marked_text, leaves, text) if marked_text is not None else None
        if spans is None:
            self._refuse_if_injected(leaves, ids, marked_text)
            return ids
        control = [j for j, t in enumerate(ids) if t in self._control_ids]
        injected = {j for j in control if overlaps(spans, *offsets[j])}
        if not injected:
            return ids
        return self._splice(text, ids, offsets, control, injected)

    def _splice(self, text: str, ids: list[int], offsets: list[tuple[int, int]],
                control: list[int], injected: set[int]) -> list[int]:
        """Keep the template's control tokens (`control` less `injected`: token indices) and
        the runs between them; re-tokenize as plain text each run holding an injected one."""
        out: list[int] = []
        lo, dirty = -1, False  # the last kept control token; whether the run since is dirty
        for j in [*control, len(ids)]:
            if j in injected:
                dirty = True
                continue
            if dirty:
                start = offsets[lo][1] if lo >= 0 else 0
                stop = offsets[j][0] if j < len(ids) else len(text)
                out += self._split.encode(text[start:stop], add_special_tokens=False).ids
            else:
                out += ids[lo + 1:j]
            out += ids[j:j + 1]
            lo, dirty = j, False
        return out

    def _refuse_if_injected(self, leaves: list[tuple[str, str]], ids: list[int],
                            marked_text: str | None) -> None:
        """The template alters user text, so its place is unknown: refuse a control token in
        user text if the rendering holds more control tokens than the template wrote."""
        found = next(((p, c) for p, v in leaves if (c := self._control_in(v)) is not None),
                     None)
        if found is None:
            return
        if marked_text is not None:
            own = Counter(t for t in self._plain.encode(marked_text, add_special_tokens=False).ids
                          if t in self._control_ids)
            seen = Counter(t for t in ids if t in self._control_ids)
            if not seen - own:
                return  # the template dropped the text that held it
        path, tok = found
        raise ValueError(f"{path} contains the special token {tok!r}; this model's chat "
                         f"template alters message text, so it cannot be kept as plain text: "
                         f"remove it, or send token ids to /v1/completions to use control "
                         f"tokens on purpose")


def _control_tokens(hf: Any) -> dict[str, int]:
    """The tokens user text must never produce: every special token, and every other added
    token except whitespace ones (some tokenizers add runs of newlines or spaces as tokens
    that plain text is meant to use)."""
    out = {c: i for c, i in zip(hf.all_special_tokens, hf.all_special_ids, strict=True)}
    for i, tok in hf.added_tokens_decoder.items():
        if tok.special or not tok.content.isspace():
            out[tok.content] = int(i)
    return out


def _backends(hf: Any, model_dir: Path | str, control: dict[str, int]) -> tuple[Any, Any]:
    """Two private copies of the fast tokenizer's backend: one as loaded, one that encodes
    every control token as plain text.

    transformers' `split_special_tokens=True` call argument flips `encode_special_tokens` on
    the one backend the HF tokenizer shares between threads: a concurrent call then runs in
    the wrong mode. These copies are configured once, here, and never changed again.
    """
    import tokenizers

    backend = getattr(hf, "_tokenizer", None)
    if not getattr(hf, "is_fast", False) or not isinstance(backend, tokenizers.Tokenizer):
        raise ValueError(f"the tokenizer in {model_dir} is not a fast tokenizer; specscope needs "
                         f"one (a tokenizer.json) to keep user text from becoming control "
                         f"tokens: save it with AutoTokenizer.from_pretrained(...)"
                         f".save_pretrained(dir)")
    state = json.loads(backend.to_str())
    plain = tokenizers.Tokenizer.from_str(json.dumps(state))
    for tok in state.get("added_tokens", []):
        if tok["content"] in control:
            tok["special"] = True  # so that encode_special_tokens splits it too
    split = tokenizers.Tokenizer.from_str(json.dumps(state))
    for copy, split_mode in ((plain, False), (split, True)):
        copy.encode_special_tokens = split_mode
        # A tokenizer.json may carry truncation or padding, which the HF tokenizer turns off
        # for each call made without them; these copies must not truncate a prompt either.
        copy.no_truncation()
        copy.no_padding()
    return plain, split


class IdTokenizer:
    """For models without a tokenizer (random weights of a real shape, in benchmarks): the
    text of a token is its id in angle brackets; there is no EOS and no chat template."""

    eos_token_ids: frozenset[int] = frozenset()
    has_chat_template = False

    def set_chat_template(self, template: str) -> None:
        raise ValueError("this model has no tokenizer: a chat template cannot apply")

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]

    def apply_chat_template(self, messages: Messages, tools: list | None = None) -> list[int]:
        raise ValueError("this model has no tokenizer and no chat template")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


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


def check_chat_template(template: str) -> None:
    """A ValueError naming the line unless `template` parses as Jinja."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None


def load_chat_template(value: str) -> str:
    """--chat-template: a file holding the template, or the template itself (vLLM's rule:
    an existing path is read; anything else with Jinja markup is the template)."""
    from pathlib import Path

    p = Path(value).expanduser()
    try:
        if p.is_file():
            return p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"could not read the chat template {value}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template "
                     f"(no {{{{ or {{% in it)")
