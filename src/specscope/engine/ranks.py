"""What an LLM does as one rank of a tensor-parallel group (docs/tensor-parallel.md).

Rank 0 is the LLM a caller holds: it has the tokenizer and the requests, sends every call
that changes the engine to the other ranks first (`_everywhere`), gathers what it reports
on (`_gather`), and fails loudly when a rank fails (`_engine_step`). Any other rank's LLM
holds only the EOS ids rank 0 sends and follows it (`_follow_rank0`, engine/tp_worker.py)
until rank 0 closes. A mixin of engine/llm.py's LLM, which provides tp, engine, timer, spec
and device.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specscope.config import ModelConfig, SpecConfig
from specscope.engine.engine import Engine, StepOutput
from specscope.engine.tokenizer import IdTokenizer, Tokenizer, load_chat_template
from specscope.parallel.launch import Call, Heartbeat, TPRuntime
from specscope.profiler import Profiler


class TensorParallelRanks:
    tp: TPRuntime | None  # None: one process, and every method here a no-op or a pass-through
    engine: Engine
    timer: Profiler | None
    spec: SpecConfig | None
    device: torch.device

    def _rank_tokenizer(self, path: Path, config: ModelConfig, chat_template: str | None
                        ) -> Tokenizer | IdTokenizer:
        """Rank 0's tokenizer (its EOS ids sent to the other ranks, whose engines stop on
        them too); the other ranks hold only those ids."""
        if self.tp is not None and not self.tp.is_driver:
            msg = self.tp.channel.recv()
            while isinstance(msg, Heartbeat):
                msg = self.tp.channel.recv()
            tok = IdTokenizer()
            tok.eos_token_ids = frozenset(msg[1])
            return tok
        tokenizer = Tokenizer(path, config.eos_token_ids)
        if chat_template is not None:
            tokenizer.set_chat_template(load_chat_template(chat_template))
        if self.tp is not None:
            self.tp.channel.send(("eos", tuple(sorted(tokenizer.eos_token_ids))))
        return tokenizer

    def _follow_rank0(self) -> None:
        """Rank 0 closes the group at exit; a rank other than 0 runs rank 0's steps and
        calls until it stops (never returning: it exits 0)."""
        if self.tp is None:
            return
        if self.tp.is_driver:
            atexit.register(self.close)
            return
        from specscope.engine.tp_worker import follow

        follow(self)
        self.tp.shutdown()
        raise SystemExit(0)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; a no-op without them)."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.shutdown()

    def _everywhere(self, name: str, *args: Any, **kwargs: Any) -> None:
        """On rank 0 of a tensor-parallel group: have every other rank run `name` too (the
        caller then runs it here)."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.check()
            self.tp.channel.send(Call(name, args, kwargs))

    @property
    def _is_rank0(self) -> bool:
        return self.tp is None or self.tp.is_driver

    def tensor_parallel(self) -> dict[str, Any] | None:
        """The group's size and the draft's placement (None without tensor parallelism)."""
        if self.tp is None:
            return None
        n = 1 if self.spec is None else self.spec.draft_tensor_parallel_size
        return {"size": self.tp.size, "draft_size": n if self.spec is not None else None,
                "draft_placement": None if self.spec is None else
                "replicated" if n == 1 else "sharded",
                "backend": "nccl" if self.device.type == "cuda" else "gloo"}

    def gather_from_ranks(self, attribute: str) -> list[Any]:
        """An attribute of every rank's LLM, in rank order (e.g. "load_stats")."""
        if self.tp is None:
            return [getattr(self, attribute)]
        return self._gather("_attribute", lambda: self._attribute(attribute), attribute)

    def _gather(self, name: str, here: Callable[[], Any], *args: Any) -> list[Any]:
        """Rank 0: every rank's result of method `name`, here's computed by `here`; the
        request and the replies under the channel's lock, with nothing in between."""
        self.tp.check()
        with self.tp.channel.lock:
            self.tp.channel.send(Call(name, args, gather=True))
            return self.tp.channel.gather(here())

    def _attribute(self, name: str) -> Any:
        return getattr(self, name)

    def _engine_step(self) -> list[StepOutput]:
        """engine.step(); under tensor parallelism a failed step (a rank died, or timed
        out) fails the group, naming what the watchdog saw."""
        if self.tp is None:
            return self.engine.step()
        self.tp.check()
        try:
            return self.engine.step()
        except Exception as e:
            self.tp.fail(f"a tensor-parallel step failed on rank {self.tp.rank} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                         f"a rank is gone or hung past the {self.tp.timeout:g} s collective "
                         f"timeout (--dist-timeout)")
            raise RuntimeError(self.tp.failure) from e
