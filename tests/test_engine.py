"""End-to-end tests of specscope.LLM on a tiny random Llama (CPU, fp32).

The reference for every generation is a plain greedy loop that recomputes the whole
sequence without a KV cache each step, so KV caching, chunked prefill and KV windows are
all checked against the model's own uncached forward.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import threading

import pytest
import torch

from specscope import LLM, SamplingParams
from specscope.engine.request import RequestOutput
from specscope.sampling import processed_logits

PROMPT = "Hello there, how are"
PROMPT_30 = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
             "lazy dog. The quick brown fox jumps over the lazy dog.")
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50)


def make_llm(model_dir: pathlib.Path, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="fp32", device="cpu", **kwargs)


@torch.inference_mode()
def reference_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Last-position logits [V] of a full, uncached forward over `ids`."""
    model = llm.model
    x = torch.tensor([ids], dtype=torch.long)
    pos = torch.arange(len(ids))[None]
    hidden, _ = model(x, pos)
    return model.compute_logits(hidden[:, -1])[0]


def reference_greedy(llm: LLM, prompt_ids: list[int], n: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(reference_logits(llm, ids).argmax()))
    return ids[len(prompt_ids):]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: pathlib.Path) -> LLM:
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def greedy_ref(llm: LLM) -> tuple[list[int], list[int]]:
    """(prompt ids, 40 reference greedy tokens) for PROMPT."""
    prompt_ids = llm.encode_prompt(PROMPT)
    return prompt_ids, reference_greedy(llm, prompt_ids, 40)


@pytest.fixture(scope="module")
def greedy_out(llm: LLM) -> RequestOutput:
    """LLM.generate's greedy output (30 tokens) for PROMPT."""
    return llm.generate(PROMPT, greedy(30))[0]


# ---------------------------------------------------------------- KV-cached == uncached


def test_tiny_model_loads(llm: LLM) -> None:
    assert llm.model_config.architecture == "LlamaForCausalLM"
    assert llm.model_config.vocab_size == 49152
    assert llm.device.type == "cpu" and llm.dtype == torch.float32
    info = llm.info()
    assert info["layers"] == 2 and info["max_model_len"] == 256
    assert "LlamaForCausalLM" in repr(llm)


def test_greedy_matches_uncached_reference(llm: LLM, greedy_ref) -> None:
    prompt_ids, ref = greedy_ref
    out = llm.generate(PROMPT, greedy(40))[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(ref)
    assert len(set(ref)) > 5  # the tiny model is not degenerate: the test has teeth
    assert out.metrics.prompt_tokens == len(prompt_ids)
    assert out.metrics.completion_tokens == 40


def test_prefill_logits_match_uncached_forward(llm: LLM, monkeypatch) -> None:
    """The engine's prefill step samples from the logits an uncached forward gives (a
    request asking for logprobs processes them); a plain greedy request takes their argmax
    from the head directly, not through the sampler."""
    ids = llm.encode_prompt(PROMPT_30)
    seen = []
    real = llm.engine._sample

    def spy(logits, seqs):
        seen.append(logits.clone())
        return real(logits, seqs)

    monkeypatch.setattr(llm.engine, "_sample", spy)
    llm.generate(PROMPT_30, greedy(1, logprobs=1))
    ref = reference_logits(llm, ids)
    torch.testing.assert_close(seen[0][0], ref, rtol=1e-4, atol=1e-4)
    plain = llm.generate(PROMPT_30, greedy(1))[0]
    assert len(seen) == 1 and plain.token_ids == [int(seen[0][0].argmax())]


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "block_size"),
    [(4, 16), (5, 16), (4, 4), (512, 1), (7, 2), (30, 16)],
)
def test_chunked_prefill_and_kv_blocks_match_reference(
        tiny_model_dir: pathlib.Path, max_num_batched_tokens: int, block_size: int) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=max_num_batched_tokens,
                   max_num_seqs=1, block_size=block_size)
    prompt_ids = llm.encode_prompt(PROMPT_30)
    assert len(prompt_ids) == 30
    ref = reference_greedy(llm, prompt_ids, 40)
    out = llm.generate(PROMPT_30, greedy(40))[0]
    assert out.token_ids == ref
    # The same engine again (its cache reused, stale slots beyond the prompt) gives the same.
    assert llm.generate(PROMPT_30, greedy(40))[0].token_ids == ref


def test_cache_reuse_across_requests_of_different_lengths(llm: LLM, greedy_ref) -> None:
    prompt_ids, ref = greedy_ref
    # A long request first leaves its K/V in the (reused) cache; a short one must not see it.
    llm.generate(PROMPT_30, greedy(60))
    assert llm.generate(PROMPT, greedy(40))[0].token_ids == ref


def test_batch_of_prompts_in_order(llm: LLM, greedy_ref) -> None:
    _, ref = greedy_ref
    outs = llm.generate([PROMPT_30, PROMPT], greedy(12))
    assert len(outs) == 2
    assert outs[1].token_ids == ref[:12]
    assert outs[0].prompt_token_ids == llm.encode_prompt(PROMPT_30)
    assert outs[0].request_id != outs[1].request_id


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_deterministic(llm: LLM) -> None:
    def run(seed: int) -> list[int]:
        return llm.generate(PROMPT, SamplingParams(max_tokens=24, seed=seed, ignore_eos=True,
                                                    **SAMPLED))[0].token_ids

    a, b, a2 = run(1), run(2), run(1)
    assert a == a2
    assert a != b
    assert run(3) not in (a, b)


def test_sampled_tokens_survive_the_filters(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, seed=5, ignore_eos=True, **SAMPLED)
    out = llm.generate(PROMPT, params)[0]
    ids = list(out.prompt_token_ids)
    for t in out.token_ids:
        allowed = processed_logits(reference_logits(llm, ids)[None], params)[0]
        assert allowed[t] != float("-inf"), "a top-k/top-p filtered token was sampled"
        ids.append(t)
    greedy_ids = llm.generate(PROMPT, greedy(16))[0].token_ids
    assert out.token_ids != greedy_ids


# ---------------------------------------------------------------- stops


def test_max_tokens_finishes_with_length(llm: LLM, greedy_ref) -> None:
    _, ref = greedy_ref
    for n in (1, 2, 7):
        out = llm.generate(PROMPT, greedy(n))[0]
        assert out.finish_reason == "length"
        assert out.token_ids == ref[:n]


def test_stop_token_ids(llm: LLM, greedy_ref) -> None:
    _, ref = greedy_ref
    stop_id = ref[5]
    k = ref.index(stop_id)  # first occurrence
    out = llm.generate(PROMPT, greedy(40, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:k + 1]  # the stop token is reported, not decoded
    assert out.text == llm.tokenizer.decode(ref[:k])


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir: pathlib.Path, greedy_ref, tmp_path_factory) -> tuple:
    """The tiny model with an extra EOS id: the 7th greedy token. Returns (dir, eos, k)."""
    _, ref = greedy_ref
    eos = ref[6]
    k = ref.index(eos)
    out = tmp_path_factory.mktemp("tiny_eos") / "model"
    shutil.copytree(tiny_model_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = [2, eos]
            path.write_text(json.dumps(cfg))
    return out, eos, k


def test_eos_stops_unless_ignore_eos(eos_model_dir, greedy_ref) -> None:
    model_dir, eos, k = eos_model_dir
    _, ref = greedy_ref
    llm = make_llm(model_dir)
    assert eos in llm.tokenizer.eos_token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:k + 1] and out.token_ids[-1] == eos
    assert out.text == llm.tokenizer.decode(ref[:k])
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == ref


def _pick_stop(text: str, start: int, length: int = 5) -> str:
    """A substring of `text` at or after `start`, free of U+FFFD and of leading space."""
    for i in range(start, len(text) - length):
        s = text[i:i + length]
        if "\ufffd" not in s and not s[0].isspace():
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates(llm: LLM, greedy_out) -> None:
    full = greedy_out.text
    stop = _pick_stop(full, len(full) // 2)
    i = full.find(stop)
    out = llm.generate(PROMPT, greedy(30, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:i]
    assert stop not in out.text
    assert out.token_ids == greedy_out.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < 30
    kept = llm.generate(PROMPT, greedy(30, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop"
    assert kept.text == full[:i + len(stop)]
    assert kept.token_ids == out.token_ids


def test_earliest_stop_string_wins(llm: LLM, greedy_out) -> None:
    full = greedy_out.text
    early = _pick_stop(full, len(full) // 4, 3)
    late = _pick_stop(full, 3 * len(full) // 4, 3)
    if full.find(late) <= full.find(early):
        pytest.skip("picked stop strings overlap in an unhelpful way")
    out = llm.generate(PROMPT, greedy(30, stop=[late, early]))[0]
    assert out.text == full[:full.find(early)]


def test_stop_string_never_seen_runs_to_length(llm: LLM, greedy_out) -> None:
    out = llm.generate(PROMPT, greedy(30, stop=["\x00never\x00"]))[0]
    assert out.finish_reason == "length"
    assert out.text == greedy_out.text


def _stream(llm: LLM, params: SamplingParams) -> tuple[list[str], RequestOutput]:
    deltas = list(llm.stream(PROMPT, params))
    assert deltas and deltas[-1].finished and deltas[-1].output is not None
    assert all(not d.finished and d.output is None for d in deltas[:-1])
    return [d.text for d in deltas], deltas[-1].output


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("offset", [0, 1])  # the stop string starts at / inside a token
@pytest.mark.parametrize("stop_len", [1, 3, 8])
def test_streaming_matches_final_text(llm: LLM, greedy_out, include: bool, offset: int,
                                      stop_len: int) -> None:
    full = greedy_out.text
    stop = _pick_stop(full, len(full) // 2 + offset, stop_len)
    params = greedy(30, stop=[stop], include_stop_str_in_output=include)
    texts, final = _stream(llm, params)
    assert "".join(texts) == final.text
    assert final.text == llm.generate(PROMPT, params)[0].text
    # Every streamed prefix is a prefix of the final text: nothing of the stop string (or
    # anything after it) was ever shown and later taken back.
    shown = ""
    for t in texts:
        shown += t
        assert final.text.startswith(shown)
        if not include:
            assert stop not in t


def test_streaming_without_stop_strings(llm: LLM, greedy_out) -> None:
    texts, final = _stream(llm, greedy(30))
    assert "".join(texts) == final.text == greedy_out.text
    assert final.token_ids == greedy_out.token_ids


def test_closed_or_dropped_stream_frees_the_engine(llm: LLM, greedy_ref) -> None:
    _, ref = greedy_ref
    it = llm.stream(PROMPT, greedy(20))
    first = next(it)
    assert first.token_ids == ref[:1]
    it.close()  # e.g. a client that disconnects mid-stream
    assert llm.generate(PROMPT, greedy(5))[0].token_ids == ref[:5]
    for _ in llm.stream(PROMPT, greedy(20)):
        break  # the abandoned generator is finalised, releasing the engine
    assert llm.generate(PROMPT, greedy(5))[0].token_ids == ref[:5]


def test_concurrent_callers_are_serialised(llm: LLM, greedy_ref) -> None:
    _, ref = greedy_ref
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        p = PROMPT if i % 2 == 0 else PROMPT_30
        results[i] = llm.generate(p, greedy(10))[0].token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4
    assert results[0] == results[2] == ref[:10]
    assert results[1] == results[3]


# ---------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def llm64(tiny_model_dir: pathlib.Path) -> LLM:
    return make_llm(tiny_model_dir, max_model_len=64)


def test_context_length_exceeded(llm64: LLM) -> None:
    assert llm64.max_model_len == 64
    n = len(llm64.encode_prompt(PROMPT_30))
    with pytest.raises(ValueError, match="context length"):
        llm64.generate(PROMPT_30, greedy(64 - n + 1))
    with pytest.raises(ValueError, match="context length"):
        list(llm64.stream(PROMPT_30, greedy(64 - n + 1)))
    with pytest.raises(ValueError, match="context length"):
        llm64.generate("word " * 80, greedy(1))


def test_context_exactly_full_is_allowed(llm64: LLM) -> None:
    n = len(llm64.encode_prompt(PROMPT_30))
    out = llm64.generate(PROMPT_30, greedy(64 - n))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - n
    assert out.token_ids == reference_greedy(llm64, out.prompt_token_ids, 64 - n)


def test_max_model_len_only_lowers(tiny_model_dir: pathlib.Path) -> None:
    assert make_llm(tiny_model_dir, max_model_len=100_000).max_model_len == 256


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError):
        llm.encode_prompt([])


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": "hi"}, "not a dict"],
    ],
    ids=["bad-role", "no-content", "no-role", "content-not-str", "non-dict"],
)
def test_bad_messages(llm: LLM, messages: list) -> None:
    with pytest.raises(ValueError, match=r"messages\[\d\]"):
        llm.generate(messages)


@pytest.mark.parametrize("prompt", [123, None, 4.5, {"role": "user", "content": "hi"}])
def test_non_string_prompt_is_type_error(llm: LLM, prompt) -> None:
    with pytest.raises(TypeError):
        llm.generate(prompt)


def test_non_string_prompt_in_a_list_is_type_error(llm: LLM) -> None:
    with pytest.raises(TypeError):
        llm.generate(["fine", 123])
    with pytest.raises(TypeError):
        list(llm.stream(123))


def test_errors_come_before_any_work(llm: LLM) -> None:
    """A bad prompt later in a batch fails before the earlier ones are generated."""
    before = next(llm._ids)
    with pytest.raises(ValueError):
        llm.generate([PROMPT, ""], greedy(4))
    assert next(llm._ids) == before + 1


def test_bad_dtype(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_model_dir), dtype="fp8", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="cuda"):
        LLM(str(tiny_model_dir), dtype="fp32", device="cuda")


@pytest.mark.parametrize("kwargs", [{"device": "tpu"}, {"max_num_batched_tokens": 0},
                                    {"max_model_len": 0}, {"block_size": 0},
                                    {"block_size": 12}, {"max_num_seqs": 0},
                                    {"gpu_memory_utilization": 1.5},
                                    {"kv_cache_memory": -5}])
def test_bad_engine_config(tiny_model_dir: pathlib.Path, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LLM(str(tiny_model_dir), **{"dtype": "fp32", "device": "cpu", **kwargs})


# ---------------------------------------------------------------- chat


def test_chat_messages_use_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    hf = llm.tokenizer.hf
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.rstrip().endswith("assistant")
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert llm.encode_prompt(messages) == expected
    assert llm.encode_prompt("hi", chat=True) == expected
    assert expected != llm.encode_prompt("hi")
    out = llm.generate(messages, greedy(5))[0]
    assert out.prompt_token_ids == expected
    assert len(out.token_ids) == 5
    # A list of conversations is a batch; chat=True turns strings into user messages.
    outs = llm.generate([messages, messages], greedy(5))
    assert [o.token_ids for o in outs] == [out.token_ids] * 2
    assert llm.generate("hi", greedy(5), chat=True)[0].token_ids == out.token_ids


def test_chat_multi_turn_with_system(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    hf = llm.tokenizer.hf
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.encode_prompt(messages)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("ids", [[], [-1], [10**9], "abc"])
def test_bad_prompt_ids(llm: LLM, ids) -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        list(llm.stream(None, prompt_ids=ids))


def test_prompt_ids_stream_matches_text_prompt(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.encode_prompt("Hello there")
    a = list(llm.stream(None, params, prompt_ids=ids))[-1].output
    b = llm.generate("Hello there", params)[0]
    assert a.token_ids == b.token_ids


def test_open_stream_in_same_thread_is_an_error_not_a_deadlock(llm: LLM) -> None:
    it = llm.stream("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    next(it)
    with pytest.raises(RuntimeError, match="still open"):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    it.close()
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True))[0]
               .token_ids) == 2


@pytest.mark.slow
def test_compiled_decode_matches_eager(tiny_model_dir: pathlib.Path) -> None:
    """torch.compile'd decode steps give the eager tokens, across several KV windows."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eager = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", block_size=8)
    compiled = LLM(str(tiny_model_dir), dtype="fp32", device="cpu", block_size=8, compile=True)
    prompt = "Speculative decoding is"
    assert compiled.generate(prompt, params)[0].token_ids == \
        eager.generate(prompt, params)[0].token_ids


# ---------------------------------------------------------------- stop strings with speculation


def test_speculative_stop_string_counts_like_plain(tiny_model_dir: pathlib.Path) -> None:
    """Issue 17: a stop string inside a speculative cycle ends the output at the token that
    completes it; the cycle's later tokens are not output (nor counted as usage)."""
    from specscope.config import SpecConfig
    from specscope.engine.request import Request

    def spec_llm() -> LLM:  # simulated acceptance: several tokens per cycle, seeded
        return make_llm(tiny_model_dir, spec=SpecConfig(draft="random", num_steps=5,
                                                        simulate_acceptance=4.0))

    full = spec_llm().generate(PROMPT, greedy(40))[0]
    tok = spec_llm().tokenizer
    cut = len(tok.decode(full.token_ids[:12]))
    params = greedy(40, stop=(full.text[cut - 2:cut + 2],))  # spans a token boundary
    deltas = list(spec_llm().stream(PROMPT, params))
    out = deltas[-1].output
    emitted = [t for d in deltas for t in d.token_ids]  # all the cycles' tokens
    assert max(len(d.token_ids) for d in deltas) > 1  # cycles of several tokens happened
    plain = Request("ref", out.prompt_token_ids, params, tok)
    for t in emitted:  # one token per append: the plain-decoding rule
        plain.append([t])
        if plain.finished:
            break
    want = plain.output()
    assert out.finish_reason == want.finish_reason == "stop"
    assert (out.token_ids, out.text) == (want.token_ids, want.text)
    assert out.metrics.completion_tokens == len(want.token_ids) < len(emitted)
