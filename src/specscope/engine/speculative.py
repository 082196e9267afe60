"""The speculative cycle's state and orchestration (the pure pieces live in spec/).

State between cycles, for one request (B = 1):
- the target KV holds tokens t_0 .. t_{n-1}; `root` = t_n (the last emitted token) is not in
  it yet; `n` is tracked on the host.
- the draft KV holds the pairs (taps_p, t_{p+1}) for p < n: draft position p sees the target's
  taps of token p and the embedding of the token after it ("inputs shifted by one").
- `h0`, `logits0`: the draft's output at position n - 1, which predicts t_{n+1}.

A cycle: draft (chain or tree) -> one target forward over the tree (tree mask, tree
positions, taps) -> accept (greedy or lossless sampling, or simulated) -> commit the
accepted path's target KV into contiguous slots -> draft extend over the accepted positions.
Shapes are static per configuration: the extend always feeds num_steps + 1 pairs and picks
its output at the accepted length with a gather, so no step needs a host value it does not
already have. The cycle's one device->host read is the emitted tokens (LLM._read_tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specscope.config import SamplingParams, SpecConfig
from specscope.draft.eagle3 import Eagle3Draft, random_draft
from specscope.draft.loader import load_draft
from specscope.engine.runner import ModelRunner
from specscope.kvcache import KVCache
from specscope.models.llama import CausalLM
from specscope.sampling import processed_logits, sample
from specscope.spec.drafter import draft_chain, draft_tree
from specscope.spec.simulate import simulated_verdict
from specscope.spec.tree import DraftTree
from specscope.spec.verify import Verdict, emitted_tokens, verify_greedy, verify_sampling

log = logging.getLogger("specscope.spec")


@dataclass
class SpecStats:
    """Per-request speculative statistics (definitions in DESIGN.md)."""

    num_steps: int
    simulated: bool
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per cycle, bonus included (tau)."""
        return (sum(self.accepted) / len(self.accepted) + 1.0) if self.accepted else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Fraction of cycles whose i-th draft token was accepted given all earlier were."""
        out = []
        for i in range(1, self.num_steps + 1):
            reached = sum(1 for a in self.accepted if a >= i - 1)
            out.append(sum(1 for a in self.accepted if a >= i) / reached if reached else 0.0)
        return out

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "accept_length": round(self.accept_length, 4),
                "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position()],
                "accepted_per_cycle": list(self.accepted), "simulated": self.simulated}


class SpecDecoder:
    """Runs speculative cycles for one request at a time on a target runner and a draft."""

    def __init__(self, runner: ModelRunner, draft: Eagle3Draft, spec: SpecConfig) -> None:
        self.runner = runner
        self.draft = draft
        self.spec = spec
        self.target = runner.model
        self.target.set_taps(draft.config.aux_layer_ids)
        self.draft_cache: KVCache | None = None
        rates = spec.acceptance_rates()
        self.sim_rates = None if rates is None else torch.tensor(rates, device=runner.device)
        self.sim_gen = torch.Generator(device=runner.device)
        self.sim_gen.manual_seed(spec.simulate_seed)
        draft.init_rope(runner.max_model_len)
        self.last_was_speculative = False

    @property
    def lookahead(self) -> int:
        """Slots a cycle may write past the committed length."""
        return max(self.spec.num_draft_tokens, self.spec.num_steps + 1) + \
            (self.spec.num_steps - 1) * self.spec.topk

    # -- request start ----------------------------------------------------------------------

    def ensure_caches(self, tokens: int) -> None:
        # Room for a full cycle past the last token when the context allows; near the end
        # of the context the cycle falls back to plain steps (see `cycle`).
        cache = self.runner.ensure_cache(min(tokens + self.lookahead, self.runner.max_model_len))
        dc = self.draft.config
        if self.draft_cache is None or not self.draft_cache.fits(1, cache.capacity,
                                                                 self.runner.dtype,
                                                                 self.runner.device):
            self.draft_cache = None
            self.draft_cache = KVCache(dc.num_layers, 1, dc.num_kv_heads, cache.capacity,
                                       dc.head_dim, self.runner.dtype, self.runner.device)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], params: SamplingParams,
                gen: torch.Generator | None) -> torch.Tensor:
        """Target prefill (with taps), first token, and the draft extend over the prompt.
        Returns the first token [1]."""
        logits, taps = self.runner.prefill(prompt_ids, return_taps=True)  # [1,V], [1,P,nH]
        root = sample(logits, params, gen)  # [1]
        n = len(prompt_ids)
        dev = self.runner.device
        next_tokens = torch.tensor(prompt_ids[1:], dtype=torch.long, device=dev)
        next_tokens = torch.cat([next_tokens, root])[None]  # [1, P]: t_1 .. t_P
        pos = torch.arange(n, device=dev)[None]
        chunk = self.runner.engine.prefill_chunk_size
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h, normed = self.draft(next_tokens[:, s:e], self.draft.project(taps[:, s:e]),
                                   pos[:, s:e], self.draft_cache, kv_len=self._kv_len(e))
        self.h0 = h[:, -1:]  # [1, 1, Hd]
        self.logits0 = self.draft.compute_logits(normed[0, -1])  # [Vd]
        self.n = n
        self.root = root
        return root

    def _kv_len(self, end: int) -> int:
        return self.runner._kv_len(end)

    # -- one cycle --------------------------------------------------------------------------

    @torch.inference_mode()
    def cycle(self, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """Run one cycle; return [1 + num_steps + 1] int64: the number of emitted tokens
        followed by the emitted tokens (padded with -1). Read it once on the host, then
        call `advance` with the count."""
        spec, n, dev = self.spec, self.n, self.runner.device
        k = spec.num_steps
        if n + self.lookahead > self.runner.cache.capacity:
            return self._plain_step(params, gen)
        self.last_was_speculative = True
        kv_len = self._kv_len(n + self.lookahead)
        # 1. draft
        if spec.topk == 1:
            tree = draft_chain(self.draft, self.draft_cache, self.h0, self.logits0, self.root,
                               n, k, kv_len, params, gen)
        else:
            tree = draft_tree(self.draft, self.draft_cache, self.h0, self.logits0, self.root,
                              n, k, spec.topk, spec.num_draft_tokens, kv_len, params)
        N = tree.size
        # 2. verify: one target forward over the tree
        k_pos = torch.arange(kv_len, device=dev)
        anc = tree.ancestor_mask(k)  # [N, N]
        rel = k_pos - n
        in_tree = (rel >= 0) & (rel < N)
        mask = (k_pos < n)[None, :] | (anc[:, rel.clamp(0, N - 1)] & in_tree[None, :])
        slots = (n + torch.arange(N, device=dev))[None]  # [1, N]
        hidden, taps = self.target(tree.tokens[None], (n + tree.depth)[None], self.runner.cache,
                                   kv_len=kv_len, slots=slots, attn_mask=mask[None],
                                   return_taps=True)
        logits = self.target.compute_logits(hidden[0])  # [N, V]
        # 3. accept
        verdict = self._accept(tree, logits, params, gen)
        out = emitted_tokens(tree, verdict)  # [k + 1], padded -1
        # 4. commit: accepted path's K/V to contiguous slots n .. n + a
        path = verdict.path.clamp_min(0)  # [k + 1]; padding points at the root (harmless)
        src = n + path
        dst = n + torch.arange(k + 1, device=dev)
        for kc, vc in zip(self.runner.cache.k, self.runner.cache.v, strict=True):
            kc[0].index_copy_(1, dst, kc[0].index_select(1, src))
            vc[0].index_copy_(1, dst, vc[0].index_select(1, src))
        # 5. draft extend over the accepted positions n .. n + a (padded to k + 1 pairs)
        a = verdict.num_accepted
        path_taps = taps[:, path]  # [1, k + 1, nH]
        nxt = torch.where(out >= 0, out, 0)[None]  # pair i: (taps of path[i], token after it)
        pos = (n + torch.arange(k + 1, device=dev))[None]
        h, normed = self.draft(nxt, self.draft.project(path_taps), pos, self.draft_cache,
                               kv_len=kv_len)
        # The output at the last accepted pair: an index_select, not h[:, a] (a 0-d index
        # tensor would be turned into a host int, a sync).
        self.h0 = h.index_select(1, a.reshape(1))  # [1, 1, Hd]
        self.logits0 = self.draft.compute_logits(normed[0].index_select(0, a.reshape(1))[0])
        self.root = verdict.bonus.reshape(1)
        return torch.cat([(a + 1).reshape(1), out])

    def _plain_step(self, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """Too close to the end of the context for a whole cycle: decode one token plainly.
        The draft state is not kept up to date any more; no cycle follows at this length."""
        self.last_was_speculative = False
        position = torch.full((1, 1), self.n, dtype=torch.long, device=self.runner.device)
        logits = self.runner.decode(self.root.view(1, 1), position, self.n)
        self.root = sample(logits, params, gen)
        return torch.cat([torch.ones_like(self.root), self.root])

    def advance(self, count: int) -> None:
        """Host bookkeeping after reading the cycle's count."""
        self.n += count

    def _accept(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                gen: torch.Generator | None) -> Verdict:
        k = self.spec.num_steps
        if self.sim_rates is not None:
            probs = None if params.greedy else processed_logits(logits, params).softmax(-1)
            return simulated_verdict(tree, logits, probs, self.sim_rates, k, self.spec.topk,
                                     self.sim_gen, gen)
        if params.greedy:
            return verify_greedy(tree, logits, k)
        probs = processed_logits(logits, params).softmax(-1)  # [N, V]
        return verify_sampling(tree, probs, k, self.spec.topk, gen)


def load_spec_draft(spec: SpecConfig, target: CausalLM, dtype: torch.dtype,
                    device: torch.device) -> tuple[Eagle3Draft, str]:
    """The draft named by spec.draft: a checkpoint directory, or "random" (an EAGLE-3-shaped
    random-weight draft for the target, for benchmarking with simulated acceptance)."""
    if spec.draft is None:
        raise ValueError("speculative decoding needs a draft: pass --draft PATH (or 'random' "
                         "with --simulate-acceptance for benchmarking)")
    if spec.draft == "random":
        draft = random_draft(target.config, dtype, device, layer_ids=spec.draft_layer_ids)
        msg = (f"random EAGLE-3 draft (hidden {draft.config.hidden_size}, draft vocab "
               f"{draft.config.draft_vocab_size}, layer ids {list(draft.config.aux_layer_ids)})")
        if not spec.simulated:
            log.warning("a random draft accepts almost nothing; use --simulate-acceptance")
    else:
        loaded = load_draft(spec.draft, target.config, dtype=dtype, device=device,
                            layer_ids=list(spec.draft_layer_ids) if spec.draft_layer_ids
                            else None)
        draft, msg = loaded.model, loaded.message
    draft.attach_target(target)
    log.info("draft: %s", msg)
    return draft, msg
