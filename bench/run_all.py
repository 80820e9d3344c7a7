"""`make bench`: regenerate every results table under bench/results/ (about 20 minutes on 2 cores).

Profiles the CPU demo and searches it first, so the CPU benchmarks have a fresh plan of this machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = [
    [str(BIN / "lagom-tune"), "profile", "--workload", "cpu-demo", "--backend", "gloo", "--ranks", "2", "--out", "runs/bench-cpu"],
    [str(BIN / "lagom-tune"), "search", "runs/bench-cpu", "--optimizer", "lagom", "--out", "runs/bench-cpu/plan.yaml"],
    [sys.executable, "bench/cpu_e2e.py", "--plan", "runs/bench-cpu/plan.yaml", "--rounds", "4", "--steps", "10", "--grid"],
    [sys.executable, "bench/shim_overhead.py", "--plan", "runs/bench-cpu/plan.yaml"],
    [sys.executable, "bench/model_accuracy.py"],
    [sys.executable, "bench/paper_sim.py", "--optuna-trials", "1500"],
]

if __name__ == "__main__":
    t0 = time.perf_counter()
    for cmd in STEPS:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"all benchmarks regenerated in {time.perf_counter() - t0:.0f} s -> bench/results/")
