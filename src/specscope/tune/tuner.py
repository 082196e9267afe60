"""The tuner: predict tok/s of every speculative configuration, confirm the best few by real
runs, recommend one (or speculation off). No weight reloads: the engine switches
configurations in place (LLM.set_spec).

    1. acceptance model: the engine answers the prompts once speculating (the served
       configuration); the draft is unrolled 10 steps along the answers (acceptance.py);
    2. cost model: plain decoding (the whole prompts where their text is needed, else one
       calibration-length run), then a short profiled calibration over the calibration
       shapes (cost.py);
    3. prediction for every (num_steps <= 10, topk <= 8, num_draft_tokens <= 64);
    4. confirmation: the best predicted chain, the best predicted tree, the configuration being
       served and the next-best predictions, each run on the prompts with the profiler;
       plain decoding runs the whole prompts too where a confirmed configuration comes
       within `plain_margin` of its prediction. The best measured wins (within 3 %, the
       better predicted). A cost model that misprices one family (trees, say) can then cost a
       wrong ranking within the family but never the family itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from specscope.config import SamplingParams, SpecConfig
from specscope.tune.acceptance import AcceptanceModel, draft_scores, measure_acceptance
from specscope.tune.batch_policy import fit_policy, moe_shape
from specscope.tune.calibration import CALIBRATION, calibration_shapes, kernel_classes
from specscope.tune.cost import (
    CostModel,
    calibration_from_summary,
    fit_cost_model,
    plain_ms_from_summary,
)
from specscope.tune.result import Config, Measured, TuneResult


def max_nodes(num_steps: int, topk: int) -> int:
    """Candidates an EAGLE-2 tree of this shape has (the root included)."""
    return 1 + topk + (num_steps - 1) * topk * topk if topk > 1 else num_steps + 1


def all_configs(max_steps: int = 10, max_topk: int = 8, max_tokens: int = 64) -> list[Config]:
    out: list[Config] = [(s, 1, s + 1) for s in range(1, max_steps + 1)]
    for k in range(2, max_topk + 1):
        for s in range(1, max_steps + 1):
            for n in range(2, min(max_nodes(s, k), max_tokens) + 1):
                out.append((s, k, n))
    return out


def spec_for(cfg: Config | None, draft: str, base: SpecConfig | None = None
             ) -> SpecConfig | None:
    """The SpecConfig of a configuration; `base` carries everything else (draft layer ids,
    simulated acceptance) unchanged. Without the confidence stop: the tuner measures and
    models cycles of fixed shape (num_steps tokens a chain)."""
    if cfg is None:
        return None
    if base is None:
        return SpecConfig(draft=draft, num_steps=cfg[0], topk=cfg[1], num_draft_tokens=cfg[2],
                          confidence_stop=0.0)
    return dataclasses.replace(base, draft=draft, num_steps=cfg[0], topk=cfg[1],
                               num_draft_tokens=cfg[2], confidence_stop=0.0)


def run_config(llm: Any, cfg: Config | None, draft: str, prompts: list[Any],
               params: SamplingParams, base: SpecConfig | None = None,
               warmup_tokens: int = 8, warm_all: bool = False,
               outputs: list[list[int]] | None = None) -> Measured:
    """Measure one configuration in process with the profiler (its summary kept in the
    result).
    The warm-up runs `warmup_tokens` of the first prompt (on CUDA, as many as a measured
    request, so that prompt's KV windows have their graphs before the clock runs);
    warm_all: every prompt in full instead, so every window the measured run reaches is
    captured first (the steady state of a long-running server). `outputs`: a list that
    receives each measured prompt's output token ids."""
    t0 = time.perf_counter()
    llm.set_spec(spec_for(cfg, draft, base))
    prof = llm.enable_profiling(True, interval=None)
    if warm_all:
        for p in prompts:
            llm.generate(p, params)
    else:
        llm.generate(prompts[0], SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))
    prof.reset()
    for p in prompts:
        out = llm.generate(p, params)[0]
        if outputs is not None:
            outputs.append(out.token_ids)
    s = prof.summary(prof.config)
    llm.enable_profiling(False)
    return Measured.of(cfg, s, time.perf_counter() - t0)


def confirmation_set(preds: dict[Config, tuple[float, float]], confirm: int,
                     served: Config | None = None) -> tuple[list[Config], list[Config]]:
    """(must, more): the configurations always confirmed, in order (the top prediction, the
    best predicted chain and tree, the served configuration), and the `confirm` next-best
    predictions beyond them, which a time budget may cut. At least one next-best is worth
    its run: the top few predictions are often within the model's error of each other (on
    the H200 the top two chains were predicted 0.6 % apart and measured 8 % apart)."""
    ranked = sorted(preds, key=lambda c: -preds[c][1])
    chains = [c for c in ranked if c[1] == 1]
    trees = [c for c in ranked if c[1] > 1]
    must: list[Config] = []
    for c in (ranked[:1] + chains[:1] + trees[:1] + ([served] if served in preds else [])):
        if c not in must:
            must.append(c)
    more = [c for c in ranked if c not in must][:confirm]
    return must, more


def pick(measured: list[Measured], preds: dict[Config, tuple[float, float]],
         plain_tok_per_s: float, tie_margin: float = 0.03) -> Measured:
    """The recommendation among confirmed runs. One run of a configuration is noisy (5-15 %
    run to run on a small shared CPU, 2-5 % on a GPU), and so is a prediction (its cost
    model's error), so runs within `tie_margin` of the fastest are tied, and the tie goes to
    the best of measurement and prediction together: each as a share of the tied runs' best,
    summed. A prediction well ahead outweighs a measurement slightly behind; two predictions
    the model cannot tell apart leave the measurement to decide."""
    top = max(m.tok_per_s for m in measured)
    tied = [m for m in measured if m.tok_per_s >= (1 - tie_margin) * top]

    def predicted(m: Measured) -> float:
        return plain_tok_per_s if m.config is None else preds[m.config][1]

    best_pred = max(predicted(m) for m in tied)
    return max(tied, key=lambda m: (m.tok_per_s / top + predicted(m) / best_pred,
                                    m.tok_per_s))


def simulated_acceptance(llm: Any, draft: str, base: SpecConfig, prompts: list[Any],
                         depth: int = 10, answers: list[list[int]] | None = None
                         ) -> AcceptanceModel:
    """The acceptance model of a simulated profile (base.simulate_acceptance, per-position
    rates): ranks drawn from the profile, the tree's shape from the scores of the draft that
    runs, teacher-forced over `prompts` (no answers needed; a random draft's flat scores fill
    the tree breadth first). `answers`: the plain run's outputs, whose first tokens end the
    teacher-forced sequences (without them one token is generated here)."""
    if not isinstance(base.simulate_acceptance, tuple):
        raise ValueError("tuning a simulated profile needs per-position acceptance rates "
                         f"(a tuple), got {base.simulate_acceptance!r}")
    from specscope.doctor.probe import target_probe_data

    llm.set_spec(spec_for(CALIBRATION[0], draft, base))
    ids = [llm.encode_prompt(p) for p in prompts]
    # One answer token: the draft is teacher-forced over the prompts themselves, so the
    # step costs about one prefill, whatever the target's size.
    data = target_probe_data(llm.model, ids, 1,
                             answers=None if answers is None else [a[:1] for a in answers])
    scores = draft_scores(llm.draft, data, depth)
    return AcceptanceModel.simulated(base.simulate_acceptance, base.simulate_sibling, depth,
                                     scores=scores)


def _acceptance_model(llm: Any, draft: str, prompts: list[Any], answers: list[list[int]],
                      base: SpecConfig | None, depth: int, calibration_prompts: int,
                      max_tokens: int, log: Any) -> AcceptanceModel:
    """The draft measured along the engine's plain answers, or a simulated profile's model."""
    t = time.perf_counter()
    if base is not None and base.simulated:
        acc = simulated_acceptance(llm, draft, base, prompts[:calibration_prompts], depth,
                                   answers[:calibration_prompts] or None)
        log(f"[tune] simulated acceptance model: the profile's ranks, the tree's shape from "
            f"the draft's scores ({time.perf_counter() - t:.1f} s)")
        return acc
    from specscope.doctor.probe import target_probe_data
    from specscope.draft.loader import load_draft
    from specscope.models.quant import GgufLinear

    ids = [llm.encode_prompt(p) for p in prompts]
    data = target_probe_data(llm.model, ids, max_tokens, answers=answers)
    t_data = time.perf_counter() - t
    # The draft the engine runs, where the LLM holds it whole, on dense weights (a CPU
    # engine's Q8_0 codes are made for few-row steps: over 2 answers of 128 tokens the
    # unroll took 20.4 s on them and 11.4 s on dense bf16, 2-core Xeon) and with rope
    # tables that reach (new ones would leave the engine's captured graphs reading freed
    # tables).
    model = llm.loaded_draft(draft)
    if model is None or model.rope_len < data.input_ids.shape[1] + depth + 1 or any(
            isinstance(m, GgufLinear) for m in model.modules()):
        loaded = load_draft(draft, llm.model_config, dtype=llm.dtype, device=llm.device)
        loaded.model.attach_target(llm.model)
        model = loaded.model
    acc = measure_acceptance(model, data, depth)
    log(f"[tune] acceptance model: {depth} steps over {data.answer_tokens} answer tokens "
        f"({time.perf_counter() - t:.1f} s, the target's taps {t_data:.1f} s)")
    return acc


def tuner_calibration_shapes(llm: Any, configs: list[Config], kc: Any = None) -> list[Config]:
    """The shapes the tuner's calibration runs on this engine for predicting `configs`
    (`kc`: kernel_classes(llm), when the caller has it)."""
    return calibration_shapes(kc if kc is not None else kernel_classes(llm), configs,
                              moe=moe_shape(llm) is not None)


def _calibrate(llm: Any, draft: str, cal_prompts: list[Any], base: SpecConfig | None,
               plain_summary: dict, calibration_tokens: int, warmup_tokens: int,
               configs: list[Config], rounds: int = 2) -> tuple[CostModel, list[str]]:
    """The cost model fitted from the calibration shapes' runs (and each shape's seconds):
    CALIBRATION, and on CUDA a shape for each kernel class of `configs` it misses.
    Each shape's `calibration_tokens` run in `rounds` parts, the shapes in turn
    (measure_interleaved): a launch-bound model's speed wanders by several per cent over
    seconds (three calibrations of one H200 process, tens of seconds apart, priced one cycle
    at 2.449, 2.247 and 2.315 ms), and shapes measured one after another would each take
    their moment's speed, which the fit would read as cost. The parts cost a prefill each."""
    per_round = max(1, round(calibration_tokens / rounds))
    cal_params = SamplingParams(max_tokens=per_round, ignore_eos=True)
    # A calibration run reads its graph replays only (steady_phases), so its warm-up only has
    # to take the first-use costs: a capture in the measured run is left out anyway.
    cal_warm = min(warmup_tokens, per_round, 8)
    kc = kernel_classes(llm)
    shapes = tuner_calibration_shapes(llm, configs, kc)
    runs = measure_interleaved(llm, shapes, draft, list(cal_prompts) * rounds, cal_params,
                               base, cal_warm)
    cals = [calibration_from_summary(m.summary, *m.config) for m in runs]
    run_s = [f"{m.config} {m.seconds:.1f}" for m in runs]
    cost = fit_cost_model(cals, plain_ms_from_summary(plain_summary), moe_shape(llm),
                          kernel_class=kc)
    return cost, run_s


def _predict(acc: AcceptanceModel, cost: CostModel, depth: int, log: Any
             ) -> tuple[dict[Config, tuple[float, float]], float]:
    """(tau, tok/s) predicted for every configuration up to `depth` steps (as deep as the
    acceptance model reaches), logged with the best; returns them and the seconds taken."""
    t = time.perf_counter()
    preds: dict[Config, tuple[float, float]] = {}
    configs = all_configs(min(depth, acc.depth))
    for cfg, tau in acc.taus(configs).items():
        preds[cfg] = (tau, cost.tok_per_s(tau, *cfg))
    seconds = time.perf_counter() - t
    ranked = sorted(preds, key=lambda c: -preds[c][1])
    log(f"[tune] predicted {len(preds)} configurations ({seconds:.1f} s); best "
        f"{ranked[0]}: tau {preds[ranked[0]][0]:.2f}, {preds[ranked[0]][1]:.1f} tok/s vs plain "
        f"{cost.plain_tok_per_s:.1f}")
    return preds, seconds


def _confirm(llm: Any, draft: str, prompts: list[Any], params: SamplingParams,
             base: SpecConfig | None, warmup_tokens: int, must: list[Config],
             more: list[Config], budget_seconds: float | None, t_start: float,
             estimate: Callable[[Config], float], log: Any) -> list[Measured]:
    """The confirmation runs: every `must` configuration, and the `more` ones whose
    estimated run time (`estimate`, seconds) fits in what is left of the budget, counted from
    `t_start` (the tuner's start); measured together by measure_interleaved."""
    runs = list(must)
    if budget_seconds is None:
        runs += more
    else:
        left = budget_seconds - (time.perf_counter() - t_start) - sum(map(estimate, must))
        for c in more:
            left -= estimate(c)
            if left < 0:
                log(f"[tune] budget of {budget_seconds:.0f} s: confirming {len(runs)} of "
                    f"{len(must) + len(more)}")
                break
            runs.append(c)
    return measure_interleaved(llm, runs, draft, prompts, params, base, warmup_tokens)


def measure_interleaved(llm: Any, configs: list[Config], draft: str, prompts: list[Any],
                        params: SamplingParams, base: SpecConfig | None = None,
                        warmup_tokens: int = 8) -> list[Measured]:
    """Speculative configurations of one draft measured prompt by prompt in turn (prompt 1
    under each, then prompt 2, ...), so a drift of the machine's speed during the runs (5-15 %
    over tens of seconds on a shared host, for a launch-bound model) weighs on each alike and
    the comparison between them stays fair. Switching costs nothing (Engine.retarget keeps
    each configuration's graphs); each is warmed up first by `warmup_tokens` of the first
    prompt, as run_config does."""
    prof = llm.enable_profiling(True, interval=None)
    labels: dict[Config, str] = {}
    seconds = dict.fromkeys(configs, 0.0)
    for cfg in configs:
        llm.set_spec(spec_for(cfg, draft, base))
        labels[cfg] = prof.config
        llm.generate(prompts[0], SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))
    prof.reset()
    for p in prompts:
        for cfg in configs:
            t = time.perf_counter()
            llm.set_spec(spec_for(cfg, draft, base))
            llm.generate(p, params)
            seconds[cfg] += time.perf_counter() - t
    out = [Measured.of(cfg, prof.summary(labels[cfg]), seconds[cfg]) for cfg in configs]
    llm.enable_profiling(False)
    return out


def _text_run(llm: Any, draft: str, prompts: list[Any], params: SamplingParams,
              base: SpecConfig | None, warmup_tokens: int, served: Config, log: Any
              ) -> tuple[list[list[int]], Measured]:
    """The text the acceptance model reads: the served configuration's greedy outputs (that
    run logged; the confirmation measures the configuration again beside the others). A
    speculating engine's text can part from plain decoding's: in bf16 on a CPU its verify
    decides near-ties with other kernels, and 3 of 4 MT-Bench answers parted within 11-26
    tokens; along the plain text the chains' accept lengths were predicted 11-14 % short,
    along a chain's own text within 1.1 % (benchmarks/acceptance_model.py --spec-text)."""
    answers: list[list[int]] = []
    m = run_config(llm, served, draft, prompts, params, base, warmup_tokens, outputs=answers)
    log(f"[tune] served {served}: {m.tok_per_s:.1f} tok/s (confirmed again with the others), "
        f"its text read by the acceptance model ({m.seconds:.1f} s)")
    return answers, m


def _plain(llm: Any, draft: str, prompts: list[Any], params: SamplingParams,
           base: SpecConfig | None, warmup_tokens: int, whole: bool, calibration_prompts: int,
           calibration_tokens: int, answers: list[list[int]], log: Any) -> Measured:
    """Plain decoding for the cost model: the whole prompts where their text is needed
    (`whole`: the acceptance model reads plain decoding's answers, filled into `answers`),
    else one calibration-length run. Each switch between plain and speculative decoding
    builds a new engine, so plain runs once, in one piece."""
    if whole:
        return run_config(llm, None, draft, prompts, params, base, warmup_tokens,
                          outputs=answers)
    m = run_config(llm, None, draft, prompts[:calibration_prompts],
                   SamplingParams(max_tokens=calibration_tokens, ignore_eos=True), base,
                   min(warmup_tokens, calibration_tokens, 8))
    log(f"[tune] plain decoding priced by {calibration_prompts} x {calibration_tokens} tokens: "
        f"{m.tok_per_s:.1f} tok/s ({m.seconds:.1f} s)")
    return m


def _confirm_plain(llm: Any, draft: str, prompts: list[Any], params: SamplingParams,
                   base: SpecConfig | None, warmup_tokens: int, result: TuneResult,
                   plain_margin: float, log: Any) -> None:
    """Plain decoding over the whole prompts, added to the confirmed runs, unless it ran so
    already or the best confirmed configuration beats its prediction by more than
    `plain_margin` (then plain cannot win within the noise of the two measurements)."""
    if any(m.config is None for m in result.measured):
        return
    best = max(m.tok_per_s for m in result.measured)
    plain = result.cost.plain_tok_per_s
    if best > (1 + plain_margin) * plain:
        log(f"[tune] plain decoding not confirmed: the best confirmed configuration "
            f"({best:.1f} tok/s) is {best / plain:.2f}x its prediction ({plain:.1f})")
        return
    result.measured.insert(0, run_config(llm, None, draft, prompts, params, base,
                                         warmup_tokens))


def _plain_and_acceptance(llm: Any, draft: str, prompts: list[Any], params: SamplingParams,
                          base: SpecConfig | None, warmup_tokens: int, served: Config | None,
                          depth: int, acceptance: AcceptanceModel | None,
                          calibration_prompts: int, calibration_tokens: int,
                          timings: dict[str, float], log: Any
                          ) -> tuple[Measured, AcceptanceModel, Measured | None]:
    """The tuner's first steps, each timed into `timings`: plain decoding (_plain), the
    served configuration's text run where that text feeds the acceptance model, and the
    acceptance model. Returns (plain's run, the model, the run over the whole prompts: plain's
    or the served configuration's, None where neither ran)."""
    measured_draft = acceptance is None and not (base is not None and base.simulated)
    served_text = measured_draft and served is not None and served in all_configs(depth)
    whole_plain = measured_draft and not served_text  # its text is the acceptance model's
    t = time.perf_counter()
    answers: list[list[int]] = []
    plain = _plain(llm, draft, prompts, params, base, warmup_tokens, whole_plain,
                   calibration_prompts, calibration_tokens, answers, log)
    timings["plain"] = time.perf_counter() - t
    whole = plain if whole_plain else None
    t = time.perf_counter()
    if served_text:
        answers, whole = _text_run(llm, draft, prompts, params, base, warmup_tokens, served,
                                   log)
    timings["text_run"] = time.perf_counter() - t
    t = time.perf_counter()
    acc = acceptance if acceptance is not None else _acceptance_model(
        llm, draft, prompts, answers, base, depth, calibration_prompts, params.max_tokens,
        log)
    if acceptance is not None:
        log(f"[tune] acceptance model given ({acc.depth} steps)")
    timings["acceptance_model"] = time.perf_counter() - t
    return plain, acc, whole


def tune(llm: Any, draft: str, prompts: list[Any], *, max_tokens: int = 128,
         confirm: int = 1, depth: int = 10, calibration_prompts: int = 1,
         calibration_tokens: int = 48, calibration_rounds: int = 2,
         budget_seconds: float | None = None, log: Any = print, base: SpecConfig | None = None,
         acceptance: AcceptanceModel | None = None, warmup_tokens: int = 8,
         tie_margin: float = 0.03, served: Config | None = None,
         batch_sizes: list[int] | None = None, plain_margin: float = 0.3) -> TuneResult:
    """The whole tuner on an LLM holding the target (weights never reloaded). With a budget,
    confirmation runs stop once it is spent (confirmation_set's must-runs always run: the
    top prediction, the best chain and tree, and `served`, the configuration in use).
    `base`: settings every configuration keeps (draft layer ids, simulated acceptance).
    `acceptance`: a given acceptance model instead of measuring the draft. With a simulated
    `base` and no `acceptance`, the model is the profile's (simulated_acceptance).
    `calibration_rounds`: the parts of each calibration shape's tokens (_calibrate).
    `tie_margin`: confirmed configurations measured within this share of the fastest are
    tied, and the tie goes to the higher prediction (pick).
    `plain_margin`: plain decoding is confirmed over the whole prompts unless the best
    confirmed configuration beats its prediction by more than this share (_confirm_plain).
    Wide, because one short run prices plain: on a 2-core CPU whose runs of one
    configuration spread ±15 %, it priced plain 21 % below the grid's whole-prompt run.
    `batch_sizes`: beyond batch 1, fit speculation by batch size (tune/batch_policy.py):
    the result's policy, served from then on."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    params = SamplingParams(max_tokens=max_tokens)
    plain, acc, whole = _plain_and_acceptance(
        llm, draft, prompts, params, base, warmup_tokens, served, depth, acceptance,
        calibration_prompts, calibration_tokens, timings, log)

    t = time.perf_counter()
    cost, run_s = _calibrate(llm, draft, prompts[:calibration_prompts], base, plain.summary,
                             calibration_tokens, warmup_tokens,
                             all_configs(min(depth, acc.depth)), calibration_rounds)
    timings["calibration"] = time.perf_counter() - t
    log(f"[tune] cost model from plain + {len(run_s)} calibration configs "
        f"({timings['plain'] + timings['calibration']:.1f} s; runs, s: plain "
        f"{plain.seconds:.1f}, {', '.join(run_s)}): {cost.as_dict()}; "
        f"worst calibration residual {cost.worst_residual():.1%}")

    preds, timings["prediction"] = _predict(acc, cost, depth, log)

    t = time.perf_counter()
    result = TuneResult(cost=cost, acceptance=acc, predictions=preds, plain_run=plain)
    if whole is plain:
        result.measured.append(plain)  # the whole prompts: confirmed already
    must, more = confirmation_set(preds, confirm, served)
    # The served configuration runs again among the others although its text run measured
    # it: a run minutes earlier met another speed of the machine (on a 2-core CPU its text
    # run measured 17.6 tok/s where the interleaved runs and the grid then gave 13-15).
    # A confirmation's seconds: a whole-prompt run's wall time (its prefills and warm-up
    # included) scaled from its speed to the prediction; without one, the decoding alone.
    result.measured += _confirm(
        llm, draft, prompts, params, base, warmup_tokens, must, more, budget_seconds, t_start,
        lambda c: (whole.seconds * whole.tok_per_s if whole else len(prompts) * max_tokens)
        / preds[c][1], log)
    _confirm_plain(llm, draft, prompts, params, base, warmup_tokens, result, plain_margin,
                   log)
    timings["confirmation"] = time.perf_counter() - t
    best = pick(result.measured, preds, cost.plain_tok_per_s, tie_margin)
    result.recommended = best.config
    if batch_sizes and max(batch_sizes) > 1:
        t = time.perf_counter()
        result.policy, result.batch_rows = fit_policy(
            llm, draft, prompts, [1, *batch_sizes], {c: v[0] for c, v in preds.items()},
            best.config, params, CALIBRATION, spec_for, base, warmup_tokens, tie_margin,
            log)
        timings["by_batch"] = time.perf_counter() - t
    result.timings = timings
    if result.policy is not None:
        llm.set_spec(result.policy.configs[0], result.policy)
    else:
        llm.set_spec(spec_for(best.config, draft, base))
    return result
