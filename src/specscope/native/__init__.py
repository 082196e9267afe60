"""specscope's native CPU layer kernels (cpu_kernels.c), built on the machine that runs them.

On the CPU a small model's decode step is mostly framework time between its matmuls: tens of
ATen calls a layer at 1-10 us each (docs/cpu.md). The C kernels do a layer's work between
its matmuls in four calls: RMSNorm with the residual add, silu(gate) * up, and q/k norms +
rotary + the paged KV write + attention. The torch code in models/ and kvcache/ stays their
reference, and runs wherever they do not apply or could not be built.

The library is compiled with the system C compiler ($CC, else cc, gcc or clang) the first
time a process asks for it, into the cache directory ($SPECSCOPE_CACHE_DIR, else
~/.cache/specscope) under a name that hashes the source, the flags and the compiler: a
later process loads it at once. It is written under a temporary name and renamed into
place, so an interrupted build is never taken for a whole one; a cached file that does not
load is built again. The instruction set follows torch's own CPU capability
(`torch.backends.cpu.get_cpu_capability()`), so `ATEN_CPU_CAPABILITY=avx2` holds these
kernels to AVX2 as it holds torch's. `SPECSCOPE_NATIVE=0` turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

import torch

from specscope.config import cache_root
from specscope.native.cpu import CpuKernels

log = logging.getLogger("specscope")

VERSION = 6  # cpu_kernels.c's sc_version(): a library reporting another is rebuilt
QUANT_VERSION = 8  # quant_kernels.c's sc_quant_version()
DECODER_VERSION = 7  # decoder.c's sc_decoder_version()
SOURCES = ("bf16.h", "kernels.h", "cpu_kernels.c", "quant_kernels.c",
           "decoder.c")  # .c: compiled
_DTYPES = (torch.float32, torch.bfloat16)
# Flags a build may drop when the compiler does not know them.
OPTIONAL_FLAGS = ["-mavxvnni"]
__all__ = ["CpuKernels", "cpu_kernels", "cpu_kernels_for", "build_flags"]


def build_flags() -> list[str]:
    """The compiler flags for this machine: the instruction set torch's CPU kernels run at."""
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-std=c99"]
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return flags
    cap = torch.backends.cpu.get_cpu_capability().upper()
    if cap.startswith("AVX512"):
        return flags + ["-march=native"]
    if cap == "AVX2":
        # AVX-VNNI (Intel client chips since Alder Lake: no AVX-512, but vpdpbusd on ymm)
        # gives the 8-bit products their VNNI path; a compiler without it builds without.
        vnni = OPTIONAL_FLAGS if "avx_vnni" in _cpu_flags() else []
        return flags + ["-mavx2", "-mfma", "-mf16c"] + vnni
    return flags  # DEFAULT: the x86-64 baseline


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dir() -> Path:
    path = cache_root() / "native"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"specscope-native-{os.environ.get('USER', 'user')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sources() -> dict[str, bytes]:
    """The library's C sources, by file name, as the package ships them."""
    return {name: resources.files("specscope.native").joinpath(name).read_bytes()
            for name in SOURCES}


def _library_path(cc: str, flags: list[str], sources: dict[str, bytes]) -> Path:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(b"\0".join([*sources.values(), " ".join(flags).encode(), cc.encode(),
                                     version.encode()])).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}.so"


def _build(cc: str, flags: list[str], sources: dict[str, bytes], path: Path) -> None:
    """Compile into a temporary file beside `path`, then rename it into place (atomic).
    With OpenMP where the compiler has it (the quantised products' threads), else without
    (one thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        srcs = [str(Path(tmp) / name) for name in sources if name.endswith(".c")]
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            for extra in (["-fopenmp"], []):
                done = subprocess.run([cc, *flags, *extra, "-o", str(part), *srcs, "-lm"],
                                      capture_output=True, text=True, timeout=300)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                raise RuntimeError(f"{cc} exited with {done.returncode}: "
                                   f"{done.stderr.strip()[-800:]}")
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)


def _load(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        return lib if lib.sc_version() == VERSION and \
            lib.sc_quant_version() == QUANT_VERSION and \
            lib.sc_decoder_version() == DECODER_VERSION else None
    except (OSError, AttributeError):
        return None


@cache
def cpu_kernels() -> CpuKernels | None:
    """The native CPU kernels, built or loaded once a process; None where they are turned
    off (SPECSCOPE_NATIVE=0) or cannot be built (no C compiler: said once in the log, and
    the torch reference runs)."""
    if os.environ.get("SPECSCOPE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): the CPU layers run their slower torch "
                    "reference; install gcc or clang for specscope's native CPU kernels")
        return None
    sources = _sources()
    # Flags to try in order: with an optional instruction set first, then without it (a
    # compiler too old for it); a library already built for either is used as it is.
    flags = build_flags()
    tries = [flags] + ([[f for f in flags if f not in OPTIONAL_FLAGS]]
                       if any(f in OPTIONAL_FLAGS for f in flags) else [])
    paths = [_library_path(cc, f, sources) for f in tries]
    for path in paths:
        lib = _load(path) if path.exists() else None
        if lib is not None:
            return CpuKernels(lib, path)
    error: Exception | None = None
    for f, path in zip(tries, paths, strict=True):
        try:
            _build(cc, f, sources, path)
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            error = e
    else:
        log.warning("specscope's native CPU kernels did not build (%s); the CPU layers "
                    "run their slower torch reference", error)
        return None
    lib = _load(path)
    if lib is None:
        log.warning("specscope's native CPU kernels built at %s but did not load; the "
                    "CPU layers run their torch reference", path)
        return None
    return CpuKernels(lib, path)


def cpu_kernels_for(x: torch.Tensor) -> CpuKernels | None:
    """The native kernels where they may serve x: a CPU tensor of fp32 or bf16, at
    inference (they have no backward), outside torch.compile's tracing."""
    if x.dtype not in _DTYPES or not x.is_cpu or torch.is_grad_enabled():
        return None
    return None if torch.compiler.is_compiling() else cpu_kernels()
