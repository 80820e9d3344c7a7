"""`make bench`: regenerate every results table under bench/results/ (about 40 minutes on 2 quiet cores).

Profiles the CPU demo and searches it first, so the CPU benchmarks have a fresh plan of this machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lagom_tune"]  # this interpreter's lagom-tune, whether or not its script is installed beside it
STEPS = [
    [*CLI, "profile", "--workload", "cpu-demo", "--backend", "gloo", "--ranks", "2", "--out", "runs/bench-cpu"],
    [*CLI, "search", "runs/bench-cpu", "--optimizer", "lagom", "--out", "runs/bench-cpu/plan.yaml"],
    [sys.executable, "bench/cpu_e2e.py", "--plan", "runs/bench-cpu/plan.yaml", "--rounds", "4", "--steps", "10", "--grid"],
    [sys.executable, "bench/shim_overhead.py", "--plan", "runs/bench-cpu/plan.yaml"],
    [sys.executable, "bench/model_accuracy.py"],
    [sys.executable, "bench/fit_speed.py"],
    [sys.executable, "bench/paper_sim.py", "--optuna-trials", "1500"],
]

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help, not 20 minutes of benchmarks
    t0 = time.perf_counter()
    for cmd in STEPS:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"all benchmarks regenerated in {time.perf_counter() - t0:.0f} s -> bench/results/")
