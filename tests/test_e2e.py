"""The real path on CPU: a 2-rank gloo profile, a fit, a search, a plan, and apply to a training run."""

import json

import pytest
import yaml

from lagom_tune.plan.schema import load_plan
from lagom_tune.profile.store import RunFolder

from conftest import BIN, ROOT, TINY_ARGS, cli

pytestmark = pytest.mark.slow


def test_profile_writes_a_complete_run_folder(tiny_run):
    run = RunFolder(tiny_run)
    meta = run.read_meta()
    assert meta["complete"] and meta["points_done"] == meta["points_total"]
    assert meta["fingerprint"]["backend"] == "gloo" and meta["fingerprint"]["ranks"] == 2
    df = run.measurements()
    assert set(df.kind) == {"gemm", "collective", "overlap", "again"}  # and three of each measured again, last
    assert (df.groupby("point").size() == meta["repeats"]).all()  # every raw repeat kept, none twice
    assert (df[df.kind == "collective"].busbw_GBps > 0).all()
    over = df[df.kind == "overlap"].groupby("point")
    assert (over["n_compute"].nunique() == 1).all()  # one job per point, sized before its repeats
    # each repeat times its GEMMs and its all-reduce alone right before running them together
    assert (over["compute_alone_us"].nunique() == meta["repeats"]).all() and (over["comm_alone_us"].nunique() == meta["repeats"]).all()
    assert set(df[df.kind == "overlap"]["baseline"]) == {"paired"}
    model = yaml.safe_load(run.model_path.read_text())
    assert model["family"] == "cpu-pairwise" and model["simulated"] is False
    assert {"gemm", "collective", "overlap_window"} <= set(model["accuracy"]["mape"])
    assert set(model["accuracy"]["remeasured"]) == set(model["accuracy"]["mape"])  # every quantity measured twice


def test_search_apply_train(tiny_run, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    r = cli("search", tiny_run, "--optimizer", "lagom", "--min-gain", "0", "--out", plan_path, check=True)  # deployed if any gain
    assert "predicted iteration time" in r.stdout
    assert r.stdout.splitlines()[0].strip(), "the output starts with the plan, not a blank line (an empty progress bar)"
    plan = load_plan(plan_path)
    assert plan.backend == "gloo" and plan.world_size == 2
    assert plan.search["optimizer"] == "lagom" and plan.search["evaluations"] >= 1
    it = plan.predicted["iteration_ms"]
    assert it["plan"] <= it["default"] and plan.predicted["bound_ms"] <= it["plan"]

    metrics = tmp_path / "m.json"
    r = cli("apply", plan_path, "--", BIN / "torchrun", "--standalone", "--nproc-per-node", "2",
            ROOT / "examples" / "train_gpt.py", *TINY_ARGS, "--steps", "2", "--warmup", "1", "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    seen = json.loads(metrics.read_text())
    # dp_replicate: torchtitan's name for DDP's dimension; a knob the plan leaves unset keeps DDP's
    # (25 MiB) and torchrun's (1 thread) default
    set_cap = plan.settings.communicators.get("dp_replicate", {}).get("bucket_cap_mb")
    assert seen["bucket_cap_bytes"] == int((set_cap or 25) * 1024 * 1024)
    assert seen["threads"] == plan.settings.process.get("threads", 1)
    assert (f"applied bucket_cap_mb={set_cap}" in r.stderr) == (set_cap is not None), r.stderr


def test_compare_json_lists_every_optimizer(tiny_run):
    r = cli("search", tiny_run, "--compare", "--json", "--n-trials", "10", check=True)
    rows = json.loads(r.stdout)
    assert {row["optimizer"] for row in rows} == {"lagom", "optuna", "autoccl", "default", "exhaustive"}
    for row in rows:
        assert row["iteration_ms"] > 0 and row["evaluations"] >= 1 and row["seconds"] >= 0


def test_show_renders_run_plan_and_workload(tiny_run):
    r = cli("show", tiny_run, check=True)
    assert "MAPE" in r.stdout and "gloo" in r.stdout
    assert "group backward" in cli("show", "cpu-demo", check=True).stdout


def test_model_mape_is_shown_to_one_decimal_everywhere():
    """A held-out MAPE of 0.1% read "gemm 0%" under a plan's prediction (as if the model were
    exact) while the profile's line said 0.1%; one format now, NaN (nothing to hold out) as n/a."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from lagom_tune import render
    from lagom_tune.plan.schema import load_plan

    assert render.mape_text({"gemm": 0.0012, "collective": float("nan"), "overlap_window": 0.0529}) == \
        "gemm 0.1%, collective n/a, overlap_window 5.3%"
    plan = load_plan(ROOT / "plans" / "sim-h100-nvlink-mpt-7b-tp8-dp2.yaml")
    plan = replace(plan, model={**plan.model, "mape": {"gemm": 0.0012, "collective": float("nan")}})
    out = Console(width=300, record=True, file=io.StringIO())
    out.print(render.prediction_table(plan))
    assert "(model MAPE gemm 0.1%, collective n/a)" in " ".join(out.export_text().split())  # the title wraps
