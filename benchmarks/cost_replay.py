"""The cost model replayed on recorded measurements: fit it to a calibration's runs, score it
against a grid's measured cycles, with and without the verify's kernel classes.

    python benchmarks/cost_replay.py \\
        --calibration benchmarks/results/cycle_costs_h200_smollm2_cal_repeats.json \\
        --grid benchmarks/results/tune_h200_smollm2_real_2026-12-03_warm.log \\
        --group 3 --tile-rows 16,32,64,128 --few-rows 16

The calibration is a `cycle_costs.py --repeats` JSON in the tuner's calibration conditions
(one prompt, 48 tokens; each shape's runs averaged); the grid a `tune.py` log, whose measured
tok/s and accept length give each configuration's measured cycle. The prediction uses the
measured accept length, so only the cost model is judged. --group (query heads per KV head),
--tile-rows and --few-rows describe the kernels of the run replayed (engine/machine.py
kernel_class); --tile-rows none replays a machine without kernel classes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import fields

from specscope.engine.machine import kernel_class
from specscope.tune.calibration import CALIBRATION, calibration_shapes
from specscope.tune.cost import Calibration, calibration_from_summary, fit_cost_model

GRID = re.compile(r"grid \((\d+), (\d+), (\d+)\)\s+([\d.]+) tok/s\s+tau ([\d.]+)")


def load_calibrations(path: str) -> dict[tuple[int, int, int], Calibration]:
    """Each measured shape's Calibration, its runs' fields averaged."""
    out = {}
    with open(path) as f:
        rows = json.load(f)["results"]
    for row in rows:
        if row["config"] == "plain":
            continue
        cfg = tuple(int(x) for x in row["config"].strip("()").split(","))
        cals = [calibration_from_summary({"modes": {"segments": r["mode"]}}, *cfg)
                for r in row["runs"]]
        avg = {f.name: statistics.fmean(getattr(c, f.name) for c in cals)
               for f in fields(Calibration) if f.type in ("float", float)}
        out[cfg] = Calibration(*cfg, **avg)
    return out


def load_grid(path: str) -> dict[tuple[int, int, int], tuple[float, float]]:
    """configuration -> (measured tok/s, measured accept length), each line once."""
    out = {}
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        m = GRID.match(line)
        if m:
            out.setdefault(tuple(map(int, m.groups()[:3])), (float(m[4]), float(m[5])))
    return out


def score(cost, grid: dict) -> list[tuple[tuple[int, int, int], float]]:
    return [(c, cost.tok_per_s(tau, *c) / tps - 1) for c, (tps, tau) in sorted(grid.items())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--grid", required=True)
    ap.add_argument("--group", type=int, required=True, help="query heads per KV head")
    ap.add_argument("--tile-rows", default="16,32,64,128")
    ap.add_argument("--few-rows", type=int, default=16)
    args = ap.parse_args()
    measured, grid = load_calibrations(args.calibration), load_grid(args.grid)
    tiles = None if args.tile_rows == "none" else tuple(int(x) for x in args.tile_rows.split(","))

    def kc(n: int) -> str | None:
        return kernel_class(n, args.group, 1, tiles, args.few_rows)

    missing = [c for c in CALIBRATION if c not in measured]
    if missing:
        raise SystemExit(f"the calibration JSON lacks the calibration shapes {missing}")
    shapes = [c for c in calibration_shapes(kc, list(measured)) if c in measured]
    models = {"linear in n (CALIBRATION)": fit_cost_model([measured[c] for c in CALIBRATION],
                                                          1.0),
              f"kernel classes ({len(shapes)} shapes)": fit_cost_model(
                  [measured[c] for c in shapes], 1.0, kernel_class=kc)}
    results = {name: score(cost, grid) for name, cost in models.items()}
    names = list(results)
    print(f"{'config':<12} {'class':<36} " + " ".join(f"{n[:24]:>24}" for n in names))
    for i, (c, _) in enumerate(results[names[0]]):
        print(f"{str(c):<12} {kc(c[2]) or '-':<36} "
              + " ".join(f"{results[n][i][1]:>+24.1%}" for n in names))
    summary = {}
    for n, errs in results.items():
        e = [abs(x) for _, x in errs]
        worst = max(errs, key=lambda t: abs(t[1]))
        summary[n] = {"mean_abs_error": round(statistics.fmean(e), 4),
                      "worst": [list(worst[0]), round(worst[1], 4)],
                      "cost_model": models[n].as_dict()}
        print(f"{n}: mean |error| {statistics.fmean(e):.1%}, worst {worst[1]:+.1%} {worst[0]}")
    print(json.dumps({"configs": len(grid), "shapes": [list(c) for c in shapes],
                      "models": summary}))


if __name__ == "__main__":
    main()
