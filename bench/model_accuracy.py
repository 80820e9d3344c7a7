"""Held-out accuracy (5-fold MAPE) of the fitted models: on the SIMULATED clusters with noise, and
on real gloo measurements from this machine's CPU ranks.

    python bench/model_accuracy.py
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
from pathlib import Path

import pandas as pd

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.registry import usable_cores
from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.model.fit import FitResult, fit_device, fit_run, new_shape_mape
from lagom_tune.profile.campaign import run_profile
from lagom_tune.render import mape_cell
from lagom_tune.workload.presets import build_preset

ROOT = Path(__file__).resolve().parents[1]
SIM_CASES = [("h100-nvlink", "llama3-8b-fsdp8"), ("a40-nvlink", "phi-2-fsdp16"), ("a40-pcie", "mpt-7b-tp8-dp2"),
             ("h200-nvlink", "olmoe-1b-7b-ep8")]
QUANTITIES = ["gemm", "gemm_new_shape", "collective", "overlap_window", "overlap_compute", "overlap_comm"]
NOISE = "noise_"  # the CSV's column of a quantity's repeat noise
AGAIN = "remeasured_"  # ... and of the gap of the quantity measured again later (model.yaml's accuracy.remeasured)


def cells(fit: FitResult, mape: dict[str, float]) -> dict[str, float | None]:
    """A row's held-out MAPE per quantity, the repeat noise of the quantities that have one, and the
    remeasured gap of those measured again later."""
    return {**{q: mape.get(q) for q in QUANTITIES}, **{NOISE + q: fit.noise[q] for q in QUANTITIES if q in fit.noise},
            **{AGAIN + q: fit.remeasured[q]["gap"] for q in QUANTITIES if q in fit.remeasured}}


def cell_text(row: pd.Series, q: str) -> str:
    """A quantity's cell as `show` prints it: MAPE (repeat noise; remeasured gap)."""
    def given(col: str) -> float | None:
        return None if pd.isna(row.get(col)) else float(row[col])

    return "" if given(q) is None else mape_cell(given(q), given(NOISE + q), given(AGAIN + q))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--gloo-repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cluster, name in SIM_CASES:
            w = build_preset(name)
            b = get_backend("sim", BackendOptions(hardware=cluster, noise=args.noise))
            run = run_profile(w, b, Path(tmp) / f"{cluster}-{name}", repeats=3)
            fit = fit_run(run)
            mape = {**fit.mape, "gemm_new_shape": new_shape_mape(run.measurements(), device=fit_device(run.read_meta()["fingerprint"]))}
            rows.append({"backend": f"sim {cluster} (SIMULATED, {args.noise:.0%} noise)", "workload": name,
                         "rows": len(run.measurements()), **cells(fit, mape)})
            print(rows[-1], flush=True)
        w = build_preset("cpu-demo")
        run = run_profile(w, get_backend("gloo", BackendOptions(ranks=2)), Path(tmp) / "gloo", repeats=args.gloo_repeats)
        fit = fit_run(run)
        mape = {**fit.mape, "gemm_new_shape": new_shape_mape(run.measurements())}
        rows.append({"backend": f"gloo, 2 ranks on {usable_cores()} cores (MEASURED)", "workload": "cpu-demo",
                     "rows": len(run.measurements()), **cells(fit, mape)})
        print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    fmt = df[[c for c in df.columns if not c.startswith((NOISE, AGAIN))]].copy()
    for q in QUANTITIES:
        fmt[q] = [cell_text(row, q) for _, row in df.iterrows()]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "model_accuracy.csv", df.to_csv(index=False))
    atomic_write_text(args.out / "model_accuracy.md", "\n".join([
        "# Model accuracy: held-out MAPE (5-fold cross-validation over measured points)",
        "",
        f"{datetime.date.today()} · {platform.node()} · sim rows are SIMULATED; the gloo row is measured on this machine.",
        "",
        fmt.to_markdown(index=False),
        "",
        "Every column but one holds out whole measured points (medians of repeats) in 5 folds and predicts them from a model",
        "fitted on the rest. `gemm`: isolated GEMM points; the fit may know the shape's time alone from its overlapped points",
        "(each records the GEMM alone, measured just before the pair). `gemm_new_shape` is stricter: shapes held out of",
        "every point, so the model extrapolates from other shapes (the search never needs this: it predicts only profiled",
        "shapes). `collective`: isolated collectives at held-out settings. The overlap columns predict a collective and n",
        "GEMMs started together (their window, and each stream's end). In brackets, the same points' repeat noise: the",
        "error a model that knew each point's true time would still score, from the gap between the medians of each",
        "point's even and odd repeats (`lagom-tune show` prints it beside the MAPE; drift between points is not in it);",
        "after it, where the same quantity was measured twice (three points of each kind again at the profile's end, and",
        "a GEMM or collective an overlapped pair timed alone right before it), half the gap between the two medians over",
        "their mean (`remeasured`): the drift between moments that the repeats cannot show.",
        "",
        "Reproduce: `python bench/model_accuracy.py`",
        "",
    ]))
    print(f"-> {args.out / 'model_accuracy.md'}")


if __name__ == "__main__":
    main()
