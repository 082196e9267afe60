"""specscope doctor: prove that a draft is wired to its target before serving it.

Static checks (checks.py) read the draft's config and tensor shapes against the target. The
wiring probe (probe.py) measures the draft's acceptance under the configured tap ids and
under every plausible mistake. A draft is healthy when nothing static is wrong, the
configured wiring is not clearly beaten by another, and its acceptance is not near zero under
every wiring.

"Clearly beaten": on the same answer tokens, an alternative predicts the target better by a
margin that is both significant and material. The per-token cross-entropy against the
target's distribution (first draft position) is lower under the alternative by at least 3
standard errors of the paired difference and by at least 1 % of the configured wiring's;
or its accept length is higher by at least 0.1 tokens and 20 % of the configured tau - 1,
with the paired per-token accepted run higher by at least 3 standard errors (a dozen answer
tokens cannot show that by chance) and the cross-entropy not worse.
Cross-entropy is the sharper test: neighbouring layers carry similar features, so a wiring
off by one can cost a trained draft only a little acceptance on a few hundred tokens while
its likelihood drops clearly. "Near zero": the best wiring's accept length is under 1.1
(first-position acceptance below about 10 %), which no trained draft for this target shows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specscope.doctor.checks import ERROR, INFO, WARNING, Finding, static_checks
from specscope.doctor.probe import Wiring, candidate_wirings, measure_wirings, target_probe_data

CLEAR_ABS, CLEAR_REL, NEAR_ZERO = 0.1, 0.2, 1.1
SIGMAS, LOSS_REL = 3.0, 0.01
# The better alternative's name -> the fault in the configured wiring (code, description).
_FAULTS = {
    "shifted -1": ("wiring.shifted_plus1", "every configured id is one layer too deep "
                   "(shifted +1)"),
    "shifted +1": ("wiring.shifted_minus1", "every configured id is one layer too shallow "
                   "(shifted -1)"),
    "other convention": ("wiring.convention", "the ids were written in the other convention "
                         "(SGLang's output-of-layer vs vLLM's input-to-layer)"),
    "embedding replaced": ("wiring.embedding", "the embedding output is tapped where the "
                           "draft expects a decoder layer"),
    "embedding first": ("wiring.embedding_expected", "the draft was trained with the "
                        "embedding output as its first tap"),
    "default": ("wiring.default_ids", "the configured ids are not the ones the draft was "
                "trained with; EAGLE-3's default ids fit"),
}


@dataclass
class DoctorReport:
    draft: str
    target: str
    findings: list[Finding] = field(default_factory=list)
    wirings: list[Wiring] = field(default_factory=list)
    probe_tokens: int = 0
    seconds: float = 0.0

    @property
    def healthy(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def as_dict(self) -> dict[str, Any]:
        return {"draft": self.draft, "target": self.target, "healthy": self.healthy,
                "findings": [f.as_dict() for f in self.findings],
                "probe": {"answer_tokens": self.probe_tokens,
                          "wirings": [w.as_dict() for w in self.wirings]},
                "seconds": round(self.seconds, 2)}

    def format(self) -> str:
        lines = [f"specscope doctor: draft {self.draft} for target {self.target}", ""]
        order = {ERROR: 0, WARNING: 1, INFO: 2}
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            lines.append(f"  [{f.severity.upper():7}] {f.code}: {f.message}")
            if f.fix:
                lines.append(f"            fix: {f.fix}")
        if self.wirings:
            lines += ["", f"wiring probe ({self.probe_tokens} answer tokens; greedy chain, "
                          f"acceptance given all earlier accepted):",
                      f"  {'wiring':<40} {'ids':<16} {'CE nats':>7} {'top-1':>6} "
                      f"{'accept len':>10}  acceptance by position"]
            for w in self.wirings:
                name = " = ".join(w.names)
                lines.append(f"  {name:<40} {str(list(w.ids)):<16} {w.loss:>7.3f} "
                             f"{w.top1:>6.3f} "
                             f"{w.accept_length:>10.3f}  "
                             + " ".join(f"{a:.2f}" for a in w.acceptance))
        lines += ["", ("HEALTHY" if self.healthy else "UNHEALTHY") +
                  f" ({self.seconds:.1f} s)"]
        return "\n".join(lines)


def _fix_for(ids: tuple[int, ...], fmt: str, target_layers: int) -> str:
    flag = f"--draft-layer-ids {','.join(str(i) for i in ids)}"
    if fmt == "sglang":
        edit = f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {list(ids)}}}'
    elif fmt == "speculators":
        edit = f'"eagle_aux_hidden_state_layer_ids": {[i + 1 for i in ids]} (input-to-layer)'
    else:
        edit = (f"convert it (the EAGLE format has no ids): specscope convert-draft DRAFT OUT "
                f"--to sglang --target-layers {target_layers}, then set "
                f"eagle_config.eagle_aux_hidden_state_layer_ids to {list(ids)}")
    return f"serve with {flag}, or edit the draft config: {edit}"


_PRIORITY = ["configured", "embedding replaced", "shifted -1", "shifted +1", "other convention",
             "embedding first", "default"]


def _paired_gain(alt: torch.Tensor | None, conf: torch.Tensor | None) -> tuple[float, float]:
    """(mean, standard error) of a paired per-token difference alt - conf; (0, inf) when
    there is no sample to judge by."""
    if alt is None or conf is None or alt.numel() < 2 or alt.shape != conf.shape:
        return 0.0, float("inf")
    d = (alt - conf).double()
    return float(d.mean()), float(d.std() / d.numel() ** 0.5)


def _clearly_better(alt: Wiring, conf: Wiring) -> bool:
    """A material accept-length gain beyond its paired noise that the cross-entropy does not
    contradict, or a cross-entropy gain beyond its paired noise. On a short probe (a dozen
    answer tokens) one token's acceptance moves the accept length by 0.1-0.2, so a gain
    without significance is not enough."""
    gain = alt.accept_length - conf.accept_length
    run, run_se = _paired_gain(alt.token_run, conf.token_run)
    if gain >= CLEAR_ABS and gain >= CLEAR_REL * (conf.accept_length - 1) \
            and alt.loss <= conf.loss and run >= SIGMAS * run_se:
        return True
    drop, se = _paired_gain(conf.token_loss, alt.token_loss)
    return drop >= max(SIGMAS * se, LOSS_REL * conf.loss)


def judge(configured: Wiring, wirings: list[Wiring], fmt: str, target_layers: int
          ) -> list[Finding]:
    """Findings from a measured probe: a clearly better alternative, or a dead draft."""
    out = []
    best = max(wirings, key=lambda w: w.accept_length)
    if best.accept_length < NEAR_ZERO:
        out.append(Finding(
            "probe.untrained", ERROR,
            f"the draft predicts the target almost never under any wiring (best accept "
            f"length {best.accept_length:.2f}, first-position acceptance "
            f"{best.acceptance[0] if best.acceptance else 0:.1%}): its weights are untrained "
            f"or corrupted (e.g. a layer at random init), its vocabulary map is scrambled, "
            f"or it was trained for another target",
            "use the checkpoint the trainer exported, or retrain: specscope train-draft"))
        return out
    better = [w for w in wirings if w is not configured and _clearly_better(w, configured)]
    if better:
        best = max(better, key=lambda w: (configured.loss - w.loss, w.accept_length))
    gain = best.accept_length - configured.accept_length
    if better:
        # Most specific cause first: an embedding tap, then a shift, then defaults.
        faults = [_FAULTS[n] for n in sorted(best.names, key=_PRIORITY.index)
                  if n in _FAULTS] or \
            [("wiring.other", "another wiring fits better")]
        codes = [c for c, _ in faults]
        why = "; or ".join(d for _, d in faults)
        out.append(Finding(
            codes[0], ERROR,
            f"the draft is mis-wired: {why}. The wiring {list(best.ids)} "
            f"('{' = '.join(best.names)}') fits the target better than "
            f"the configured {list(configured.ids)}: cross-entropy {best.loss:.3f} vs "
            f"{configured.loss:.3f} nats, accept length {best.accept_length:.2f} vs "
            f"{configured.accept_length:.2f} ({gain:+.2f} tokens per cycle), first-position "
            f"acceptance {best.acceptance[0]:.1%} vs {configured.acceptance[0]:.1%}"
            + (f" (also named: {', '.join(codes[1:])})" if len(codes) > 1 else ""),
            _fix_for(best.ids, fmt, target_layers)))
        for extra, desc in faults[1:]:
            out.append(Finding(extra, INFO, f"same measurement as {codes[0]}: {desc}"))
    else:
        out.append(Finding("probe.wiring_ok", INFO,
                           f"the configured wiring {list(configured.ids)} is the best "
                           f"measured (accept length {configured.accept_length:.2f})"
                           if best is configured else
                           f"the configured wiring {list(configured.ids)} is within noise of "
                           f"the best ({configured.accept_length:.2f} vs "
                           f"{best.accept_length:.2f})"))
    return out


def default_probe_prompts(n: int = 8) -> list[Any]:
    """A few prompts from the built-in sets: maths, open-ended chat and code."""
    from specscope.bench.datasets import load_prompts

    k = max(1, n // 3)
    return (load_prompts("gsm8k", k) + load_prompts("mt_bench", k)
            + load_prompts("humaneval", n - 2 * k))


def run_doctor(llm: Any, draft: str, *, prompts: list[Any] | None = None,
               layer_ids: tuple[int, ...] | None = None, max_new_tokens: int = 64,
               steps: int = 5, probe_data: Any = None) -> DoctorReport:
    """Static checks, then (when they pass) the wiring probe. `llm`: a specscope LLM holding
    the target. `probe_data` reuses an earlier target_probe_data (tests, several drafts)."""
    from specscope.draft.formats import detect_format
    from specscope.draft.loader import _resolve_dir, load_draft

    t0 = time.perf_counter()
    report = DoctorReport(draft=str(draft), target=llm.model_name)
    try:
        d = _resolve_dir(draft)
    except FileNotFoundError as e:
        report.findings.append(Finding("static.config", ERROR, str(e),
                                       "pass a draft checkpoint directory"))
        report.seconds = time.perf_counter() - t0
        return report
    target = llm.model
    report.findings += static_checks(d, llm.model_config, Path(llm.model_path)
                                     if llm.model_path else None, layer_ids)
    if not report.healthy:
        report.seconds = time.perf_counter() - t0
        return report
    try:
        loaded = load_draft(d, llm.model_config, dtype=llm.dtype, device=llm.device,
                            layer_ids=list(layer_ids) if layer_ids else None)
    except ValueError as e:
        report.findings.append(Finding("static.load", ERROR, str(e), ""))
        report.seconds = time.perf_counter() - t0
        return report
    model = loaded.model
    model.attach_target(target)
    if probe_data is None:
        ids = [llm.encode_prompt(p) for p in (prompts or default_probe_prompts())]
        probe_data = target_probe_data(target, ids, max_new_tokens)
    fmt = detect_format(json.loads((d / "config.json").read_text()))
    wirings = candidate_wirings(loaded.config.aux_layer_ids,
                                loaded.config.layer_ids_convention,
                                llm.model_config.num_layers)
    measure_wirings(model, probe_data, wirings, steps)
    report.wirings = wirings
    report.probe_tokens = probe_data.answer_tokens
    report.findings += judge(wirings[0], wirings, fmt, llm.model_config.num_layers)
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["DoctorReport", "Finding", "run_doctor", "static_checks", "judge"]
