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
from specscope.models.packed import pack_linears
from specscope.profiler import Phase, Profiler
from specscope.sampling import processed_logits, sample
from specscope.spec.drafter import draft_chain, draft_tree
from specscope.spec.simulate import simulated_verdict
from specscope.spec.tree import DraftTree
from specscope.spec.verify import Verdict, emitted_tokens, verify_greedy, verify_sampling

log = logging.getLogger("specscope.spec")

SIM_BLOCK = 1024  # cycles of simulated-acceptance uniforms drawn at once


def _capturing() -> bool:
    """Inside a CUDA-graph capture, phase marks are skipped: graphs are timed whole."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    """Runs speculative cycles for one request at a time on a target runner and a draft.

    A cycle is two segments, each a pure function of static device buffers:
    - draft: extend the draft KV over the previous cycle's accepted pairs, then draft steps
      and tree building;
    - verify_commit: one target forward over the tree, accept, KV commit, and the next
      extend's inputs.
    On CUDA with greedy verification each segment is captured as a CUDA graph per KV window
    and replayed; otherwise they run eagerly. Both paths run the same code.
    """

    def __init__(self, runner: ModelRunner, draft: Eagle3Draft, spec: SpecConfig) -> None:
        self.runner = runner
        self.draft = draft
        self.spec = spec
        self.target = runner.model
        self.target.set_taps(draft.config.aux_layer_ids)
        self.draft_cache: KVCache | None = None
        dev = runner.device
        rates = spec.acceptance_rates()
        self.sim_rates = None if rates is None else torch.tensor(rates, device=dev)
        self.sim_gen = torch.Generator(device=dev)
        self.sim_gen.manual_seed(spec.simulate_seed)
        draft.init_rope(runner.max_model_len)
        # CPU bf16: the draft's GEMVs on oneDNN-packed weights, bit-identical and 2-3x
        # faster (models/packed.py); a no-op on other devices and dtypes.
        pack_linears(draft)
        self.last_was_speculative = False
        self.timer: Profiler | None = None
        k = spec.num_steps
        n_taps = len(draft.config.aux_layer_ids) * runner.config.hidden_size
        # Static state buffers (see the module docstring).
        self.n_t = torch.zeros(1, dtype=torch.long, device=dev)  # committed length = root pos
        self.root = torch.zeros(1, dtype=torch.long, device=dev)
        self.ext_taps = torch.zeros(1, k + 1, n_taps, dtype=runner.dtype, device=dev)
        self.ext_tokens = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
        self.ext_start = torch.zeros(1, dtype=torch.long, device=dev)
        self.ext_a = torch.zeros(1, dtype=torch.long, device=dev)
        # Simulated acceptance draws its uniforms a block of cycles at a time, so a cycle
        # launches nothing extra between graph replays (the graph indexes the block).
        # Columns: the top child, then (with a sibling rate, in a tree) each lower rank.
        self.sim_cols = spec.topk if spec.simulate_sibling > 0 and spec.topk > 1 else 1
        self.sim_block = torch.zeros(SIM_BLOCK, k, self.sim_cols, device=dev)
        self.sim_idx = torch.zeros(1, dtype=torch.long, device=dev)
        self._sim_used = 0
        self.graphs: dict[int, tuple] = {}
        self.use_graphs = dev.type == "cuda" and runner.engine.cuda_graphs

    def reset_simulation(self) -> None:
        """Restart the simulated-acceptance random stream (identical accept decisions on
        identical workloads, e.g. profiling on vs off)."""
        self.sim_gen.manual_seed(self.spec.simulate_seed)
        self._sim_used = 0

    @property
    def lookahead(self) -> int:
        """Slots a cycle may write past the committed length."""
        return max(self.spec.num_draft_tokens, self.spec.num_steps + 1) + \
            (self.spec.num_steps - 1) * self.spec.topk

    # -- request start ----------------------------------------------------------------------

    def ensure_caches(self, tokens: int) -> None:
        # Room for a full cycle past the last token when the context allows; near the end
        # of the context the cycle falls back to plain steps (see `cycle`).
        gen = self.runner.cache_generation
        cache = self.runner.ensure_cache(min(tokens + self.lookahead, self.runner.max_model_len))
        dc = self.draft.config
        stale = gen != self.runner.cache_generation
        if self.draft_cache is None or not self.draft_cache.fits(1, cache.capacity,
                                                                 self.runner.dtype,
                                                                 self.runner.device):
            stale = True
            self.graphs.clear()  # captured graphs hold the old buffers' addresses
            self.draft_cache = None
            self.draft_cache = KVCache(dc.num_layers, 1, dc.num_kv_heads, cache.capacity,
                                       dc.head_dim, self.runner.dtype, self.runner.device)
        if stale:
            self.graphs.clear()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], params: SamplingParams,
                gen: torch.Generator | None) -> torch.Tensor:
        """Target prefill (with taps), the first token, and the draft extend over all prompt
        pairs but the last, which becomes the first cycle's pending extend. -> root [1]."""
        t = self.timer
        if t:
            t.mark(Phase.PREFILL)
        logits, taps = self.runner.prefill(prompt_ids, return_taps=True)  # [1,V], [1,P,nH]
        root = sample(logits, params, gen)  # [1]
        n = len(prompt_ids)
        dev = self.runner.device
        nxt = torch.cat([torch.tensor(prompt_ids[1:], dtype=torch.long, device=dev), root])
        pos = torch.arange(n, device=dev)[None]
        chunk = self.runner.engine.prefill_chunk_size
        for s in range(0, n - 1, chunk):  # pairs 0 .. n-2 now; pair n-1 in the first cycle
            e = min(n - 1, s + chunk)
            self.draft(nxt[None, s:e], self.draft.project(taps[:, s:e]), pos[:, s:e],
                       self.draft_cache, kv_len=self._kv_len(e))
        self.ext_taps.zero_()
        self.ext_taps[:, 0] = taps[:, n - 1]
        self.ext_tokens.zero_()
        self.ext_tokens[0, 0] = root[0]
        self.ext_start.fill_(n - 1)
        self.ext_a.zero_()
        self.n_t.fill_(n)
        self.root.copy_(root)
        self.n = n
        if t:
            t.stop()
        return root

    def _kv_len(self, end: int) -> int:
        return self.runner._kv_len(end)

    # -- one cycle --------------------------------------------------------------------------

    @torch.inference_mode()
    def cycle(self, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """Run one cycle; return [1 + num_steps + 1] int64: the number of emitted tokens
        followed by the emitted tokens (padded with -1). Read it once on the host, then
        call `advance` with the count."""
        if self.n + self.lookahead > self.runner.cache.capacity:
            return self._plain_step(params, gen)
        self.last_was_speculative = True
        kv_len = self._kv_len(self.n + self.lookahead)
        if self.sim_rates is not None:
            if self._sim_used % SIM_BLOCK == 0:
                self.sim_block.copy_(torch.rand(SIM_BLOCK, self.spec.num_steps,
                                                self.sim_cols, generator=self.sim_gen,
                                                device=self.sim_block.device))
                self.sim_idx.zero_()
            self._sim_used += 1
        t = self.timer
        if self.use_graphs and params.greedy:
            entry = self.graphs.get(kv_len)
            if entry is None:
                return self._run_and_capture(kv_len, params)
            graph_a, graph_b, out = entry
            if t:
                t.mark(Phase.DRAFT)
            graph_a.replay()
            if t:
                t.mark(Phase.VERIFY_COMMIT)
            graph_b.replay()
            if t:
                t.stop()
            return out
        tree = self._draft_segment(params, gen, kv_len)
        out = self._verify_segment(tree, params, gen, kv_len)
        if t:
            t.stop()
        return out

    def _run_and_capture(self, kv_len: int, params: SamplingParams) -> torch.Tensor:
        """First cycle in a KV window on CUDA: run both segments eagerly (this is the real
        cycle, on a side stream as capture requires), then capture them as graphs. Capture
        records kernels without running them, so the state is not advanced twice."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            out = self._verify_segment(self._draft_segment(params, None, kv_len), params,
                                       None, kv_len)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_a):
            tree = self._draft_segment(params, None, kv_len)
        with torch.cuda.graph(graph_b, pool=graph_a.pool()):
            static_out = self._verify_segment(tree, params, None, kv_len)
        self.graphs[kv_len] = (graph_a, graph_b, static_out)
        if self.timer:
            self.timer.stop()
        return out

    def _draft_segment(self, params: SamplingParams, gen: torch.Generator | None,
                       kv_len: int) -> DraftTree:
        """Draft extend over the pending pairs, then draft steps (chain) or tree expansion."""
        spec, dev, t = self.spec, self.runner.device, self.timer
        k = spec.num_steps
        if t and not _capturing():
            t.mark(Phase.DRAFT_EXTEND)
        pos = (self.ext_start + torch.arange(k + 1, device=dev))[None]  # [1, k + 1]
        h, normed = self.draft(self.ext_tokens, self.draft.project(self.ext_taps), pos,
                               self.draft_cache, kv_len=kv_len)
        # The output at the last accepted pair: an index_select, not h[:, a] (a 0-d index
        # tensor would be turned into a host int, a sync).
        h0 = h.index_select(1, self.ext_a)  # [1, 1, Hd]
        logits0 = self.draft.compute_logits(normed[0].index_select(0, self.ext_a)[0])  # [Vd]
        prof = t if t and not _capturing() else None
        if spec.topk == 1:
            return draft_chain(self.draft, self.draft_cache, h0, logits0, self.root, self.n_t,
                               k, kv_len, params, gen, prof)
        return draft_tree(self.draft, self.draft_cache, h0, logits0, self.root, self.n_t, k,
                          spec.topk, spec.num_draft_tokens, kv_len, params, prof)

    def _verify_segment(self, tree: DraftTree, params: SamplingParams,
                        gen: torch.Generator | None, kv_len: int) -> torch.Tensor:
        """One target forward over the tree, accept, KV commit, next extend's inputs."""
        k, dev, t = self.spec.num_steps, self.runner.device, self.timer
        timing = t is not None and not _capturing()
        if timing:
            t.mark(Phase.VERIFY)
        n = self.n_t
        N = tree.size
        k_pos = torch.arange(kv_len, device=dev)
        anc = tree.ancestor_mask(k)  # [N, N]
        rel = k_pos - n  # [kv_len]
        in_tree = (rel >= 0) & (rel < N)
        mask = (k_pos < n)[None, :] | (anc[:, rel.clamp(0, N - 1)] & in_tree[None, :])
        slots = (n + torch.arange(N, device=dev))[None]  # [1, N]
        hidden, taps = self.target(tree.tokens[None], (n + tree.depth)[None], self.runner.cache,
                                   kv_len=kv_len, slots=slots, attn_mask=mask[None],
                                   return_taps=True)
        logits = self.target.compute_logits(hidden[0])  # [N, V]
        if timing:
            t.mark(Phase.ACCEPT)
        verdict = self._accept(tree, logits, params, gen)
        out = emitted_tokens(tree, verdict)  # [k + 1], padded -1
        if timing:
            t.mark(Phase.KV_COMMIT)
        path = verdict.path.clamp_min(0)  # [k + 1]; padding points at the root (harmless)
        if not tree.chain:
            # A chain's accepted nodes 0..a already sit at slots n..n+a: nothing to move
            # (slots past n + a are rewritten by the next verify before anything reads them).
            src = n + path
            dst = n + torch.arange(k + 1, device=dev)
            for kc, vc in zip(self.runner.cache.k, self.runner.cache.v, strict=True):
                kc[0].index_copy_(1, dst, kc[0].index_select(1, src))
                vc[0].index_copy_(1, dst, vc[0].index_select(1, src))
        a = verdict.num_accepted.reshape(1)
        # Next extend: pair i = (taps of path[i], the token after it), at position n + i.
        self.ext_taps.copy_(taps[:, path])
        self.ext_tokens.copy_(torch.where(out >= 0, out, 0)[None])
        self.ext_start.copy_(n)
        self.ext_a.copy_(a)
        self.root.copy_(verdict.bonus.reshape(1))
        self.n_t.add_(a + 1)
        return torch.cat([a + 1, out])

    def _plain_step(self, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """Too close to the end of the context for a whole cycle: decode one token plainly.
        The draft state is not kept up to date any more; no cycle follows at this length."""
        self.last_was_speculative = False
        if self.timer:
            self.timer.mark(Phase.DECODE)
        position = self.n_t.view(1, 1)
        logits = self.runner.decode(self.root.view(1, 1), position, self.n)
        tok = sample(logits, params, gen)
        self.root.copy_(tok)
        self.n_t.add_(1)
        if self.timer:
            self.timer.stop()
        return torch.cat([torch.ones_like(tok), tok])

    def advance(self, count: int) -> None:
        """Host bookkeeping after reading the cycle's count (the device side already moved)."""
        self.n += count

    def _accept(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                gen: torch.Generator | None) -> Verdict:
        k = self.spec.num_steps
        if self.sim_rates is not None:
            probs = None if params.greedy else processed_logits(logits, params).softmax(-1)
            u = self.sim_block.index_select(0, self.sim_idx)[0]  # [k, C]: this cycle's
            self.sim_idx.add_(1)
            return simulated_verdict(tree, logits, probs, self.sim_rates, u, k,
                                     self.spec.topk, gen, self.spec.simulate_sibling)
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
