"""The machine an engine runs on: its device, on the CPU the dtype and weight format that
run fastest there (measured by CPU class: docs/cpu.md), and the process's garbage
collector (frozen once the engine is built)."""

from __future__ import annotations

import atexit
import gc
import os
import re
from pathlib import Path
from typing import Any

import torch

from specscope.config import normalize_dtype


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
    verify GEMMs efficient; elsewhere bf16 is emulated and slower than fp32. Kernels held to
    AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: how an AVX2 laptop is emulated)
    count as no native bf16, whatever the CPU's flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or \
            os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith(("AVX2", "SSE")):
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def inductor_cache_for_capability() -> str | None:
    """Under ATEN_CPU_CAPABILITY (how an AVX2 laptop is emulated on an AVX-512 machine),
    point torch.compile's on-disk cache at a directory of that capability: the cache keys
    leave the variable out, so a process held to AVX2 loaded the kernels an unrestricted
    one had compiled and decoded token 0 throughout (torch 2.13). Returns the directory set,
    or None where nothing was changed (no such variable, or the caller chose a cache other
    than the default, which importing torch's compiler writes into the environment)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    if not cap:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and os.path.abspath(chosen) != default:
        return None
    path = os.path.join(default, f"aten-{re.sub(r'[^A-Za-z0-9_]', '_', cap)}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def resolve_quantization(quantization: str, model: str | None, device: torch.device,
                         dtype: str, tensor_parallel_size: int = 1,
                         cache_dir: str | None = None) -> tuple[str, str]:
    """(mode, why) for quantization "auto": the faster way to run this model's weights on
    this CPU, as measured (docs/cpu.md). int4-gguf where the model is a GGUF whose layer
    linears are Q4_0/Q4_1 and specscope's native kernels are built (native/quant_kernels.c):
    plain and speculative decoding of the default model both run faster on the GGUF's codes
    than on dense weights, with or without native bf16 (a draft beside them runs Q8_0 codes
    made at load). Without the native kernels (no C compiler) the codes' torch reference is
    slower than dense weights, so none. Anything else (CUDA, an HF checkpoint, an explicit
    --dtype other than bf16, tensor parallelism): none, no reason given. An explicit mode is
    returned as it is."""
    if quantization != "auto":
        return quantization, ""
    gguf = model is None or str(model).endswith(".gguf")
    if device.type != "cpu" or not gguf or dtype not in ("auto", "bf16") \
            or tensor_parallel_size != 1:
        return "none", ""
    from specscope.models.gguf import q4_linears
    from specscope.models.loader import resolve_model_dir
    from specscope.native import cpu_kernels

    if not q4_linears(resolve_model_dir(model, cache_dir)):  # converts once, then cached
        return "none", ""
    if cpu_kernels() is None:
        return "none", ("auto: dense weights, the GGUF's 4-bit codes run natively only with "
                        "specscope's C kernels (install a C compiler)")
    return "int4-gguf", "auto: the GGUF's 4-bit weights on specscope's native kernels"


def default_draft_note(spec: Any, device: torch.device, tensor_parallel_size: int = 1) -> str:
    """What the default model's machine-chosen speculation runs, for the status line: its
    shipped draft, and on the CPU the confidence stop that sizes each chain. Speculating is
    the faster path on both CPU classes since the stop (benchmarks/cpu_confidence_stop.py,
    2-core Zen 4, 8 MT-Bench first turns: 1.12x / 1.49x plain decoding at 128 / 256 new
    tokens with AVX-512, 1.10x / 1.14x held to AVX2, where fixed chains of 5 read 1.03x /
    1.23x and 0.84x / 0.80x; docs/cpu.md)."""
    stop = resolve_confidence_stop(spec, device, tensor_parallel_size)
    if not stop:
        return "auto: the shipped EAGLE-3 draft"
    return (f"auto: the shipped EAGLE-3 draft, chains of up to {spec.num_steps} ended where "
            f"the draft's confidence falls below {stop:g}")


# The confidence stop chains run with on the CPU unless told otherwise. From the shipped
# draft's probabilities and verdicts over 40 MT-Bench first turns (2,250 cycles, chains of
# up to 7) and the measured cost of a cycle by its length, the simulated throughput was
# flat within 1 % for stops of 0.10-0.20 on both CPU classes' costs, and 17 % above the
# best fixed chain length (docs/cpu.md).
CPU_CONFIDENCE_STOP = 0.15


def resolve_confidence_stop(spec: Any, device: torch.device,
                            tensor_parallel_size: int = 1) -> float:
    """The confidence stop a configuration runs with (SpecConfig.confidence_stop): the
    one it gives, or for None the machine's: CPU_CONFIDENCE_STOP for a trained draft's
    chain on the CPU (each verified token costs compute there, so a token unlikely to be
    accepted is not worth its verify row), else 0 (a random draft's probabilities say
    nothing). Under tensor parallelism none: the ranks would each read their own draft
    probabilities to end a chain, and must end it alike."""
    stop = spec.confidence_stop
    if tensor_parallel_size > 1:
        if stop:
            raise ValueError("confidence_stop is not supported with tensor parallelism; set "
                             "it to 0 (--confidence-stop 0)")
        return 0.0
    if stop is not None:
        return stop
    if device.type == "cpu" and spec.topk == 1 and not spec.simulated and \
            spec.draft != "random":
        return CPU_CONFIDENCE_STOP
    return 0.0


def resolve_dtype(dtype: str, device: torch.device, quantization: str = "none"
                  ) -> torch.dtype:
    """The activations' dtype for "auto": bf16 on CUDA, on a CPU with native bf16, and on
    any CPU where the weights run as GGUF codes on the native kernels (the resolved
    quantization int4-gguf, the kernels built), which read bf16 activations by a shift
    whatever the CPU and
    leave torch almost no bf16 work; fp32 on other CPUs, where torch emulates bf16. Held
    to AVX2 (2-core Zen 4, 8 MT-Bench first turns x 128 tokens, benchmarks/cpu_dtype.py),
    bf16 against fp32 on the codes read 221.2 against 209.2 tok/s plain and 254.0 against
    229.9 speculating: the shipped draft accepts more behind a bf16 target (accept length
    2.73 against 2.00 on make demo's prompts), as on AVX-512 (docs/cpu.md)."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        from specscope.native import cpu_kernels

        native_codes = quantization == "int4-gguf" and cpu_kernels() is not None
        return torch.bfloat16 if native_codes else torch.float32
    return getattr(torch, normalize_dtype(dtype))


def verify_kernel_class(cfg: Any, device: torch.device, dtype: torch.dtype, tokens: int,
                        batch: int = 1) -> str | None:
    """Which kernel variants a verify of `tokens` tokens for each of `batch` sequences runs
    on this machine, where a kernel's cost changes in steps with the row count rather than
    per token (kernel_class); None where one code path serves every size (the CPU). On the
    H200 the default model's verify cost 1.37 ms for 2-5 tokens (16-row tiles) and 1.69 ms
    for 6-9 (32-row tiles) with the kernel configurations of the time (docs/gpu-floor.md):
    a cost model linear in the tokens mispriced both sides."""
    if device.type != "cuda":
        return None
    from specscope.kvcache.paged import fast_backend_available
    from specscope.models.linear import _backend

    tiles = None
    if getattr(cfg, "mla", None) is None and fast_backend_available():
        from specscope.kvcache.triton_attention import TILE_ROWS as tiles
    few = _backend()
    few_rows = few.MAX_ROWS if few is not None and dtype in (torch.bfloat16,
                                                             torch.float16) else None
    return kernel_class(tokens, cfg.num_heads // cfg.num_kv_heads, batch, tiles, few_rows)


def kernel_class(tokens: int, group: int, batch: int, tile_rows: tuple[int, ...] | None,
                 few_rows: int | None) -> str | None:
    """The paged attention's query tile for `tokens` tokens of one sequence with `group`
    query heads per KV head (the smallest of tile_rows holding tokens x group rows, else
    several of the largest, as kvcache/triton_attention.py tokens_per_tile cuts them, each
    padded to a power of two) and whether the few-row linear (at most few_rows rows) or a
    GEMM serves batch x tokens rows. None: neither kernel is in use."""
    parts = []
    if tile_rows:
        rows = next((r for r in tile_rows if tokens * group <= r), tile_rows[-1])
        tpt = max(1, rows // group)
        block = max(16, 1 << (tpt * group - 1).bit_length())
        parts.append(f"attention {block} rows x {-(-tokens // tpt)}")
    if few_rows:
        parts.append("few-row linear" if batch * tokens <= few_rows else "GEMM")
    return ", ".join(parts) or None


# Whether freeze_heap has moved this process's objects out of the collector's sight.
_heap_frozen = False


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's sight
    (gc.freeze): for a process that has built its engine. The ~350k objects it holds by then
    (torch's and the compilers' modules, the tokenizer) make each full collection a 0.1-0.25 s
    pause (0.13-0.2 s on the H200's host), and one that falls inside a decode cycle stalls
    it: a launch-bound GPU model's cycle waits for the host. vLLM freezes its startup heap
    likewise. Engine rebuilds (collect_heap, settle_heap) thaw, collect and freeze again."""
    global _heap_frozen
    gc.collect()
    gc.freeze()
    if not _heap_frozen:
        # Frozen objects are never finalised at exit (native bindings then report them as
        # leaked): thaw first.
        atexit.register(gc.unfreeze)
    _heap_frozen = True


def collect_heap() -> None:
    """A full collection that reaches frozen objects too: an engine being replaced (its
    captured graphs and KV pools hold each other) was frozen with the rest. The heap stays
    thawed until settle_heap."""
    if _heap_frozen:
        gc.unfreeze()
    gc.collect()


def settle_heap() -> None:
    """After an engine rebuild: freeze again if freeze_heap froze this process's heap (no
    second collection: collect_heap has just made one, and each costs 0.1-0.25 s)."""
    if _heap_frozen:
        gc.freeze()


def thaw_heap() -> None:
    """Undo freeze_heap (tests; a process about to drop its engine for good)."""
    global _heap_frozen
    gc.unfreeze()
    _heap_frozen = False
