"""`specscope.LLM`: load a model once, generate from prompts or chat messages.

The decode loop is written once (`_run`): prefill, then cycles that each emit tokens, with
the cycle's single device->host read in `_read_tokens`. Plain decoding is the cycle with no
draft; speculative decoding plugs a different cycle into the same loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specscope.config import (
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpecConfig,
    normalize_dtype,
)
from specscope.engine.request import Request, RequestOutput
from specscope.engine.runner import ModelRunner, PlainDecoder
from specscope.engine.speculative import SpecDecoder, SpecStats
from specscope.engine.tokenizer import (
    IdTokenizer,
    Messages,
    Tokenizer,
    check_unicode,
    validate_messages,
)
from specscope.models.llama import CausalLM
from specscope.models.loader import load_model
from specscope.profiler import Phase, Profiler
from specscope.sampling import make_generator

log = logging.getLogger("specscope.llm")

Prompt = str | Messages


@dataclass
class StreamDelta:
    """One cycle's worth of output while streaming."""

    request_id: str
    text: str  # new text (may be empty while a multi-byte char or stop-string prefix waits)
    token_ids: list[int]  # tokens emitted this cycle
    finished: bool
    output: RequestOutput | None = None  # set on the final delta


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device "
                         "(CPU build of torch, or no GPU); use --device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (x86 avx512_bf16 or AMX). There bf16
    halves the weight bytes a decode step streams and oneDNN's bf16 kernels keep the small-M
    verify GEMMs efficient; elsewhere bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, normalize_dtype(dtype))


class LLM:
    """An engine for one model.

    model: a local HF directory, a .gguf file, a HF hub id, or None for the embedded default
    (SmolLM2-135M-Instruct). dtype: auto | fp32 | bf16 | fp16. device: auto | cpu | cuda.
    quantization: none | int4-gguf (run a GGUF's Q4_0/Q4_1 weights as packed 4-bit on CPU).
    cuda_graphs: replay the decode step as CUDA graphs (CUDA only; False = eager).
    kv_block: KV windows are multiples of this many slots (fewer distinct shapes/graphs).
    spec: speculative decoding with an EAGLE-3 draft (SpecConfig); None = plain decoding.
    profile: time every phase of every cycle (None: on when SPECSCOPE_PROFILE=1);
    profile_interval: log a summary every N cycles (default 100 when profiling).
    compile: torch.compile the decode step (slow first request, faster decoding after).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, prefill_chunk_size: int = 512,
                 cache_dir: str | None = None, quantization: str = "none",
                 cuda_graphs: bool = True, kv_block: int = 256,
                 compile: bool = False, spec: SpecConfig | None = None,
                 profile: bool | None = None, profile_interval: int | None = None) -> None:
        self.engine_config = EngineConfig(dtype=dtype, device=device,
                                          max_model_len=max_model_len,
                                          prefill_chunk_size=prefill_chunk_size,
                                          cache_dir=cache_dir, cuda_graphs=cuda_graphs,
                                          kv_block=kv_block, compile=compile)
        self.device = resolve_device(self.engine_config.device)
        self.dtype = resolve_dtype(self.engine_config.dtype, self.device)
        if quantization == "int4-gguf" and self.engine_config.dtype == "auto":
            self.dtype = torch.bfloat16  # the int4 CPU kernel computes in bf16
        self.quantization = quantization
        loaded = load_model(model, self.dtype, self.device, cache_dir, quantization)
        self._setup(loaded.model, loaded.config, loaded.path, loaded.source,
                    Tokenizer(loaded.path, loaded.config.eos_token_ids), spec)
        self._profile_from_env(profile, profile_interval)

    def _profile_from_env(self, profile: bool | None, interval: int | None) -> None:
        """profile=None follows SPECSCOPE_PROFILE=1; the summary interval defaults to 100."""
        if profile is None:
            profile = os.environ.get("SPECSCOPE_PROFILE", "") not in ("", "0")
        if profile:
            self.enable_profiling(True, interval if interval is not None else 100)

    @classmethod
    def from_model(cls, model: CausalLM, *, tokenizer: Tokenizer | IdTokenizer | None = None,
                   spec: SpecConfig | None = None, name: str = "in-memory",
                   **engine: Any) -> LLM:
        """An engine around an already built model (e.g. random weights of a real shape for
        benchmarks). Without a tokenizer, text is the token ids (IdTokenizer)."""
        self = cls.__new__(cls)
        self.engine_config = EngineConfig(**engine)
        param = next(model.parameters())
        self.device, self.dtype, self.quantization = param.device, param.dtype, "none"
        self._setup(model, model.config, None, name, tokenizer or IdTokenizer(), spec)
        self._profile_from_env(None, None)
        return self

    def _setup(self, model: CausalLM, config: ModelConfig, path, name: str, tokenizer,
               spec: SpecConfig | None) -> None:
        self.model_config = config
        self.model_path = path
        self.model_name = name
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config, self.engine_config, self.device, self.dtype)
        self._ids = itertools.count()
        # One request runs at a time on this engine; callers on other threads queue here.
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding _lock
        self.spec: SpecConfig | None = None
        self.draft_info: str | None = None
        self._draft: tuple[tuple, Any] | None = None  # ((draft, layer ids), loaded draft)
        self.timer: Profiler | None = None
        self.decoder: PlainDecoder | SpecDecoder = PlainDecoder(self.runner)
        self.set_spec(spec)

    def set_spec(self, spec: SpecConfig | None) -> None:
        """Switch speculative decoding on (with this configuration) or off, keeping the
        target weights loaded. A draft is loaded again only if its path or taps changed."""
        with self._lock:
            if spec is None:
                self.decoder = PlainDecoder(self.runner)
            else:
                from specscope.engine.speculative import load_spec_draft

                # The last draft stays loaded while speculation is off, so switching back
                # (or a tuner alternating plain and speculative runs) never reloads it.
                key = (spec.draft, spec.draft_layer_ids)
                if self._draft is not None and self._draft[0] == key:
                    draft = self._draft[1]
                else:
                    draft, self.draft_info = load_spec_draft(spec, self.runner.model,
                                                             self.dtype, self.device)
                    self._draft = (key, draft)
                self.decoder = SpecDecoder(self.runner, draft, spec)
            self.spec = spec
            self.decoder.timer = self.timer
            self._label_config()

    def enable_profiling(self, on: bool = True, interval: int | None = 100) -> Profiler | None:
        """Time every phase of every cycle (profiler/); log a summary every `interval`
        cycles (None: never). Off (the default) adds no work at all. Returns the profiler."""
        self.timer = Profiler(self.device, interval=interval) if on else None
        self.decoder.timer = self.timer
        self._label_config()
        return self.timer

    def _label_config(self) -> None:
        if self.timer is None:
            return
        s = self.spec
        if s is None:
            self.timer.set_config("plain")
        else:
            label = f"spec steps={s.num_steps} topk={s.topk} ndt={s.num_draft_tokens}"
            self.timer.set_config(label + (" SIMULATED" if s.simulated else ""), s.simulated,
                                  s.num_steps)

    def profile_summary(self) -> list[dict]:
        """Per-configuration phase summaries (see profiler/profiler.py for the fields)."""
        if self.timer is None:
            raise RuntimeError("profiling is off: LLM(..., profile=True), "
                               "llm.enable_profiling() or SPECSCOPE_PROFILE=1")
        return self.timer.summary()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # -- prompts ----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a raw prompt, or for chat messages through the chat template.

        Text never yields control tokens (see Tokenizer); send token ids (`stream(...,
        prompt_ids=...)`) to use them on purpose."""
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            if chat:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            validate_messages(prompt)
            ids = self.tokenizer.apply_chat_template(prompt)
        else:
            raise TypeError(f"a prompt must be a string or a list of chat messages, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty after tokenisation; give at least one token")
        if max(ids) >= self.model_config.vocab_size:  # a tokenizer larger than the model
            raise ValueError(f"the tokenizer produced id {max(ids)}, outside the model's "
                             f"vocabulary of {self.model_config.vocab_size}")
        return ids

    def _check_length(self, n_prompt: int, params: SamplingParams) -> None:
        total = n_prompt + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length ({self.max_model_len}); shorten the "
                f"prompt or lower max_tokens")

    @staticmethod
    def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], dict):
            return [prompts]  # one conversation
        if isinstance(prompts, list):
            return list(prompts)
        raise TypeError("prompts must be a string, a list of strings, a list of messages, "
                        "or a list of conversations")

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | None = None, *,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of {'role', 'content'} messages).

        With chat=True, string prompts are sent as a single user message through the chat
        template. Returns one RequestOutput per prompt, in order.
        """
        params = sampling_params or SamplingParams()
        batch = self._as_list(prompts)
        encoded = [self.encode_prompt(p, chat) for p in batch]  # all errors before any work
        for ids in encoded:
            self._check_length(len(ids), params)
        outputs = []
        for ids in encoded:
            final = None
            for delta in self._run(ids, params):
                final = delta.output
            assert final is not None
            outputs.append(final)
        return outputs

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
        yield from self._run(ids, params)

    def _check_ids(self, ids: list[int]) -> None:
        V = self.model_config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt_ids hold ids outside the vocabulary [0, {V}): {bad[:8]}")

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        if self._owner == threading.get_ident():
            # The lock is held by a suspended stream of this very thread: waiting would
            # deadlock, so say what to do instead.
            raise RuntimeError("a stream on this engine is still open in this thread; "
                               "finish or close() it before starting another request")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield from self._cycle_loop(prompt_ids, params)
            finally:
                self._owner = None

    def _cycle_loop(self, prompt_ids: list[int],
                    params: SamplingParams) -> Iterator[StreamDelta]:
        """The one decode loop: prefill, then cycles until the request finishes.

        A cycle returns [count, tokens...] on the device; plain decoding emits one token per
        cycle, speculative decoding 1 .. num_steps + 1.
        """
        req = Request(f"req-{next(self._ids)}", prompt_ids, params, self.tokenizer)
        dec = self.decoder
        dec.ensure_caches(len(prompt_ids) + params.max_tokens)
        gen = None if params.greedy else make_generator(params.seed, self.device)
        stats = SpecStats(self.spec.num_steps, self.spec.simulated) if self.spec else None
        prof = self.timer
        cycling, accepted = False, None  # the prefill's token is not a cycle's
        emitted = self._read_tokens(dec.prefill(prompt_ids, params, gen))
        while True:
            if prof and cycling:
                prof.mark(Phase.DETOKENIZE)
            text = req.append(emitted)
            if prof and cycling:
                prof.end_cycle(len(emitted), accepted)
            if req.finished:
                out = req.output()
                out.spec = stats.as_dict() if stats else None
                yield StreamDelta(req.request_id, text, emitted, True, out)
                return
            yield StreamDelta(req.request_id, text, emitted, False)
            if prof:
                prof.begin_cycle()
            result = self._read_tokens(dec.cycle(params, gen))
            count = result[0]
            dec.advance(count)
            emitted = result[1:1 + count]
            cycling = True
            accepted = count - 1 if dec.last_was_speculative else None
            if stats is not None and dec.last_was_speculative:
                stats.cycles += 1
                stats.accepted.append(count - 1)

    @staticmethod
    def _read_tokens(tokens: torch.Tensor) -> list[int]:
        """The cycle's one device->host read: the emitted token ids."""
        return tokens.tolist()

    def __repr__(self) -> str:
        c = self.model_config
        return (f"LLM({self.model_name!r}, {c.architecture}, layers={c.num_layers}, "
                f"dtype={self.dtype}, device={self.device})")

    def info(self) -> dict[str, Any]:
        c = self.model_config
        return {"model": self.model_name, "path": str(self.model_path),
                "architecture": c.architecture, "layers": c.num_layers,
                "hidden": c.hidden_size, "vocab": c.vocab_size, "dtype": str(self.dtype),
                "device": str(self.device), "max_model_len": self.max_model_len}
