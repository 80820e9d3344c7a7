"""The simulated cluster as a backend: labelled, deterministic, sized to the workload (its physics
against published observations: tests/test_sim_observations.py)."""

import shutil
import subprocess

import pytest
import yaml

from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.plan.schema import knob_space_for
from lagom_tune.profile.campaign import run_profile
from lagom_tune.search.replay import validate
from lagom_tune.search.space import default_settings, variables
from lagom_tune.workload.presets import build_preset

from conftest import BIN, ROOT, cli

def test_simulated_noise_is_deterministic_for_a_seed(tmp_path):
    w = build_preset("olmoe-1b-7b-ep8")
    runs = []
    for i, seed in enumerate((1, 1, 2)):
        b = get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=0.02, seed=seed))
        runs.append(run_profile(w, b, tmp_path / f"r{i}", repeats=2).measurements()["time_us"].tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_plan_replayed_round_after_round_draws_fresh_noise(tmp_path):
    """Replaying the same settings in interleaved rounds (`search --validate`) measures them anew
    each round, as on hardware; without noise every round is the ground truth."""
    w = build_preset("phi-2-tp8-dp2")
    fp = run_profile(w, get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=0.02)), tmp_path / "r",
                     repeats=1).read_meta()["fingerprint"]
    vars_ = variables(w, knob_space_for("sim", fp))
    defaults = default_settings(vars_)
    noisy = validate(w, fp, {"default": defaults}, 3)
    low, high = noisy["spread_ms"]["default"]
    assert low < high
    exact = validate(w, {**fp, "noise": 0.0}, {"default": defaults}, 3)
    truth = SimCluster(CLUSTERS["h100-nvlink"], nodes=fp["nodes"]).iteration(w, defaults) * 1e3
    assert exact["spread_ms"]["default"] == [round(truth, 3)] * 2


@pytest.fixture(scope="module")
def llama_sim(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "run"
    r = cli("profile", "--backend", "sim", "--hardware", "h100-nvlink", "--noise", "0.02", "--workload", "llama3-8b-fsdp8",
            "--out", out, "--repeats", "3", check=True)
    assert "(simulated)" in r.stdout
    return out


def test_the_fit_reports_its_error_on_the_mechanistic_simulator(llama_sim):
    model = yaml.safe_load((llama_sim / "model.yaml").read_text())
    assert model["family"] == "lagom-gpu" and model["simulated"] is True
    assert all(v > 0 for v in model["accuracy"]["mape"].values())
    assert (llama_sim / "fit.png").stat().st_size > 0 and (llama_sim / "slowdown.png").stat().st_size > 0


def test_every_sim_artifact_says_simulated(llama_sim, tmp_path):
    meta = yaml.safe_load((llama_sim / "meta.yaml").read_text())
    assert meta["simulated"] is True and "simulated" in meta["fingerprint"]["device"]
    header, first = (llama_sim / "measurements.csv").read_text().splitlines()[:2]
    assert first.split(",")[header.split(",").index("simulated")] == "True"
    shown = cli("show", llama_sim, check=True).stdout
    assert "simulated" in shown
    assert "measured medians" not in shown and "medians by kind (simulated)" in shown  # was titled so, untagged
    for args in ((), ("--json",)):  # fit's tables and show's collectives as JSON said nothing of it
        assert "simulated" in cli("show", llama_sim, "--collectives", *args, check=True).stdout.lower()
    refit = tmp_path / "refit"
    shutil.copytree(llama_sim, refit)
    fitted = cli("fit", refit, check=True).stdout
    assert fitted.lower().count("simulated") >= 2, fitted  # the accuracy and ranking tables
    plan = tmp_path / "p.yaml"
    out = cli("search", llama_sim, "--out", plan, check=True).stdout
    assert "simulated" in out and yaml.safe_load(plan.read_text())["target"]["simulated"] is True


def test_unknown_hardware_is_a_user_error(tmp_path):
    r = cli("profile", "--backend", "sim", "--hardware", "b200", "--workload", "phi-2-fsdp8", "--out", tmp_path / "x")
    assert r.returncode == 2 and "unknown --hardware 'b200'" in r.stderr


def test_a_simulated_cluster_is_sized_to_the_workload_and_says_its_default(tmp_path):
    """phi-2-fsdp16 without --nodes was recorded as 8 ranks on one node, and its plan said world_size 8."""
    run = tmp_path / "run"
    # 2 repeats: the sizing is the point here, not the fit
    r = cli("profile", "--backend", "sim", "--hardware", "a40-nvlink", "--workload", "phi-2-fsdp16", "--out", run, "--repeats", 2,
            check=True)
    fp = yaml.safe_load((run / "meta.yaml").read_text())["fingerprint"]
    assert (fp["nodes"], fp["ranks"]) == (2, 16) and "hardware_note" not in fp and "note" not in r.stdout
    plan = tmp_path / "plan.yaml"
    cli("search", run, "--out", plan, check=True)
    assert yaml.safe_load(plan.read_text())["target"]["world_size"] == 16
    few = cli("profile", "--backend", "sim", "--workload", "phi-2-fsdp16", "--nodes", "1", "--out", tmp_path / "few")
    assert few.returncode == 2 and "needs 2 nodes" in few.stderr and not (tmp_path / "few" / "measurements.csv").exists()
    many = cli("profile", "--backend", "sim", "--workload", "phi-2-fsdp16", "--nodes", "1000000", "--out", tmp_path / "many")
    assert many.returncode == 2 and "--nodes 1000000 is too many" in many.stderr
    small = tmp_path / "small.yaml"  # two GEMMs and an all-reduce: 16 s to profile where cpu-demo's 17,728 points took 100
    small.write_text("name: small\ngroups:\n- name: layer\n  repeat: 4\n  compute:\n  - {name: g1, m: 4096, n: 4096, k: 4096, dtype: bf16}\n"
                     "  - {name: g2, m: 4096, n: 1024, k: 4096, dtype: bf16}\n  comm:\n  - {name: ar, op: all_reduce, nbytes: 100000000, ranks: 8}\n")
    default = cli("profile", "--backend", "sim", "--workload", small, "--out", tmp_path / "d", "--repeats", 1, check=True)
    assert "--hardware not given: the default h100-nvlink" in default.stdout
    assert "h100" in cli("profile", "--help", check=True).stdout.replace("\n", " ")


def test_a_profile_resumes_only_on_the_setup_it_was_started_on(tmp_path):
    """Resuming with another --hardware or --noise once relabelled an H200 profile's points as an
    A40's (the fingerprint was rewritten, the points kept)."""
    from lagom_tune.errors import UserError

    w, run = build_preset("cpu-demo"), tmp_path / "r"
    run_profile(w, get_backend("sim", BackendOptions(hardware="h200-nvlink", noise=0.02)), run, repeats=2)
    before = ((run / "meta.yaml").read_text(), (run / "measurements.csv").read_text())
    for hardware, noise, said in (("a40-pcie", 0.02, "cluster: h200-nvlink -> a40-pcie"), ("h200-nvlink", 0.05, "noise: 0.02 -> 0.05")):
        with pytest.raises(UserError, match=f"profiled on another setup \\({said}\\)"):
            run_profile(w, get_backend("sim", BackendOptions(hardware=hardware, noise=noise)), run, repeats=2)
    assert ((run / "meta.yaml").read_text(), (run / "measurements.csv").read_text()) == before
    run_profile(w, get_backend("sim", BackendOptions(hardware="h200-nvlink", noise=0.02)), run, repeats=2)  # the same setup resumes


def test_points_a_rank_cannot_hold_are_refused_before_the_folder_is_touched(tmp_path):
    """A micro-batch of 100000 once profiled on a simulated H100 as if 50,000 GiB of operands fit
    it; on gloo a GEMM too large for memory failed 14 points in."""
    from lagom_tune.backends.base import Point, check_memory, rank_bytes
    from lagom_tune.errors import UserError
    from lagom_tune.workload.spec import Gemm

    g = Gemm("g", 1 << 15, 1 << 15, 1 << 15, "bf16")  # A, B and C of 2 GiB each
    assert rank_bytes(Point("overlap", (), gemm=g, op="all_reduce", nbytes=1 << 30)) == 7 << 30
    check_memory([Point("gemm", (), gemm=g)], {"rank_memory_GiB": 6.0})
    with pytest.raises(UserError, match=r"the GEMM 1x32768x32768x32768:bf16 \(6.0 GiB\) needs 6.0 GiB on each rank, at least; a rank here has 5.9 GiB"):
        check_memory([Point("collective", (), op="all_reduce", nbytes=1), Point("gemm", (), gemm=g)], {"rank_memory_GiB": 5.9})
    # an overlapped point names both halves (a 100 TB all-gather was blamed on its GEMM)
    small = Gemm("s", 64, 64, 64, "bf16")
    with pytest.raises(UserError, match=r"the GEMM 1x64x64x64:bf16 \(0.0 GiB\) beside the all_gather of 1099511627776 bytes \(1024.0 GiB\)"):
        check_memory([Point("overlap", (), gemm=small, op="all_gather", nbytes=1 << 40)], {"rank_memory_GiB": 80.0})
    check_memory([Point("gemm", (), gemm=g)], {})  # a backend that does not say: nothing is checked
    r = cli("profile", "--workload", "llama3-8b-fsdp8", "--backend", "sim", "--hardware", "a40-pcie", "--mbs", "4000",
            "--out", tmp_path / "r")
    assert r.returncode == 2 and "GiB on each rank, at least; a rank here has 44.7 GiB" in r.stderr
    assert not (tmp_path / "r").exists()


def test_a_workload_with_nothing_to_overlap_is_refused_before_measuring(tmp_path):
    """A collective-only (or GEMM-only) workload was measured in full, then the fit failed, and
    search's hint (rerun `fit`) failed the same way."""
    w = tmp_path / "w.yaml"
    w.write_text("name: comm-only\ngroups:\n- name: g\n  comm: [{name: c, op: all_reduce, nbytes: 1048576, ranks: 8}]\n")
    r = cli("profile", "--backend", "sim", "--workload", w, "--out", tmp_path / "r")
    assert r.returncode == 2 and "workload comm-only has no GEMM: nothing overlaps" in r.stderr and not (tmp_path / "r").exists()


GEMM_1024 = "{name: g, m: 1024, n: 1024, k: 1024, dtype: bf16}"


@pytest.mark.parametrize("groups, said", [
    # a GEMM and a collective that never overlap were measured in full, then the fit raised
    # KeyError 'compute_alone_us', and rerunning the profile or `fit` did the same
    (f"- name: a\n  compute: [{GEMM_1024}]\n- name: b\n  comm: [{{name: c, op: all_reduce, nbytes: 8388608, ranks: 8}}]\n",
     "workload w runs no GEMM beside a collective"),
    # 16 ranks on one node of 8 simulated GPUs: the cluster was sized to two nodes, but the collective
    # was simulated over one node's NVLink (106.6 GB/s busbw against 37.0 over two nodes' InfiniBand)
    (f"- name: a\n  compute: [{GEMM_1024}]\n  comm: [{{name: c, op: all_reduce, nbytes: 8388608, ranks: 16, nodes: 1}}]\n",
     "collective c: 16 ranks cannot be on 1 node(s) of 8 simulated GPUs"),
])
def test_a_workload_the_simulator_cannot_play_is_refused_before_measuring(tmp_path, groups, said):
    """Two workloads an audit (2026-12-03) found profiled without a word."""
    w = tmp_path / "w.yaml"
    w.write_text(f"name: w\ngroups:\n{groups}")
    r = cli("profile", "--backend", "sim", "--workload", w, "--out", tmp_path / "r")
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()


def test_a_model_that_gives_no_usable_time_is_neither_written_nor_searched(tmp_path):
    """One collective's repeats edited to 1e-300 us: the fit wrote a link of inf GB/s over a good
    model.yaml, which search then refused; a GEMM's theta edited to 1e308, finite, passed the
    loader and search raised an internal error (an audit, 2026-12-03)."""
    import io
    import re

    import pandas as pd

    w, run = tmp_path / "w.yaml", tmp_path / "r"
    w.write_text(f"name: w\ngroups:\n- name: a\n  compute: [{GEMM_1024}]\n"
                 "  comm: [{name: c, op: all_reduce, nbytes: 8388608, ranks: 16, nodes: 2}]\n")
    cli("profile", "--backend", "sim", "--workload", w, "--out", run, "--repeats", "2", check=True)
    good, rows = (run / "model.yaml").read_text(), (run / "measurements.csv").read_text()
    df = pd.read_csv(run / "measurements.csv", low_memory=False)
    df.loc[df["point"] == df[df["kind"] == "collective"]["point"].iloc[0], "time_us"] = 1e-300
    df.to_csv(run / "measurements.csv", index=False)
    r = cli("fit", run)
    said = [line for line in r.stderr.splitlines() if not line.startswith("fit model")]  # the progress bar
    assert r.returncode == 2 and len(said) == 1 and "the fit gave no usable model" in said[0] and "finite number" in said[0], r.stderr
    assert (run / "model.yaml").read_text() == good
    # every GEMM point at 1e300 us was fitted (an audit, 2026-12-07): a time is at most a day ...
    df = pd.read_csv(io.StringIO(rows), low_memory=False)
    df.loc[df["kind"] == "gemm", "time_us"] = 1e300
    df.to_csv(run / "measurements.csv", index=False)
    r = cli("fit", run)
    assert r.returncode == 2 and "not a positive time of at most a day" in r.stderr, r.stderr
    assert (run / "model.yaml").read_text() == good
    (run / "measurements.csv").write_text(rows)  # the rows the model was fitted to again
    # since 2026-12-04 the loader bounds a GEMM's times (an hour), naming the field; before, search
    # said "the cost model gives no usable time" (theta) or "no usable iteration time" (alone_s,
    # each group's time finite, their sum not), which its evaluator still checks
    (run / "model.yaml").write_text(re.sub(r"\{theta: [0-9.e+-]+,", "{theta: 1.0e+308,", good))
    r = cli("search", run, "--out", tmp_path / "plan.yaml")
    assert r.returncode == 2 and re.search(r"model.yaml.params.gemms.\S+.theta: must be <= 3600", r.stderr), r.stderr
    assert "alone_s: " in good
    (run / "model.yaml").write_text(re.sub(r"alone_s: [0-9.e+-]+", "alone_s: 1.0e+308", good))
    r = cli("search", run, "--out", tmp_path / "plan.yaml")
    assert r.returncode == 2 and re.search(r"alone_s: must be <= 3600", r.stderr) and "bound_ms" not in r.stderr, r.stderr
    assert not (tmp_path / "plan.yaml").exists()
    # the evaluator's own check, for a model built in code: each group's time finite, their sum not
    from dataclasses import replace

    from lagom_tune.errors import UserError
    from lagom_tune.model.contention import load_model
    from lagom_tune.plan.schema import knob_space_for
    from lagom_tune.profile.store import open_run
    from lagom_tune.search.run import search

    folder = open_run(run)
    (run / "model.yaml").write_text(good)
    model, _ = load_model(run / "model.yaml")
    key = next(iter(model.gemms))
    model.gemms[key] = replace(model.gemms[key], alone=1e308)
    with pytest.raises(UserError, match="no usable iteration time for w"):
        search(folder.workload(), model, knob_space_for("sim", folder.read_meta()["fingerprint"]), "default")


def test_one_profile_at_a_time_measures_into_a_folder(tmp_path):
    """Two profiles started into one folder both measured (on 2 cores, each timing the other) and
    appended 62 of the demo's 76 points twice."""
    import os

    from lagom_tune.errors import UserError
    from lagom_tune.profile.store import RunFolder

    w, run = build_preset("cpu-demo"), tmp_path / "r"
    release = RunFolder(run).lock()  # what a profile running in another process holds
    with pytest.raises(UserError, match=f"r is being profiled by pid {os.getpid()} on .* since .*; wait for it to end, or choose a new --out"):
        run_profile(w, get_backend("sim", BackendOptions(hardware="h200-nvlink")), run, repeats=1)
    assert not (run / "measurements.csv").exists()
    release()
    done = run_profile(w, get_backend("sim", BackendOptions(hardware="h200-nvlink")), run, repeats=1)
    assert done.read_meta()["complete"]
    run_profile(w, get_backend("sim", BackendOptions(hardware="h200-nvlink")), run, repeats=1)  # released at the end: it resumes


def test_a_collective_size_that_is_anothers_eighth_is_measured_once():
    """Every collective is also measured at an eighth of its size: where that is another
    collective's size, the point was planned twice, and the profile refused its own CSV."""
    from lagom_tune.workload.spec import Collective, Gemm, OverlapGroup, Workload

    w = Workload("dup", (OverlapGroup("a", (Gemm("x", 2048, 4096, 4096, "bf16"),), (Collective("c1", "all_reduce", 8 << 20, ranks=8),)),
                         OverlapGroup("b", (Gemm("y", 4096, 4096, 4096, "bf16"),), (Collective("c2", "all_reduce", 1 << 20, ranks=8),))))
    keys = [p.key for p in get_backend("sim", BackendOptions()).plan_points(w)]
    assert len(keys) == len(set(keys)) and any("all_reduce:1048576:" in k for k in keys)


def test_output_cut_by_its_reader_ends_the_verb_quietly_with_its_own_code(llama_sim):
    """`| head -1` closed the pipe: click ended the verb with exit 1 and not a word (a profile or
    search had still written every file); the rest of the output now goes nowhere."""
    proc = subprocess.Popen([str(BIN / "lagom-tune"), "show", str(llama_sim), "--collectives", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.read(1) == b"["
    proc.stdout.close()  # the reader goes away long before the ~100 KB are written
    assert proc.wait(timeout=120) == 0 and proc.stderr.read() == b""
