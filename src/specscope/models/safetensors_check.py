"""Check a safetensors file's header against its size, without reading any tensor.

A truncated download or a file that is not safetensors at all otherwise fails inside the
Rust reader with a message that names neither the file nor the problem, and only when the
loader first opens it (for a draft: after the target, which can take minutes, has loaded).
Reading the 8-byte header length and the JSON header is enough to catch both at start-up.

The layout (safetensors' spec): an unsigned 64-bit little-endian header length N, N bytes
of JSON mapping each tensor name to {dtype, shape, data_offsets} (offsets relative to the
end of the header; tensors packed back to back from 0) plus an optional `__metadata__`
string map, then the tensor data, which must end exactly at the file's end.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

# Bits per element of every dtype the format defines (sub-byte floats included).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER_BYTES = 100_000_000  # the reader refuses larger headers ("header too large")
_FIX = "re-download or re-export it"


def human_bytes(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as download tools print them)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def check_safetensors(path: str | os.PathLike, label: str = "checkpoint") -> list[str]:
    """The tensor names of the safetensors file at `path`, once its header is known sound.

    Raises ValueError starting "{label} {path} ..." and saying what is wrong: not a
    safetensors file (bad header length, not JSON, malformed entries), entries whose
    offsets disagree with their dtype and shape, or a file shorter (truncated) or longer
    than its header describes. OSError (e.g. a missing file) passes through.
    """
    p = Path(path)
    where = f"{label} {p}"
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{where} is not a safetensors file: it holds {size} bytes, "
                             f"fewer than the 8 of a header length ({_FIX})")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{where} is not a safetensors file (or is cut short inside "
                             f"its header): header length {_count(n)} exceeds the file size "
                             f"{size} bytes ({_FIX})")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{where} is not a safetensors file: header length {_count(n)} is "
                             f"over the format's limit of {MAX_HEADER_BYTES:.0e} bytes")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} is not a safetensors file: its header is not valid JSON "
                         f"({e}) ({_FIX})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where} is not a safetensors file: its header is a JSON "
                         f"{type(header).__name__}, not an object ({_FIX})")
    end = _check_entries(header, where)
    data = size - 8 - n
    if end > data:
        raise ValueError(f"{where} is truncated: its header describes {human_bytes(end)} of "
                         f"tensor data, the file holds {human_bytes(data)} ({_FIX})")
    if end < data:
        raise ValueError(f"{where} is not a valid safetensors file: {data - end} bytes follow "
                         f"the {human_bytes(end)} of tensor data its header describes "
                         f"(the safetensors reader refuses it; {_FIX})")
    return [k for k in header if k != "__metadata__"]


def _check_entries(header: dict, where: str) -> int:
    """Check each tensor entry; the end offset of the tensor data (its total size)."""
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{where} is not a valid safetensors file: its __metadata__ must map "
                         f"strings to strings")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        spans.append((*_entry_span(name, entry, where), name))
    spans.sort()
    expected = 0  # the format packs tensors back to back, the first at offset 0
    for begin, end, name in spans:
        if begin != expected:
            gap = "overlaps the tensor before it" if begin < expected else \
                f"leaves a gap of {begin - expected} bytes before it"
            raise ValueError(f"{where} is not a valid safetensors file: tensor {name!r} at "
                             f"offset {begin} {gap}")
        expected = end
    return expected


def _entry_span(name: str, entry: object, where: str) -> tuple[int, int]:
    """(begin, end) of one tensor entry, checked against its dtype and shape."""
    bad = f"{where} is not a valid safetensors file: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ValueError(f"{bad} needs dtype, shape and data_offsets, got {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise ValueError(f"{bad} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise ValueError(f"{bad} has shape {shape!r:.200}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{bad} has data_offsets {offsets!r:.200}, not [begin, end]")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise ValueError(f"{bad} ({dtype} {shape}) takes {bits / 8:g} bytes, but its "
                         f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def _count(n: int) -> str:
    """A byte count as written in a message: exact when short, 8e+18 when absurd."""
    return str(n) if n < 10**9 else f"{n:.3g}"


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
