"""IncrementalDetokenizer with the real default-model (SmolLM2, byte-level BPE) tokenizer."""

from __future__ import annotations

import pathlib

import pytest

from specscope.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "🙂🚀",
    " 🙂🚀 rocket",
    "日本語のテキスト",
    "café naïve",
    "Déjà vu, señor — voilà: crème brûlée!",
    "line one\nline two\n\n  indented\ttab 12345 67.89\n",
    "mixed 日本 🙂 text, 2024-01-01;   three   spaces",
    "👨‍👩‍👧‍👦 family 🇫🇷 flag",
    "Ελληνικά и русский текст, עברית",
    "x" * 40 + " " + "🚀" * 7,
    "The quick brown fox jumps over the lazy dog.",
    "a . b , c ! d ? e 's f n't",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf(text, add_special_tokens=False)["input_ids"]


def _feed(tok: Tokenizer, prompt_ids: list[int], ids: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = _ids(tokenizer, text)
    expected = tokenizer.decode(ids)
    assert expected == text  # the tokenizer round-trips these texts
    deltas = _feed(tokenizer, [], ids, chunk)
    assert "".join(deltas) == expected
    for d in deltas:
        assert "\ufffd" not in d, (d, deltas)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_with_prompt_context(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    """With prompt tokens as context (as the engine uses it), the output text is the same."""
    prompt_ids = _ids(tokenizer, "Some prompt text ending in an emoji 🙂")
    ids = _ids(tokenizer, text)
    deltas = _feed(tokenizer, prompt_ids, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "🙂")
    assert len(ids) >= 2, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🙂"
    assert detok.flush() == ""


def test_long_generation_stays_exact(tokenizer: Tokenizer) -> None:
    """Past the CONTEXT window the decoder drops history; the text must not drift."""
    text = " ".join(TEXTS) * 3
    ids = _ids(tokenizer, text)
    assert len(ids) > 10 * IncrementalDetokenizer.CONTEXT
    for chunk in (1, 2, 3, 7):
        assert "".join(_feed(tokenizer, [], ids, chunk)) == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello") + [tokenizer.hf.eos_token_id] + _ids(tokenizer, " world")
    deltas = _feed(tokenizer, [], ids, 1)
    assert "".join(deltas) == tokenizer.decode(ids) == "hello world"


def test_flush_emits_a_trailing_partial_character(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "ok 🚀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    assert tokenizer.decode(cut).endswith("\ufffd")
    deltas = _feed(tokenizer, [], cut, 1)
    assert "".join(deltas) == tokenizer.decode(cut)
    assert deltas[-1].endswith("\ufffd")  # flush shows what there is, once, at the end
    assert all("\ufffd" not in d for d in deltas[:-1])


def test_empty_add(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, _ids(tokenizer, "prompt"))
    assert detok.add([]) == ""
    assert detok.flush() == ""


# ------------------------------------------------- Request: stop strings over speculative cycles

STOP_TEXT = ("The quick brown fox 🙂 jumps over the lazy dog. 日本語のテキスト, café 🚀 there!\n"
             "Next line: the end.")
STOP_SETS = [
    (" the",),
    ("r the",),  # spans a token boundary (" over" " the")
    (" th",),  # completed by a token (" the") that holds text after it
    ("fo", "lazy"),  # the earliest of several wins
    ("🙂",),  # a multi-byte character split over byte-level tokens
    ("本語の",),  # starts in text the detokenizer holds back
    ("é 🚀 t",),
    ("dog.", "\n"),
    ("line: the end.",),  # ends on the last token
    ("zzz",),  # never seen
]


def _run_request(tok: Tokenizer, ids: list[int], params, chunks: list[int]):
    """Feed `ids` to a Request in cycles of the given sizes, as the engine does."""
    from specscope.engine.request import Request

    req = Request("r", [1, 2, 3], params, tok)
    streamed, pos = [], 0
    for n in chunks:
        if req.finished or pos >= len(ids):
            break
        streamed.append(req.append(ids[pos:pos + n]))
        pos += n
    assert req.finished, "the test's token stream should always reach a stop or max_tokens"
    out = req.output()
    assert "".join(streamed) == out.text  # what was streamed is what was returned
    assert out.metrics.completion_tokens == len(out.token_ids)
    return out.token_ids, out.text, out.finish_reason


@pytest.mark.parametrize("stop", STOP_SETS, ids=lambda s: repr(s[0]))
def test_speculative_cycles_stop_exactly_like_plain_decoding(tokenizer: Tokenizer,
                                                              stop: tuple[str, ...]) -> None:
    """Several tokens per append (a speculative cycle) give the same output_ids, text and
    finish_reason as one token per append (plain decoding), whatever the cycle sizes."""
    import random

    from specscope.config import SamplingParams

    base = _ids(tokenizer, STOP_TEXT)
    eos = tokenizer.hf.eos_token_id
    streams = {"plain": base, "eos-mid": base[:9] + [eos] + base[9:],
               "eos-late": base[:30] + [eos] + base[30:]}
    rng = random.Random(0)
    for name, ids in streams.items():
        for max_tokens in (len(ids), 7, 26):
            for include in (False, True):
                params = SamplingParams(max_tokens=max_tokens, stop=stop,
                                        include_stop_str_in_output=include)
                want = _run_request(tokenizer, ids, params, [1] * len(ids))
                for trial in range(6):
                    sizes = [rng.randint(1, 6) for _ in ids] if trial else [len(ids)]
                    got = _run_request(tokenizer, ids, params, sizes)
                    assert got == want, (name, max_tokens, include, sizes)


def test_stop_string_drops_the_rest_of_the_cycle(tokenizer: Tokenizer) -> None:
    """Issue 17: stop [" the"] after "In": 2 completion tokens, not the cycle's 6."""
    from specscope.config import SamplingParams

    ids = _ids(tokenizer, "In the golden autumn light, leaves")
    assert [tokenizer.decode([t]) for t in ids[:2]] == ["In", " the"]
    params = SamplingParams(max_tokens=40, stop=(" the",))
    # The prefill emits one token, then a speculative cycle accepts five at once.
    got = _run_request(tokenizer, ids, params, [1, 5, 1])
    assert got == (ids[:2], "In", "stop")
    assert _run_request(tokenizer, ids, params, [1] * len(ids)) == got
