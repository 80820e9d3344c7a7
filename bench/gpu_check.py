"""GPU check on one GPU: profile a preset's GEMMs beside the contention probe, fit, report.

    python bench/gpu_check.py [--out bench/results] [--workload llama3-8b-fsdp8]

Runs ``lagom-tune profile --backend nccl`` in one process (single-GPU mode: the workload's GEMMs
alone and beside the probe over channels and buffer sizes), which fits the model; then writes
``gpu_check.md`` and ``gpu_check_*.csv`` to ``--out``: the device, the GEMMs (median and trimmed
mean, TFLOP/s), the probe's copy bandwidth against channels, GEMM slowdown against channels, and
the held-out MAPE. Everything in them is measured on the GPU named in the file.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lagom_tune.backends.base import trimmed_mean  # noqa: E402
from lagom_tune.model.fit import point_medians, two_rate_slowdowns  # noqa: E402


def tables(run: Path) -> dict[str, pd.DataFrame]:
    """The check's tables from a profiled single-GPU run folder."""
    df = pd.read_csv(run / "measurements.csv")
    gemm = df[df["kind"] == "gemm"].groupby("gemm").agg(
        median_us=("time_us", "median"), trimmed_mean_us=("time_us", trimmed_mean), flops=("flops", "first"), repeats=("time_us", "size"))
    gemm["TFLOPs"] = gemm["flops"] / (gemm["median_us"] * 1e-6) / 1e12
    gemm = gemm.sort_values("flops").reset_index()[["gemm", "median_us", "trimmed_mean_us", "TFLOPs", "repeats"]]
    pts = point_medians(df)
    probe = pts[(pts["kind"] == "collective") & (pts["nbytes"] == pts.loc[pts["kind"] == "collective", "nbytes"].max())]
    probe = probe.assign(GBps=probe["nbytes"] / (probe["time_us"] * 1e-6) / 1e9)
    probe = probe.pivot_table(index="channels", columns="buffsize", values="GBps").rename(columns=lambda b: f"buffsize {int(b) >> 20} MiB")
    over = pts[pts["kind"] == "overlap"].copy()
    over["gemm_slowdown"] = [s for s, _ in over.apply(two_rate_slowdowns, axis=1)]
    slow = over.pivot_table(index="channels", columns="buffsize", values="gemm_slowdown", aggfunc="median")
    slow = slow.rename(columns=lambda b: f"buffsize {int(b) >> 20} MiB")
    return {"gemm": gemm, "probe_GBps": probe.reset_index(), "gemm_slowdown": slow.reset_index()}


def write_report(run: Path, out_dir: Path, workload: str, elapsed: float) -> str:
    """Write ``gpu_check.md`` and its CSV tables for a profiled run folder; return the markdown."""
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    model = yaml.safe_load((run / "model.yaml").read_text())
    fp = meta["fingerprint"]
    out = tables(run)
    mape = pd.DataFrame([{"quantity": k, "held-out MAPE": f"{v:.1%}"} for k, v in model["accuracy"]["mape"].items()])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, t in out.items():
        t.to_csv(out_dir / f"gpu_check_{name}.csv", index=False)
    device = (f"{fp['gpu']} ({fp['sms']} SMs, {fp['hbm_GBps']} GB/s {fp['hbm_method']}), driver {fp['driver']}, "
              f"CUDA {fp['cuda']}, NCCL {fp['nccl']}, torch {fp['torch']}, host {fp['host']}")
    text = "\n\n".join([
        "# GPU check: GEMMs beside the single-GPU contention probe (MEASURED)",
        f"{datetime.date.today().isoformat()} · {device}",
        f"Workload `{workload}` · {meta['points_done']} points × {meta['repeats']} repeats · profile and fit took {elapsed:.0f} s · "
        f"mode {fp['mode']}: the probe (a persistent Triton copy kernel, one block per channel, NCCL's step of buffsize/8) "
        "stands in for NCCL, so the communication figures are the probe's, not NCCL's.",
        "## Held-out accuracy (" + model["accuracy"]["method"] + ")",
        mape.to_markdown(index=False),
        "## GEMMs alone", out["gemm"].to_markdown(index=False, floatfmt=".1f"),
        "## Probe copy bandwidth (GB/s, largest size) by channels", out["probe_GBps"].to_markdown(index=False, floatfmt=".1f"),
        "## GEMM slowdown beside the probe (median over shapes) by channels", out["gemm_slowdown"].to_markdown(index=False, floatfmt=".3f"),
        "Reproduce: `bash bench/gpu_check.sh [OUT_DIR]` on one GPU.",
    ]) + "\n"
    (out_dir / "gpu_check.md").write_text(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--workload", default="llama3-8b-fsdp8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run", type=Path, help="run folder to (re)use; default a temporary one")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or Path(tmp) / "run"
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "lagom_tune", "profile", "--backend", "nccl", "--workload", args.workload,
                        "--out", str(run), "--repeats", str(args.repeats)], check=True, cwd=ROOT)
        print(write_report(run, args.out, args.workload, time.monotonic() - t0))


if __name__ == "__main__":
    main()
