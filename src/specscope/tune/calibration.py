"""What the tuner's calibration measures: the shapes whose runs the cost model is fitted to.

Seven configurations over-determine the cost model's lines (cost.py: five draft terms, four
verify terms, each identified): chains of 1, 4 and 8 steps (the chain step, the verify per
token), and trees that vary depth, width and size independently enough to tell a tree's
per-depth work from its per-row and per-token work. On a GPU each costs well under a second;
the confirmation runs are most of the tuner's time.

On CUDA a verify's cost also steps with its kernel class (engine/machine.py
verify_kernel_class: the attention's query tile, the few-row linear or a GEMM), and each
class the predicted configurations reach must be measured: calibration_shapes adds one shape
per class the seven miss, and chains until the verify line has a point to spare.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from specscope.tune.cost import VERIFY_TERMS

Config = tuple[int, int, int]  # (num_steps, topk, num_draft_tokens)
CALIBRATION: list[Config] = [(1, 1, 2), (4, 1, 5), (8, 1, 9), (2, 4, 8), (3, 8, 16),
                             (5, 2, 10), (6, 8, 32)]
KernelClass = Callable[[int], "str | None"]


def kernel_classes(llm: Any, batch: int = 1) -> KernelClass | None:
    """n -> the kernel class of a verify of n tokens per sequence at this batch size on this
    engine; None where one code path serves every size (the CPU)."""
    from specscope.engine.machine import verify_kernel_class

    cfg, dtype = llm.model_config, llm.dtype
    device = torch.device(llm.device)
    if verify_kernel_class(cfg, device, dtype, 2, batch) is None:
        return None
    # Asked once per configuration predicted (thousands), of a few dozen sizes.
    return cache(lambda n: verify_kernel_class(cfg, device, dtype, n, batch))


def calibration_shapes(kernel_class: KernelClass | None, configs: list[Config],
                       base: list[Config] | None = None, moe: bool = False) -> list[Config]:
    """`base` (CALIBRATION), and with kernel classes: for each class of `configs`' verify
    sizes that no shape reaches, one shape at that class's middle size (the chain of that
    size where `configs` has it, else its shallowest, widest tree of that size); then chains
    of 2, 3, ... steps until the verify line (cost.py's terms, the expert term on a MoE
    target, a step per class beyond the first) has one point more than terms."""
    shapes = list(CALIBRATION if base is None else base)
    if kernel_class is None:
        return shapes
    sizes: dict[Any, set[int]] = {}
    for c in configs:
        sizes.setdefault(kernel_class(c[2]), set()).add(c[2])
    covered = {kernel_class(c[2]) for c in shapes}
    for k, ns in sorted(sizes.items(), key=lambda kv: min(kv[1])):
        if k in covered:
            continue
        n = sorted(ns)[len(ns) // 2]
        of_n = [c for c in configs if c[2] == n]
        shapes.append(min(of_n, key=lambda c: (c[1] > 1, c[0], -c[1])))
        covered.add(k)
    terms = len(VERIFY_TERMS) + moe + len(covered) - 1
    chains = [c for c in configs if c[1] == 1 and c not in shapes]
    for c in sorted(chains):
        if len(shapes) > terms:
            break
        shapes.append(c)
    return shapes
