"""The draft tree: the tokens one cycle proposes, and how they hang together.

A chain (topk = 1) is the special case where every node has one child. Node 0 is the root:
the last token already accepted (or the bonus token of the previous cycle); it is verified
along with the draft tokens because the target has not yet processed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """S trees of N nodes each, batch-first (a single tree: the same fields without the
    leading S), nodes in topological order (parents[i] < i).

    tokens [S, N] int64: target-vocabulary ids; tokens[:, 0] is the root.
    parents [S, N] int64: parent node index; parents[:, 0] = -1.
    depth [S, N] int64: distance from the root; depth[:, 0] = 0.
    draft_probs [S, N, V] fp32 or None: the draft's processed distribution at node i, from
        which node i's children were *sampled* (chain drafting at temperature > 0). None when
        children were chosen deterministically (greedy, or top-k tree expansion); the
        verifier then treats each child as a one-hot proposal.
    chain: set by the chain drafter when parents[i] = i - 1 for every i > 0 (a host-known
        structural fact, not read from the device). Masks, greedy verification and the KV
        commit then take shortcuts with a handful of ops; False (any tree) takes the
        general path, which is also the shortcuts' reference.
    lengths: chains only, where each ended at its own confidence stop (a batch with sampled
        sequences, draft_chain): row s's draft tokens are tokens[s, 1:lengths[s] + 1], its
        later nodes padding that no verdict may accept. None: every row holds N - 1.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    draft_probs: torch.Tensor | None = None
    chain: bool = False
    lengths: list[int] | None = None

    @property
    def size(self) -> int:
        """N, the nodes of one tree."""
        return self.tokens.shape[-1]

    def row(self, s: int) -> DraftTree:
        """Tree s of a batch, as a single tree (views, no copy); a chain of its own length
        without its padding."""
        end = self.size if self.lengths is None else self.lengths[s] + 1
        probs = None if self.draft_probs is None else self.draft_probs[s, :end]
        return DraftTree(self.tokens[s, :end], self.parents[s, :end], self.depth[s, :end],
                         probs, self.chain)

    def children_table(self, max_children: int) -> torch.Tensor:
        """[N, max_children] int64 of a single tree: its nodes' children in index order,
        -1 padded."""
        from specscope.spec.verify import children_table

        return children_table(self.parents, max_children)

    def ancestor_mask(self, max_depth: int) -> torch.Tensor:
        """[..., N, N] bool: mask[..., i, j] = node j is node i or one of its ancestors.

        max_depth (host-known: num_steps) bounds the walk, so no host sync is needed.
        """
        N = self.size
        dev = self.tokens.device
        lead = self.parents.shape[:-1]
        if self.chain:  # every earlier node is an ancestor
            return torch.ones(N, N, dtype=torch.bool, device=dev).tril().expand(*lead, N, N)
        mask = torch.eye(N, dtype=torch.bool, device=dev).expand(*lead, N, N)
        cur = self.parents
        cols = torch.arange(N, device=dev)
        for _ in range(max_depth):
            has = cur >= 0  # [..., N]
            # A comparison, not F.one_hot: one_hot validates its input with a host sync.
            hit = (cur[..., :, None] == cols) & has[..., :, None]  # [..., N, N]
            mask = mask | hit
            cur = torch.where(has, self.parents.gather(-1, cur.clamp_min(0)), cur)
        return mask
