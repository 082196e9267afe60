"""The phases of a cycle, named once (profiler.py records them).

Inside a CUDA graph individual kernels cannot be timed, so graph-replayed segments are timed
as a whole: DRAFT and VERIFY_COMMIT name what such a segment contains.
"""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_STEP = "draft_step"
    TREE_BUILD = "tree_build"
    VERIFY = "verify"
    ACCEPT = "accept"
    KV_COMMIT = "kv_commit"
    DECODE = "decode"  # one plain decoding step (the no-draft cycle)
    DRAFT = "draft"  # a graph-replayed segment: draft extend + draft steps + tree build
    VERIFY_COMMIT = "verify_commit"  # a graph-replayed segment: verify + accept + kv commit
    DETOKENIZE = "detokenize"
    OTHER = "other"
