"""Verification: which draft tokens the target accepts, and the bonus token that follows them.

The target ran one forward over all N tree nodes (tree attention mask), so row i of its
output predicts the token *after* node i. Node 0 is the root (the last accepted token).

Definitions (used in every function below):

- **accepted path**: root = n_0, n_1, ..., n_a with parents[n_k] = n_{k-1}; a = num_accepted
  draft tokens were accepted (0 <= a <= max_depth).
- **bonus token**: one token drawn from the target at the end of the path (its prediction
  after n_a, or the rejection residual there). It is always emitted, so a cycle emits
  tau = a + 1 tokens: tokens[n_1..n_a] followed by the bonus.

Greedy (temperature 0). y_i = argmax_v target_logits[i, v] is what plain greedy decoding
would emit after node i. Node i > 0 is *correct* iff tokens[i] == y[parents[i]]; it is
accepted iff it and all its ancestors are correct. Siblings carry distinct tokens, so at
most one child per node is correct and the accepted nodes form a single path; it ends at
the deepest accepted node d and bonus = y_d. The output is token-for-token plain greedy.

Sampling (temperature > 0), lossless recursive rejection, sibling by sibling. p is the
target's processed distribution, q the proposal the draft used for a child:

    c = root, p = target_probs[c]
    for the children x_1..x_m of c in index order, with proposals q_1..q_m:
        accept x_j with probability min(1, p(x_j) / q_j(x_j))
            -> c = x_j, p = target_probs[x_j], start again at the children of x_j
        on rejection:
            p       <- normalize(max(p - q_j, 0))          (the residual)
            q_{j+1} <- normalize(q_j with x_j removed)     (draws without replacement)
    if no child of c is accepted (or c is a leaf): bonus ~ p

Why it is lossless (induction on the number of remaining siblings): with x ~ q,
P(accept x = v) = q(v) min(1, p(v)/q(v)) = min(p(v), q(v)) and P(reject) = 1 - sum_v
min(p, q) = sum_v max(p - q, 0) =: Z. If later siblings are drawn from q without x (their
conditional law given x) the induction hypothesis says the rest of the walk emits a draw from
the residual max(p - q, 0) / Z, so v comes out with probability min(p, q) + Z * max(p - q,
0)(v) / Z = p(v). A rejected x has p(x) < q(x), so the residual already gives it zero mass.

Proposals:
- `tree.draft_probs is None`: children were chosen deterministically (greedy or top-k
  expansion), so each is a one-hot proposal q_j = delta_{x_j}: accept with probability
  p(x_j); on rejection p <- p with x_j zeroed, renormalized (EAGLE's official tree sampling,
  SGLang's "target_only"). Lossless for any deterministic set of distinct tokens.
- `tree.draft_probs` given: the children of node c were *sampled* from q = draft_probs[c]
  (sequentially without replacement when there are several, e.g. Gumbel-top-k). For a chain
  this is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023); for
  several children it is Recursive Speculative Decoding (Jeon et al. 2024). Children drawn
  i.i.d. *with* replacement would need q kept unchanged; they are not supported.
- If a residual sums to 0 (p == q on the support, so rejection had probability 0 in exact
  arithmetic) it falls back to p rather than dividing by zero.

Everything runs on the input's device without host syncs: the loops run over host-known
bounds (max_depth, max_children) and data-dependent choices are torch.where / gather.
B = 1: one request, no batch dimension (vmap the functions for a batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specscope.spec.tree import DraftTree


@dataclass
class Verdict:
    """The outcome of verifying one draft tree.

    path [max_depth + 1] int64: node indices of the accepted path, path[0] = 0 (root),
        padded with -1 after path[num_accepted].
    num_accepted [] int64: accepted draft tokens (0..max_depth), the bonus excluded.
    bonus [] int64: target-vocabulary id emitted after the accepted tokens.
    The cycle emits tree.tokens[path[1:num_accepted + 1]] then bonus: tau = num_accepted + 1.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def children_table(parents: torch.Tensor, max_children: int) -> torch.Tensor:
    """[..., N, max_children] int64: the children of each node in index order, -1 padded,
    for parents [..., N] (one tree, or a batch of trees).

    Same table as DraftTree.children_table, built with comparisons and argmax only (no
    boolean-mask indexing, which needs a nonzero and so a host sync). Children beyond
    max_children are dropped.
    """
    N = parents.shape[-1]
    dev = parents.device
    # Rank of each node among its siblings = number of earlier nodes with the same parent.
    same = parents[..., None, :] == parents[..., :, None]  # [..., N, N]
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)  # [N, N]
    rank = (same & earlier).sum(-1)  # [..., N]
    node = torch.arange(N, device=dev)  # [N]
    slot = torch.arange(max_children, device=dev)  # [M]
    # match[..., i, j, k]: node k is the j-th child of node i.
    match = (parents[..., None, None, :] == node[:, None, None]) & (
        rank[..., None, None, :] == slot[None, :, None])  # [..., N, M, N]
    return torch.where(match.any(-1), match.long().argmax(-1), -1)  # [..., N, M]


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor, max_depth: int) -> Verdict:
    """Greedy verification. target_logits [N, V] (row i: the target's logits after node i).
    One tree: verify_greedy_batch with B = 1."""
    assert target_logits.shape[0] == tree.size, (target_logits.shape, tree.size)
    path, a, bonus = verify_greedy_batch(tree.tokens[None], tree.parents[None],
                                         tree.depth[None], target_logits[None], max_depth,
                                         tree.chain)
    return Verdict(path=path[0], num_accepted=a[0], bonus=bonus[0])


def verify_greedy_batch(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                        target_logits: torch.Tensor, max_depth: int, chain: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of B trees of N nodes each (batch-first).

    tokens, parents, depth [B, N] (DraftTree's fields, one row per tree); target_logits
    [B, N, V]. chain: every tree is a chain (parents[i] = i - 1), a host-known fact that
    takes the few-op path. Returns path [B, max_depth + 1] (-1 padded), num_accepted [B],
    bonus [B], all int64 on the device."""
    return verify_greedy_ids(tokens, parents, depth, target_logits.argmax(-1), max_depth, chain)


def verify_greedy_ids(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                      y: torch.Tensor, max_depth: int, chain: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_greedy_batch from y [B, N], the target's greedy token after each node (its
    logits' argmax), which a fused head computes without writing the logits."""
    N = tokens.shape[1]
    if chain:
        assert tokens.shape[1] - 1 == max_depth, (N, max_depth)
        correct = tokens[:, 1:] == y[:, :-1]  # [B, N - 1]: draft token i + 1 matches
        a = correct.long().cumprod(1).sum(1)  # [B]: the leading run of matches
        slot = torch.arange(N, device=y.device)[None]  # [1, N]
        path = torch.where(slot <= a[:, None], slot, -1)  # [B, N]
        return path, a, y.gather(1, a[:, None])[:, 0]
    parent = parents.clamp_min(0)  # [B, N]; the root points at itself, masked below
    is_root = parents < 0
    # correct[i] = tokens[i] == y[parents[i]]; the root is correct by definition.
    correct = is_root | (tokens == y.gather(1, parent))  # [B, N]
    # accepted[i] = correct[i] & accepted[parents[i]]; depth <= max_depth, so max_depth
    # rounds of propagation reach every node.
    accepted = correct
    for _ in range(max_depth):
        accepted = correct & (is_root | accepted.gather(1, parent))
    # The deepest accepted node (unique: siblings carry distinct tokens; the root has depth
    # 0 and is always accepted, so argmax never lands on a rejected node).
    d = torch.where(accepted, depth, -1).argmax(1)  # [B]
    path = _paths_to(parents, depth, d, max_depth)  # [B, max_depth + 1]
    return path, depth.gather(1, d[:, None])[:, 0].long(), y.gather(1, d[:, None])[:, 0]


def _paths_to(parents: torch.Tensor, depth: torch.Tensor, node: torch.Tensor,
              max_depth: int) -> torch.Tensor:
    """[B, max_depth + 1] int64: each tree's root-to-`node[b]` path by depth, -1 padded."""
    B = parents.shape[0]
    dev = parents.device
    slot = torch.arange(max_depth + 1, device=dev)[None]  # [1, D + 1]
    path = torch.full((B, max_depth + 1), -1, dtype=torch.long, device=dev)
    cur = node  # [B]
    for _ in range(max_depth + 1):
        here = cur >= 0
        c = cur.clamp_min(0)[:, None]  # [B, 1]
        path = torch.where(here[:, None] & (slot == depth.gather(1, c)), c, path)
        cur = torch.where(here, parents.gather(1, c)[:, 0], cur)
    return path


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, max_depth: int,
                    max_children: int, generator: torch.Generator | None) -> Verdict:
    """Lossless rejection sampling over the tree (rules in the module docstring).

    target_probs [N, V]: the target's processed (temperature / top-k / top-p) distribution
    after each node. tree.draft_probs [N, V] or None: the draft's, processed the same way.
    Randomness, in this order from `generator`: uniforms [max_depth, max_children] (one per
    possible accept test), then Exp(1) draws [V] for the bonus's exponential race.
    """
    dev = target_probs.device
    V = target_probs.shape[-1]
    uniforms = torch.rand(max_depth, max_children, generator=generator, device=dev)
    race = torch.empty(V, device=dev).exponential_(generator=generator)  # [V]
    children = children_table(tree.parents, max_children)  # [N, M]
    path, num_accepted, bonus = verify_sampling_from_noise(
        tree.tokens, children, target_probs, tree.draft_probs, uniforms, race)
    return Verdict(path=path, num_accepted=num_accepted, bonus=bonus)


def verify_sampling_from_noise(
        tokens: torch.Tensor, children: torch.Tensor, target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
        race: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rejection walk of verify_sampling with its randomness passed in: deterministic,
    so it can be replayed, and torch.vmap-ped over many trials in tests.

    tokens [N] int64; children [N, M] int64 (children_table); target_probs [N, V];
    draft_probs [N, V] or None; uniforms [D, M] in [0, 1) with D = max_depth; race [V] Exp(1).
    Returns path [D + 1], num_accepted [], bonus [] (int64).
    """
    D, M = uniforms.shape
    N, V = target_probs.shape
    assert children.shape == (N, M) and tokens.shape == (N,), (children.shape, tokens.shape)
    assert draft_probs is None or draft_probs.shape == (N, V), draft_probs.shape
    dev = target_probs.device
    tiny = torch.finfo(torch.float32).tiny
    vocab = torch.arange(V, device=dev)  # [V]

    cur = torch.zeros((), dtype=torch.long, device=dev)  # []: the node the walk stands on
    p = _at(target_probs, cur).float()  # [V]: the target after cur, later a residual
    stopped = torch.zeros((), dtype=torch.bool, device=dev)  # []: a level rejected every child
    path = [cur]
    for level in range(D):
        q = _at(draft_probs, cur).float() if draft_probs is not None else None  # [V]
        moved = torch.zeros((), dtype=torch.bool, device=dev)  # []
        nxt = cur  # []: the accepted child, once moved
        for j in range(M):
            x = _at(children[:, j], cur)  # []: node index, -1 past the last child
            live = (x >= 0) & ~stopped & ~moved  # []: this sibling gets tested
            xs = x.clamp_min(0)
            tok = _at(tokens, xs)  # []
            is_tok = vocab == tok  # [V]
            if q is None:
                # One-hot proposal: accept w.p. p(x); residual max(p - delta_x, 0) = p, x zeroed.
                ratio = _at(p, tok)  # []
                residual = torch.where(is_tok, 0.0, p)  # [V]
            else:
                # Accept w.p. min(1, p(x) / q(x)); q(x) > 0 since x was drawn from q.
                ratio = (_at(p, tok) / _at(q, tok).clamp_min(tiny)).clamp_max(1.0)  # []
                residual = (p - q).clamp_min(0.0)  # [V] max(p - q, 0)
            accept = live & (uniforms[level, j] < ratio)  # []
            reject = live & ~accept  # []
            p = torch.where(reject, _normalize_or(residual, p), p)  # [V]
            if q is not None:
                # Later siblings were drawn without x: q <- normalize(q with x removed).
                q = torch.where(reject, _normalize_or(torch.where(is_tok, 0.0, q), q), q)
            nxt = torch.where(accept, x, nxt)
            moved = moved | accept
        # Move down to the accepted child; if there is none, stop here (p is the residual).
        cur = torch.where(moved, nxt, cur)
        p = torch.where(moved, _at(target_probs, cur).float(), p)  # [V]
        stopped = stopped | ~moved
        path.append(torch.where(moved, cur, -1))
    path_t = torch.stack(path)  # [D + 1]
    num_accepted = (path_t[1:] >= 0).sum()  # []
    # Bonus ~ p by the exponential race: argmax_v p(v) / E_v, E_v ~ Exp(1), picks v w.p. p(v).
    # exponential_ can return exactly 0, and 0/0 = NaN would win the argmax.
    bonus = (p / race.clamp_min(tiny)).argmax()  # []
    return path_t, num_accepted, bonus


def emitted_tokens(tree: DraftTree, verdict: Verdict) -> torch.Tensor:
    """[max_depth + 1] int64: the tokens this cycle emits (accepted drafts, then the bonus),
    padded with -1. A device op: read verdict.num_accepted once to know how many are valid.
    """
    return emitted_tokens_batch(tree.tokens[None], verdict.path[None],
                                verdict.num_accepted.reshape(1), verdict.bonus.reshape(1))[0]


def emitted_tokens_batch(tokens: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                         bonus: torch.Tensor) -> torch.Tensor:
    """[B, D + 1] int64: each tree's emitted tokens, -1 padded. tokens [B, N], path
    [B, D + 1], num_accepted and bonus [B]."""
    D1 = path.shape[1]
    k = torch.arange(D1, device=path.device)[None]  # [1, D + 1]: output position
    # Position k < num_accepted holds the token of path[k + 1]; shift path left by one.
    nodes = torch.cat([path[:, 1:], path.new_full((path.shape[0], 1), -1)], 1)  # [B, D + 1]
    drafted = tokens.gather(1, nodes.clamp_min(0))
    out = torch.where(k < num_accepted[:, None], drafted, -1)
    return torch.where(k == num_accepted[:, None], bonus[:, None], out)


def _normalize_or(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """r / sum(r) over the last dim, or `fallback` where r sums to 0 (p == q: any draw works)."""
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), fallback)


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a 0-d index tensor i, as a device op: t[i] with a 0-d integer tensor is
    turned into a Python int index, a host sync."""
    return t.index_select(0, i.reshape(1)).squeeze(0)
