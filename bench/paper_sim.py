"""Reproduce the Lagom evaluation (its Table 2 workloads) on SIMULATED clusters.

For each cluster and workload: profile the simulator (2% noise), fit the model, search with the
default, AutoCCL-style and Lagom optimizers, and replay default and plan on the simulator's own
ground truth. Also: how many evaluations each optimizer needs to get within 1% of the best plan
known (the best of all optimizers, Optuna run long); and, on each cluster's worst cell, the
held-out error under several splits of the folds (paper_sim_splits.csv). Every number here is SIMULATED.

    python bench/paper_sim.py [--clusters a40-nvlink a40-pcie h100-nvlink h200-nvlink] [--optuna-trials 1500]
    python bench/paper_sim.py --report-only   # paper_sim.md again from the two csv files (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.backends.sim_clusters import GB
from lagom_tune.model.fit import fit_device, fit_model, fit_run
from lagom_tune.plan.schema import knob_space_for
from lagom_tune.profile.store import RunFolder
from lagom_tune.search.replay import validate
from lagom_tune.profile.campaign import run_profile
from lagom_tune.profile.summary import backend_choices
from lagom_tune.search.evaluate import ModelEvaluator
from lagom_tune.search import DEFAULT_MIN_GAIN
from lagom_tune.search.run import deployed as deploy, run_optimizer
from lagom_tune.search.space import default_settings, variables
from lagom_tune.workload.presets import TABLE2, build_preset
from lagom_tune.workload.spec import Workload

from calibrate_sim import AUTOCCL_CLUSTER, AUTOCCL_GAIN, autoccl_gains  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
# The paper's clusters were 2 nodes x 8 GPUs; FSDP and TP+DP workloads use all 16, EP uses one node.
WORKLOADS = ["phi-2-fsdp16", "llama3-8b-fsdp16", "mpt-7b-fsdp16", "phi-2-tp8-dp2", "llama3-8b-tp8-dp2", "mpt-7b-tp8-dp2",
             "deepseek-moe-16b-ep8", "olmoe-1b-7b-ep8"]
PAPER = "Lagom paper: 1.07-1.33x over NCCL, 1.03-1.27x over AutoCCL (measured on 16 A40s)"
LEE = "Lee et al. 2025 (GPT and LLaMA training on 4 A100s, H100s, MI250s, MI210s)"
LEE_CLUSTERS = ["a100-nvlink", "h100-nvlink"]  # the simulated GPUs Lee et al. measured
# Lee et al.'s conditions: 4 GPUs of one node training GPT- and LLaMA-family models (the presets'
# GPT-style phi-2 and mpt-7b, and llama3-8b), sharded (FSDP) or tensor-parallel, at their defaults
LEE_WORKLOADS = {f"{model} {parallel}": (model, parallel) for model in ("phi-2", "llama3-8b", "mpt-7b")
                 for parallel in ("fsdp=4", "tp=4")}


def overlap_costs(cluster: str, workloads: dict[str, Workload]) -> pd.DataFrame:
    """Lee et al.'s two figures on the simulator's ground truth at NCCL's defaults, per workload
    (by name): the iteration's GEMM time beside its collectives over alone, and the two streams run
    one after the other over overlapped."""
    sim, space = SimCluster(CLUSTERS[cluster]), knob_space_for("sim", {"cluster": cluster})
    return pd.DataFrame([{"cluster": cluster, "workload": name,
                          **asdict(sim.overlap_cost(w, default_settings(variables(w, space, sim.own_choices(w, space)))))}
                         for name, w in workloads.items()])


def lee_workloads() -> dict[str, Workload]:
    """The workloads of Lee et al.'s conditions (:data:`LEE_WORKLOADS`), by name."""
    return {name: build_preset(model, parallel=parallel) for name, (model, parallel) in LEE_WORKLOADS.items()}


def cost_summary(costs: pd.DataFrame) -> pd.DataFrame:
    """Per cluster, the mean and worst of Lee et al.'s two figures."""
    return costs.groupby("cluster", sort=False).agg(
        compute_slowdown_mean=("compute_slowdown", "mean"), compute_slowdown_max=("compute_slowdown", "max"),
        serial_over_overlapped_mean=("serial_over_overlapped", "mean"),
        serial_over_overlapped_max=("serial_over_overlapped", "max")).reset_index()


def within_1pct(history: list[float], best: float) -> int | None:
    """First evaluation count at which the best-so-far is within 1% of ``best``."""
    so_far = float("inf")
    for i, t in enumerate(history, 1):
        so_far = min(so_far, t)
        if so_far <= best * 1.01:
            return i
    return None


class Recording(ModelEvaluator):
    """An evaluator that remembers the iteration time of each new evaluation, in order."""

    def __init__(self, workload, model, space):
        super().__init__(workload, model, space)
        self.history: list[float] = []

    def _evaluate(self, settings):
        ev = super()._evaluate(settings)
        self.history.append(ev.iteration_s)
        return ev


# The folds' seeds the held-out error is read over on each cluster's worst cell: which points a
# fold holds out together moves the 5-fold figure (a fold holding out the only shapes of a kind
# leaves the regression extrapolating), and one split's figure says nothing of how much.
SPLIT_SEEDS = range(6)


def split_spread(cluster: str, name: str, work: Path) -> list[dict]:
    """The held-out MAPE per quantity of one cell's profile (in ``work``, as :func:`run_one` left
    it) under each of :data:`SPLIT_SEEDS`, one row per seed."""
    run = RunFolder(work / f"{cluster}-{name}")
    df, device = run.measurements(), fit_device(run.read_meta()["fingerprint"])
    return [{"cluster": cluster, "workload": name, "simulated": True, "seed": seed,
             **fit_model(df, device=device, simulated=True, seed=seed).mape}
            for seed in SPLIT_SEEDS]


def worst_cells(df: pd.DataFrame) -> list[tuple[str, str]]:
    """Per cluster, the workload whose worst held-out quantity is the highest."""
    worst = df[[c for c in df.columns if c.startswith("mape_")]].max(axis=1)
    return [(c, df.loc[idx, "workload"]) for c, idx in worst.groupby(df["cluster"]).idxmax().items()]


def run_one(cluster: str, name: str, trials: int, work: Path) -> dict:
    w = build_preset(name)
    backend = get_backend("sim", BackendOptions(hardware=cluster, noise=0.02, seed=0))
    t0 = time.perf_counter()
    run = run_profile(w, backend, work / f"{cluster}-{name}", repeats=3)
    fit = fit_run(run)
    fit_s = time.perf_counter() - t0
    fp = run.read_meta()["fingerprint"]
    space = knob_space_for("sim", fp)
    vars_ = variables(w, space, backend_choices(run.read()[0], w))  # NCCL's defaults as the profile saw the simulated NCCL choose
    res, hist = {}, {}
    for opt in ("default", "autoccl", "lagom", "optuna"):
        ev = Recording(w, fit.model, space)
        # Optuna unseeded here, so its count is its own (the CLI seeds it with the Lagom result).
        res[opt] = run_optimizer(opt, ev, vars_, {"n_trials": trials, "seed": 0, "enqueue_lagom": False})
        hist[opt] = ev.history
    best = min(r.evaluation.iteration_s for r in res.values())
    d = res["default"].evaluation.iteration_s
    # What `search` deploys: Lagom's settings only when predicted more than DEFAULT_MIN_GAIN faster,
    # its process-wide knobs that gain under search.TIE_TOLERANCE left to NCCL.
    deployed = deploy(res["lagom"], res["default"], ModelEvaluator(w, fit.model, space), DEFAULT_MIN_GAIN)
    # Replayed on the ground truth itself: the profile's noise would move each ratio by ~3%.
    replay = validate(w, {**fp, "noise": 0.0}, {"default": res["default"].settings, "autoccl": res["autoccl"].settings,
                                                "lagom": res["lagom"].settings, "plan": deployed.settings}, 1)
    row = {
        "cluster": cluster, "workload": name, "simulated": True, "fit_s": round(fit_s, 1),
        "mape_window": round(fit.mape.get("overlap_window", float("nan")), 4),
        **{f"mape_{q}": round(v, 4) for q, v in fit.mape.items() if q != "overlap_window"},
        "default_ms": round(d * 1e3, 2),
        "autoccl_x": round(d / res["autoccl"].evaluation.iteration_s, 3),
        "lagom_x": round(d / res["lagom"].evaluation.iteration_s, 3),
        "lagom_vs_autoccl_x": round(res["autoccl"].evaluation.iteration_s / res["lagom"].evaluation.iteration_s, 3),
        "optuna_x": round(d / res["optuna"].evaluation.iteration_s, 3),
        "bound_x": round(d / res["lagom"].evaluation.bound_s, 3),
        "replay_lagom_x": round(replay["iteration_ms"]["default"] / replay["iteration_ms"]["lagom"], 3),
        "plan_x": round(d / deployed.evaluation.iteration_s, 3),
        "replay_plan_x": round(replay["iteration_ms"]["default"] / replay["iteration_ms"]["plan"], 3),
        "replay_autoccl_x": round(replay["iteration_ms"]["default"] / replay["iteration_ms"]["autoccl"], 3),
    }
    for opt in ("lagom", "autoccl", "optuna"):
        row[f"{opt}_evals"] = res[opt].evaluations
        row[f"{opt}_s"] = round(res[opt].seconds, 3)
        reached = res[opt].evaluation.iteration_s <= best * 1.01  # counted only if its answer gets there
        row[f"{opt}_evals_to_1pct"] = within_1pct(hist[opt], best) if reached else None
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", nargs="+", default=["a40-nvlink", "a40-pcie", "h100-nvlink", "h200-nvlink"])
    p.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=sorted(TABLE2))
    p.add_argument("--optuna-trials", type=int, default=1500)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--report-only", action="store_true", help="rewrite paper_sim.md from the csv files in --out")
    args = p.parse_args()
    if args.report_only:
        df, splits = pd.read_csv(args.out / "paper_sim.csv"), pd.read_csv(args.out / "paper_sim_splits.csv")
    else:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for cluster in args.clusters:
                for name in args.workloads:
                    row = run_one(cluster, name, args.optuna_trials, Path(tmp))
                    rows.append(row)
                    print(f"{cluster:12s} {name:22s} default {row['default_ms']:9.2f} ms | autoccl {row['autoccl_x']:.3f}x "
                          f"lagom {row['lagom_x']:.3f}x ({row['lagom_evals']} ev) optuna {row['optuna_x']:.3f}x "
                          f"({row['optuna_evals']} ev) | replay lagom {row['replay_lagom_x']:.3f}x", flush=True)
            df = pd.DataFrame(rows)
            splits = pd.DataFrame([r for cell in worst_cells(df) for r in split_spread(*cell, Path(tmp))])
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "paper_sim.csv", df.to_csv(index=False))
        atomic_write_text(args.out / "paper_sim_splits.csv", splits.to_csv(index=False))
    atomic_write_text(args.out / "paper_sim.md", report(df, splits, args.optuna_trials, remade=args.report_only))
    print(f"-> {args.out / 'paper_sim.md'}")


def spread_table(splits: pd.DataFrame) -> pd.DataFrame:
    """Per cell of ``splits`` (:func:`split_spread`'s rows), each quantity's held-out MAPE over the
    seeds as "lowest–highest (mean)"."""
    quantities = [c for c in splits.columns if c not in ("cluster", "workload", "simulated", "seed")]
    cells = splits.groupby(["cluster", "workload"], sort=False)[quantities]
    return cells.agg(lambda v: f"{v.min():.3f}–{v.max():.3f} ({v.mean():.3f})").reset_index()


def report(df: pd.DataFrame, splits: pd.DataFrame, trials: int, remade: bool = False) -> str:
    """paper_sim.md: the side-by-side tables, the model's error (and how it moves with the split),
    and where the simulation agrees with the papers and where not. ``remade``: the optimizer tables
    come from an earlier run's CSV (``--report-only``), and the header says so rather than dating
    them today."""
    speed = df[["cluster", "workload", "mape_window", "default_ms", "autoccl_x", "lagom_x", "lagom_vs_autoccl_x", "optuna_x",
                "bound_x", "replay_autoccl_x", "replay_lagom_x", "plan_x", "replay_plan_x"]]
    eff = df[["cluster", "workload", "lagom_evals", "lagom_evals_to_1pct", "lagom_s", "autoccl_evals", "autoccl_evals_to_1pct",
              "optuna_evals", "optuna_evals_to_1pct", "optuna_s"]]
    mape_cols = [c for c in df.columns if c.startswith("mape_")]
    accuracy = df.groupby("cluster")[mape_cols].max().rename(columns=lambda c: c.removeprefix("mape_")).reset_index()
    lo, hi = df["lagom_x"].min(), df["lagom_x"].max()
    autoccl_gain = pd.Series(autoccl_gains(CLUSTERS[AUTOCCL_CLUSTER])).median()
    nvls_tp = df["cluster"].map(lambda c: CLUSTERS[c].nvls) & df["workload"].str.contains("-tp")  # NVLS is their TP default
    hopper_tp = df.loc[nvls_tp, "lagom_x"]
    lo_a, hi_a = df["lagom_vs_autoccl_x"].min(), df["lagom_vs_autoccl_x"].max()
    clusters = list(dict.fromkeys([*LEE_CLUSTERS, *df["cluster"]]))
    lee = cost_summary(pd.concat([overlap_costs(c, lee_workloads()) for c in clusters]))
    paper = {name: build_preset(name) for name in dict.fromkeys(df["workload"])}
    at_scale = cost_summary(pd.concat([overlap_costs(c, paper) for c in clusters]))
    return "\n".join([
        "# Lagom evaluation on SIMULATED clusters",
        "",
        (f"tables remade {datetime.date.today()} · {platform.node()} from paper_sim.csv, whose profiles and searches ran "
         "earlier (the date of that file's commit); the contention tables at the end are computed as remade · "
         if remade else f"{datetime.date.today()} · {platform.node()} · ") + "every number below is **simulated** (lagom-tune's sim backend, "
        "2% noise, seed 0); `*_x` columns are speedups over NCCL's defaults, predicted by the fitted model, "
        "except `replay_*` which replay the plans on the simulator's ground truth (without noise).",
        "",
        f"Lagom over NCCL defaults: **{lo:.3f}–{hi:.3f}×** (replayed: {df['replay_lagom_x'].min():.3f}–{df['replay_lagom_x'].max():.3f}×); "
        f"over AutoCCL-style tuning: **{lo_a:.3f}–{hi_a:.3f}×**. {PAPER}.",
        "",
        f"`plan_x` is what `lagom-tune search` deploys: Lagom's settings only when predicted more than {DEFAULT_MIN_GAIN:.0%} faster "
        f"(`--min-gain`), else the defaults. Replayed on the simulator's ground truth, deployed plans range "
        f"{df['replay_plan_x'].min():.3f}–{df['replay_plan_x'].max():.3f}× (raw Lagom: {df['replay_lagom_x'].min():.3f}–"
        f"{df['replay_lagom_x'].max():.3f}×): predicted gains below the model's error can be losses.",
        "",
        "## The model's held-out error on each simulated cluster (worst workload, 5-fold MAPE, 2% noise)",
        "",
        "The simulator is a mechanism (tiles in waves on SMs, channel blocks, HBM arbitration, step pipelines over a",
        "link; `backends/sim_compute.py`, `backends/sim_comm.py`) calibrated on one H200 and on published figures,",
        "not the model's equations, and it plays the two streams CTA group by CTA group (`backends/sim_overlap.py`),",
        "not on the model's timeline of two rates switched at once. The two still share structure the data cannot",
        "yet separate (the channel blocks' placement on SMs, the candidate tiles, a step curve for channels whose sum",
        "rolls off before the link, as 8xH200's all-reduce with its CTAs capped did). Aim: 5%.",
        "",
        accuracy.to_markdown(index=False, floatfmt=".3f"),
        "",
        "Folds follow a seeded hash of each point within its kind (seed 0 above). Which points a fold holds out",
        "together moves the figure: a fold holding out the only shapes of a kind (the batched k=128 attention",
        "GEMM, the MoE routers' 64-wide outputs) leaves the GEMM regression extrapolating from shapes that hardly",
        "tell its math from its re-reads (the MoE cells' GEMM column). Each cluster's worst cell above, over split",
        f"seeds {SPLIT_SEEDS.start}–{SPLIT_SEEDS.stop - 1}: lowest–highest (mean) held-out MAPE:",
        "",
        spread_table(splits).to_markdown(index=False),
        "",
        "## Predicted iteration time, side by side",
        "",
        speed.to_markdown(index=False),
        "",
        "## Optimizer efficiency: evaluations to reach within 1% of the best plan known",
        "",
        f"Lagom's search gets within 1% of the best plan any optimizer found in {int(df['lagom_evals_to_1pct'].notna().sum())} "
        f"of {len(df)} cases (blank: never).",
        "",
        eff.to_markdown(index=False),
        "",
        "## Where the simulation and the paper agree and disagree",
        "",
        "Inputs, each checked in `tests/test_sim_observations.py`, where the ones the simulator misses are marked",
        "as known failures (issue 16): the H200's GEMM slowdowns beside copy blocks (17 of 18 cells within 0.1;",
        "mpt-7b beside 48 blocks +0.30, missed); nccl-tests ring bus bandwidths (A100 218 GB/s against 230-250; H100 and",
        "H200 356 GB/s against the ring's ~370); NCCL's default all-reduce on Hopper, NVLink SHARP at ~480 GB/s busbw",
        "(simulated NVLS 479 GB/s, the rate calibrated on it); AutoCCL's "
        f"{AUTOCCL_GAIN[0]}-{AUTOCCL_GAIN[1]}x isolated-collective gain on A40s (simulated {autoccl_gain:.3f}x median, the",
        f"A40 NVLink link, {CLUSTERS[AUTOCCL_CLUSTER].link / GB:.1f} GB/s, solved for it by `bench/calibrate_sim.py`); Lagom's §2 A40 PCIe observation;",
        "Lagom's Phi-2 FSDP on A40 NVLink, where AutoCCL's NC=61 runs 0.87x the defaults (simulated 0.89x) but Lagom's",
        "NC=2, C=684 KB, 1.35x faster on its pattern, runs the simulated iteration 0.73x (missed: two simulated A40",
        "channels carry 10 GB/s). Checked there too, though nothing was calibrated on it: Lagom's A40 computation slowed",
        "by up to 35% (the worst paper workload at NCCL's defaults in the second table below). Everything else below",
        "is an output, not tuned toward the paper.",
        "",
        f"- AutoCCL-style tuning (minimise each collective's own time) is predicted slower than NCCL's defaults in "
        f"{int((df['autoccl_x'] < 1).sum())} of {len(df)} cases (replayed: {int((df['replay_autoccl_x'] < 1).sum())}), although the same",
        f"  simulator gives it {autoccl_gain:.3f}x for collectives alone (published: {AUTOCCL_GAIN[0]}-{AUTOCCL_GAIN[1]}x): the channels it adds hold SMs and HBM the",
        "  overlapped GEMMs then lack (Lagom reports the same for AutoCCL on Phi-2, A40 NVLink: 0.87x). The paper",
        "  measured AutoCCL ahead of NCCL on average.",
        f"- Lagom's gains over NCCL here ({lo:.3f}–{hi:.3f}×) are "
        + ("smaller than" if hi < 1.07 else "in the range of" if lo >= 1.07 else "partly below")
        + " the paper's 1.07–1.33×: the workloads model GEMMs and collectives only (no",
        "  element-wise kernels, no optimizer step), and NCCL's defaults are near the best for collectives on the",
        "  NVLink clusters, so there is less to win. On the Hopper clusters NCCL's default all-reduce within a node is",
        "  NVLS (the switch reduces: ~480 GB/s busbw against the ring's ~370, and 2 bytes of HBM traffic per byte of",
        f"  data against the ring's 5.25), so the tensor-parallel workloads there gain {hopper_tp.min():.3f}–{hopper_tp.max():.3f}×.",
        f"- Model vs simulator ground truth: the fitted model's predicted gains and the replayed gains differ by up to "
        f"{(df['replay_lagom_x'] - df['lagom_x']).abs().max():.3f}× (held-out window MAPE ≤ {df['mape_window'].max():.1%}); "
        f"in {int((df['replay_lagom_x'] < 1).sum())} of {len(df)} cases Lagom's raw settings replay slower than the defaults,",
        "  which is why `search` deploys them only above `--min-gain`.",
        f"- {LEE} measured overlap slowing the computation by 18.9% on average (40.0% at worst) and serial execution",
        "  10.2% (26.6%) slower than overlapped. The same quantities on the simulator's ground truth at NCCL's defaults",
        "  (the iteration's GEMM time beside its collectives over alone, and both streams one after the other over",
        "  overlapped), under Lee's conditions: 4 GPUs of one node training phi-2, llama3-8b and mpt-7b, FSDP or",
        "  tensor-parallel (a100-nvlink is simulated for this comparison only):",
        "",
        lee.to_markdown(index=False, floatfmt=".3f"),
        "",
        "  Lee's figures are averages over A100s, H100s and two AMD GPUs; the simulated A100 lies below them, the",
        "  Hopper clusters near them. The paper workloads above (16 GPUs over two nodes; the MoE ones 8) slow their",
        "  computation more, because their collectives, slower across nodes, run beside nearly every GEMM, and on",
        "  Hopper a one-wave GEMM doubles once channel blocks push a few CTAs into a second round (the H200's",
        "  measured 1.9-2.0x beside 4-32 copy blocks):",
        "",
        at_scale.to_markdown(index=False, floatfmt=".3f"),
        "",
        f"Reproduce: `python bench/paper_sim.py --optuna-trials {trials}`",
        "",
    ])


if __name__ == "__main__":
    main()
