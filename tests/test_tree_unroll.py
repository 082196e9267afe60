"""The tree unroll (tune/tree_unroll.py) against the engine's own EAGLE-2 tree builder."""

from __future__ import annotations

import pytest
import torch

from specscope.config import ModelConfig, SamplingParams
from specscope.draft.eagle3 import random_draft
from specscope.kvcache import KVCache
from specscope.models.loader import random_model
from specscope.spec.drafter import draft_tree
from specscope.tune.tree_unroll import unroll_tree

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=80,
                   hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=128, tie_word_embeddings=False, name="tiny")


def _engine_tree(draft, ids, taps, t, topk, steps):
    """draft_tree after an extend over indices 0..t, every candidate kept: its tokens in
    creation order (depth 1's topk, then topk^2 per step) and their parents."""
    cache = KVCache(len(draft.layers), 1, TINY.num_kv_heads, 96, TINY.head_dim,
                    torch.float32, "cpu")
    h, normed = draft(ids[:, 1:t + 2], draft.project(taps[:, :t + 1]),
                      torch.arange(t + 1)[None], cache, kv_len=t + 1)
    n_all = topk + (steps - 1) * topk * topk
    n = t + 1
    k_pos = torch.arange(96)

    def step(tokens, hidden, rope, query_slots, anc):  # drafter.DraftStep on a contiguous cache
        T = anc.shape[-1]
        rel = k_pos - n
        in_tree = (rel >= 0) & (rel < T)
        mask = (k_pos < n)[None, :] | (anc[0][:, rel.clamp(0, T - 1)] & in_tree[None, :])
        hh, nn = draft(tokens, hidden, rope, cache, kv_len=96, slots=(n + query_slots)[None],
                       attn_mask=mask[None])
        return hh, nn

    tree = draft_tree(step, draft, h[:, t], normed[:, t],
                      ids[0, t + 1:t + 2], torch.tensor([n]), steps, topk, n_all + 1,
                      [SamplingParams(max_tokens=1)])
    return tree.tokens[0, 1:], tree.parents[0, 1:]


def _setup(num_layers: int, seed: int = 0):
    torch.manual_seed(seed)
    target = random_model(TINY, torch.float32, "cpu", seed=1)
    draft = random_draft(TINY, torch.float32, "cpu", draft_vocab_size=50, seed=2,
                         num_layers=num_layers, std=0.2)
    draft.attach_target(target)
    draft.init_rope(128)
    target.set_taps(draft.config.aux_layer_ids)
    return target, draft


@pytest.mark.parametrize("num_layers,topk", [(1, 2), (1, 4), (2, 3)])
def test_unrolled_trees_equal_the_engines(num_layers, topk):
    """At every index t, the unrolled candidates (tokens in creation order, depth by depth)
    are exactly those draft_tree builds after an extend ending at t."""
    target, draft = _setup(num_layers)
    T, steps = 16, 4
    ids = torch.randint(0, TINY.vocab_size, (1, T))
    _, taps = target(ids, torch.arange(T)[None], return_taps=True)
    mask = torch.ones(1, T, dtype=torch.bool)
    lo = 3
    _, _, _, tokens = unroll_tree(draft, taps, ids, mask, lo, topk, steps)
    for t in range(lo, T - 1):
        eng, _ = _engine_tree(draft, ids, taps, t, topk, steps)
        mine = torch.cat([tokens[0, t - lo, 0, :topk]] +
                         [tokens[0, t - lo, d] for d in range(1, steps)])
        assert torch.equal(mine, eng), t


def test_the_path_is_found_where_the_answer_follows_the_tree():
    """Tokens after index t + 1 do not change the tree at t, so an answer can be made to walk
    any of its nodes: the path is then present down to that node and absent past it unless
    the next token happens to be a child too."""
    target, draft = _setup(1, seed=3)
    T, steps, topk, t = 20, 4, 3, 5
    ids = torch.randint(0, TINY.vocab_size, (1, T))
    _, taps = target(ids, torch.arange(T)[None], return_taps=True)
    tok, par = _engine_tree(draft, ids, taps, t, topk, steps)
    node = len(tok) - 1  # the last candidate: depth `steps`, a child of the last beam
    chain = []
    while node >= 0:
        chain.append(int(tok[node]))
        node = int(par[node]) - 1  # parents index the tree with the root at 0
    chain.reverse()
    assert len(chain) == steps
    ids[0, t + 2:t + 2 + steps] = torch.tensor(chain)
    _, taps = target(ids, torch.arange(T)[None], return_taps=True)
    mask = torch.ones(1, T, dtype=torch.bool)
    scores, path, present, _ = unroll_tree(draft, taps, ids, mask, t, topk, steps)
    assert present[0, 0].tolist() == [True] * steps
    for d in range(steps):  # the path's score is one of its depth's candidates'
        assert (scores[0, 0, d] == path[0, 0, d]).any()
    assert (path[0, 0, 1:] <= path[0, 0, :-1]).all()  # cumulative log-probs only fall
    # Outside the answer (label mask off), no path at all.
    off = mask.clone()
    off[0, t + 2:] = False
    _, _, present_off, _ = unroll_tree(draft, taps, ids, off, t, topk, steps)
    assert not present_off[0, 0].any()


def test_a_batch_of_sequences_equals_each_alone():
    """Sequences of different lengths unrolled together (padded, from the earliest start)
    give each one's trees as when it runs alone."""
    target, draft = _setup(2, seed=5)
    lens, lo, steps, topk = [15, 11], 4, 4, 3
    T = max(lens)
    ids = torch.randint(0, TINY.vocab_size, (2, T))
    mask = torch.zeros(2, T, dtype=torch.bool)
    for b, n in enumerate(lens):
        mask[b, 6:n] = True
    _, taps = target(ids, torch.arange(T)[None].expand(2, T), return_taps=True)
    both = unroll_tree(draft, taps, ids, mask, lo, topk, steps)
    for b, n in enumerate(lens):
        alone = unroll_tree(draft, taps[b:b + 1, :n], ids[b:b + 1, :n], mask[b:b + 1, :n],
                            lo, topk, steps)
        for x, y in zip(both, alone, strict=True):
            # up to index n - 2: the last index's root would be the token after the end
            torch.testing.assert_close(x[b:b + 1, :n - 1 - lo], y[:, :n - 1 - lo], atol=1e-5,
                                       rtol=0)
