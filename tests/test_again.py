"""Points measured a second time at a profile's end: the machine's drift between moments, beside a
model's held-out error, for every quantity (the pairs' own baselines cover only some GEMMs and
collectives: on gloo, one all-reduce of a demo profile; on the H200, 2 collectives)."""

import numpy as np
import pandas as pd
import pytest
import yaml

from lagom_tune.backends.base import BackendOptions, Point, get_backend
from lagom_tune.backends.nccl_sweep import batches, process_settings
from lagom_tune.errors import UserError
from lagom_tune.measurements import AGAIN, again_key, first_of
from lagom_tune.model.fit import fit_run, remeasured_noise
from lagom_tune.model.rows import AT_THE_END, again_rows, fitted_rows, point_medians, remeasured_pairs, remeasured_points
from lagom_tune.profile.campaign import AGAIN_PER_KIND, again_points, run_profile
from lagom_tune.profile.store import RunFolder
from lagom_tune.workload.spec import Collective, Gemm, OverlapGroup, Workload

from conftest import cli

G = Gemm("x", 1024, 1024, 1024, "bf16")
ONE = Workload("one", (OverlapGroup("a", (G, Gemm("y", 2048, 1024, 1024, "bf16")),
                                    (Collective("c", "all_gather", 8 << 20, ranks=8),)),))


def _sim(noise: float):
    return get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=noise))


def test_a_key_measured_again_names_its_first_point_and_its_rows_are_of_their_own_kind():
    p = Point("overlap", (("threads", 2),), gemm=G, op="all_reduce", nbytes=1 << 20, ranks=2)
    again = again_points([p])[0]
    assert again.again and again.kind == "overlap" and again.row_kind == AGAIN and p.row_kind == "overlap"
    assert again.key == again_key(p.key) == f"again|{p.key}" and first_of(again.key) == p.key
    assert first_of(p.key) is None and first_of("again|") is None and first_of("gemm|again") is None


def test_a_few_points_of_each_fitted_kind_are_chosen_spread_from_the_start():
    pts = ([Point("gemm", (("threads", t),), gemm=G) for t in range(1, 10)]
           + [Point("collective", (("chunk_bytes", c),), op="all_reduce", nbytes=1 << 20, ranks=2) for c in (0, 1024)]
           + [Point("default", (("nodes", 1),), op="all_reduce", nbytes=1 << 20, ranks=2)])
    chosen = again_points(pts)
    assert [p.key for p in chosen] == [again_key(pts[i].key) for i in (0, 3, 6, 9, 10)]  # no overlap points: none of them
    assert all(p.kind != "default" for p in chosen)  # collectives at the backend's own choice are never fitted
    assert again_points(pts, per_kind=0) == [] and AGAIN_PER_KIND == 3


def test_the_nccl_backend_measures_them_in_workers_of_their_own_after_every_other():
    """In the same worker right after the first measurement a second one would show no drift."""
    pts = [Point("collective", (("algo", "ring"), ("proto", "simple"), ("channels", ch)), op="all_gather", nbytes=1 << 20, ranks=8)
           for ch in (2, 4)] + [Point("gemm", (), gemm=G)]
    todo = pts + again_points(pts)
    groups = batches(todo)
    assert [[p.again for p in b.points] for b in groups] == [[False, False], [False], [True], [True, True]]
    assert [b.process for b in groups[2:]] == [(), process_settings(pts[0])]


def test_a_simulated_profile_measures_them_last_and_the_fit_reads_only_their_drift(tmp_path):
    """Without noise the simulator gives the same time twice: every quantity's remeasured gap is 0;
    with 2% noise drawn afresh it is about the noise. The again rows are fitted to nothing."""
    run = run_profile(ONE, _sim(0.0), tmp_path / "exact", repeats=2)
    df = run.measurements()
    again = again_rows(df)
    chosen = {k: min(AGAIN_PER_KIND, n) for k, n in fitted_rows(df).groupby("kind")["point"].nunique().items()}
    assert chosen["gemm"] == 2 and list(dict.fromkeys(df["kind"]))[-1] == AGAIN and again["point"].nunique() == sum(chosen.values())
    assert fitted_rows(df)["kind"].isin(("gemm", "collective", "overlap")).all()
    meta = run.read_meta()
    assert meta["complete"] and meta["points_total"] == df["point"].nunique()
    fit_run(run)
    acc = yaml.safe_load(run.model_path.read_text())["accuracy"]
    quantities = {"gemm", "collective", "overlap_window", "overlap_compute", "overlap_comm"}
    assert set(acc["remeasured"]) == quantities and all(e["gap"] == 0.0 for e in acc["remeasured"].values()), acc["remeasured"]
    assert acc["points"] == {k: n for k, n in fitted_rows(df).groupby("kind")["point"].nunique().items()}

    noisy = run_profile(ONE, _sim(0.02), tmp_path / "noisy", repeats=2)
    pts = point_medians(fitted_rows(noisy.measurements()))
    gaps = remeasured_noise(pts, None, point_medians(again_rows(noisy.measurements())))
    assert set(gaps) == quantities and all(0 < e["gap"] < 0.05 for e in gaps.values()), gaps


def test_the_gap_of_a_point_measured_again_is_found_for_each_of_its_quantities():
    first = pd.DataFrame([
        dict(point="gemm|g", kind="gemm", gemm="g", time_us=100.0),
        dict(point="overlap|g|c", kind="overlap", gemm="g", time_us=300.0, comm_us=200.0, window_us=310.0,
             compute_alone_us=280.0, comm_alone_us=190.0, n_compute=1, baseline=None),  # alone times not paired: not read
    ])
    later = pd.DataFrame([
        dict(point="again|gemm|g", kind=AGAIN, time_us=125.0),
        dict(point="again|overlap|g|c", kind=AGAIN, time_us=300.0, comm_us=220.0, window_us=310.0),
        dict(point="again|gemm|gone", kind=AGAIN, time_us=1.0),  # its first point is not in the profile: nothing to compare
    ])
    pairs = remeasured_pairs(first, None, later)
    assert (pairs["when"] == AT_THE_END).all()
    got = {q: (f, a) for q, f, a in pairs[["quantity", "first_us", "again_us"]].itertuples(index=False)}
    assert got == {"gemm": (100.0, 125.0), "overlap_compute": (300.0, 300.0), "overlap_comm": (200.0, 220.0),
                   "overlap_window": (310.0, 310.0)}
    gaps = remeasured_noise(first, None, later)
    assert gaps["gemm"] == {"gap": round(25 / 225, 4), "median_ratio": 1.25, "pairs": 1} and gaps["overlap_window"]["gap"] == 0.0


def test_an_interrupted_profile_resumes_inside_the_points_measured_again(tmp_path):
    run = run_profile(ONE, _sim(0.02), tmp_path / "r", repeats=2)
    whole = run.measurements()
    kept = whole[~whole["point"].isin(again_rows(whole)["point"].unique()[1:])]  # stopped after the first of them
    kept.to_csv(run.csv_path, index=False)
    meta = run.read_meta()
    run.write_meta({**meta, "complete": False, "points_done": int(kept["point"].nunique())})
    measured = []
    done = run_profile(ONE, _sim(0.02), run.path, repeats=2, progress=lambda n, total, what: measured.append(what)).measurements()
    left = again_rows(whole)["point"].nunique() - 1
    assert measured[1:] == [AGAIN] * left  # after the first call (resuming), the points left and nothing else
    assert len(done) == len(whole) and set(done["point"]) == set(whole["point"]) and run.read_meta()["complete"]


def test_an_again_row_is_checked_as_its_first_points_kind(tmp_path):
    run = run_profile(ONE, _sim(0.0), tmp_path / "r", repeats=2)
    df = run.measurements()
    over = df["point"].str.startswith("again|overlap|")
    df.assign(window_us=np.where(over, np.nan, df["window_us"])).to_csv(run.csv_path, index=False)
    with pytest.raises(UserError, match=r"overlapped point again\|overlap\|.* has no window_us"):
        RunFolder(run.path).read()
    one = df["point"] == df.loc[over, "point"].iloc[0]
    df.assign(m=np.where(one, 4096, df["m"])).to_csv(run.csv_path, index=False)
    with pytest.raises(UserError, match=r"point again\|overlap\|.*: m is 4096(\.0)?, but its shape"):
        RunFolder(run.path).read()


def test_show_lists_points_measured_again_with_when(tmp_path):
    run = run_profile(ONE, _sim(0.02), tmp_path / "r", repeats=2)
    table = remeasured_points(run.measurements())
    at_end = table[table["when"] == AT_THE_END]
    assert len(at_end) == 2 + 3 + 3 * 3, at_end  # both GEMMs, three collectives and overlaps (each of three quantities)
    shown = cli("show", run.path, "--remeasured", check=True).stdout
    assert "points measured again" in shown and "profile's end" in shown
