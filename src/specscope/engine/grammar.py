"""Structured output: each constrained sequence's grammar state, and the token masks it puts
on the logits the engine samples, drafts and verifies from.

A `Grammar` wraps one llguidance matcher (the `structured` extra) over the target
vocabulary. It always stands at the sequence's *committed* state: every output token
consumed, nothing more. The masks of a step are computed from there:

- plain sampling: the committed state's mask on the sampled row (`constrain_rows`);
- drafting: at draft step j, each beam's mask is that of the state after its own path of j
  draft tokens: consumed, mask written, rolled back (`DraftConstraint`), so every draft token
  is grammatical;
- verification: each tree node's row is masked with the state after the path from the root
  to that node (`constrain_trees`), so greedy verification accepts exactly the tokens that
  constrained plain decoding emits, and lossless sampling samples the masked target law.

Then the emitted tokens are consumed for good (`Grammar.advance`); a grammar that can take
nothing but EOS ends its request with finish_reason "stop".

The cost, and why it is confined to constrained sequences: masks are computed on the host
from tokens the host must know, so a constrained speculating sequence reads its draft
tokens back after every draft step and its tree once before the verify (extra
device->host reads beside the step's one), and uploads one packed mask per row ([V / 32]
int32). Rows without a grammar take none of this: a batch with no constrained sequence
runs the unchanged, sync-free path, and the pure speculative CUDA graph excludes
constrained sequences (engine.py `_spec_graphable`). A plain decode step needs no extra
read (its mask depends only on committed tokens), so it stays graphable: the mask applies
to the graph's output logits, outside the captured region.

A token the matcher refuses is never consumed (llguidance's matcher never leaves an error
state): paths and tree nodes are checked before they are consumed, and an ungrammatical
node (a draft that found no allowed token in its vocabulary) is left unmasked: the target's
masked logits reject it anyway.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specscope.config import StructuredOutputs
from specscope.kvcache.paged import upload

log = logging.getLogger("specscope.grammar")

INSTALL_HINT = ("structured output (response_format, structured_outputs, tool_choice "
                "'required' or a named function) needs the `structured` extra: "
                "pip install 'specscope[structured]'")

# JSON as models write it (Python's json.dumps spacing), with no free whitespace: a free
# whitespace rule lets a small model emit newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputUnavailable(ValueError):
    """The structured-output library is not installed (a ValueError: the request's 400)."""


def _library() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise StructuredOutputUnavailable(INSTALL_HINT) from None
    return llguidance


def words(vocab_size: int) -> int:
    """int32 words of one packed mask over vocab_size tokens."""
    return (vocab_size + 31) // 32


class Grammar:
    """One sequence's grammar state, always at its committed tokens (module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.words = words(vocab_size)

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete, or broken)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    def fill_mask(self, out: np.ndarray) -> None:
        """The packed allowed-token mask of the current state into out (int32 [words])."""
        assert out.dtype == np.int32 and out.flags.c_contiguous and out.size == self.words
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, token: int) -> bool:
        """Consume one emitted token; True when the request must end here (the grammar is
        complete, or the token was refused: possible only under simulated acceptance,
        which ignores the target's masked verdicts)."""
        if self._m.is_stopped():
            return True
        if self._m.try_consume_tokens([token]) != 1:
            log.warning("token %d is outside the grammar; the request ends here", token)
            return True
        return self._m.is_stopped()

    def masks_after(self, paths: Sequence[Sequence[int]], out: np.ndarray) -> list[bool]:
        """out[i] = the mask after consuming paths[i] from the committed state (then rolled
        back). Returns per path whether it was grammatical; an ungrammatical path's row is
        all ones (unmasked: its tokens are never accepted)."""
        ok = []
        for i, path in enumerate(paths):
            n = self._m.try_consume_tokens(list(path)) if path else 0
            good = n == len(path)
            if good:
                self.fill_mask(out[i])
            else:
                out[i] = -1
            if n:
                self._m.rollback(n)
            ok.append(good)
        return ok

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int],
                   out: np.ndarray) -> None:
        """out[i] = the mask after the path root -> node i (the root is committed; nodes
        are in topological order, parents[i] < i)."""
        paths: list[list[int]] = []
        for i, p in enumerate(parents):
            paths.append([] if p < 0 else paths[p] + [tokens[i]])
        self.masks_after(paths, out)


class GrammarCompiler:
    """Grammars for one tokenizer. The llguidance tokenizer (every token's bytes) is built
    once, on first use (about half a second for a 50k vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf = getattr(tokenizer, "hf", None)  # IdTokenizer has none
        self._eos = sorted(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._tok: Any = None

    def _tokenizer(self) -> Any:
        lib = _library()
        with self._lock:
            if self._tok is None:
                if self._hf is None:
                    raise ValueError("structured output needs the model's tokenizer; this "
                                     "model has none (its text is token ids)")
                self._tok = lib.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                  eos_token=self._eos or None)
        return self._tok

    @staticmethod
    def grammar_text(so: StructuredOutputs) -> str:
        """The llguidance grammar of a constraint (not yet checked)."""
        lib = _library()
        M = lib.LLMatcher
        if so.json_object:
            return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if so.json is not None:
            try:
                schema = json.loads(so.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true / false)")
            return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if so.regex is not None:
            return M.grammar_from_regex(so.regex)
        if so.choice is not None:
            return lib.grammar_from("choice", json.dumps(list(so.choice)))
        try:
            return lib.grammar_from("grammar", so.grammar)
        except ValueError as e:
            raise ValueError(f"the grammar does not parse: {e}") from None

    def check(self, so: StructuredOutputs) -> str:
        """The checked grammar text, or a ValueError naming what is wrong with it."""
        text = self.grammar_text(so)
        err = _library().LLMatcher.validate_grammar(text, self._tokenizer())
        if err:
            what = "JSON schema" if so.json is not None else "grammar"
            raise ValueError(f"the {what} is not supported: {err.strip()}")
        return text

    def compile(self, so: StructuredOutputs) -> Grammar:
        """A fresh grammar state for one request."""
        matcher = _library().LLMatcher(self._tokenizer(), self.check(so), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks [..., W] int32 -> allowed [..., vocab_size] bool (bit b of word w is
    token 32 w + b)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab_size]


def _masked(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """logits [..., V] with -inf where the packed masks bits [..., W] refuse a token."""
    allowed = unpack(torch.from_numpy(bits).to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def constrain_rows(logits: torch.Tensor, grammars: Sequence[Grammar | None]) -> torch.Tensor:
    """logits [R, V], row r masked by grammars[r]'s committed state (None: unmasked).
    Unconstrained batches return logits itself: no host work, no upload."""
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    bits = np.empty((len(rows), grammars[rows[0]].words), np.int32)
    for j, r in enumerate(rows):
        grammars[r].fill_mask(bits[j])
    idx = upload(rows, torch.long, logits.device)
    return logits.index_copy(0, idx, _masked(logits.index_select(0, idx), bits))


def constrain_trees(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    grammars: Sequence[Grammar | None]) -> torch.Tensor:
    """Verify logits [S, N, V] (row i of tree s predicts the token after node i), each node
    masked with the state after its root-to-node path; tokens, parents [S, N]. One host
    read of the constrained trees."""
    rows = [s for s, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    idx = upload(rows, torch.long, logits.device)
    host = torch.stack([tokens.index_select(0, idx), parents.index_select(0, idx)]).tolist()
    N = tokens.shape[1]
    bits = np.empty((len(rows), N, grammars[rows[0]].words), np.int32)
    for j, s in enumerate(rows):
        grammars[s].tree_masks(host[0][j], host[1][j], bits[j])
    return logits.index_copy(0, idx, _masked(logits.index_select(0, idx), bits))


class DraftConstraint:
    """The draft steps' mask (spec/drafter.py's `mask` hook): draft logits [S, B, Vd] of B
    beams, each masked with the state after its path [S, B, j] of draft tokens (target
    vocabulary). A beam none of whose allowed tokens is in the draft vocabulary is left
    unmasked (an all -inf row has no distribution); verification rejects its proposal."""

    def __init__(self, grammars: Sequence[Grammar | None], draft_ids: torch.Tensor) -> None:
        self.grammars = grammars
        self.rows = [s for s, g in enumerate(grammars) if g is not None]
        self.draft_ids = draft_ids  # [Vd]: the target id of each draft-vocabulary id
        self.idx = upload(self.rows, torch.long, draft_ids.device)  # once, not per step

    def __call__(self, logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        S, B, _ = logits.shape
        dev, idx = logits.device, self.idx
        # The draft tokens so far, read to the host (the constrained rows' extra read).
        host = paths.index_select(0, idx).tolist() if paths.shape[-1] else \
            [[[] for _ in range(B)] for _ in self.rows]
        g0 = self.grammars[self.rows[0]]
        bits = np.empty((len(self.rows), B, g0.words), np.int32)
        for j, s in enumerate(self.rows):
            self.grammars[s].masks_after(host[j], bits[j])
        allowed = unpack(torch.from_numpy(bits).to(dev), g0.vocab_size)[..., self.draft_ids]
        some = allowed.any(-1, keepdim=True)  # [R, B, 1]
        sub = logits.index_select(0, idx)
        sub = sub.masked_fill(~allowed & some, float("-inf"))
        return logits.index_copy(0, idx, sub)


def draft_constraint(grammars: Sequence[Grammar | None],
                     draft_ids: torch.Tensor) -> DraftConstraint | None:
    """The draft steps' mask for these sequences, or None when none is constrained (the
    drafter then runs its unchanged, sync-free path). draft_ids [Vd]: each draft token's
    target id (DraftRunner.target_ids, built once)."""
    if all(g is None for g in grammars):
        return None
    return DraftConstraint(grammars, draft_ids)
