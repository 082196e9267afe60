"""The scheduler over block pools, driven by a fake engine that appends tokens: budgets,
chunked prefill, speculation near the context's end, prefix-cache hits, preemption when
blocks run out, and every block back in the pool at the end."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specscope.config import SamplingParams
from specscope.engine.scheduler import Pool, Scheduler, block_keys
from specscope.engine.sequence import Sequence, SequenceStatus
from specscope.kvcache.block_pool import BlockPool

BS = 4


def _sched(num_blocks=64, spec_tokens=0, draft=True, max_tokens=32, max_seqs=8,
           max_model_len=256, caching=True):
    pools = [Pool(BlockPool(num_blocks, BS, caching))]
    if draft:
        pools.append(Pool(BlockPool(num_blocks, BS, caching), draft=True,
                          spec_lookahead=max(spec_tokens, 1) + 1))
    return Scheduler(pools, max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                     max_model_len=max_model_len, spec_tokens=spec_tokens)


def _check_tables(s: Scheduler) -> None:
    """Every held block's reference count is the number of running tables holding it."""
    for i, p in enumerate(s.pools):
        held = Counter(b for q in s.running for b in q.block_tables[i])
        for b in range(p.blocks.num_blocks):
            assert p.blocks.ref_count(b) == held[b], (i, b)


def _drive(s: Scheduler, seqs, out_len, rng, max_steps=2000, accept=None):
    """Run until every sequence has out_len tokens; returns the plans. accept(n): the draft
    tokens a tree of n nodes gets accepted (default: uniformly drawn)."""
    for q in seqs:
        s.add(q)
    plans = []
    for _ in range(max_steps):
        if not s.has_work:
            break
        plan = s.schedule()
        assert not plan.empty
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert len(plan.scheduled) <= s.max_num_seqs
        plans.append(plan)
        for item in plan.scheduled:
            q = item.seq
            if item.speculative:  # the whole tree fits the context
                assert q.num_computed + item.num_tokens <= s.max_model_len
            for i, table in enumerate(q.block_tables):  # every written position has a block
                assert len(table) * BS >= q.num_computed + item.num_tokens, i
            if item.speculative:
                a = accept(item.num_tokens) if accept else rng.randrange(item.num_tokens)
                q.output_ids += [rng.randrange(1000) for _ in range(a + 1)]
                s.computed(q, a + 1)
            else:
                done = item.num_tokens == q.num_uncomputed
                if done:
                    q.output_ids.append(rng.randrange(1000))
                s.computed(q, item.num_tokens)
            if len(q.output_ids) >= out_len:
                s.finish(q, "length")
        _check_tables(s)
    assert not s.has_work
    assert all(q.finished and len(q.output_ids) >= out_len for q in seqs)
    for p in s.pools:
        assert p.blocks.all_free()
    return plans


def _seq(i, prompt):
    return Sequence(f"s{i}", list(prompt), SamplingParams(max_tokens=64))


@pytest.mark.parametrize("spec_tokens", [0, 5])
def test_every_sequence_finishes_within_budgets_and_frees_its_blocks(spec_tokens):
    rng = random.Random(0)
    s = _sched(spec_tokens=spec_tokens, max_tokens=16, max_seqs=4)
    seqs = [_seq(i, [rng.randrange(1000) for _ in range(rng.randrange(3, 40))])
            for i in range(10)]
    plans = _drive(s, seqs, 20, rng)
    # long prompts went in chunks, never over the budget, and running ones went first
    assert any(0 < it.num_tokens < len(it.seq.prompt_ids) for p in plans for it in p.scheduled)
    if spec_tokens:
        assert any(it.speculative for p in plans for it in p.scheduled)


def test_a_shared_system_prompt_is_prefilled_once():
    rng = random.Random(1)
    s = _sched(max_tokens=64)
    system = [rng.randrange(1000) for _ in range(21)]  # 5 full blocks and one token
    a = _seq(0, system + [1, 2])
    _drive(s, [a], 4, rng)
    b = _seq(1, system + [7, 8, 9])
    s.add(b)
    plan = s.schedule()
    assert b.num_cached == 20  # 5 blocks of 4 (target and draft agree: the draft's key
    # needs the token after a block, which both prompts share up to position 20)
    assert plan.scheduled[0].num_tokens == b.num_tokens - 20
    st = s.pools[0].blocks.stats()
    assert st.prefix_hits == 5
    s.finish(b, "cancelled")
    for p in s.pools:
        assert p.blocks.all_free()


def test_the_draft_hit_is_cut_where_the_next_token_differs():
    """Block 4 of the two prompts is equal, but the token after it is not: the draft's K/V
    at that block's last position differ, so both pools hit 4 blocks, not 5."""
    rng = random.Random(2)
    s = _sched(max_tokens=64)
    shared = [rng.randrange(1000) for _ in range(20)]
    _drive(s, [_seq(0, shared + [1, 2, 3])], 2, rng)
    b = _seq(1, shared + [9, 2, 3])
    s.add(b)
    s.schedule()
    assert b.num_cached == 16
    s.finish(b, "cancelled")
    # without the draft pool the target alone hits all 5
    s2 = _sched(max_tokens=64, draft=False)
    _drive(s2, [_seq(0, shared + [1, 2, 3])], 2, rng)
    c = _seq(1, shared + [9, 2, 3])
    s2.add(c)
    s2.schedule()
    assert c.num_cached == 20
    s2.finish(c, "cancelled")


def test_preemption_when_blocks_run_out_loses_nothing():
    """A pool of 14 blocks for 4 sequences that need up to 11 each: the newest running ones
    are preempted, recomputed later, and every sequence still reaches its length."""
    rng = random.Random(3)
    s = _sched(num_blocks=14, spec_tokens=4, max_tokens=32, max_seqs=4)
    seqs = [_seq(i, [rng.randrange(1000) for _ in range(10)]) for i in range(4)]
    plans = _drive(s, seqs, 30, rng)
    assert sum(len(p.preempted) for p in plans) > 0
    assert any(q.num_preemptions for q in seqs)


def test_speculation_falls_back_to_plain_steps_near_the_end_of_the_context():
    rng = random.Random(4)
    s = _sched(spec_tokens=6, max_model_len=40, max_tokens=64)
    q = _seq(0, [rng.randrange(1000) for _ in range(8)])
    plans = _drive(s, [q], 31, rng, accept=lambda n: 0)  # checks each tree fits as it runs
    kinds = [it.speculative for p in plans for it in p.scheduled]
    assert True in kinds and kinds[-1] is False  # the last steps are plain


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="must cover one step of every sequence"):
        Scheduler([Pool(BlockPool(8, BS))], max_num_batched_tokens=4, max_num_seqs=8,
                  max_model_len=64)
    with pytest.raises(ValueError, match="one block size"):
        Scheduler([Pool(BlockPool(8, 4)), Pool(BlockPool(8, 8))], max_num_batched_tokens=16,
                  max_num_seqs=2, max_model_len=64)
    s = _sched(num_blocks=3, max_model_len=1000)
    with pytest.raises(ValueError, match="needs more KV blocks than the pool holds"):
        s.add(_seq(0, list(range(20))))
    with pytest.raises(ValueError, match="leave no room under max_model_len"):
        _sched(max_model_len=10).add(_seq(0, list(range(10))))


def test_block_keys_chain_and_the_draft_key_needs_the_next_token():
    t = list(range(12))
    assert len(block_keys(t, 4, False)) == 3 and len(block_keys(t, 4, True)) == 2
    assert block_keys(t, 4, False)[:2] == block_keys(t[:9], 4, False)[:2]
    k = block_keys(t, 4, False)
    assert block_keys(t, 4, False, start=1, parent=k[0]) == k[1:]
    assert block_keys([0, 1, 2, 3, 4], 4, True) != block_keys([0, 1, 2, 3, 5], 4, True)
    assert Sequence("x", [1], SamplingParams()).status is SequenceStatus.WAITING


def test_sequence_token_slices_equal_the_whole_list():
    from specscope.config import SamplingParams
    from specscope.engine.sequence import Sequence

    seq = Sequence("s", [1, 2, 3, 4], SamplingParams(max_tokens=8), output_ids=[5, 6, 7])
    whole = seq.token_ids
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 2):
            assert seq.tokens(a, b) == whole[a:b], (a, b)
    assert seq.last_token == 7
    assert Sequence("t", [9, 8], SamplingParams()).last_token == 8


def test_a_step_verifies_no_more_trees_than_fit_the_budget_once_padded():
    """Trees of 7 nodes on a 48-token budget: 6 would fit, but a CUDA-graph verify pads 6 to
    the bucket of 8 (56 rows of logits), so a step verifies at most 4; the other running
    sequences take plain steps beside them."""
    rng = random.Random(6)
    s = _sched(num_blocks=256, spec_tokens=7, max_tokens=48, max_seqs=8)
    assert s.max_trees() == 4
    seqs = [_seq(i, [rng.randrange(1000) for _ in range(5)]) for i in range(8)]
    plans = _drive(s, seqs, 24, rng)
    trees = [sum(it.speculative for it in p.scheduled) for p in plans]
    assert max(trees) == 4
    assert any(t == 4 and len(p.scheduled) > 4 for t, p in zip(trees, plans, strict=True))
    assert _sched(spec_tokens=0).max_trees() == 0
    assert _sched(spec_tokens=2, max_tokens=2048, max_seqs=8).max_trees() == 1024
