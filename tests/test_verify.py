"""Tests for specscope.spec.verify: greedy and lossless rejection-sampling verification.

The statistical tests check losslessness: with a Markov target (the next-token distribution
after a node is P[token of that node]), the first emitted token must follow P[root] and the
first two emitted tokens must follow P[root, a] * P[a, b], whatever the draft proposes. Trials
run vectorised with torch.vmap over verify_sampling_from_noise (the same walk verify_sampling
runs, with its random numbers passed in); every seed is fixed, so the tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from specscope.spec.tree import DraftTree
from specscope.spec.verify import (
    Verdict,
    _normalize_or,
    children_table,
    emitted_tokens,
    emitted_tokens_batch,
    verify_greedy,
    verify_greedy_batch,
    verify_sampling,
    verify_sampling_from_noise,
)

# ---------------------------------------------------------------- helpers


def _tree(parents: list[int], tokens: list[int], draft_probs: torch.Tensor | None = None,
          ) -> DraftTree:
    depth = [0] * len(parents)
    for i, par in enumerate(parents):
        depth[i] = 0 if par < 0 else depth[par] + 1
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                     depth=torch.tensor(depth), draft_probs=draft_probs)


def _chain_parents(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def _logits(argmaxes: list[int], V: int = 16) -> torch.Tensor:
    """[N, V] random logits whose row i has its argmax at argmaxes[i]."""
    g = torch.Generator().manual_seed(len(argmaxes))
    x = torch.randn(len(argmaxes), V, generator=g)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return x


def _check(v: Verdict, tree: DraftTree, path: list[int], bonus: int, emitted: list[int]
           ) -> None:
    assert v.path.tolist() == path
    assert v.num_accepted.item() == sum(n >= 0 for n in path) - 1
    assert v.bonus.item() == bonus
    assert emitted_tokens(tree, v).tolist() == emitted


# ---------------------------------------------------------------- greedy


def test_greedy_chain_perfect_match() -> None:
    tree = _tree(_chain_parents(4), [9, 3, 5, 7])
    v = verify_greedy(tree, _logits([3, 5, 7, 11]), max_depth=3)
    _check(v, tree, [0, 1, 2, 3], 11, [3, 5, 7, 11])


def test_greedy_chain_first_token_mismatch() -> None:
    tree = _tree(_chain_parents(4), [9, 3, 5, 7])
    # Later drafts "match" their own parents' predictions, but the first one is wrong.
    v = verify_greedy(tree, _logits([4, 5, 7, 11]), max_depth=3)
    _check(v, tree, [0, -1, -1, -1], 4, [4, -1, -1, -1])


def test_greedy_chain_mismatch_in_middle() -> None:
    tree = _tree(_chain_parents(4), [9, 3, 5, 7])
    v = verify_greedy(tree, _logits([3, 6, 7, 11]), max_depth=3)
    _check(v, tree, [0, 1, -1, -1], 6, [3, 6, -1, -1])


def test_greedy_tree_second_child_correct() -> None:
    #   0 ─┬─ 1 (5) ── 3 (1)
    #      └─ 2 (7)
    tree = _tree([-1, 0, 0, 1], [9, 5, 7, 1])
    v = verify_greedy(tree, _logits([7, 1, 12, 0]), max_depth=2)
    _check(v, tree, [0, 2, -1], 12, [7, 12, -1])


def test_greedy_tree_deeper_branch_wins_and_ancestors_matter() -> None:
    #   0 ─┬─ 1 (5) ── 3 (1) ── 6 (8)      1 is wrong, so 3 and 6 are rejected although
    #      │                               each matches its own parent's prediction
    #      └─ 2 (7) ─┬─ 4 (2)
    #                └─ 5 (3) ── 7 (4)     the accepted path: 0, 2, 5, 7
    tree = _tree([-1, 0, 0, 1, 2, 2, 3, 5], [9, 5, 7, 1, 2, 3, 8, 4])
    y = [7, 1, 3, 8, 0, 4, 0, 13]
    v = verify_greedy(tree, _logits(y), max_depth=3)
    _check(v, tree, [0, 2, 5, 7], 13, [7, 3, 4, 13])
    # One more level of padding changes nothing but the shapes.
    v = verify_greedy(tree, _logits(y), max_depth=4)
    _check(v, tree, [0, 2, 5, 7, -1], 13, [7, 3, 4, 13, -1])


@pytest.mark.parametrize("chain", [False, True])
def test_a_batch_of_trees_is_verified_each_as_alone(chain: bool) -> None:
    """Batch-first verification of 6 trees of one shape, each with its own tokens and
    logits (some accept everything, some nothing), equals each verified alone: no row reads
    another's nodes."""
    g = torch.Generator().manual_seed(7)
    parents = _chain_parents(5) if chain else [-1, 0, 0, 1, 1, 2, 3]
    N, V, D = len(parents), 16, 4 if chain else 3
    trees, logits = [], []
    for b in range(6):
        tokens = torch.randperm(V, generator=g)[:N].tolist()  # distinct: siblings differ
        t = _tree(parents, tokens)
        t.chain = chain
        # the target agrees with a random child after each node, more often for low b
        arg = [tokens[c] if torch.rand(1, generator=g) < 1 - b / 6 else (tokens[c] + 1) % V
               for c in [next((j for j in range(N) if parents[j] == i), 0)
                         for i in range(N)]]
        trees.append(t)
        logits.append(_logits(arg, V))
    tok = torch.stack([t.tokens for t in trees])
    par = torch.stack([t.parents for t in trees])
    dep = torch.stack([t.depth for t in trees])
    path, a, bonus = verify_greedy_batch(tok, par, dep, torch.stack(logits), D, chain)
    emitted = emitted_tokens_batch(tok, path, a, bonus)
    seen = set()
    for b, (t, lg) in enumerate(zip(trees, logits, strict=True)):
        v = verify_greedy(t, lg, D)
        assert path[b].tolist() == v.path.tolist() and int(a[b]) == int(v.num_accepted)
        assert int(bonus[b]) == int(v.bonus)
        assert emitted[b].tolist() == emitted_tokens(t, v).tolist()
        seen.add(int(a[b]))
    assert len(seen) > 1  # the batch mixes accept lengths


def test_greedy_root_only() -> None:
    tree = _tree([-1], [9])
    v = verify_greedy(tree, _logits([6]), max_depth=2)
    _check(v, tree, [0, -1, -1], 6, [6, -1, -1])


@pytest.mark.parametrize("k", [1, 2, 5, 7])
def test_chain_shortcuts_match_the_general_path(k: int) -> None:
    """DraftTree(chain=True) takes shortcuts in verify_greedy and ancestor_mask; the general
    walk (chain=False) is their reference. Tokens are drawn from a tiny vocabulary so every
    accept length 0..k occurs."""
    g = torch.Generator().manual_seed(k)
    seen = set()
    for trial in range(200):
        V = 3
        logits = torch.randn(k + 1, V, generator=g)
        tokens = torch.randint(0, V, (k + 1,), generator=g)
        if trial % 4 == 0:  # the target's own choices up to a cut: long runs get accepted
            cut = (trial // 4) % (k + 1)
            tokens[1:] = logits[:-1].argmax(-1)
            tokens[1 + cut:] = torch.randint(0, V, (k - cut,), generator=g)
        ref = _tree(_chain_parents(k + 1), tokens.tolist())
        fast = DraftTree(tokens=ref.tokens, parents=ref.parents, depth=ref.depth, chain=True)
        want, got = verify_greedy(ref, logits, k), verify_greedy(fast, logits, k)
        assert got.path.tolist() == want.path.tolist()
        assert got.num_accepted.item() == want.num_accepted.item()
        assert got.bonus.item() == want.bonus.item()
        assert emitted_tokens(fast, got).tolist() == emitted_tokens(ref, want).tolist()
        seen.add(got.num_accepted.item())
        assert torch.equal(fast.ancestor_mask(k), ref.ancestor_mask(k))
    assert seen == set(range(k + 1))


# ---------------------------------------------------------------- oracle drafts


def test_oracle_greedy_chain_and_tree_accept_everything() -> None:
    V, D = 12, 4
    g = torch.Generator().manual_seed(1)
    L = torch.randn(V, V, generator=g)  # Markov target: logits after token t are L[t]
    chain = [3]
    for _ in range(D):
        chain.append(int(L[chain[-1]].argmax()))
    tree = _tree(_chain_parents(D + 1), chain)
    v = verify_greedy(tree, L[tree.tokens], max_depth=D)
    assert v.num_accepted.item() == D
    assert emitted_tokens(tree, v).tolist() == chain[1:] + [int(L[chain[-1]].argmax())]
    # Top-2 tree, depth 2, whose *second* child is the target's choice at every node.
    top2 = L.topk(2, dim=-1).indices  # [V, 2]
    r = 3
    second, best = top2[r, 1].item(), top2[r, 0].item()
    tokens = [r, second, best,
              top2[second, 1].item(), top2[second, 0].item(),  # children of node 1
              top2[best, 1].item(), top2[best, 0].item()]  # children of node 2
    tree = _tree([-1, 0, 0, 1, 1, 2, 2], tokens)
    v = verify_greedy(tree, L[tree.tokens], max_depth=2)
    assert v.path.tolist() == [0, 2, 6] and v.num_accepted.item() == 2


def test_oracle_sampling_draft_equal_to_target_accepts_everything() -> None:
    # q == p: every ratio is 1, so every draft token is accepted (tau = num_steps + 1).
    V, D = 8, 3
    g = torch.Generator().manual_seed(2)
    P = torch.randn(V, V, generator=g).softmax(-1)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        toks = [0]
        for _ in range(D):
            toks.append(int(torch.multinomial(P[toks[-1]], 1, generator=gen)))
        tree = _tree(_chain_parents(D + 1), toks, draft_probs=P[torch.tensor(toks)])
        v = verify_sampling(tree, P[tree.tokens], D, 1, gen)
        assert v.num_accepted.item() == D
        assert emitted_tokens(tree, v)[:D].tolist() == toks[1:]


# ---------------------------------------------------------------- statistical (lossless)

V_STAT = 6
TRIALS = 50_000
ROOT_TOKEN = 0
CHAIN3 = _chain_parents(4)  # root + 3 drafts
#   0 ─┬─ 1 ─┬─ 4      three children at the root, two, one and none below them:
#      │     └─ 5      leaves at depth 1 and 2, and siblings tested one after another
#      ├─ 2 ── 6
#      └─ 3
TREE = [-1, 0, 0, 0, 1, 1, 2]


def _markov(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and draft Q transition matrices [V, V], far from each other."""
    g = torch.Generator().manual_seed(seed)
    P = (1.2 * torch.randn(V_STAT, V_STAT, generator=g)).softmax(-1)
    Q = (1.2 * torch.randn(V_STAT, V_STAT, generator=g)).softmax(-1)
    return P, Q


def _draft(parents: list[int], roots: torch.Tensor, Q: torch.Tensor, draw: str,
           g: torch.Generator) -> torch.Tensor:
    """[T, N] tokens. The m children of a node, from q = Q[node's token], are:
    draw="top": the top-m of q (deterministic); draw="wor": m draws without replacement, in
    draw order (Gumbel-top-k: sorting log q + Gumbel noise, descending, is sequential sampling
    without replacement); draw="iid": m independent draws (duplicates possible)."""
    T, N = roots.shape[0], len(parents)
    tokens = torch.zeros(T, N, dtype=torch.long)
    tokens[:, 0] = roots
    for i in range(N):
        kids = [k for k in range(N) if parents[k] == i]
        if not kids:
            continue
        q = Q[tokens[:, i]]  # [T, V]
        if draw == "iid":
            tokens[:, kids] = torch.multinomial(q, len(kids), replacement=True, generator=g)
            continue
        scores = q.log()
        if draw == "wor":
            u = torch.rand(T, V_STAT, generator=g).clamp_min(1e-20)
            scores = scores - (-u.log()).log()
        tokens[:, kids] = scores.topk(len(kids), dim=-1).indices
    return tokens


def _cycle(parents: list[int], roots: torch.Tensor, P: torch.Tensor, Q: torch.Tensor,
           draw: str, pass_q: bool, g: torch.Generator, max_children: int = 3,
           zero_uniforms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One vectorised verify cycle per trial: emitted tokens [T, D + 1], num_accepted [T]."""
    tree0 = _tree(parents, [0] * len(parents))
    D = int(tree0.depth.max())
    children = children_table(tree0.parents, max_children)  # [N, M]
    tokens = _draft(parents, roots, Q, draw, g)  # [T, N]
    T = tokens.shape[0]
    target = P[tokens]  # [T, N, V]
    draft = Q[tokens] if pass_q else None
    uniforms = torch.rand(T, D, max_children, generator=g)
    if zero_uniforms:
        uniforms.zero_()
    race = torch.empty(T, V_STAT).exponential_(generator=g)

    def one(tok, tgt, dq, u, r):
        path, num, bonus = verify_sampling_from_noise(tok, children, tgt, dq, u, r)
        tree = DraftTree(tokens=tok, parents=tree0.parents, depth=tree0.depth)
        return emitted_tokens(tree, Verdict(path, num, bonus)), num

    if draft is None:
        return torch.vmap(lambda tok, tgt, u, r: one(tok, tgt, None, u, r))(
            tokens, target, uniforms, race)
    return torch.vmap(one)(tokens, target, draft, uniforms, race)


def _first_two(parents: list[int], P: torch.Tensor, Q: torch.Tensor, draw: str,
               pass_q: bool, seed: int, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and second emitted tokens [T] each (the second from a next cycle rooted at the
    first when the first cycle emitted only its bonus), and the first cycle's num_accepted."""
    g = torch.Generator().manual_seed(seed)
    roots = torch.full((TRIALS,), ROOT_TOKEN)
    out1, num1 = _cycle(parents, roots, P, Q, draw, pass_q, g, **kw)
    out2, _ = _cycle(parents, out1[:, 0], P, Q, draw, pass_q, g, **kw)
    second = torch.where(num1 >= 1, out1[:, 1], out2[:, 0])
    return out1[:, 0], second, num1


def _chi2_critical(dof: int, z: float = 3.090232) -> float:
    """Upper 1e-3 quantile of chi-square(dof) by Wilson-Hilferty (z = Phi^-1(1 - 1e-3))."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic of integer samples against probs [K], and its 1e-3 critical value.

    Cells with expected count < 5 are pooled into one cell (the usual validity rule)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a sample fell on a probability-0 cell"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, _chi2_critical(int(keep.sum()) - 1)


def _assert_lossless(first: torch.Tensor, second: torch.Tensor, P: torch.Tensor) -> None:
    stat, crit = _chi2(first, P[ROOT_TOKEN])
    assert stat < crit, f"first token: chi2 {stat:.1f} >= {crit:.1f}"
    joint = (P[ROOT_TOKEN][:, None] * P).reshape(-1)  # [V * V]: P(a) P(b | a)
    stat, crit = _chi2(first * V_STAT + second, joint)
    assert stat < crit, f"first two tokens: chi2 {stat:.1f} >= {crit:.1f}"


def test_chi2_critical_values_match_tables() -> None:
    # Tabulated upper 1e-3 quantiles: dof 5 -> 20.515, 10 -> 29.588, 35 -> 66.619.
    for dof, table in ((5, 20.515), (10, 29.588), (35, 66.619)):
        assert abs(_chi2_critical(dof) - table) / table < 0.015


@pytest.mark.parametrize(("parents", "draw", "pass_q"), [
    pytest.param(CHAIN3, "wor", True, id="chain_sampled_drafts"),
    pytest.param(CHAIN3, "top", False, id="chain_deterministic_drafts"),
    # Sampled drafts verified with the one-hot rule: lossless too (any candidate set is).
    pytest.param(CHAIN3, "wor", False, id="chain_sampled_drafts_one_hot_rule"),
    pytest.param(TREE, "top", False, id="tree_topk_children"),
    pytest.param(TREE, "wor", True, id="tree_sampled_without_replacement"),
])
def test_sampling_is_lossless(parents: list[int], draw: str, pass_q: bool) -> None:
    P, Q = _markov(seed=10)
    first, second, num = _first_two(parents, P, Q, draw, pass_q, seed=20)
    _assert_lossless(first, second, P)
    # The test exercised both branches: some cycles accept drafts, some reject the first.
    assert 0.05 < (num >= 1).double().mean() < 0.95
    assert (num == int(_tree(parents, [0] * len(parents)).depth.max())).any()


def test_sampling_tests_siblings_in_index_order() -> None:
    # Hand-made uniforms: reject every sibling before j (u close to 1 > p(x), one-hot rule),
    # accept sibling j (u = 0 < p(x)), then reject at the next level.
    P, _ = _markov(seed=10)
    children = children_table(torch.tensor(TREE), 3)
    tok = torch.tensor([ROOT_TOKEN, 1, 2, 3, 4, 5, 0])
    for j in range(3):
        u = torch.full((2, 3), 1.0 - 1e-6)
        u[0, j] = 0.0
        path, n, bonus = verify_sampling_from_noise(tok, children, P[tok], None, u,
                                                    torch.ones(V_STAT))
        assert path.tolist() == [0, j + 1, -1] and n.item() == 1
        # The level below rejected its children, so their tokens are out of the bonus's reach.
        below = {tok[k].item() for k in children[j + 1].tolist() if k >= 0}
        assert bonus.item() not in below


@pytest.mark.parametrize(("parents", "draw", "pass_q", "zero_u"), [
    # Accept every draft token (probability 1): the draft's distribution comes out.
    pytest.param(CHAIN3, "wor", True, True, id="accept_always"),
    # Deterministic drafts verified as if sampled from Q: min(1, p/q) is then wrong.
    pytest.param(CHAIN3, "top", True, False, id="deterministic_chain_as_sampled"),
    pytest.param(TREE, "top", True, False, id="topk_tree_as_sampled"),
    # Siblings drawn i.i.d. but verified with the without-replacement update of q.
    pytest.param(TREE, "iid", True, False, id="iid_siblings_as_without_replacement"),
])
def test_chi2_detects_wrong_rules(parents: list[int], draw: str, pass_q: bool,
                                  zero_u: bool) -> None:
    P, Q = _markov(seed=10)
    first, second, _ = _first_two(parents, P, Q, draw, pass_q, seed=20, zero_uniforms=zero_u)
    with pytest.raises(AssertionError, match="chi2"):
        _assert_lossless(first, second, P)


def test_verify_sampling_loop_is_lossless() -> None:
    # The public function itself (generator, children table, bonus race), trial by trial.
    P, Q = _markov(seed=11)
    gen = torch.Generator().manual_seed(4)
    top = Q[ROOT_TOKEN].topk(3).indices.tolist()
    tree = _tree([-1, 0, 0, 0, 1], [ROOT_TOKEN, *top, int(Q[top[0]].argmax())])
    target = P[tree.tokens]
    first = torch.stack([
        emitted_tokens(tree, verify_sampling(tree, target, 2, 3, gen))[0] for _ in range(4000)])
    stat, crit = _chi2(first, P[ROOT_TOKEN])
    assert stat < crit, (stat, crit)


# ---------------------------------------------------------------- sampling: exact behaviour


def test_verify_sampling_replays_from_its_noise() -> None:
    P, Q = _markov(seed=12)
    tree = _tree(TREE, [0, 1, 2, 3, 4, 5, 1], draft_probs=Q[torch.tensor([0, 1, 2, 3, 4, 5, 1])])
    target = P[tree.tokens]
    for seed in range(10):
        v = verify_sampling(tree, target, 2, 3, torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(2, 3, generator=g)
        race = torch.empty(V_STAT).exponential_(generator=g)
        path, num, bonus = verify_sampling_from_noise(
            tree.tokens, children_table(tree.parents, 3), target, tree.draft_probs, u, race)
        assert v.path.tolist() == path.tolist()
        assert v.num_accepted.item() == num.item() and v.bonus.item() == bonus.item()
        # Accepted tokens are a prefix of a root-to-leaf path of the tree.
        n = v.num_accepted.item()
        for k in range(1, n + 1):
            assert tree.parents[v.path[k]].item() == v.path[k - 1].item()
        assert (v.path[n + 1:] == -1).all()


def test_sampling_respects_filtered_target_support() -> None:
    # Tokens the (top-k / top-p processed) target gives probability 0 are never accepted and
    # never drawn as the bonus, even if the draft is sure of them.
    V = 8
    p = torch.zeros(V)
    p[[1, 2]] = torch.tensor([0.7, 0.3])
    tree = _tree(_chain_parents(3), [0, 5, 6], draft_probs=torch.eye(V)[[5, 6, 0]])
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        v = verify_sampling(tree, p.expand(3, V), 2, 1, gen)
        assert v.num_accepted.item() == 0 and v.bonus.item() in (1, 2)
    # The same with deterministic (one-hot) children.
    tree = _tree([-1, 0, 0], [0, 5, 6])
    for _ in range(200):
        v = verify_sampling(tree, p.expand(3, V), 1, 2, gen)
        assert v.num_accepted.item() == 0 and v.bonus.item() in (1, 2)


def test_one_hot_rule_rejected_children_are_excluded_from_the_bonus() -> None:
    # Reject both children with certainty-free uniforms close to 1: the bonus is drawn from
    # p with both children's tokens zeroed.
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tree = _tree([-1, 0, 0], [0, 0, 1])
    children = children_table(tree.parents, 2)
    u = torch.full((1, 2), 0.99)
    for seed in range(50):
        race = torch.empty(4).exponential_(generator=torch.Generator().manual_seed(seed))
        path, num, bonus = verify_sampling_from_noise(
            tree.tokens, children, p.expand(3, 4), None, u, race)
        assert num.item() == 0 and path.tolist() == [0, -1] and bonus.item() in (2, 3)


def test_normalize_falls_back_when_residual_is_zero() -> None:
    p = torch.tensor([0.25, 0.75])
    out = _normalize_or(torch.zeros(2), p)
    assert out.tolist() == p.tolist() and not out.isnan().any()
    torch.testing.assert_close(_normalize_or(torch.tensor([1.0, 3.0]), p), p)


def test_children_table_matches_tree() -> None:
    for parents in (TREE, CHAIN3, [-1], [-1, 0, 0, 0, 0, 1, 1, 4, 4, 4]):
        tree = _tree(parents, [0] * len(parents))
        for m in (1, 2, 3, 4):
            assert children_table(tree.parents, m).tolist() == tree.children_table(m).tolist()


# ---------------------------------------------------------------- devices, shapes, no syncs


def test_outputs_are_tensors_on_the_input_device() -> None:
    tree = _tree(TREE, [0, 1, 2, 3, 4, 5, 1])
    P, _ = _markov(seed=13)
    target = P[tree.tokens]
    for v in (verify_greedy(tree, target.log(), 2),
              verify_sampling(tree, target, 2, 3, torch.Generator().manual_seed(0)),
              verify_sampling(tree, target, 2, 3, None)):
        assert v.path.shape == (3,) and v.num_accepted.shape == () and v.bonus.shape == ()
        for t in (v.path, v.num_accepted, v.bonus, emitted_tokens(tree, v)):
            assert t.dtype == torch.int64 and t.device == target.device


def test_functions_trace_without_graph_breaks() -> None:
    # fullgraph=True fails on .item(), bool(tensor), nonzero and data-dependent Python
    # control flow: the closest CPU check that the functions never read the device.
    P, Q = _markov(seed=14)
    toks = torch.tensor([0, 1, 2, 3, 4, 5, 1])
    for tree in (_tree(TREE, toks.tolist()), _tree(TREE, toks.tolist(), draft_probs=Q[toks])):
        target = P[tree.tokens]
        want = verify_greedy(tree, target.log(), 2)
        got = torch.compile(verify_greedy, backend="eager", fullgraph=True)(
            tree, target.log(), 2)
        assert got.path.tolist() == want.path.tolist() and got.bonus.item() == want.bonus.item()
        torch.manual_seed(0)
        want = verify_sampling(tree, target, 2, 3, None)
        torch.manual_seed(0)
        got = torch.compile(verify_sampling, backend="eager", fullgraph=True)(
            tree, target, 2, 3, None)
        assert got.path.tolist() == want.path.tolist() and got.bonus.item() == want.bonus.item()
        out = torch.compile(emitted_tokens, backend="eager", fullgraph=True)(tree, got)
        assert out.tolist() == emitted_tokens(tree, want).tolist()
