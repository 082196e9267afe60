"""The Python API in vLLM's shape: LLM(model, speculative_config={...}), outputs[0].text,
llm.chat(), and LLM() on the default model with its shipped draft."""

from __future__ import annotations

import pytest

from specscope import LLM, SamplingParams
from specscope.config import SpecConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def test_speculative_config_and_vllm_shaped_outputs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
              speculative_config={"method": "eagle3", "model": "random",
                                  "num_speculative_tokens": 3})
    assert (llm.spec.draft, llm.spec.num_steps, llm.spec.topk) == ("random", 3, 1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = llm.generate(["one two", "three"], params)
    assert out[0].outputs[0].text == out[0].text and out[0].outputs[0].index == 0
    assert out[1].outputs[0].token_ids == out[1].token_ids and out[1].finished
    assert out[0].outputs[0].finish_reason == "length"
    plain = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")  # another model: plain
    assert plain.spec is None
    assert [o.token_ids for o in plain.generate(["one two", "three"], params)] == \
        [o.token_ids for o in out]  # speculation is lossless
    with pytest.raises(ValueError, match="not both"):
        LLM(str(tiny_model_dir), dtype="fp32", device="cpu", spec=SpecConfig(draft="random"),
            speculative_config={"model": "random"})
    with pytest.raises(ValueError, match="unsupported key"):
        LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
            speculative_config={"model": "random", "num_lookahead_slots": 2})


def test_chat_takes_one_conversation_or_several(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    conv = [{"role": "user", "content": "Hello"}]
    one = llm.chat(conv, params)
    both = llm.chat([conv, [{"role": "user", "content": "Bye"}]], params)
    assert len(one) == 1 and len(both) == 2 and both[0].token_ids == one[0].token_ids
    assert one[0].token_ids == llm.generate(conv, params)[0].token_ids
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([], params)


def test_vllm_prompt_dicts_are_prompts(tiny_model_dir):
    """vLLM's TokensPrompt and TextPrompt: {'prompt_token_ids': [...]} runs its ids as they
    are, {'prompt': '...'} as the string; alone or in a batch beside strings; bad ids fail
    before any work."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.encode_prompt("one two")
    by_text = llm.generate(["one two", "three"], params)
    mixed = llm.generate([{"prompt_token_ids": ids}, {"prompt": "three"}], params)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in by_text]
    alone = llm.generate({"prompt_token_ids": ids}, params)
    assert len(alone) == 1 and alone[0].token_ids == by_text[0].token_ids
    vocab = llm.model_config.vocab_size
    for bad, match in (([], "non-empty"), ([1, "2"], "ints"), ([vocab], "outside")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": bad}], params)
    with pytest.raises(TypeError, match="TextPrompt"):
        llm.generate({"prompt": 3}, params)


def test_the_default_model_speculates_with_its_shipped_draft(specscope_cache_dir):
    llm = LLM(dtype="fp32", device="cpu", cache_dir=str(specscope_cache_dir))
    assert llm.spec is not None and llm.spec.draft == "default"
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0]
    assert out.spec is not None and out.spec["cycles"] > 0
