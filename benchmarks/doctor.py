"""specscope doctor on the shipped default draft and on each planted fault: probe tables and
run time on this machine.

    python benchmarks/doctor.py [--out benchmarks/results/doctor_cpu.log]

The faults are the issue's list: ids shifted +1 / -1, the embedding captured in place of the
first tap, the input/output convention swapped, d2t permuted, lm_head missing with
draft_vocab_size set, a decoder weight at random init, an fc width mismatch. The first case
(healthy) is timed as a user runs it: a fresh probe of the target plus every wiring; the
faulty drafts reuse that probe (as a user checking several drafts would).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specscope import LLM
from specscope.doctor import default_probe_prompts, run_doctor
from specscope.doctor.probe import target_probe_data
from specscope.draft.convert import convert_draft
from specscope.draft.loader import default_draft_dir


def _cfg(d: Path, fn: Callable[[dict], None]) -> None:
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def _tensors(d: Path, fn: Callable[[dict], None]) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def _ids(ids):
    return lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids)


def _scramble(t):
    for name in ("midlayer.mlp.down_proj.weight", "midlayer.self_attn.o_proj.weight"):
        g = torch.Generator().manual_seed(1)
        t[name] = (torch.randn(t[name].shape, generator=g) * t[name].float().std()).to(
            t[name].dtype)


def _permute(t):
    t["d2t"] = t["d2t"][torch.randperm(t["d2t"].numel(), generator=torch.Generator()
                                       .manual_seed(0))]


def plant(name: str, root: Path, provenance: bool = True) -> Path:
    """The shipped draft with one fault. provenance=False drops its specscope_provenance
    block, as a draft trained elsewhere has none: wiring faults are then the probe's alone."""
    d = root / name.replace(" ", "_")
    if name in ("embedding first tap", "convention swapped"):
        d = convert_draft(default_draft_dir(), d, "speculators")
        ids = [0, 15, 27] if name == "embedding first tap" else [1, 14, 26]
        _cfg(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=ids))
        if not provenance:
            _cfg(d, lambda c: c.pop("specscope_provenance", None))
        return d
    shutil.copytree(default_draft_dir(), d)
    if not provenance:
        _cfg(d, lambda c: c.pop("specscope_provenance", None))
    {"healthy": lambda: None,
     "ids shifted +1": lambda: _cfg(d, _ids([2, 15, 27])),
     "ids shifted -1": lambda: _cfg(d, _ids([0, 13, 25])),
     "d2t permuted": lambda: _tensors(d, _permute),
     "lm_head missing": lambda: _tensors(d, lambda t: t.pop("lm_head.weight")),
     "decoder weight random": lambda: _tensors(d, _scramble),
     "fc width mismatch": lambda: _tensors(d, lambda t: t.update(
         {"fc.weight": t["fc.weight"][:, :1152].clone()})),
     }[name]()
    return d


CASES = ["healthy", "ids shifted +1", "ids shifted -1", "embedding first tap",
         "convention swapped", "d2t permuted", "lm_head missing", "decoder weight random",
         "fc width mismatch"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--no-provenance", action="store_true",
                    help="drop the drafts' provenance block (wiring faults: probe only)")
    args = ap.parse_args()
    lines: list[str] = []
    t0 = time.perf_counter()
    llm = LLM(None, dtype=args.dtype, device="cpu", spec=None)
    load_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        probe = None
        for case in CASES:
            d = plant(case, Path(tmp), provenance=not args.no_provenance)
            t = time.perf_counter()
            if probe is None:  # the healthy run: a user's full doctor run, probe included
                report = run_doctor(llm, str(d))
                ids = [llm.encode_prompt(p) for p in default_probe_prompts(8)]
                probe = target_probe_data(llm.model, ids, 64)
            else:
                report = run_doctor(llm, str(d), probe_data=probe)
            dt = time.perf_counter() - t
            errors = [f.code for f in report.findings if f.severity == "error"]
            lines.append(f"=== {case}: {'HEALTHY' if report.healthy else 'UNHEALTHY'} "
                         f"{errors} ({dt:.1f} s)")
            lines.append(report.format())
            lines.append("")
    lines.append(f"target load {load_s:.1f} s; total {time.perf_counter() - t0:.1f} s; "
                 f"torch threads {torch.get_num_threads()}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
