"""The model runner: owns the model, its KV cache and the prefill/decode forwards.

Lengths live on the host (the runner knows how many tokens it fed), so no step reads a
length back from the device. Each forward attends over a KV window rounded up to
`kv_block` slots: shapes change once per block, not once per token, and within a block the
decode step is a fixed-shape, sync-free graph of kernels (what CUDA-graph capture needs).
"""

from __future__ import annotations

import logging

import torch

from specscope.config import EngineConfig, ModelConfig, SamplingParams
from specscope.kvcache import KVCache
from specscope.models.llama import CausalLM
from specscope.models.packed import pack_linears
from specscope.profiler import Phase, Profiler
from specscope.sampling import sample

log = logging.getLogger("specscope.runner")


class ModelRunner:
    def __init__(self, model: CausalLM, config: ModelConfig, engine: EngineConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.engine = engine
        self.device = device
        self.dtype = dtype
        ctx = config.max_position_embeddings
        if engine.max_model_len is not None:
            ctx = min(ctx, engine.max_model_len)
        self.max_model_len = ctx
        model.init_rope(ctx)
        if not engine.compile:
            # CPU bf16: every linear on oneDNN-packed weights (models/packed.py), bit-identical
            # to F.linear; measured on the default model, a decode step 30 -> 24 ms and a
            # 6-token verify 36 -> 25 ms. Costs a second copy of the linear weights. Not
            # under torch.compile, which traces F.linear. A no-op off the CPU or bf16.
            # At most a quarter of the free memory: a large target keeps F.linear instead.
            n = pack_linears(model, memory_fraction=0.25)
            if n:
                log.info("%d linears run on oneDNN-packed bf16 weights", n)
        self.cache: KVCache | None = None
        self.cache_generation = 0  # bumped whenever the KV buffers are reallocated
        # The decode step, optionally compiled: torch.compile fuses each layer's small
        # elementwise ops (norms, rope, residual adds), which dominate at batch 1 once the
        # weights are small or the launches are cheap. Prefill stays eager: its shapes vary
        # with every prompt length.
        self._step = torch.compile(self._decode_step) if engine.compile else self._decode_step
        self.graphs = None
        if device.type == "cuda" and engine.cuda_graphs:
            from specscope.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self._step, device)

    def ensure_cache(self, tokens: int, batch: int = 1) -> KVCache:
        """A cache holding `tokens` positions: reuse the current one if big enough."""
        if tokens > self.max_model_len:
            raise ValueError(f"{tokens} tokens exceed the context length {self.max_model_len}")
        block = self.engine.kv_block
        capacity = min(-(-tokens // block) * block, self.max_model_len)
        if self.cache is None or not self.cache.fits(batch, capacity, self.dtype, self.device):
            # Graphs captured over the old buffers must go before the buffers do (they hold
            # raw addresses); then free the old buffers before allocating the new ones.
            if self.graphs is not None:
                self.graphs.reset()
            self.cache_generation += 1
            self.cache = None
            cfg = self.config
            self.cache = KVCache(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim,
                                 self.dtype, self.device)
        return self.cache

    def _kv_len(self, end: int) -> int:
        """Slots to attend over when the last token written sits at end - 1."""
        assert self.cache is not None
        block = self.engine.kv_block
        return min(-(-end // block) * block, self.cache.capacity)

    @torch.inference_mode()
    def prefill(self, ids: list[int], start: int = 0, return_taps: bool = False):
        """Feed prompt tokens at positions [start, start+len) in chunks; return last logits.

        Only the final position's hidden state goes through lm_head: the vocabulary
        projection of the others would be wasted work. Returns logits [1, V] fp32, and with
        return_taps also the taps of every prompt position [1, N, n_taps * hidden].
        """
        chunk = self.engine.prefill_chunk_size
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)[None]  # [1, N]
        hidden = None
        taps = []
        for s in range(0, len(ids), chunk):
            piece = ids_t[:, s:s + chunk]
            pos = torch.arange(start + s, start + s + piece.shape[1], device=self.device)[None]
            hidden, t = self.model(piece, pos, self.cache, return_taps=return_taps,
                                   kv_len=self._kv_len(start + s + piece.shape[1]))
            taps.append(t)
        assert hidden is not None, "prefill needs at least one token"
        logits = self.model.compute_logits(hidden[:, -1])
        if return_taps:
            return logits, torch.cat(taps, dim=1)
        return logits

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, position: torch.Tensor, pos_host: int) -> torch.Tensor:
        """One decode step. token [1, 1] and position [1, 1] stay on the device (the sampled
        token feeds straight back in, no round trip); pos_host only picks the KV window.
        Returns logits [1, V] fp32 (with CUDA graphs: a static buffer, valid until the next
        step)."""
        kv_len = self._kv_len(pos_host + 1)
        if self.graphs is not None:
            return self.graphs.run(self.cache, token, position, kv_len)
        return self._step(token, position, kv_len)

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor,
                     kv_len: int) -> torch.Tensor:
        hidden, _ = self.model(token, position, self.cache, kv_len=kv_len)
        return self.model.compute_logits(hidden[:, -1])  # [1, V]


class PlainDecoder:
    """Plain decoding as a cycle: one target step per cycle, emitting one token.

    The same interface as engine.speculative.SpecDecoder (ensure_caches / prefill / cycle /
    advance), so LLM runs one loop for both; plain decoding is the reference path that
    speculative decoding must reproduce token for token under greedy sampling.
    """

    lookahead = 1
    last_was_speculative = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.timer: Profiler | None = None

    def ensure_caches(self, tokens: int) -> None:
        self.runner.ensure_cache(tokens)

    def prefill(self, prompt_ids: list[int], params: SamplingParams,
                gen: torch.Generator | None) -> torch.Tensor:
        if self.timer:
            self.timer.mark(Phase.PREFILL)
        self.n = len(prompt_ids)
        self.position = torch.tensor([[self.n]], dtype=torch.long, device=self.runner.device)
        self.token = sample(self.runner.prefill(prompt_ids), params, gen)  # [1]
        self._fresh = True  # the greedy graph has not been fed this request's inputs yet
        if self.timer:
            self.timer.stop()
        return self.token

    def cycle(self, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """-> [2] int64: the count (1) and the token."""
        if self.timer:
            self.timer.mark(Phase.DECODE)
        graphs = self.runner.graphs
        if graphs is not None and params.greedy:
            # One replay per cycle: the graph samples and feeds itself (see run_greedy).
            first = self._fresh
            self._fresh = False
            out = graphs.run_greedy(self.runner.cache, self.token.view(1, 1) if first else None,
                                    self.position if first else None,
                                    self.runner._kv_len(self.n + 1))
            if self.timer:
                self.timer.stop()
            return out
        logits = self.runner.decode(self.token.view(1, 1), self.position, self.n)
        self.token = sample(logits, params, gen)
        if self.timer:
            self.timer.stop()
        return torch.cat([torch.ones_like(self.token), self.token])

    def advance(self, count: int) -> None:
        if self._fresh or self.runner.graphs is None:
            self.position += count  # the greedy graph advances its own position
        self.n += count
