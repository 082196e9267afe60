"""A ServerConfig's per-request limits, each checked as early as it can be.

The prompt's length is bounded before it is tokenized or rendered: the vocabulary's longest
entry (in characters) bounds how much text one token can cover, and the chat template's own
tokens per message are measured once at start-up. A prompt that cannot fit is then refused
from its size alone, so no request makes the server tokenize megabytes only to say no.
"""

from __future__ import annotations

from typing import Any

from specscope.config import ServerConfig
from specscope.engine.llm import LLM
from specscope.server.schemas import APIError, ChatCompletionRequest, CompletionRequest


def max_token_chars(tokenizer: Any) -> int | None:
    """The longest token's text, in characters (None: unknown). A text of c characters is
    then at least ceil(c / this) tokens, which bounds a prompt's length before it is
    tokenized: each character of a byte-level BPE vocabulary entry is one byte, and a text's
    characters are never more than its bytes."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    try:
        return max(len(t) for t in hf.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None


def message_overhead(llm: LLM) -> int:
    """The fewest tokens the chat template adds for one more message, over the roles (0
    when unknown): measured once, from two renderings that differ by one message."""
    if not getattr(llm.tokenizer, "has_chat_template", False):
        return 0
    try:
        least = None
        for role in ("user", "assistant", "system"):
            one = [{"role": "user", "content": "a"}]
            two = one + [{"role": role, "content": "a"}]
            extra = len(llm.encode_prompt(two, chat=True)) - len(llm.encode_prompt(one, chat=True))
            least = extra - 1 if least is None else min(least, extra - 1)  # minus the "a"
        return max(least or 0, 0)
    except (ValueError, TypeError):  # a template that refuses such a conversation
        return 0


class PromptLimits:
    """The per-request limits of a ServerConfig, checked as early as each can be."""

    def __init__(self, llm: LLM, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.max_prompt = min(cfg.max_prompt_tokens or llm.max_model_len - 1,
                              llm.max_model_len - 1)
        self.context = llm.max_model_len
        self.token_chars = max_token_chars(llm.tokenizer)
        self.per_message = message_overhead(llm)

    def check_chars(self, chars: int, field: str, messages: int = 0) -> None:
        """Before tokenization: a prompt too long to fit whatever its tokens turn out to be.
        messages: each costs at least the template's own tokens for one (a 4 MB body of
        131k tiny messages would otherwise be rendered in full before it is refused)."""
        if self.token_chars is None:
            return
        at_least = -(-chars // self.token_chars) + messages * self.per_message
        if at_least > self.max_prompt:
            raise APIError(400, f"the prompt ({chars} characters"
                           f"{f' in {messages} messages' if messages else ''}, so at least "
                           f"{at_least} tokens) is longer than this server's limit of "
                           f"{self.max_prompt} prompt tokens; shorten it", param=field,
                           code="context_length_exceeded")

    def check_tokens(self, n: int, field: str) -> None:
        if n > self.max_prompt:
            where = "the model's context length" if self.max_prompt == self.context - 1 \
                else "this server's limit (--max-prompt-tokens)"
            raise APIError(400, f"the prompt ({n} tokens) is longer than {where} allows "
                           f"({self.max_prompt} tokens with room for one generated token); "
                           f"shorten it", param=field, code="context_length_exceeded")

    def check_request(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        cfg = self.cfg
        if req.n > cfg.max_n:
            raise APIError(400, f"n must be at most {cfg.max_n} (--max-n), got {req.n}",
                           param="n")
        stops = req.stop or ()
        if len(stops) > cfg.max_stop_strings:
            raise APIError(400, f"at most {cfg.max_stop_strings} stop strings are allowed "
                           f"(--max-stop-strings), got {len(stops)}", param="stop")
        long = [i for i, s in enumerate(stops) if len(s) > cfg.max_stop_chars]
        if long:
            raise APIError(400, f"stop strings may be at most {cfg.max_stop_chars} characters "
                           f"(--max-stop-chars); stop[{long[0]}] has {len(stops[long[0]])}",
                           param="stop")
