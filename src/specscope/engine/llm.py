"""`specscope.LLM`: load a model once, generate from prompts or chat messages.

Every generation runs on the one batched engine loop (engine/engine.py): `generate` runs its
prompts as one batch, `stream` one request, and the server feeds many through
`add_request` / `step` / `abort_request` (vLLM's LLMEngine names). A request's text, stop
strings and timings live in its `Request`; its tokens, KV blocks and speculative state in
its `Sequence`.

A request of n choices (SamplingParams.n) is n sequences of one prompt: the first is added
at once, the others once its prompt is computed, so they are admitted with its prompt's
blocks from the prefix cache (every full block; each computes only its last partial one).
Seeded, choice i draws from seed + i.

With `tensor_parallel_size` N > 1 this process is rank 0 of N (parallel/launch.py starts
the others, or torchrun does): it holds the tokenizer, the requests and the scheduler;
every rank holds a shard of the model and runs each step rank 0 sends. Calls that change
the engine (set_spec, enable_profiling, reset_simulation) run on every rank. Under
torchrun the LLM(...) call never returns on the other ranks: they follow rank 0 and exit
when it closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specscope.config import (
    MAX_NUM_DRAFT_TOKENS,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpecConfig,
    SpecPolicy,
    spec_fields_from_vllm,
)
from specscope.draft.eagle3 import Eagle3Draft
from specscope.engine.engine import BatchConfig, Engine, StepOutput, end_profiled_cycle
from specscope.engine.grammar import Grammar, GrammarCompiler
from specscope.engine.machine import (  # noqa: F401  (re-exported: the engine's API)
    collect_heap,
    cpu_has_native_bf16,
    default_draft_note,
    resolve_device,
    resolve_dtype,
    resolve_quantization,
    settle_heap,
)
from specscope.engine.ranks import TensorParallelRanks
from specscope.engine.request import (
    Request,
    RequestOutput,
    SampleLogprobs,
    prompt_logprobs,
    request_output,
)
from specscope.engine.sequence import Sequence
from specscope.engine.speculative import SpecStats, load_spec_draft
from specscope.engine.tokenizer import (
    IdTokenizer,
    Messages,
    Tokenizer,
    check_unicode,
    validate_messages,
)
from specscope.kvcache.budget import KVLayout, activation_bytes, kv_budget
from specscope.models.loader import load_model
from specscope.models.packed import pack_fp32_rows, pack_linears
from specscope.models.quant import quantize_q8_0
from specscope.models.registry import TargetModel
from specscope.parallel import launch as tp_launch
from specscope.parallel.launch import DEFAULT_DIST_TIMEOUT, TPRuntime
from specscope.profiler import Phase, Profiler
from specscope.profiler.collectives import with_rank_skew
from specscope.sampling import make_generator

log = logging.getLogger("specscope.llm")

# vLLM's prompt dicts: TokensPrompt {"prompt_token_ids": [...]}, TextPrompt {"prompt": "..."}.
PromptDict = dict[str, Any]
Prompt = str | Messages | PromptDict


def _is_prompt_dict(p: Any) -> bool:
    """A vLLM prompt dict (TokensPrompt / TextPrompt), not a chat message."""
    return isinstance(p, dict) and ("prompt_token_ids" in p or "prompt" in p) and "role" not in p


@dataclass
class _Group:
    """A request's choices in flight: their sequences and text states by index, the
    sequences not yet in the engine (added once the first's prompt is cached), and how many
    have finished."""

    request_id: str
    prompt_ids: list[int]
    seqs: list[Sequence]
    choices: list[Request]
    waiting: list[Sequence] = field(default_factory=list)
    done: int = 0
    prompt_sent: bool = False  # its prompt log-probabilities went out with a delta


@dataclass
class _Active:
    """A choice in flight: its engine sequence, its text state, its request, and how many
    of its log-probability entries were streamed."""

    seq: Sequence
    req: Request
    group: _Group
    lp_sent: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the server's guardrail and throughput log see it (LLM.last_step):
    sequences in it and of them speculating, prefill tokens, tokens emitted, its wall
    seconds, and per speculating sequence its draft tokens verified and accepted."""

    batch: int
    speculating: int
    prefill_tokens: int
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: tuple[int, ...] = ()
    depth: int = 0  # the speculative configuration's num_steps (0: a plain step)
    # Per speculating sequence, the draft positions it verified (depth, or fewer where the
    # confidence stop ended its chain), in `accepted`'s order.
    positions: tuple[int, ...] = ()


@dataclass
class StreamDelta:
    """One cycle's worth of output of one choice (`index`) while streaming."""

    request_id: str
    text: str  # new text (may be empty while a multi-byte char or stop-string prefix waits)
    token_ids: list[int]  # tokens emitted this cycle
    finished: bool  # the whole request is done (every choice): output is set
    output: RequestOutput | None = None  # set on the final delta
    index: int = 0  # the choice this delta belongs to
    finish_reason: str | None = None  # set on the choice's last delta
    logprobs: SampleLogprobs | None = None  # the entries of the tokens this delta kept
    # With SamplingParams.prompt_logprobs: on the request's first delta (RequestOutput's).
    prompt_logprobs: list | None = None


def _resolve_spec(spec: SpecConfig | None | str, speculative_config: dict | None,
                  model: str | None) -> SpecConfig | None:
    """LLM's speculation: a SpecConfig, vLLM's speculative_config dict, or "auto" (the
    default model with its shipped draft, as the CLI runs it; any other model plainly)."""
    if speculative_config is not None:
        if spec not in ("auto", None):
            raise ValueError("give spec or speculative_config, not both")
        return SpecConfig(**spec_fields_from_vllm(speculative_config))
    if spec == "auto":
        return SpecConfig(draft="default") if model is None else None
    if spec is not None and not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig, None or 'auto', got {spec!r}")
    return spec


class LLM(TensorParallelRanks):
    """An engine for one model.

    model: a local HF directory, a .gguf file, a HF hub id, or None for the embedded default
    (SmolLM2-135M-Instruct). dtype: auto | fp32 | bf16 | fp16. device: auto | cpu | cuda.
    quantization: auto | none | int4-gguf (run a GGUF's Q4_0/Q4_1 weights natively on the
    CPU, a draft beside them as Q8_0); auto (the default) picks int4-gguf for such a GGUF
    where the native kernels build (resolve_quantization); `config_note` says what it
    picked.
    cuda_graphs: replay plain decode and pure speculative steps as CUDA graphs per
    batch-size bucket (CUDA only).
    max_num_batched_tokens / max_num_seqs: a step's token and sequence budgets (longer
    prompts are prefilled in chunks). block_size: tokens per KV block.
    gpu_memory_utilization / kv_cache_memory: the KV pools' budget (kvcache/budget.py).
    enable_prefix_caching: reuse the KV blocks of a shared prompt prefix.
    spec: speculative decoding with an EAGLE-3 draft (SpecConfig); None = plain decoding;
    "auto" (the default): the default model with its shipped draft (on the CPU its chains
    sized by the confidence stop: engine/machine.py default_draft_note), other models
    plainly.
    speculative_config: vLLM's dict instead of spec ({"method": "eagle3", "model": DRAFT,
    "num_speculative_tokens": 5}).
    profile: time every phase of every step (None: on when SPECSCOPE_PROFILE=1);
    profile_interval: log a summary every N steps (default 100 when profiling).
    compile: torch.compile the target's forward (slow first steps, faster after).
    chat_template: a Jinja chat template (or a file holding one) instead of the tokenizer's.
    seed: the seeds of sampled requests that give none (seed, seed + 1, ... in arrival
    order), so a run's sampled output repeats; None: unseeded.
    tensor_parallel_size: shard the model over this many ranks (processes; GPUs on CUDA),
    started here on one host or joined under torchrun (docs/tensor-parallel.md);
    dist_timeout: seconds any collective may wait before the group is declared failed.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, cache_dir: str | None = None,
                 quantization: str = "auto", cuda_graphs: bool = True, compile: bool = False,
                 spec: SpecConfig | None | str = "auto", spec_policy: SpecPolicy | None = None,
                 speculative_config: dict | None = None,
                 profile: bool | None = None, profile_interval: int | None = None,
                 chat_template: str | None = None, seed: int | None = None,
                 tensor_parallel_size: int = 1, dist_timeout: float = DEFAULT_DIST_TIMEOUT,
                 **batching: Any) -> None:
        payload = {k: v for k, v in locals().items() if k not in ("self", "batching")}
        payload.update(batching, chat_template=None)  # the other ranks hold no tokenizer
        self.engine_config = EngineConfig(dtype=dtype, device=device,
                                          max_model_len=max_model_len, cache_dir=cache_dir,
                                          cuda_graphs=cuda_graphs, compile=compile,
                                          **batching)
        self.device = resolve_device(self.engine_config.device)
        self.tp = tp_launch.start(tensor_parallel_size, self.device.type, payload,
                                  dist_timeout)
        if self.tp is not None:
            self.device = self.tp.group.device if self.device.type == "cuda" else self.device
        chosen = spec == "auto" and speculative_config is None and model is None
        spec = _resolve_spec(spec, speculative_config, model)
        quantization, note = resolve_quantization(
            quantization, model, self.device, self.engine_config.dtype, tensor_parallel_size,
            cache_dir)
        self.dtype = resolve_dtype(self.engine_config.dtype, self.device, quantization)
        drafted = default_draft_note(spec, self.device, tensor_parallel_size) if chosen else ""
        self.config_note = "; ".join(n for n in (note, drafted) if n)
        self.quantization = quantization
        loaded = load_model(model, self.dtype, self.device, cache_dir, quantization,
                            tp=self.tp.group if self.tp is not None else None)
        self.load_stats = loaded.reads
        tokenizer = self._rank_tokenizer(loaded.path, loaded.config, chat_template)
        self._setup(loaded.model, loaded.config, loaded.path, loaded.source, tokenizer, spec,
                    spec_policy)
        self.seed = seed
        self._profile_from_env(profile, profile_interval)
        self._follow_rank0()

    def _profile_from_env(self, profile: bool | None, interval: int | None) -> None:
        """profile=None follows SPECSCOPE_PROFILE=1; the summary interval defaults to 100."""
        if profile is None:
            profile = os.environ.get("SPECSCOPE_PROFILE", "") not in ("", "0")
        if profile:
            self._enable_profiling(True, interval if interval is not None else 100)

    @classmethod
    def from_model(cls, model: TargetModel, *, tokenizer: Tokenizer | IdTokenizer | None = None,
                   spec: SpecConfig | None = None, spec_policy: SpecPolicy | None = None,
                   name: str = "in-memory", tp: TPRuntime | None = None,
                   **engine: Any) -> LLM:
        """An engine around an already built model (e.g. random weights of a real shape for
        benchmarks). Without a tokenizer, text is the token ids (IdTokenizer). tp: the
        group the model is a shard of (parallel.launch.start under torchrun); on a rank
        other than 0 this never returns (the rank follows rank 0, then exits)."""
        self = cls.__new__(cls)
        self.engine_config = EngineConfig(**engine)
        self.tp = tp
        param = next(model.parameters())
        self.device, self.dtype, self.quantization = param.device, param.dtype, "none"
        self.config_note = ""
        self.load_stats = None
        self._setup(model, model.config, None, name, tokenizer or IdTokenizer(), spec,
                    spec_policy)
        self.seed = None
        self._profile_from_env(None, None)
        self._follow_rank0()
        return self

    def _setup(self, model: TargetModel, config: ModelConfig, path, name: str, tokenizer,
               spec: SpecConfig | None, policy: SpecPolicy | None = None) -> None:
        self.model_config = config
        self.model_path = path
        self.model_name = name
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size)  # structured output
        self.model = model
        ctx = config.max_position_embeddings
        if self.engine_config.max_model_len is not None:
            ctx = min(ctx, self.engine_config.max_model_len)
        self.max_model_len = ctx
        if not self.engine_config.compile:
            # CPU bf16: every linear on oneDNN-packed weights (models/packed.py), bit-identical
            # to F.linear and faster; costs a second copy of the linear weights, so at most a
            # quarter of the free memory. Not under torch.compile, which traces F.linear. A
            # no-op off the CPU or bf16.
            n = pack_linears(model, memory_fraction=0.25)
            if n:
                log.info("%d linears run on oneDNN-packed bf16 weights", n)
        self._ids = itertools.count()
        # generate/stream run one caller at a time (the server drives add_request/step from
        # its own engine thread instead); callers on other threads queue here.
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding _lock
        self._active: dict[str, _Active] = {}  # by sequence id (one per choice)
        self._groups: dict[str, _Group] = {}  # by request id
        # Deltas a generate/stream call stepped out for other callers' requests (a server
        # calibration running between steps): the next step() hands them over.
        self._undelivered: list[StreamDelta] = []
        self.last_step: StepRecord | None = None
        self._seeds = itertools.count()  # with LLM(seed=...): the unseeded requests' seeds
        self.spec: SpecConfig | None = None
        self.draft_info: str | None = None
        self._draft: tuple[tuple, Any] | None = None  # ((draft, layer ids), loaded draft)
        self.draft: Eagle3Draft | None = None
        self.timer: Profiler | None = None
        self.engine: Engine | None = None
        self.spec_policy: SpecPolicy | None = None
        self._set_spec(spec, policy)

    def set_spec(self, spec: SpecConfig | None, policy: SpecPolicy | None = None) -> None:
        """Switch speculative decoding on (with this configuration) or off, keeping the
        target weights loaded. A draft is loaded again only if its path or taps changed.
        policy: speculation by batch size (each step runs the configuration of its batch's
        bucket; spec gives the draft). Between configurations of the same draft the engine
        switches in place (Engine.retarget: KV pools, requests and captured graphs kept);
        otherwise requests in flight carry over into a new engine, which recomputes their
        KV. On every tensor-parallel rank."""
        self._everywhere("set_spec", spec, policy)
        self._set_spec(spec, policy)

    def loaded_draft(self, draft: str) -> Eagle3Draft | None:
        """The draft this LLM holds loaded (kept while decoding plainly too) if it was loaded
        from `draft` and is whole on this process (no tensor parallelism); else None."""
        if self._draft is None or self._draft[0][0] != draft or self.tp is not None:
            return None
        return self._draft[1]

    def _set_spec(self, spec: SpecConfig | None, policy: SpecPolicy | None) -> None:
        with self._lock:
            draft = None
            if spec is not None:
                # The last draft stays loaded while speculation is off, so switching back
                # (or a tuner alternating plain and speculative runs) never reloads it.
                key = (spec.draft, spec.draft_layer_ids, spec.draft_tensor_parallel_size)
                if self._draft is not None and self._draft[0] == key:
                    draft = self._draft[1]
                else:
                    draft, self.draft_info = load_spec_draft(spec, self.model, self.dtype,
                                                             self.device)
                    if self.quantization == "int4-gguf":  # the draft's linears as Q8_0
                        quantize_q8_0(draft)
                    pack_linears(draft)
                    self._draft = (key, draft)
            if spec is not None and self.spec is not None and draft is self.draft:
                # Same draft: the engine switches configuration in place.
                self.engine.retarget(spec, policy)
                self._pack_verify_rows(spec)
                self.spec, self.spec_policy = spec, policy
                self._label_config()
                return
            carried = self.engine.scheduler.drain() if self.engine is not None else []
            self.engine = None  # the old pools go before the new ones are allocated
            collect_heap()  # an engine and its captured graphs hold each other
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.engine = self._build_engine(draft, spec, policy if spec is not None else None)
            self._pack_verify_rows(spec)
            for seq in carried:
                self.engine.add(seq)
            self.spec, self.draft = spec, draft
            self.spec_policy = policy if spec is not None else None
            self.engine.timer = self.timer
            self._label_config()
            settle_heap()

    def _pack_verify_rows(self, spec: SpecConfig | None) -> None:
        """CPU fp32: the target's linears serve a verify's rows (num_draft_tokens, the
        batch-1 verify) from MKL-packed weights (models/packed.py pack_fp32_rows); plain
        decoding drops the copy. Not under torch.compile, which traces F.linear."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or \
                self.engine_config.compile:
            return
        rows = spec.num_draft_tokens if spec is not None else None
        if pack_fp32_rows(self.model, rows):
            log.info("fp32 linears serve %d-row verify GEMMs from MKL-packed weights", rows)

    def _build_engine(self, draft: Eagle3Draft | None, spec: SpecConfig | None,
                      policy: SpecPolicy | None) -> Engine:
        ec, mc = self.engine_config, self.model_config
        layouts = [self.model.kv_layout(self.dtype)]  # this rank's KV heads
        if draft is not None:
            dc = draft.config
            layouts.append(KVLayout(dc.num_layers, draft.local_heads[1], dc.head_dim,
                                    self.dtype))
        lookahead = MAX_NUM_DRAFT_TOKENS if spec is not None else 1
        budget = kv_budget(layouts, ec.block_size, self.device,
                           gpu_memory_utilization=ec.gpu_memory_utilization,
                           kv_cache_memory=ec.kv_cache_memory,
                           activation_bytes=activation_bytes(
                               mc, ec, self.dtype,
                               ec.max_num_batched_tokens if draft is not None else 0),
                           max_tokens=ec.max_num_seqs * (self.max_model_len + lookahead))
        if self.tp is not None:  # every rank holds the same block ids: what fits on all
            n = self.tp.group.min_int(budget.num_blocks)
            budget = dataclasses.replace(budget, num_blocks=n,
                                         bytes=budget.bytes // budget.num_blocks * n)
        log.info("%s", budget.describe(self.max_model_len))
        self.kv_budget = budget
        cfg = BatchConfig(num_blocks=budget.num_blocks, block_size=ec.block_size,
                          max_num_batched_tokens=ec.max_num_batched_tokens,
                          max_num_seqs=ec.max_num_seqs, max_model_len=self.max_model_len,
                          enable_prefix_caching=ec.enable_prefix_caching,
                          cuda_graphs=ec.cuda_graphs, compile=ec.compile)
        return Engine(self.model, cfg, frozenset(self.tokenizer.eos_token_ids), draft, spec,
                      policy, tp=self.tp)

    def reset_simulation(self) -> None:
        """Restart the simulated-acceptance random stream (the same accept decisions on
        the same workload, e.g. profiling on vs off)."""
        self._everywhere("reset_simulation")
        self.engine.reset_simulation()

    def enable_profiling(self, on: bool = True, interval: int | None = 100) -> Profiler | None:
        """Time every phase of every cycle (profiler/); log a summary every `interval`
        cycles (None: never). Off (the default) adds no work at all. Returns the profiler.
        Under tensor parallelism every rank profiles itself, its collectives included."""
        self._everywhere("enable_profiling", on, interval)
        return self._enable_profiling(on, interval)

    def _enable_profiling(self, on: bool, interval: int | None) -> Profiler | None:
        if not self._is_rank0:
            interval = None  # rank 0 logs the summaries
        self.timer = Profiler(self.device, interval=interval) if on else None
        self.engine.timer = self.timer
        if self.tp is not None:
            self.tp.group.timer = self.timer  # every collective timed into its phase
        self._label_config()
        return self.timer

    def _label_config(self) -> None:
        if self.timer is None:
            return
        s = self.spec
        tp = self.tensor_parallel()
        suffix = "" if tp is None else f" tp={tp['size']}" + (
            "" if s is None else f" draft_tp={tp['draft_size']}")
        self.timer.parallel = tp
        if s is None:
            self.timer.set_config("plain" + suffix)
        else:
            label = f"spec steps={s.num_steps} topk={s.topk} ndt={s.num_draft_tokens}"
            if self.spec_policy is not None:
                label = f"spec policy [{self.spec_policy.describe()}]"
            self.timer.set_config(label + suffix + (" SIMULATED" if s.simulated else ""),
                                  s.simulated, s.num_steps)

    def profile_summary(self) -> list[dict]:
        """Per-configuration phase summaries (see profiler/profiler.py for the fields).
        Under tensor parallelism every rank's summary is gathered, and each configuration
        says how much slower its slowest rank ran each phase than its fastest
        (`ranks`)."""
        if self.timer is None:
            raise RuntimeError("profiling is off: LLM(..., profile=True), "
                               "llm.enable_profiling() or SPECSCOPE_PROFILE=1")
        if self.tp is None or not self.tp.is_driver:
            return self.timer.summary()
        return with_rank_skew(self._gather("profile_summary", self.timer.summary))

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """The target's logits [T, V] (fp32) at every position of a prompt, in one forward
        without a cache (no engine state is touched). On every tensor-parallel rank."""
        self._check_ids(prompt_ids)
        self._everywhere("prompt_logits", prompt_ids)
        ids = torch.tensor([prompt_ids], device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        with torch.inference_mode():
            hidden, _ = self.model(ids, pos)
            return self.model.compute_logits(hidden[0])

    # -- prompts ----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool = False,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids for a raw prompt, or for chat messages through the chat template (with
        the tools offered, OpenAI's shape: {"type": "function", "function": {...}}).

        Text never yields control tokens (see Tokenizer); send token ids (`stream(...,
        prompt_ids=...)`) to use them on purpose."""
        if _is_prompt_dict(prompt):
            if "prompt_token_ids" in prompt:
                return self._token_prompt(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"a TextPrompt's 'prompt' must be a string, got "
                                f"{type(prompt).__name__}")
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            if chat:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          tools=tools)
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            validate_messages(prompt)
            ids = self.tokenizer.apply_chat_template(prompt, tools=tools)
        else:
            raise TypeError(f"a prompt must be a string or a list of chat messages, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty after tokenisation; give at least one token")
        if max(ids) >= self.model_config.vocab_size:  # a tokenizer larger than the model
            raise ValueError(f"the tokenizer produced id {max(ids)}, outside the model's "
                             f"vocabulary of {self.model_config.vocab_size}")
        return ids

    def _token_prompt(self, ids: Any) -> list[int]:
        """A TokensPrompt's ids, checked: a non-empty list of ints inside the vocabulary."""
        if not isinstance(ids, (list, tuple)) or not ids or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids (ints)")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds {bad[0]}, outside the model's vocabulary "
                             f"of {self.model_config.vocab_size}")
        return list(ids)

    def _check_length(self, n_prompt: int, params: SamplingParams) -> None:
        total = n_prompt + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length ({self.max_model_len}); shorten the "
                f"prompt or lower max_tokens")

    @staticmethod
    def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or _is_prompt_dict(prompts):
            return [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], dict) and \
                not _is_prompt_dict(prompts[0]):
            return [prompts]  # one conversation
        if isinstance(prompts, list):
            return list(prompts)
        raise TypeError("prompts must be a string, a prompt dict ({'prompt_token_ids': [...]} "
                        "or {'prompt': '...'}), a list of those, a list of messages, or a list "
                        "of conversations")

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | None = None, *,
                 chat: bool = False, tools: list[dict[str, Any]] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of {'role', 'content'} messages, or
        vLLM's prompt dicts: {'prompt_token_ids': [...]} as it is, {'prompt': '...'} as the
        string), all prompts in one batch.

        With chat=True, string prompts are sent as a single user message through the chat
        template. Returns one RequestOutput per prompt, in order.
        """
        params = sampling_params or SamplingParams()
        batch = self._as_list(prompts)
        encoded = [self.encode_prompt(p, chat, tools) for p in batch]  # errors before any work
        for ids in encoded:
            self._check_length(len(ids), params)
        if params.structured_outputs is not None:  # a bad grammar fails before any request
            self.grammars.check(params.structured_outputs)
        with self._exclusive():
            rids = [self.add_request(ids, params) for ids in encoded]
            done: dict[str, RequestOutput] = {}
            try:
                mine = set(rids)
                while len(done) < len(rids):
                    for d in self.step():
                        if d.request_id not in mine:
                            self._undelivered.append(d)  # another caller's (the server's)
                        elif d.finished:
                            done[d.request_id] = d.output
            finally:
                for rid in rids:
                    if rid not in done:
                        self.abort_request(rid)
        return [done[r] for r in rids]

    def chat(self, messages: Messages | list[Messages],
             sampling_params: SamplingParams | None = None, *,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {'role', 'content'} messages) or a
        list of them, each through the chat template (offered `tools`, OpenAI's shape), all
        in one batch."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() takes a conversation (a non-empty list of messages) or "
                             "a list of conversations")
        batch = messages if isinstance(messages[0], list) else [messages]
        return self.generate(batch, sampling_params, tools=tools)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               chat: bool = False, prompt_ids: list[int] | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas as they are produced; the last one carries the RequestOutput."""
        params = sampling_params or SamplingParams()
        if prompt_ids is not None:
            self._check_ids(prompt_ids)
            ids = list(prompt_ids)
        else:
            ids = self.encode_prompt(prompt, chat)
        self._check_length(len(ids), params)
        yield from self._stream(ids, params)

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        with self._exclusive():
            rid = self.add_request(ids, params)
            try:
                while True:
                    for d in self.step():
                        if d.request_id != rid:
                            self._undelivered.append(d)
                            continue
                        yield d
                        if d.finished:
                            return
            finally:
                if rid in self._groups:
                    self.abort_request(rid)  # closed early: free its blocks now

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            # The lock is held by a suspended stream of this very thread: waiting would
            # deadlock, so say what to do instead.
            raise RuntimeError("a stream on this engine is still open in this thread; "
                               "finish or close() it before starting another request")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _check_ids(self, ids: list[int]) -> None:
        V = self.model_config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt_ids hold ids outside the vocabulary [0, {V}): {bad[:8]}")

    # -- the request-level API (the server's) ------------------------------------------------

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary; a
        structured output under tensor parallelism (the other ranks hold no tokenizer to
        run its grammar)."""
        if params.structured_outputs is not None and self.tp is not None \
                and self.tp.group.size > 1:
            raise ValueError("structured outputs (response_format, tool_choice required or "
                             "named) are not supported with --tensor-parallel-size > 1 yet")
        V = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= V]
        if bad:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {V}): "
                             f"{bad[:8]}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, grammar: Grammar | None = None) -> str:
        """Queue a request (params.n choices) for the next steps; returns its id. Checked
        like `stream`. grammar: params.structured_outputs already compiled
        (`self.grammars.compile`), so that a server compiles it off its engine thread; else
        it is compiled here (and for every choice after the first: each has its own)."""
        self._check_length(len(prompt_ids), params)
        self.check_params(params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._groups:
            raise ValueError(f"request id {rid!r} is already running")
        n, now = params.n, time.perf_counter()
        child = params if n == 1 else replace(params, n=1)
        group = _Group(rid, list(prompt_ids), [], [])
        for i in range(n):
            if i == 1 and params.prompt_logprobs is not None:  # the first computes them
                child = replace(child, prompt_logprobs=None)
            seed = None if params.seed is None else params.seed + i
            if seed is None and self.seed is not None:  # --seed: every run draws the same
                seed = self.seed + next(self._seeds)
            gen = None if params.greedy else make_generator(seed, self.device)
            sid = rid if n == 1 else f"{rid}#{i}"
            seq = Sequence(sid, list(prompt_ids), child, gen, arrival=now)
            if params.structured_outputs is not None:
                seq.grammar = (grammar if i == 0 and grammar is not None
                               else self.grammars.compile(params.structured_outputs))
            req = Request(rid, list(prompt_ids), child, self.tokenizer, index=i)
            group.seqs.append(seq)
            group.choices.append(req)
            self._active[sid] = _Active(seq, req, group)
        self._groups[rid] = group
        self.engine.add(group.seqs[0])
        if self.engine_config.enable_prefix_caching:
            group.waiting = group.seqs[1:]  # after the first's prompt: cached blocks
        else:
            for seq in group.seqs[1:]:
                self.engine.add(seq)
        return rid

    def _admit_choices(self) -> None:
        """Add the waiting choices of every request whose first choice has computed its
        prompt (or ended): its full prompt blocks are in the prefix cache by now."""
        for g in self._groups.values():
            first = g.seqs[0]
            if g.waiting and (first.finished or first.num_computed >= len(g.prompt_ids)):
                for seq in g.waiting:
                    self.engine.add(seq)
                g.waiting = []

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (client gone, cancelled, the server stopping): its KV blocks
        are freed. Returns what it produced, its unfinished choices' finish_reason "abort"
        (None for an unknown or finished request)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq, req in zip(group.seqs, group.choices, strict=True):
            if self._active.pop(seq.seq_id, None) is not None:
                self.engine.cancel(seq, "abort")
                req.end("abort")
        return request_output(group.request_id, group.prompt_ids, group.choices)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        sch = self.engine.scheduler
        return len(sch.running), len(sch.waiting)

    def step(self) -> list[StreamDelta]:
        """One engine step for every scheduled request: the deltas of those that produced
        text or finished (and any that an inner generate/stream stepped out for them).
        Callers that drive requests themselves (the server) run on one thread."""
        ready, self._undelivered = self._undelivered, []
        prof = self.timer
        if prof:
            prof.begin_cycle()
        t0 = time.perf_counter()
        self._admit_choices()
        outs = self._engine_step()
        st = self.engine.last_stats
        spec = [o for o in outs if o.accepted is not None]
        self.last_step = StepRecord(st.num_seqs, st.num_speculating, st.prefill_tokens,
                                    sum(len(o.new_tokens) for o in outs),
                                    time.perf_counter() - t0,
                                    st.verify_tokens - st.num_speculating,
                                    tuple(o.accepted for o in spec),
                                    self.engine.spec.num_steps if spec else 0,
                                    tuple(o.drafted for o in spec))
        if prof:
            prof.mark(Phase.DETOKENIZE)
        deltas = ready + [d for o in outs if (d := self._delta(o)) is not None]
        if prof:
            end_profiled_cycle(prof, st, outs)
        return deltas

    def _delta(self, o: StepOutput) -> StreamDelta | None:
        act = self._active.get(o.seq.seq_id)
        if act is None or (not o.new_tokens and not o.finished):
            return None
        req, group = act.req, act.group
        text = req.append(o.new_tokens, o.logprobs) if o.new_tokens else ""
        if o.finished and not req.finished:  # ended by the engine (context full)
            text += req.end(o.seq.finish_reason or "length")
        lps = None
        if req.logprobs is not None:
            lps, act.lp_sent = req.logprobs[act.lp_sent:], len(req.logprobs)
        plp = None
        if not group.prompt_sent:
            plp = self._prompt_logprobs(group)
            group.prompt_sent = plp is not None
        if not req.finished:
            return StreamDelta(group.request_id, text, o.new_tokens, False, index=req.index,
                               logprobs=lps, prompt_logprobs=plp)
        if not o.finished:
            self.engine.cancel(o.seq, req.finish_reason)  # a stop string ended it
        del self._active[o.seq.seq_id]
        group.done += 1
        out = None
        if group.done == len(group.choices):
            del self._groups[group.request_id]
            out = request_output(group.request_id, group.prompt_ids, group.choices,
                                 self._prompt_logprobs(group))
            out.spec = self._spec_stats(group.seqs)
        return StreamDelta(group.request_id, text, o.new_tokens, out is not None, out,
                           index=req.index, finish_reason=req.finish_reason, logprobs=lps,
                           prompt_logprobs=plp)

    def _prompt_logprobs(self, group: _Group) -> list | None:
        """The request's prompt log-probabilities, once its first choice has them all."""
        first = group.seqs[0]
        if first.params.prompt_logprobs is None or first.wants_prompt_logprobs:
            return None
        return prompt_logprobs(group.prompt_ids, first.prompt_lp, self.tokenizer)

    def _spec_stats(self, seqs: list[Sequence]) -> dict | None:
        """A request's speculative statistics over all its choices (None: plain)."""
        if self.spec is None:
            return None
        configs = self.spec_policy.configs if self.spec_policy else []
        steps = max(c.num_steps for c in configs or [self.spec])
        stats = SpecStats(steps, self.spec.simulated)
        stats.accepted = [a for s in seqs if s.spec for a in s.spec.accepted]
        stats.drafted = [d for s in seqs if s.spec for d in s.spec.drafted]
        stats.cycles = len(stats.accepted)
        return stats.as_dict()

    def __repr__(self) -> str:
        c = self.model_config
        return (f"LLM({self.model_name!r}, {c.architecture}, layers={c.num_layers}, "
                f"dtype={self.dtype}, device={self.device})")

    def describe(self) -> str:
        """One line for the start-up log: the model, its dtype and device, the draft and its
        taps, the KV pool and the scheduler's limits."""
        c, ec = self.model_config, self.engine_config
        dtype = str(self.dtype).removeprefix("torch.")
        where = str(self.device) if self.tp is None else \
            f"{self.tp.size} tensor-parallel ranks ({self.device.type})"
        text = (f"{self.model_name} ({c.architecture}, {c.num_layers} layers, vocab "
                f"{c.vocab_size}) in {dtype} on {where}; max_model_len "
                f"{self.max_model_len}, max {ec.max_num_seqs} sequences, "
                f"{ec.max_num_batched_tokens} batched tokens per step")
        if self.kv_budget is not None:
            text += f"; {self.kv_budget.describe(self.max_model_len)}"
        if self.spec is None:
            return text + "; speculation off"
        taps = list(self.draft.config.aux_layer_ids) if self.draft is not None else "?"
        how = (f"policy {self.spec_policy.flag()}" if self.spec_policy else
               f"steps={self.spec.num_steps} topk={self.spec.topk} "
               f"ndt={self.spec.num_draft_tokens}")
        tp = self.tensor_parallel()
        place = "" if tp is None else f", {tp['draft_placement']} (draft TP {tp['draft_size']})"
        return (text + f"; EAGLE-3 draft {self.spec.draft} tapping target layers {taps}, "
                f"{how}{place}" + (" (SIMULATED acceptance)" if self.spec.simulated else ""))

    def info(self) -> dict[str, Any]:
        c = self.model_config
        return {"model": self.model_name, "path": str(self.model_path),
                "architecture": c.architecture, "layers": c.num_layers,
                "hidden": c.hidden_size, "vocab": c.vocab_size, "dtype": str(self.dtype),
                "device": str(self.device), "max_model_len": self.max_model_len}
