"""GPU check on one GPU: profile a preset's GEMMs beside the contention probe, fit, report.

    python bench/gpu_check.py [--out bench/results] [--workload llama3-8b-fsdp8]

Runs ``lagom-tune profile --backend nccl`` in one process (single-GPU mode: the workload's GEMMs
alone and beside the probe over channels and buffer sizes), which fits the model; then writes
``gpu_check-<workload>.md`` and ``gpu_check-<workload>_*.csv`` to ``--out``: the device and date,
the held-out MAPE, the ranking figures (Spearman per shape, best-setting gap), the GEMMs (median
and trimmed mean, TFLOP/s), the probe's copy bandwidth (total and per block) and GEMM slowdown by
channels × buffer size, and measured vs predicted overlapped windows. Everything in them is
measured on the GPU named in the file.
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

from lagom_tune.artifact_io import atomic_write_text  # noqa: E402
from lagom_tune.backends.base import trimmed_mean  # noqa: E402
from lagom_tune.backends.nccl_sweep import PROBE_THREADS  # noqa: E402
from lagom_tune.backends.sim_clusters import CLUSTERS, Cluster  # noqa: E402
from lagom_tune.model.contention import load_model  # noqa: E402
from lagom_tune.model.fit import predict_point  # noqa: E402
from lagom_tune.model.rows import consistent_baselines, overlap_slowdowns, paired_alone, point_medians  # noqa: E402


def tables(run: Path) -> dict[str, pd.DataFrame]:
    """The check's tables from a profiled single-GPU run folder (measurements and model.yaml)."""
    df = pd.read_csv(run / "measurements.csv")
    gemm_rows = df[df["kind"] == "gemm"]
    how = gemm_rows["timing"] if "timing" in gemm_rows else pd.Series("stream (legacy)", index=gemm_rows.index)
    gemm = gemm_rows.assign(timing=how.fillna("stream (legacy)")).groupby("gemm").agg(
        median_us=("time_us", "median"), trimmed_mean_us=("time_us", trimmed_mean), flops=("flops", "first"),
        repeats=("time_us", "size"), timing=("timing", "first"))
    gemm["TFLOPs"] = gemm["flops"] / (gemm["median_us"] * 1e-6) / 1e12
    pts = consistent_baselines(point_medians(df))
    # a GEMM point and its overlapped pairs' alone times are one measurement (2026-11-30): they should agree
    paired = paired_alone(pts[pts["kind"] == "overlap"]).groupby(level=0).median() * 1e6
    gemm["paired_baseline_us"] = paired.reindex(gemm.index)
    gemm["point_over_baseline"] = gemm["median_us"] / gemm["paired_baseline_us"]
    gemm = gemm.sort_values("flops").reset_index()[["gemm", "median_us", "trimmed_mean_us", "TFLOPs", "repeats", "timing",
                                                    "paired_baseline_us", "point_over_baseline"]]
    coll = pts[pts["kind"] == "collective"]
    # every (channels, buffer size) cell: its largest probe point (a row's bytes follow the geometry)
    largest = coll.loc[coll.groupby(["channels", "buffsize"])["nbytes"].idxmax()]
    largest = largest.assign(GBps=largest["nbytes"] / (largest["time_us"] * 1e-6) / 1e9)
    largest = largest.assign(per_block_GBps=largest["GBps"] / largest["channels"])
    probe = largest.pivot_table(index="channels", columns="buffsize", values="GBps").rename(columns=_mib)
    per_block = largest.pivot_table(index="channels", columns="buffsize", values="per_block_GBps").rename(columns=_mib)
    over = overlap_slowdowns(pts)
    slow = over.pivot_table(index="channels", columns="buffsize", values="gemm_slowdown", aggfunc="median").rename(columns=_mib)
    model, _ = load_model(run / "model.yaml")
    over["predicted_window_us"] = [predict_point(model, r)["window_us"] for _, r in over.iterrows()]
    over["error"] = over["predicted_window_us"] / over["window_us"] - 1
    windows = over[["gemm", "channels", "buffsize", "n_compute", "window_us", "predicted_window_us", "error"]].sort_values(
        ["gemm", "buffsize", "channels"]).reset_index(drop=True)
    by_channels = windows.groupby("channels").agg(measured_us=("window_us", "median"), predicted_us=("predicted_window_us", "median"),
                                                  mean_abs_error=("error", lambda e: e.abs().mean())).reset_index()
    return {"gemm": gemm, "probe_GBps": probe.reset_index(), "probe_per_block_GBps": per_block.reset_index(),
            "gemm_slowdown": slow.reset_index(), "windows": windows, "windows_by_channels": by_channels}


def simulated_peer(gpu: str) -> Cluster:
    """The simulated cluster of the GPU named ``gpu`` (its device's name, ``H100-SXM``'s first part,
    in it), else the H200 the simulator's compute side was calibrated on.

    Args:
        gpu: the GPU's name as torch gives it (``NVIDIA H100 80GB HBM3``).
    Returns:
        The cluster.
    """
    return next((c for c in CLUSTERS.values() if c.device.split("-")[0] in gpu), CLUSTERS["h200-nvlink"])


def measure_placement(run: Path) -> pd.DataFrame:
    """Where the probe's blocks run at each channel count of the run (one launch each on the idle
    GPU, ``Probe.placement``), by TPC, beside the simulated GPU's assumption (``simulated_peer``,
    ``sim_compute.slots``: blocks spread evenly over its GPCs and paired within one). Measures on the GPU."""
    import torch

    from lagom_tune.backends.probe import Probe, placement_summary, probe_geometry
    from lagom_tune.backends.sim_compute import slots

    df = pd.read_csv(run / "measurements.csv")
    props = torch.cuda.get_device_properties(0)
    peer = simulated_peer(props.name)
    rows = []
    for ch in sorted(int(c) for c in df.loc[df["kind"] == "collective", "channels"].dropna().unique()):
        smids = Probe(probe_geometry(ch << 20, ch, 1 << 20), PROBE_THREADS, torch.device("cuda")).placement()
        rows.append({"channels": ch, **vars(placement_summary(smids, props.multi_processor_count)),
                     "sim_gpu": peer.device, "sim_free_tpcs": slots(peer, ch, 2), "smids": " ".join(map(str, smids))})
    return pd.DataFrame(rows)


def placement_csv(out_dir: Path, workload: str) -> Path:
    """Where ``main`` writes the placement table, and ``write_report`` (also under --report-only) reads it."""
    return out_dir / f"gpu_check-{workload}_probe_placement.csv"


def _mib(b: float) -> str:
    return f"buffsize {int(b) >> 20} MiB"


def _ranking(model: dict) -> pd.DataFrame:
    shapes = (model["accuracy"].get("ranking") or {}).get("shapes", [])
    return pd.DataFrame(shapes, columns=["shape", "collective", "spearman", "best_gap", "points"])


def write_report(run: Path, out_dir: Path, workload: str, elapsed: float | None = None) -> str:
    """Write ``gpu_check-<workload>.md`` and its CSV tables for a profiled run folder; return the markdown.

    ``elapsed`` is the seconds profile and fit took here; None when the tables are remade from an
    existing run folder (then the profile's own start and end times are quoted).
    """
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    profiled = (datetime.datetime.fromisoformat(str(meta["updated"])) - datetime.datetime.fromisoformat(str(meta["started"]))).total_seconds()
    took = (f"profile and fit took {elapsed:.0f} s" if elapsed is not None else
            f"profiled {str(meta['started'])[:10]} in {profiled:.0f} s; tables remade from the run folder with the model of "
            "`lagom-tune fit` (measuring nothing)")
    model = yaml.safe_load((run / "model.yaml").read_text())
    fp = meta["fingerprint"]
    out = tables(run)
    out["ranking"] = _ranking(model)
    acc = model["accuracy"]
    noise, again = acc.get("noise", {}), acc.get("remeasured", {})
    mape = pd.DataFrame([{"quantity": k, "held-out MAPE": f"{v:.1%}", "repeat noise": f"{noise[k]:.1%}" if k in noise else "-",
                          "remeasured (median ratio, pairs)": (f"{again[k]['gap']:.1%} ({again[k]['median_ratio']:.2f}x, "
                                                               f"{again[k]['pairs']})" if k in again else "-")}
                         for k, v in acc["mape"].items()])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check-{workload}"
    for name, t in out.items():
        atomic_write_text(out_dir / f"{stem}_{name}.csv", t.to_csv(index=False))
    placed = placement_csv(out_dir, workload)
    placement = pd.read_csv(placed).drop(columns="smids") if placed.exists() else None
    device = (f"{fp['gpu']} ({fp['sms']} SMs, {fp['hbm_GBps']} GB/s {fp['hbm_method']}), driver {fp['driver']}, "
              f"CUDA {fp['cuda']}, NCCL {fp['nccl']}, torch {fp['torch']}, host {fp['host']}")
    ranking = acc.get("ranking") or {}
    warnings = acc.get("warnings", [])
    text = "\n\n".join([
        "# GPU check: GEMMs beside the single-GPU contention probe (MEASURED)",
        f"Measured {str(meta['started'])[:10]} · {device}",
        f"Workload `{workload}` · {meta['points_done']} points × {meta['repeats']} repeats · {took} · "
        f"mode {fp['mode']}: the probe (a persistent Triton copy kernel, one {PROBE_THREADS}-thread block per channel, NCCL's "
        "step of buffsize/8, 32 KiB in flight per block) stands in for NCCL, so the communication figures are the probe's, "
        "not NCCL's. Timing: a GEMM alone and beside the probe is the same launches on the same stream (a CUDA graph under "
        "50 µs), the baseline measured right before each overlapped repeat.",
        f"## Held-out accuracy ({acc['method']}) · model form `{model.get('form', 'lagom-eq4-6')}`",
        mape.to_markdown(index=False),
        f"Repeat noise: {acc.get('noise_method', 'not recorded')}. Remeasured: {acc.get('remeasured_method', 'not recorded')}.",
        f"## Ranking of settings per GEMM shape and collective ({ranking.get('method', 'not computed')})",
        "Spearman: rank correlation of predicted and measured windows across channel counts (median over buffer sizes); "
        "best-setting gap: how much longer the measured window of the model's best setting is than the measured best.",
        f"Median-shape Spearman **{ranking.get('median_spearman', float('nan')):.2f}**.",
        out["ranking"].to_markdown(index=False, floatfmt=".3f"),
        "## Warnings", "\n".join(f"- {w}" for w in warnings) or "none: no measured slowdown below 0.97",
        "## GEMMs alone",
        "`paired_baseline_us`: the median alone time its overlapped pairs measured just before each pair; since 2026-11-30 "
        "both are timed over >= 1 ms on operands rotated past the L2, so `point_over_baseline` should be within about 1% of 1 "
        "(the 11-30 H200 runs, timed before: llama3-8b 0.99-1.37 for its 80-640 µs GEMMs, mpt-7b 0.98-1.04 for its graph-timed 8-47 µs ones).",
        out["gemm"].to_markdown(index=False, floatfmt=".3f"),
        "## Probe copy bandwidth (GB/s, largest size) by channels × buffer size", out["probe_GBps"].to_markdown(index=False, floatfmt=".1f"),
        "## Probe copy bandwidth per block (GB/s)", out["probe_per_block_GBps"].to_markdown(index=False, floatfmt=".1f"),
        "NCCL's published per-channel figure on H200 NVLink is about 30 GB/s of bus bandwidth (74/134/234 GB/s at 2/4/8 "
        "channels), about 90 GB/s of HBM traffic; a probe block's copy rate counts each byte once but reads and writes it.",
        "## Where the probe's blocks run (one launch per channel count on the idle GPU; TPC = `%smid // 2`)",
        placement.to_markdown(index=False) if placement is not None else
        "not measured (runs before 2026-11-30's seventh session have none; a failed measurement said why on stderr)",
        "`free_tpcs`: the places left to a GEMM launched in 2-CTA clusters; `sim_free_tpcs`: the simulator's assumption "
        "for its GPU of this kind, `sim_gpu` (blocks spread evenly over its GPCs, paired within one; tables before "
        f"2026-12-07 name the H200's `sim_h200_free_tpcs`); every block's SM in `{stem}_probe_placement.csv`.",
        "## GEMM slowdown beside the probe (median over shapes) by channels × buffer size",
        out["gemm_slowdown"].to_markdown(index=False, floatfmt=".3f"),
        "## Overlapped windows, measured vs predicted (median over shapes and buffer sizes; the fitted model, in-sample)",
        out["windows_by_channels"].to_markdown(index=False, floatfmt=".3f"),
        f"Every point: `{stem}_windows.csv`.",
        "Reproduce: `bash bench/gpu_check.sh [OUT_DIR] [WORKLOAD]` on one GPU.",
    ]) + "\n"
    atomic_write_text(out_dir / f"{stem}.md", text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--workload", default="llama3-8b-fsdp8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run", type=Path, help="run folder to (re)use (kept afterwards); default a temporary one")
    p.add_argument("--report-only", action="store_true", help="tabulate --run as it is: refit nothing, measure nothing")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or Path(tmp) / "run"
        t0 = time.monotonic()
        if args.report_only:
            if args.run is None:
                p.error("--report-only needs --run")
            print(write_report(run, args.out, args.workload))
            return
        subprocess.run([sys.executable, "-m", "lagom_tune", "profile", "--backend", "nccl", "--workload", args.workload,
                        "--out", str(run), "--repeats", str(args.repeats)], check=True, cwd=ROOT)
        elapsed = time.monotonic() - t0
        args.out.mkdir(parents=True, exist_ok=True)
        placed = placement_csv(args.out, args.workload)
        placed.unlink(missing_ok=True)  # never an older run's
        try:  # a diagnostic beside the check: its failure must not cost the report of the profile just measured
            atomic_write_text(placed, measure_placement(run).to_csv(index=False))
        except Exception as e:  # noqa: BLE001 (reported, and the report says "not measured")
            print(f"gpu_check: probe placement not measured: {type(e).__name__}: {e}", file=sys.stderr)
        print(write_report(run, args.out, args.workload, elapsed))


if __name__ == "__main__":
    main()
