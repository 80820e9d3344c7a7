"""How long the model fit takes with its k-fold fits in one process and side by side in workers.

`profile` and `fit` fit the folds in a process per usable core (``model/fit_workers.py``). This
times ``fit_model`` both ways on the same points, interleaved, on a real H200 profile (committed
under tests/data) and a simulated 8-GPU one, and checks that both ways give the same model.

    python bench/fit_speed.py
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.registry import usable_cores
from lagom_tune.comparison import interleaved
from lagom_tune.model.fit import fit_device, fit_model
from lagom_tune.profile.store import RunFolder

ROOT = Path(__file__).resolve().parents[1]
H200_RUN = ROOT / "tests" / "data" / "h200-2026-11-30" / "mpt-7b-tp8-dp1"
SIM_PROFILE = ["--backend", "sim", "--hardware", "h100-nvlink", "--workload", "llama3-8b-fsdp8", "--noise", "0.02"]


def time_fits(run: Path, workers: int, rounds: int) -> tuple[dict[int, list[float]], bool, int]:
    """Seconds of ``fit_model`` per round with 1 and ``workers`` processes; whether every fit gave
    the same model; the number of points."""
    folder = RunFolder(run)
    df, fp = folder.measurements(), folder.read_meta()["fingerprint"]
    seconds: dict[int, list[float]] = {1: [], workers: []}
    models = []
    for _, n in interleaved([1, workers], rounds):
        start = time.perf_counter()
        with np.errstate(all="ignore"):  # as fit_run fits
            result = fit_model(df, device=fit_device(fp), simulated=bool(fp.get("simulated")), workers=n)
        seconds[n].append(time.perf_counter() - start)
        models.append(result.model.to_dict())
    return seconds, all(m == models[0] for m in models), int(df["point"].nunique())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fit_speed.md")
    args = p.parse_args()
    workers = usable_cores()
    if workers < 2:
        sys.exit("fit_speed: this process may use one core; there is nothing to run side by side")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sim = Path(tmp) / "sim"
        subprocess.run([sys.executable, "-m", "lagom_tune", "profile", *SIM_PROFILE, "--out", str(sim)], check=True,
                       capture_output=True)
        for label, run in (("real H200, mpt-7b-tp8-dp1 (2026-11-30)", H200_RUN),
                           ("simulated 8xH100, llama3-8b-fsdp8, 2% noise", sim)):
            seconds, same, points = time_fits(run, workers, args.rounds)
            one, many = statistics.median(seconds[1]), statistics.median(seconds[workers])
            rows.append(f"| {label} | {points} | {one:.1f} | {many:.1f} | {one / many:.2f} | {'yes' if same else '**no**'} |")
    text = "\n".join([
        "# Model fit: one process and workers side by side (measured)",
        "",
        f"{datetime.date.today()} · {platform.node()} · {workers} usable cores · `fit_model`, 5 folds · {args.rounds} interleaved "
        "rounds (median)",
        "",
        f"| profile | points | s, 1 process | s, {workers} processes | speed-up | same model |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "The first fold's fit runs in the calling process and is timed; when it took a second or more, the calling",
        "process and one spawned worker per further core share the rest (each worker imports torch first, about",
        "2 s). The fit on every point, after the folds, runs in the calling process: 11 fits take about 7 fits' time",
        "on 2 cores at best; with a core per fit, about 3 (not measured here).",
        "",
        "Reproduce: `python bench/fit_speed.py`",
        "",
    ])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
