"""Tests for specscope.train: data and loss mask, vocabulary maps, regeneration, the unrolled
training-time test against the engine's cached chain, checkpoints, resume, and a tiny
end-to-end run whose export the engine loads and decodes losslessly."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from specscope import LLM, SamplingParams, SpecConfig
from specscope.config import ModelConfig
from specscope.draft.eagle3 import random_draft
from specscope.draft.loader import load_draft
from specscope.draft.vocab import check_vocab_maps, frequent_vocab, vocab_coverage, vocab_maps
from specscope.engine.tokenizer import Tokenizer
from specscope.kvcache import KVCache
from specscope.models.loader import load_model, random_model
from specscope.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from specscope.train.data import (
    Example,
    parse_conversation,
    read_conversations,
    split_examples,
    token_batches,
    token_counts,
    tokenize_conversation,
    tokenize_conversations,
)
from specscope.train.regenerate import BatchGenerator, generate_batch, read_regenerated, regenerate
from specscope.train.self_prompts import (
    read_openers,
    self_prompts,
    user_turn_prefix,
    write_prompts,
)
from specscope.train.trainer import TrainConfig, train_draft
from specscope.train.ttt import (
    answer_spans,
    predicted_accept_length,
    shift_left,
    unroll,
    walk_cycles,
    walk_totals,
)

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=80,
                   hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=128, tie_word_embeddings=False, name="tiny")


# -- the unrolled training-time test equals the engine's chain -----------------------------

@pytest.mark.parametrize("num_layers", [1, 2])
def test_unroll_equals_cached_draft_chain(num_layers):
    """Unrolled step j at index t == extend over pairs 0..t, then j cached chain steps fed the
    sequence's tokens, exactly what engine/speculative.py runs."""
    torch.manual_seed(0)
    target = random_model(TINY, torch.float32, "cpu", seed=1)
    draft = random_draft(TINY, torch.float32, "cpu", draft_vocab_size=50, seed=2,
                         num_layers=num_layers, std=0.2)
    draft.attach_target(target)
    draft.init_rope(128)
    target.set_taps(draft.config.aux_layer_ids)
    T, steps = 14, 4
    ids = torch.randint(0, TINY.vocab_size, (1, T))
    _, taps = target(ids, torch.arange(T)[None], return_taps=True)
    unrolled = unroll(draft, taps, ids, steps)  # each [1, T, Vd]
    for t in range(T - 1 - steps):
        cache = KVCache(num_layers, 1, TINY.num_kv_heads, 64, TINY.head_dim, torch.float32,
                        "cpu")
        h, normed = draft(ids[:, 1:t + 2], draft.project(taps[:, :t + 1]),
                          torch.arange(t + 1)[None], cache, kv_len=t + 1)
        logits = draft.compute_logits(normed[0, t])
        torch.testing.assert_close(unrolled[0][0, t], logits, atol=1e-5, rtol=1e-5)
        h = h[:, t:t + 1]
        for j in range(1, steps):
            h, normed = draft(ids[:, t + 1 + j:t + 2 + j], h, torch.tensor([[t + j]]), cache,
                              kv_len=t + j + 1)
            torch.testing.assert_close(unrolled[j][0, t], draft.compute_logits(normed[0, 0]),
                                       atol=1e-5, rtol=1e-5)


def test_sdpa_attention_equals_the_dense_reference():
    """--ttt-attention sdpa: the same unrolled logits and gradients as the dense reference,
    with GQA (4 heads over 2 KV heads) and two draft layers."""
    cfg = TINY
    target = random_model(cfg, torch.float32, "cpu", seed=1)
    target.set_taps((0, 1, 2))
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    _, taps = target(ids, torch.arange(17)[None].expand(2, 17), return_taps=True)
    grads = {}
    for mode in ("dense", "sdpa"):
        draft = random_draft(cfg, torch.float32, "cpu", draft_vocab_size=50, seed=2,
                             num_layers=2, std=0.2, layer_ids=(0, 1, 2))
        draft.attach_target(target)
        draft.init_rope(64)
        draft.requires_grad_(True)
        out = unroll(draft, taps, ids, 5, attention=mode)
        sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in out).backward()
        grads[mode] = (out, [p.grad.clone() for p in draft.parameters() if p.grad is not None])
    for a, b in zip(grads["dense"][0], grads["sdpa"][0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(grads["dense"][1]) == len(grads["sdpa"][1]) > 0
    for a, b in zip(grads["dense"][1], grads["sdpa"][1], strict=True):
        torch.testing.assert_close(a, b, atol=5e-4, rtol=1e-3)  # fp32 summation order
    with pytest.raises(ValueError, match="TTT attention must be one of"):
        unroll(draft, taps, ids, 2, attention="flash")
    from specscope.cli_draft import TTT_ATTENTION
    from specscope.train.ttt import ATTENTION
    assert TTT_ATTENTION == ATTENTION  # the CLI's choices (kept free of the torch import)


def test_shift_left_and_predicted_accept_length():
    x = torch.arange(6).view(1, 6)
    assert shift_left(x, 2, -1).tolist() == [[2, 3, 4, 5, -1, -1]]
    assert shift_left(x, 9, -1).tolist() == [[-1] * 6]
    assert predicted_accept_length([1.0, 1.0, 0.5], 3) == 3.5
    assert predicted_accept_length([0.5, 0.5], 1) == 1.5


def test_walk_cycles_follow_the_engine():
    # prompt of 3 tokens (indices 0..2), answer at 3..11; a second answer at 14..16
    mask = torch.zeros(1, 18, dtype=torch.bool)
    mask[0, 3:12] = True
    mask[0, 14:17] = True
    assert answer_spans(mask) == [[(2, 12), (13, 17)]]
    a = [[0] * 18]
    a[0][2], a[0][5], a[0][6], a[0][9] = 2, 3, 1, 5
    # first answer: t=2 accepts 2 -> t=5 accepts 3 -> t=9 accepts min(5, 12-9-2=1) -> t=11
    # stops (no root left); second answer: t=13 accepts 0 (emits tok_15), t=14 0 (emits
    # tok_16, the answer's last) -> t=15 stops: its root is the last token, nothing follows
    assert walk_cycles(a, answer_spans(mask)) == [2, 3, 1, 0, 0]
    # the mean over all start positions would count positions the walk skips
    assert walk_cycles([[0] * 18], [[(0, 1)]]) == []


def test_walk_totals_equal_walk_cycles_per_pattern():
    """The lock-step walk of many patterns (the tuner's thousands of configurations) sums
    exactly what walk_cycles counts pattern by pattern, answers ending early included."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 7, (40, 3, 60), generator=g).to(torch.int8)  # [N, B, T]
    starts, ends = [4, 10, 0], [60, 33, 1]
    tokens, cycles = walk_totals(a, starts, ends)
    for i in range(a.shape[0]):
        c = walk_cycles(a[i].tolist(), [[(s, e)] for s, e in zip(starts, ends, strict=True)])
        assert (int(tokens[i]), int(cycles[i])) == (sum(c), len(c)), i


# -- data: formats, loss mask, vocabulary --------------------------------------------------

def test_parse_conversation_formats():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert parse_conversation({"messages": msgs}, "x") == msgs
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert parse_conversation(share, "x") == msgs
    assert parse_conversation({"question": "q?"}, "x") == [{"role": "user", "content": "q?"}]
    got = parse_conversation({"instruction": "Sort", "input": "3 1 2"}, "x")
    assert got == [{"role": "user", "content": "Sort\n\n3 1 2"}]
    for bad, words in [([1], "JSON object"), ({"messages": []}, "non-empty"),
                       ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]"),
                       ({"conversations": [{"from": "alien", "value": "x"}]}, "conversations"),
                       ({"text": "x"}, "no 'messages'")]:
        with pytest.raises(ValueError, match=words):
            parse_conversation(bad, "f.jsonl:3")


def test_jsonl_lines_end_only_at_newline(tmp_path):
    """Text a model wrote can hold U+2028 / U+0085, which json.dumps(ensure_ascii=False)
    leaves raw; they must not split a JSONL line (a regenerated file once failed so)."""
    conv = [{"role": "user", "content": "a\u2028b\x85c\u2029d"},
            {"role": "assistant", "content": "e\x1cf"}]
    p = tmp_path / "odd.jsonl"
    p.write_text(json.dumps({"messages": conv}, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert read_conversations([p]) == [conv]


def test_read_conversations_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not valid JSON"):
        read_conversations([p])
    with pytest.raises(FileNotFoundError, match="not found"):
        read_conversations([tmp_path / "missing.jsonl"])
    p.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    assert len(read_conversations([p])) == 2


def test_loss_mask_decodes_to_the_assistant_turns(default_model_dir):
    """Masked tokens, decoded, are exactly each assistant answer and its end-of-turn marker;
    nothing of the system prompt, user turns or template headers."""
    tok = Tokenizer(default_model_dir)
    conv = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "That makes 6, of course."}]
    ex = tokenize_conversation(tok.hf, conv)
    assert len(ex.ids) == len(ex.mask)
    full = tok.hf.apply_chat_template(conv, tokenize=False)
    assert tok.hf.decode(ex.ids) == full
    spans, cur = [], []
    for t, m in zip(ex.ids, ex.mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    decoded = [tok.hf.decode(s) for s in spans]
    assert decoded == ["It is 4.<|im_end|>\n", "That makes 6, of course.<|im_end|>\n"]
    # a prompt-only conversation has nothing to learn
    assert not any(tokenize_conversation(tok.hf, conv[:1]).mask)


def test_batched_tokenization_equals_the_reference(default_model_dir):
    """The trainer's batched path gives the per-conversation reference's Examples exactly:
    multi-turn, system prompts, prompt-only rows, truncation, and chunk boundaries."""
    tok = Tokenizer(default_model_dir)
    convs = [
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
         {"role": "assistant", "content": "Goodbye, see you soon."}],
        [{"role": "user", "content": "prompt only"}],
        [{"role": "user", "content": "Écris un poème\u2028sur la mer."},
         {"role": "assistant", "content": "La mer, bleue et vaste\n" * 5}],
    ] * 3
    for max_len in (None, 12):
        ref = [tokenize_conversation(tok.hf, c, max_len) for c in convs]
        for chunk in (1, 5, 100):
            assert tokenize_conversations(tok.hf, convs, max_len, chunk=chunk) == ref
    assert tokenize_conversations(tok.hf, []) == []


def test_token_counts_reject_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        token_counts([Example(ids=[1, 20], mask=[True, True])], 12)


def test_draft_vocabulary_is_the_most_frequent_labels():
    exs = [Example(ids=[5, 7, 7, 9, 9, 9, 3], mask=[False, True, True, True, True, True, False])]
    counts = token_counts(exs, 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 0, 3, 0, 0]  # 5, 3 unmasked
    ids = frequent_vocab(counts, 3)
    assert ids.tolist() == [0, 7, 9]  # 9 (3x), 7 (2x), then the lowest unseen id
    d2t, t2d = vocab_maps(ids, 12)
    check_vocab_maps(d2t, t2d, 12, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 7, 9]
    assert torch.nonzero(t2d).flatten().tolist() == [0, 7, 9]
    assert vocab_coverage(counts, ids) == 1.0
    assert vocab_coverage(counts, torch.tensor([9])) == 0.6
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_vocab(counts, 13)


def test_batches_are_deterministic_and_bounded():
    exs = [Example(ids=[1] * n, mask=[True] * n) for n in [5, 30, 12, 7, 50, 3, 22, 9] * 5]
    a = token_batches(exs, 64, seed=1, epoch=0)
    assert a == token_batches(exs, 64, seed=1, epoch=0)
    assert a != token_batches(exs, 64, seed=1, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(len(exs)))
    for b in a:
        assert len(b) == 1 or max(len(exs[i].ids) for i in b) * len(b) <= 64
    train, held = split_examples(exs, 0.1, seed=0)
    assert len(held) == 4 and len(train) == 36


# -- regeneration ---------------------------------------------------------------------------

def test_batched_generation_equals_the_engine(tiny_model_dir):
    """Right-padded batched greedy generation gives each prompt the engine's own output."""
    llm = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    prompts = ["Hello there", "A much longer prompt about the weather in the mountains",
               "One"]
    ids = [llm.encode_prompt(p) for p in prompts]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    refs = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert generate_batch(llm.model, ids, 10, params, set(), None) == refs
    # One generator reused across batches (stale slots from the previous batch), decode
    # windows of 8 slots, prefill in groups of 2 rows, idle padding rows.
    gen = BatchGenerator(llm.model, 4, 64)
    assert gen.generate(ids, 10, params, set(), None) == refs
    assert gen.generate(ids[::-1][:2], 10, params, set(), None) == refs[::-1][:2]
    with pytest.raises(ValueError, match="capacity"):
        gen.generate([ids[1] * 10], 40, params, set(), None)


def test_regeneration_resumes_after_an_interrupted_write(tmp_path, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir))
    tok = Tokenizer(loaded.path, loaded.config.eos_token_ids)
    convs = [[{"role": "user", "content": f"Tell me about the number {i}."}]
             for i in range(7)]
    convs[3] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"},
                {"role": "user", "content": "Again"}]
    kw = dict(batch_size=3, max_new_tokens=6, temperature=0.8, seed=3, chunk=3,
              progress=False)
    full = regenerate(loaded.model, tok, convs, tmp_path / "a.jsonl", **kw)
    assert len(full) == 7
    assert [m["role"] for m in full[3]] == ["user", "assistant", "user", "assistant"]
    assert full[3][1]["content"] != "old"
    # interrupted: the first chunk whole, the second cut mid-line
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "b.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    assert sorted(read_regenerated(tmp_path / "b.jsonl")) == [0, 1, 2]
    resumed = regenerate(loaded.model, tok, convs, tmp_path / "b.jsonl", **kw)
    assert resumed == full


def test_self_prompts_are_whole_distinct_user_requests(default_model_dir, tmp_path):
    """Magpie: the default model, given its template up to an opened user turn, writes
    requests; kept ones ended with end-of-turn, are distinct, and the run is repeatable."""
    loaded = load_model(str(default_model_dir), dtype=torch.float32)
    tok = Tokenizer(loaded.path, loaded.config.eos_token_ids)
    prefix = tok.decode(user_turn_prefix(tok), skip_special_tokens=False)
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    kw = dict(batch_size=6, max_new_tokens=64, seed=1, progress=False)
    got = self_prompts(loaded.model, tok, 5, **kw)
    assert len(got) == 5 and len({g.lower() for g in got}) == 5
    assert all(16 <= len(g) <= 1500 and "<|im_end|>" not in g for g in got)
    assert self_prompts(loaded.model, tok, 5, **kw) == got
    with pytest.raises(ValueError, match="temperature"):
        self_prompts(loaded.model, tok, 2, temperature=0.0)
    write_prompts(tmp_path / "p.jsonl", got)
    assert [json.loads(x)["prompt"] for x in (tmp_path / "p.jsonl").read_text().splitlines()] \
        == got
    assert not (tmp_path / "p.jsonl.tmp").exists()


def test_self_prompts_start_with_their_openers(default_model_dir, tmp_path):
    """Seeded Magpie: each row's request begins with its opener (rows take the openers in
    turn) and the target writes the rest; a bad openers file is a clear error."""
    loaded = load_model(str(default_model_dir), dtype=torch.float32)
    tok = Tokenizer(loaded.path, loaded.config.eos_token_ids)
    openers = ["Write a short poem about", "Explain why"]
    got = self_prompts(loaded.model, tok, 4, batch_size=4, max_new_tokens=64, seed=2,
                       openers=openers, progress=False)
    assert len(got) == 4 and {o for o in openers if any(g.startswith(o) for g in got)} \
        == set(openers)
    assert all(any(g.startswith(o) and len(g) > len(o) + 2 for o in openers) for g in got)
    f = tmp_path / "openers.txt"
    f.write_text("# writing\nWrite a\n\nImagine you are\n")
    assert read_openers(str(f)) == ["Write a", "Imagine you are"]
    with pytest.raises(FileNotFoundError, match="openers"):
        read_openers(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no openers"):
        read_openers(str(tmp_path / "empty.txt"))


# -- checkpoints ------------------------------------------------------------------------------

def test_checkpoints_are_whole_or_ignored(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(root, 1, {"x": 1})
    save_checkpoint(root, 2, {"x": 2})
    save_checkpoint(root, 3, {"x": 3}, keep=2)
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000002", "step-00000003"]
    # a killed write: a temp dir, and a renamed dir without its marker
    (root / ".tmp-step-00000009-1").mkdir()
    (root / ".tmp-step-00000009-1" / "state.pt").write_bytes(b"half")
    (root / "step-00000010").mkdir()
    (root / "step-00000010" / "state.pt").write_bytes(b"half")
    assert latest_checkpoint(root).name == "step-00000003"
    assert load_checkpoint(latest_checkpoint(root))["x"] == 3
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(root / "step-00000010")


# -- end to end ----------------------------------------------------------------------------

def _prompts(tmp_path: pathlib.Path, n: int) -> pathlib.Path:
    p = tmp_path / "prompts.jsonl"
    topics = ["cats", "rivers", "trains", "bread", "stars", "music", "rain", "chess"]
    with p.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Write about {topics[i % 8]} number {i}."}) + "\n")
    return p


def _cfg(tmp_path, data, out, **kw) -> TrainConfig:
    base = dict(target=str(data["model"]), data=[str(data["prompts"])], out=str(out),
                draft_vocab_size=400, ttt_length=3, epochs=8, lr=3e-3, batch_tokens=512,
                max_len=96, eval_fraction=0.1, eval_every=0, save_every=4, log_every=2,
                regen_max_new_tokens=24, regen_batch_size=8, device="cpu", progress=False,
                export_formats=("sglang", "speculators"), export_dtype="float32")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("train")
    data = {"model": tiny_model_dir, "prompts": _prompts(tmp, 40)}
    out = tmp / "run"
    exported = train_draft(_cfg(tmp, data, out))
    return tmp, data, out, exported


def test_training_loss_falls_and_the_export_decodes_losslessly(tiny_run, tiny_model_dir):
    tmp, data, out, exported = tiny_run
    hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in hist if "loss" in h]
    assert len(losses) >= 5 and losses[-1] < 0.7 * losses[0], losses
    final = [h for h in hist if h.get("final")][0]["eval"]
    assert len(final["acceptance_by_position"]) == 3 and final["labels"] > 0
    cfg_json = json.loads((exported / "config.json").read_text())
    prov = cfg_json["specscope_provenance"]
    assert prov["target_num_layers"] == 2 and prov["aux_layer_ids_convention"] == \
        "output-of-layer" and prov["draft_vocab_size"] == 400
    assert prov["trainer"].startswith("specscope-train-draft")
    # the engine loads both exports with no options, and speculation stays lossless
    plain = LLM(str(tiny_model_dir), dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = plain.generate("Write about cats number 3.", params)[0].token_ids
    for d in (exported, out / "draft-speculators"):
        spec = LLM(str(tiny_model_dir), dtype="fp32", device="cpu",
                   spec=SpecConfig(draft=str(d), num_steps=3))
        got = spec.generate("Write about cats number 3.", params)[0]
        assert got.token_ids == ref
        assert got.spec["cycles"] > 0 and got.spec["simulated"] is False
    loaded = load_draft(exported, plain.model_config)
    assert loaded.config.aux_layer_ids == tuple(prov["aux_layer_ids"])


def test_resume_after_an_interruption_gives_the_same_state(tiny_run, tmp_path):
    """Killed after step 6 (last checkpoint at 4), resumed: the final draft, optimizer and
    metrics equal an uninterrupted run's."""
    _, data, ref_out, _ = tiny_run
    # reuse the reference run's regenerated data so both runs see the same conversations
    out = tmp_path / "run"
    out.mkdir()
    (out / "regenerated.jsonl").write_bytes((ref_out / "regenerated.jsonl").read_bytes())
    train_draft(_cfg(tmp_path, data, out, stop_after_steps=6))
    assert latest_checkpoint(out / "checkpoints").name == "step-00000004"
    train_draft(_cfg(tmp_path, data, out, resume=True))
    a = load_checkpoint(latest_checkpoint(ref_out / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert a["step"] == b["step"]
    for k in a["draft"]:
        assert torch.equal(a["draft"][k], b["draft"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
    assert [h.get("loss") for h in a["history"]] == [h.get("loss") for h in b["history"]]


def test_resume_refuses_other_settings(tiny_run, tmp_path):
    _, data, ref_out, _ = tiny_run
    out = tmp_path / "run"
    out.mkdir()
    (out / "regenerated.jsonl").write_bytes((ref_out / "regenerated.jsonl").read_bytes())
    train_draft(_cfg(tmp_path, data, out, stop_after_steps=4))
    with pytest.raises(ValueError, match="cannot resume"):
        train_draft(_cfg(tmp_path, data, out, resume=True, lr=1e-3))


def test_tap_cache_is_written_once_and_read_back(tiny_run, tmp_path, capsys):
    _, data, ref_out, _ = tiny_run
    out = tmp_path / "run"
    out.mkdir()
    (out / "regenerated.jsonl").write_bytes((ref_out / "regenerated.jsonl").read_bytes())
    cache = tmp_path / "taps"
    train_draft(_cfg(tmp_path, data, out, tap_cache=str(cache), epochs=2,
                     export_formats=("sglang",)))
    assert "tap cache" in capsys.readouterr().err
    files = list(cache.glob("*/*.safetensors"))
    n_train = json.loads((out / "draft" / "config.json").read_text())[
        "specscope_provenance"]["train_examples"]
    assert len(files) == n_train and not list(cache.glob("*/.tmp-*"))


def test_cli_train_draft_errors_cleanly(tmp_path, capsys):
    from specscope.cli import main

    assert main(["train-draft", "--data", str(tmp_path / "nope.jsonl"), "--out",
                 str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "nope.jsonl not found" in capsys.readouterr().err
    assert main(["train-draft", "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "no training data" in capsys.readouterr().err


def test_the_shipped_default_draft_loads_and_is_lossless(default_model_dir):
    """`--draft default` is the draft trained for SmolLM2-135M-Instruct: under 25 MB, with a
    provenance block, loaded with no options; greedy speculation equals plain decoding."""
    from specscope.draft.loader import default_draft_dir

    d = default_draft_dir()
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size <= 25_000_000, size
    prov = json.loads((d / "config.json").read_text())["specscope_provenance"]
    assert prov["target_num_layers"] == 30 and prov["aux_layer_ids"] == [1, 14, 26]
    plain = LLM(str(default_model_dir), dtype="fp32", device="cpu")
    msgs = [{"role": "user", "content": "What is 12 times 7?"}]
    params = SamplingParams(max_tokens=32)
    ref = plain.generate(msgs, params)[0]
    plain.set_spec(SpecConfig(draft="default", num_steps=5))
    got = plain.generate(msgs, params)[0]
    assert got.token_ids == ref.token_ids
    assert got.spec["accept_length"] > 1.5, got.spec  # a trained draft, not a random one


def test_init_from_continues_from_a_trained_draft(tiny_run, tmp_path):
    """--init-from: the trained draft's weights, taps and vocabulary, a fresh schedule; its
    first loss is the trained draft's, far below a fresh draft's first loss."""
    tmp, data, out, exported = tiny_run
    fresh = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    cont = tmp_path / "cont"
    regen = {**data, "prompts": out / "regenerated.jsonl"}
    train_draft(_cfg(tmp, regen, cont, init_from=str(exported), epochs=1, save_every=0,
                     draft_vocab_size=None, regenerate=False))
    hist = [json.loads(x) for x in (cont / "metrics.jsonl").read_text().splitlines()]
    first = next(h["loss"] for h in hist if "loss" in h)
    assert first < 0.8 * next(h["loss"] for h in fresh if "loss" in h)
    prov = json.loads((cont / "draft" / "config.json").read_text())["specscope_provenance"]
    assert prov["init_from"] == exported.name and prov["draft_vocab_size"] == 400
    assert prov["aux_layer_ids"] == json.loads((exported / "config.json").read_text())[
        "specscope_provenance"]["aux_layer_ids"]


def test_ttt_step_benchmark_runs(tmp_path):
    """benchmarks/ttt_step.py (the GPU measurement of --ttt-attention) runs end to end and
    reports every mode."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "ttt.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "ttt_step.py"), "--device", "cpu",
                    "--shape", "tiny", "--draft-vocab", "200", "--batch-tokens", "128",
                    "--seq", "64", "--ttt-length", "3", "--iters", "1", "--warmup", "0",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"dense", "sdpa"}
    assert all(r["step_ms"] > 0 and r["loss"] > 0 for r in res.values())
    # same weights, same batch, same math (the timed steps use lengths of their own per mode)
    assert abs(res["dense"]["check_loss"] - res["sdpa"]["check_loss"]) < 1e-3


def test_provenance_names_data_files_by_their_shortest_distinct_path():
    """Rounds of regeneration all write regenerated.jsonl: the provenance block tells them
    apart by the shortest trailing path, without publishing whole directories."""
    from specscope.train.provenance import short_names

    assert short_names(["/a/x/gsm8k.jsonl", "/b/y/chat.jsonl"]) == ["gsm8k.jsonl", "chat.jsonl"]
    assert short_names(["/r/regen/regenerated.jsonl", "/r/self4/regenerated.jsonl"]) == [
        "regen/regenerated.jsonl", "self4/regenerated.jsonl"]
    assert short_names(["/p/a/d.jsonl", "/q/a/d.jsonl"]) == ["p/a/d.jsonl", "q/a/d.jsonl"]
    assert short_names([]) == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_data_parallel_training_over_two_processes(tiny_run, tmp_path):
    """A torchrun-style launch of two processes (gloo on the CPU): regeneration is sharded
    and put back in input order, every step averages both ranks' gradients (the replicas are
    checked bit-equal at each checkpoint and at the end, else training fails), rank 0 alone
    writes, and its export decodes losslessly."""
    import os
    import subprocess
    import sys

    _, data, _, _ = tiny_run
    out = tmp_path / "ddp"
    cfg = dataclasses.asdict(_cfg(tmp_path, data, out, max_steps=6, save_every=3,
                                  eval_every=3, export_formats=("sglang",)))
    script = ("import json, sys\n"
              "from specscope.train.trainer import TrainConfig, train_draft\n"
              "cfg = json.loads(sys.argv[1])\n"
              "cfg['export_formats'] = tuple(cfg['export_formats'])\n"
              "train_draft(TrainConfig(**cfg))\n")
    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script, json.dumps(cfg)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    # each rank answered every other conversation, into its own file
    shards = [read_regenerated(out / f"regenerated.rank{r}-of-2.jsonl") for r in range(2)]
    assert sorted(shards[0]) == list(range(20)) and sorted(shards[1]) == list(range(20))
    assert shards[0][3][0]["content"] == "Write about rain number 6."  # input 2 * 3 + 0
    assert shards[1][3][0]["content"] == "Write about chess number 7."  # input 2 * 3 + 1
    assert not (out / "regenerated.jsonl").exists()
    # rank 0 alone wrote the metrics: one line per log step, the evaluations, the final one
    hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist if "loss" in h] == [2, 4, 6]
    assert [h["step"] for h in hist if "eval" in h] == [3, 6] and hist[-1]["final"]
    assert hist[-1]["eval"]["labels"] > 0
    assert latest_checkpoint(out / "checkpoints").name == "step-00000006"
    prov = json.loads((out / "draft" / "config.json").read_text())["specscope_provenance"]
    assert prov["processes"] == 2 and prov["steps"] == 6
    plain = LLM(str(data["model"]), dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = plain.generate("Write about cats number 3.", params)[0].token_ids
    spec = LLM(str(data["model"]), dtype="fp32", device="cpu",
               spec=SpecConfig(draft=str(out / "draft"), num_steps=3))
    assert spec.generate("Write about cats number 3.", params)[0].token_ids == ref


def test_data_parallel_self_prompts_are_sharded_and_read_back_in_order(tmp_path, monkeypatch):
    """Each rank writes its share of --self-prompts with its own seed into its own file; every
    rank reads all shares back in rank order, without duplicates."""
    from specscope.train import corpus
    from specscope.train.parallel import Ranks

    seeds = []

    def fake(model, tokenizer, n, *, seed, **kw):
        seeds.append(seed)
        first = 0 if seed == 4 else 2  # rank 1's first request repeats rank 0's last
        return [f"request {first + i}" for i in range(n)]

    class Waiting(Exception):
        pass

    def waits(ranks):  # rank 1 reaches the barrier before rank 0 has written
        raise Waiting

    monkeypatch.setattr(corpus, "self_prompts", fake)
    monkeypatch.setattr(corpus, "barrier", waits)
    cfg = TrainConfig(target=None, data=[], out=str(tmp_path), self_prompts=5, seed=4,
                      progress=False)
    with pytest.raises(Waiting):
        corpus.run_self_prompts(None, None, cfg, tmp_path, None, Ranks(1, 2, 1))
    monkeypatch.setattr(corpus, "barrier", lambda ranks: None)
    got = corpus.run_self_prompts(None, None, cfg, tmp_path, None, Ranks(0, 2, 0))
    assert seeds == [4 + 100_003, 4]
    assert (tmp_path / "self_prompts.rank1-of-2.jsonl").is_file()
    # rank 0's 3 requests, then rank 1's 2 less the repeat; rank 1 reads the same
    assert got == ["request 0", "request 1", "request 2", "request 3"]
    assert corpus.run_self_prompts(None, None, cfg, tmp_path, None, Ranks(1, 2, 1)) == got
    assert len(seeds) == 2  # its share was read back, not written again
    # one process: the old file name and the run's own seed
    seeds.clear()
    one = corpus.run_self_prompts(None, None, cfg, tmp_path, None, Ranks())
    assert seeds == [4] and len(one) == 5 and (tmp_path / "self_prompts.jsonl").is_file()


def test_max_answer_tokens_cuts_each_example_after_its_nth_assistant_token():
    """--max-answer-tokens N keeps each example up to its N-th assistant token (all turns
    counted together); shorter examples stay whole; runs without it keep their fingerprint."""
    from specscope.train.config import fingerprint
    from specscope.train.data import Example, cap_answer_tokens

    ex = Example(ids=list(range(10)), mask=[False, False, True, True, False, True, True, True,
                                            False, True])
    assert cap_answer_tokens(ex, 3) == Example(ids=list(range(6)), mask=ex.mask[:6])
    assert cap_answer_tokens(ex, 6) == ex and cap_answer_tokens(ex, 99) == ex
    with pytest.raises(ValueError, match="max-answer-tokens"):
        cap_answer_tokens(ex, 0)
    base = TrainConfig(target=None, data=[], out="o")
    capped = dataclasses.replace(base, max_answer_tokens=256)
    assert fingerprint(base, 10) == "4fdfd8dfe6853cee"  # as before the option existed
    assert fingerprint(capped, 10) != fingerprint(base, 10)
