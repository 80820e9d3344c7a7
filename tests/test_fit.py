import shutil
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import yaml

from lagom_tune.errors import UserError
from lagom_tune.model.contention import CpuPairwiseModel, Linear, model_from_dict
from lagom_tune.model.contention import fit_linear
from lagom_tune.model.fit import HELDOUT_COLUMNS, fit_model, fit_run, fold_assignment, predict_point, repeat_noise
from lagom_tune.model.rows import point_medians
from lagom_tune.profile.store import open_run
from lagom_tune.render import percent
from lagom_tune.yaml_io import read_yaml
from lagom_tune.timeline import simulate
from lagom_tune.workload.spec import Collective, Gemm

from conftest import ROOT, cli

STANDIN = ROOT / "tests" / "data"

TRUE = CpuPairwiseModel(
    compute={1: Linear(20.0, (("per_gflop", 11000.0), ("per_mb", 50.0), ("per_m_outputs", 2000.0))),
             2: Linear(60.0, (("per_gflop", 7000.0), ("per_mb", 80.0), ("per_m_outputs", 1500.0)))},
    comm={"all_reduce": Linear(150.0, (("per_mb", 700.0),))},
    compute_slow={1: 1.4, 2: 1.8},
    comm_slow={1: 2.0, 2: 3.0},
)
SHAPES = [Gemm("g", m, n, k) for m, n, k in [(64, 64, 64), (128, 256, 64), (256, 256, 256), (512, 128, 256),
                                              (512, 512, 512), (1024, 256, 512), (256, 1024, 128), (2048, 512, 256)]]


def synthetic(noise: float, seed: int = 0) -> pd.DataFrame:
    """A profile as the gloo backend would record it, generated from TRUE with multiplicative noise."""
    rng = np.random.default_rng(seed)
    jitter = lambda: 1 + noise * rng.standard_normal()
    rows = []
    for t in (1, 2):
        for g in SHAPES:
            for r in range(5):
                rows.append(dict(point=f"gemm|{g.shape_key}|{t}", kind="gemm", repeat=r, threads=t, gemm=g.shape_key, m=g.m, n=g.n, k=g.k,
                                 batch=1, dtype="fp32", time_us=TRUE.compute_time(g, {"threads": t}) * 1e6 * jitter()))
    for nbytes in [1 << p for p in range(14, 26)]:
        c = Collective("c", "all_reduce", nbytes)
        for r in range(5):
            rows.append(dict(point=f"coll|{nbytes}", kind="collective", repeat=r, op="all_reduce", nbytes=nbytes,
                             time_us=TRUE.comm_time(c, {}) * 1e6 * jitter()))
    for t in (1, 2):
        for g in SHAPES[2::2]:
            for nbytes in (1 << 20, 1 << 22, 1 << 24):
                c = Collective("c", "all_reduce", nbytes)
                s = {"threads": t}
                y, x = TRUE.compute_time(g, s), TRUE.comm_time(c, s)
                n = max(1, round(x / y))
                tl = simulate([g] * n, [y] * n, [c], [x], lambda a, b: (TRUE.compute_slow[t], TRUE.comm_slow[t]))
                ty = max(sp.end for sp in tl.spans if sp.stream == "compute")
                tc = max(sp.end for sp in tl.spans if sp.stream == "comm")
                for r in range(5):
                    j = jitter()
                    rows.append(dict(point=f"ov|{g.shape_key}|{nbytes}|{t}", kind="overlap", repeat=r, threads=t, gemm=g.shape_key, m=g.m, n=g.n,
                                     k=g.k, batch=1, dtype="fp32", op="all_reduce", nbytes=nbytes, n_compute=n,
                                     time_us=ty * 1e6 * j, comm_us=tc * 1e6 * j, window_us=max(ty, tc) * 1e6 * j,
                                     compute_alone_us=y * n * 1e6, comm_alone_us=x * 1e6))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("nbytes", [1 << 20, 1 << 30])
def test_an_overlap_point_predicts_its_gemms_back_to_back(nbytes):
    """predict_point plays an overlap point's n GEMMs as one op of n times the time: the ends are
    those of the GEMM-by-GEMM timeline (tens of thousands of GEMMs beside a 1 GiB all-reduce, the
    case that made a fit of a 64 GiB all-reduce take minutes per fold)."""
    g, t = SHAPES[2], 2
    c = Collective("c", "all_reduce", nbytes)
    y, x = TRUE.compute_time(g, {"threads": t}), TRUE.comm_time(c, {"threads": t})
    n = max(1, round(x / y))
    tl = simulate([g] * n, [y] * n, [c], [x], lambda a, b: (TRUE.compute_slow[t], TRUE.comm_slow[t]))
    row = pd.Series(dict(kind="overlap", threads=t, gemm=g.shape_key, m=g.m, n=g.n, k=g.k, batch=1, dtype="fp32", op="all_reduce",
                         nbytes=nbytes, n_compute=n))
    got = predict_point(TRUE, row)
    assert got["time_us"] == pytest.approx(max(sp.end for sp in tl.spans if sp.stream == "compute") * 1e6, rel=1e-9)
    assert got["comm_us"] == pytest.approx(max(sp.end for sp in tl.spans if sp.stream == "comm") * 1e6, rel=1e-9)
    assert got["window_us"] == pytest.approx(tl.makespan * 1e6, rel=1e-9)
    assert n > (1000 if nbytes > 1 << 20 else 1)


def test_fit_linear_recovers_coefficients():
    rng = np.random.default_rng(1)
    x = rng.uniform(1, 100, size=(40, 2))
    y = 5 + 3 * x[:, 0] + 0.5 * x[:, 1]
    lin = fit_linear(x, ("a", "b"), y)
    assert lin.intercept_us == pytest.approx(5, rel=1e-6)
    assert dict(lin.coefs) == pytest.approx({"a": 3, "b": 0.5}, rel=1e-6)


def test_fit_linear_never_keeps_a_negative_slope():
    x = np.arange(1, 11, dtype=float)[:, None].repeat(2, 1)
    x[:, 1] = x[:, 1][::-1]
    lin = fit_linear(x, ("a", "b"), 10 + 2 * x[:, 0])
    assert all(c >= 0 for _, c in lin.coefs)


def test_fit_recovers_a_known_model_exactly_without_noise():
    result = fit_model(synthetic(noise=0.0))
    m = result.model
    assert m.compute_slow == pytest.approx(TRUE.compute_slow, rel=1e-3)
    assert m.comm_slow == pytest.approx(TRUE.comm_slow, rel=1e-3)
    assert max(result.mape.values()) < 0.01


def test_held_out_error_tracks_the_noise():
    result = fit_model(synthetic(noise=0.03, seed=3))
    assert set(result.mape) >= {"gemm", "collective", "overlap_window"}
    assert result.mape["overlap_window"] < 0.06
    assert result.mape["gemm"] < 0.06
    noisier = fit_model(synthetic(noise=0.15, seed=3))
    assert noisier.mape["gemm"] > result.mape["gemm"]


def test_every_point_is_scored_or_the_fit_says_which_were_not():
    full = fit_model(synthetic(noise=0.03, seed=3))
    points = synthetic(noise=0.03, seed=3).groupby("kind")["point"].nunique()
    assert full.scored["gemm"] == points["gemm"] and full.scored["overlap_window"] == points["overlap"], full.scored
    assert not any("held-out" in w for w in full.warnings)
    # one GEMM point: the fold holding it out has none to fit on (an auditor's gloo profile)
    df = synthetic(noise=0.03, seed=3)
    one = df[(df["kind"] != "gemm") | (df["point"] == df.loc[df["kind"] == "gemm", "point"].iloc[0])]
    result = fit_model(one)
    assert "gemm" not in result.mape and sum(result.scored.values()) < sum(full.scored.values())
    assert any("could not be fitted" in w and "in no held-out figure" in w for w in result.warnings), result.warnings


def test_the_held_out_predictions_are_every_figure_behind_the_mape():
    """``FitResult.heldout`` holds each prediction a MAPE averages: one row per scored point and
    quantity, its error the relative gap, the mean per quantity the MAPE model.yaml records."""
    result = fit_model(synthetic(noise=0.05, seed=2))
    held = result.heldout
    assert list(held.columns) == list(HELDOUT_COLUMNS)
    by = held.groupby("quantity")
    assert by.size().to_dict() == result.scored
    assert {q: round(float(np.mean(e.to_numpy())), 4) for q, e in by["error"]} == result.mape
    gap = (held["predicted_us"] - held["measured_us"]).abs() / held["measured_us"]
    assert np.allclose(held["error"], gap) and set(held["point"]) == set(synthetic(noise=0.05, seed=2)["point"])
    assert held.groupby("point").size().max() == 3  # an overlapped point: its window and each stream's end


def test_a_points_fold_depends_on_its_own_kind_alone():
    """Adding collective points leaves every GEMM point in its fold (a split drawn from one
    generator across kinds moved them all, and a held-out figure with them)."""
    df = synthetic(noise=0.0)
    pts = point_medians(df)
    fewer = pts[~pts["point"].isin(pts.loc[pts["kind"] == "collective", "point"].iloc[:3])]
    folds = fold_assignment(pts, 5)
    others = fewer.index[fewer["kind"] != "collective"]
    assert (fold_assignment(fewer, 5)[others] == folds[others]).all()
    assert sorted(folds[pts["kind"] == "gemm"].value_counts()) == [3, 3, 3, 3, 4]  # 16 GEMM points dealt round-robin


def test_model_yaml_round_trip():
    result = fit_model(synthetic(noise=0.0))
    d = result.to_dict(rows=synthetic(noise=0.0), simulated=False)
    back = model_from_dict(d)
    g = SHAPES[3]
    assert back.compute_time(g, {"threads": 2}) == pytest.approx(result.model.compute_time(g, {"threads": 2}))
    assert d["accuracy"]["method"].startswith("5-fold")


def test_measured_shapes_are_predicted_by_their_measurement():
    """A line through noisy medians must not override what was measured for that very shape."""
    df = synthetic(noise=0.0)
    slow = df["kind"].eq("gemm") & df["threads"].eq(2) & df["m"].eq(512) & df["n"].eq(512)
    df.loc[slow, "time_us"] *= 5  # an outlier shape: oversubscribed threads
    model = fit_model(df).model
    g = next(g for g in SHAPES if (g.m, g.n) == (512, 512))
    measured = df.loc[slow, "time_us"].median() / 1e6
    assert model.compute_time(g, {"threads": 2}) == pytest.approx(measured)
    back = model_from_dict(fit_model(df).to_dict(rows=df, simulated=False))
    assert back.compute_time(g, {"threads": 2}) == pytest.approx(measured)


def test_a_communication_fit_that_runs_off_keeps_finite_parameters():
    """A CPU stand-in profile whose ring/Simple timings sent the L2-warm curve's Adam steps to NaN
    (tests/data/standin-2026-11-30-diverging-comm): that group ends at its best finite parameters."""
    from lagom_tune.model.gpu_fit import alone_comm_rows, fit_comm
    from lagom_tune.model.rows import consistent_baselines, point_medians

    df = pd.read_csv(STANDIN / "standin-2026-11-30-diverging-comm" / "measurements.csv")
    comm = fit_comm(alone_comm_rows(consistent_baselines(point_medians(df))), warm=True)
    numbers = [[v for v in vars(c).values() if isinstance(v, float)] for c in comm.values()]
    assert all(np.isfinite(n).all() for n in numbers), comm


@pytest.mark.parametrize("name", ["standin-2026-11-30-diverging-comm", "standin-2026-11-30-negative-drag"])
def test_the_gpu_fit_of_a_noisy_standin_profile_completes(name):
    """Two CPU stand-in profiles (tests/data/<name>/README.md) whose fits failed: a NaN
    communication curve (ZeroDivisionError), and a fold predicting a collective -10x slower beside
    a GEMM (the timeline refused the negative time). Every fold now predicts, every error is finite."""
    import yaml

    df = pd.read_csv(STANDIN / name / "measurements.csv")
    fp = yaml.safe_load((STANDIN / name / "meta.yaml").read_text())["fingerprint"]
    result = fit_model(df, device={"sms": fp["sms"], "hbm_GBps": fp["hbm_GBps"]})
    assert all(np.isfinite(v) for v in result.mape.values()), result.mape


def test_a_timeline_refuses_a_non_finite_time_instead_of_spinning():
    """A NaN slowdown (a degenerate fit) once stalled ``simulate`` for ever; now it is an error."""
    import signal

    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("simulate spun")))
    signal.alarm(10)
    try:
        with pytest.raises(ValueError, match="positive numbers"):
            simulate([Gemm("g", 64, 64, 64)], [1e-3], [Collective("c", "all_reduce", 1 << 20)], [1e-3],
                     lambda g, c: (float("nan"), 1.0))
        with pytest.raises(ValueError, match="positive numbers"):  # a NaN collective time (link_GBps: 0) spun too
            simulate([Gemm("g", 64, 64, 64)], [1e-3], [Collective("c", "all_reduce", 1 << 20)], [float("nan")],
                     lambda g, c: (1.0, 1.0))
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("curve, name", [("exp-pipeline", "link_GBps"), ("steps", "per_channel_GBps"), ("steps", "saturation"),
                                         ("steps-depth", "threads_knee"), ("steps-rolloff", "rolloff_GBps")])
def test_a_communication_fit_refuses_a_zero_it_divides_by(curve, name):
    """``link_GBps: 0`` in a hand-edited model.yaml made every time NaN and the search spin."""
    from lagom_tune.model.gpu import CURVE_PARAMS, CommFit

    d = {"curve": curve, **{n: 1.0 for n in CURVE_PARAMS[curve]}}
    CommFit.from_dict(d)
    with pytest.raises(UserError, match=f"comm.{name}: must be > 0, got 0"):
        CommFit.from_dict({**d, name: 0})


def test_a_sharp_fitted_knee_predicts_without_overflow():
    """A standin profile once fitted a thread knee so sharp that 8.0 ** 2000 overflowed during the
    k-fold predictions (OverflowError, an internal error in CI); the soft minimum is computed in
    logs, and below the knee a channel copies at its rate times threads / knee."""
    import numpy as np

    from lagom_tune.model.gpu import CURVE_STEPS, CommFit, step_bandwidth

    f = CommFit(latency_us=10, link_GBps=300, per_channel_GBps=20, threads_exp=2000.0, pipeline_bytes=0.0, curve=CURVE_STEPS,
                threads_knee=512, saturation=3000.0, handshake_us=0.0)
    assert f.bandwidth(8, 64, 4 << 20) == pytest.approx(8 * 20e9 * 64 / 512)
    assert f.bandwidth(64, 512, 4 << 20) == pytest.approx(300e9, rel=1e-3)  # 64 x 20 GB/s offered, the link carries 300
    # where the direct form does not overflow, the same number
    link, per, knee, sharp, sat, hand, ch, th, bs = 300, 20, 256, 4.0, 2.0, 1.0, 8, 128, 4 << 20
    rate = per * 1e9 / (1 + (knee / th) ** sharp) ** (1 / sharp)
    carried = ch * rate / (1 + (ch * rate / (link * 1e9)) ** sat) ** (1 / sat)
    assert step_bandwidth(np, link, per, knee, sharp, sat, hand, ch, th, bs) == pytest.approx(1 / (1 / carried + hand * 1e-6 / (ch * bs / 8)))
    # steps-rolloff: the channels' sum rolls off (offered / (1 + offered / R)) before it meets the link
    rolled = ch * rate / (1 + ch * rate / 400e9)
    carried = rolled / (1 + (rolled / (link * 1e9)) ** sat) ** (1 / sat)
    assert step_bandwidth(np, link, per, knee, sharp, sat, hand, ch, th, bs, 400) == \
        pytest.approx(1 / (1 / carried + hand * 1e-6 / (ch * bs / 8)))


def test_a_cpu_model_refuses_an_op_it_has_no_fit_for():
    """gloo's fit holds a curve per op it measured (all_reduce); an all-gather's time used to come
    from the all-reduce curve, a guess the search then trusted."""
    assert TRUE.comm_time(Collective("ar", "all_reduce", 1 << 20), {}) > 0
    with pytest.raises(UserError, match=r"no fit for all_gather \(fitted: all_reduce\)"):
        TRUE.comm_time(Collective("ag", "all_gather", 1 << 20), {})


def test_a_gpu_model_refuses_a_device_of_no_sms():
    """``device: {sms: 0}`` in model.yaml was shown, then crashed search (ZeroDivisionError)."""
    from lagom_tune.model.contention import model_from_dict

    d = yaml.safe_load((ROOT / "bench" / "results" / "gpu_check-mpt-7b-tp8-dp1-run" / "model.yaml").read_text())
    model_from_dict(d)
    d["device"]["sms"] = 0
    with pytest.raises(UserError, match="device.sms: must be >= 1"):
        model_from_dict(d)


@pytest.mark.parametrize("edit, said", [
    (lambda d: d.update(foo=1), r"model.foo: unknown field"),
    (lambda d: d.update(acuracy=d.pop("accuracy")), r"did you mean 'accuracy'"),  # a misspelt section read as absent
    (lambda d: d["params"]["gemms"].update({"bogus:": {"theta": 1e-6, "dbytes": 1.0}}), r"'bogus:' is not a GEMM shape"),
    # shown, then search crashed on NaN times (a log of 0, a bandwidth overflowing to inf)
    (lambda d: d["params"]["comm"]["probe|copy|copy|1"].update(threads_knee=0), r"threads_knee: must be > 0, got 0"),
    (lambda d: d["params"]["comm"]["probe|copy|copy|1"].update(link_GBps=1e300), r"link_GBps: must be <= 1000000.0"),
    # search wrote a plan from it (an audit, 2026-12-04)
    (lambda d: next(iter(d["params"]["gemms"].values())).update(theta=1e300), r"theta: must be <= 3600"),
])
def test_a_gpu_model_refuses_unknown_sections_and_shapes(edit, said):
    """Each was accepted by show and search."""
    from lagom_tune.model.contention import model_from_dict

    d = yaml.safe_load((ROOT / "bench" / "results" / "gpu_check-mpt-7b-tp8-dp1-run" / "model.yaml").read_text())
    edit(d)
    with pytest.raises(UserError, match=said):
        model_from_dict(d)


def test_a_model_of_zero_slowdowns_or_zero_time_gemms_is_refused():
    """Each was shown, then ended search in a ZeroDivisionError."""
    from lagom_tune.model.contention import model_from_dict

    cpu = yaml.safe_load((ROOT / "tests" / "data" / "cpu-demo-model.yaml").read_text())
    model_from_dict(cpu)
    cpu["params"]["compute_slowdown"]["threads=1"] = 0.0
    with pytest.raises(UserError, match=r"compute_slowdown.threads=1: must be >= 1e-09"):
        model_from_dict(cpu)
    gpu = yaml.safe_load((ROOT / "bench" / "results" / "gpu_check-mpt-7b-tp8-dp1-run" / "model.yaml").read_text())
    key = next(iter(gpu["params"]["gemms"]))
    gpu["params"]["gemms"][key].update(theta=0.0, dbytes=0.0, alone_s=0.0)
    with pytest.raises(UserError, match="theta, dbytes and alone_s are all 0"):
        model_from_dict(gpu)


def test_the_mape_a_fit_prints_is_the_one_model_yaml_records(tiny_run, tmp_path):
    """One rounding: `profile` printed a gloo fit's 105.6% from the held-out mean while `show` printed
    105.7% from model.yaml's four decimals of it (an audit, 2026-12-04)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    result = fit_run(open_run(run))
    assert result.mape == yaml.safe_load((run / "model.yaml").read_text())["accuracy"]["mape"]


def test_profile_prints_the_warnings_show_prints(tmp_path):
    """A workload of one GEMM shape: a fold holding every GEMM point cannot be fitted, and its points
    are in no held-out figure; `fit` and `show` said so, `profile` printed the MAPE alone (an audit,
    2026-12-04)."""
    wl = tmp_path / "one.yaml"
    wl.write_text("name: one\ngroups:\n- name: layer\n  repeat: 4\n  compute:\n  - {name: g1, m: 4096, n: 4096, k: 4096, dtype: bf16}\n"
                  "  comm:\n  - {name: ag, op: all_gather, nbytes: 100000000, group: dp_shard, ranks: 8}\n")
    r = cli("profile", "--backend", "sim", "--workload", wl, "--out", tmp_path / "run", check=True)
    said = " ".join(r.stdout.split())
    assert "warning fold" in said and "could not be fitted from the other folds' points" in said, said
    assert "in no held-out figure" in " ".join(cli("show", tmp_path / "run", check=True).stdout.split())
    # each held-out MAPE beside its repeat noise, the floor under it (`show` prints both; profile printed the MAPE alone)
    acc = read_yaml(tmp_path / "run" / "model.yaml")["accuracy"]
    assert "model's held-out MAPE (its repeat noise; remeasured: its gap when measured again): " in said and acc["noise"], said
    assert all(f"{k} {percent(acc['mape'][k])} ({percent(x)}" in said for k, x in acc["noise"].items()), (acc, said)
    # and, where its pairs timed it again, the gap of the second measurement (the simulator draws it afresh: no drift)
    assert acc["remeasured"]["collective"]["gap"] < 0.05 and f"; remeasured {percent(acc['remeasured']['collective']['gap'])})" in said, said


def test_a_mape_is_shown_beside_its_noise_where_known():
    from lagom_tune.render import mape_text

    assert mape_text({"collective": 0.337, "gemm": 0.108}, {"gemm": 0.022}) == "collective 33.7%, gemm 10.8% (2.2%)"
    assert mape_text({"gemm": 0.108}) == "gemm 10.8%"


def test_a_short_collective_still_takes_its_pipeline_steps():
    """``steps-depth``: a ring all-gather over 8 ranks takes at least 7 handshaked steps however few
    bytes a channel carries; a long one fills more steps than that and is timed as by ``steps``,
    which files written before 2026-12-06 still use (their predictions unchanged)."""
    from lagom_tune.model.gpu import CURVE_DEPTH, CURVE_STEPS, CommFit

    steps = CommFit(latency_us=5, link_GBps=300, per_channel_GBps=20, threads_exp=8.0, pipeline_bytes=0.0, curve=CURVE_STEPS,
                    threads_knee=256, saturation=2.0, handshake_us=3.0)
    depth = CommFit(**{**vars(steps), "curve": CURVE_DEPTH})
    step = 16 * (4 << 20) / 8  # bus bytes one round of 16 channels' steps moves
    tiny, large = step / 100, step * 100
    assert depth.seconds(tiny, tiny, 16, 512, 4 << 20, depth=7) - steps.seconds(tiny, tiny, 16, 512, 4 << 20, depth=7) == \
        pytest.approx(3e-6 * (7 - 0.01))
    assert depth.seconds(large, large, 16, 512, 4 << 20, depth=7) == steps.seconds(large, large, 16, 512, 4 << 20)
    assert CommFit.from_dict(depth.to_dict()) == depth


def test_the_communication_fit_finds_the_launch_and_the_handshake_of_a_simulated_all_to_all():
    """8 simulated H100s' all-to-alls over the knob grid, without noise: a 5 us launch and a 3.5 us
    handshake per step (sim_comm). Charging the 7 steps a short all-to-all takes as latency, the
    ``steps`` curve fitted a 26 us launch, and NCCL's default all-to-all of 96 MiB came out 5-8%
    slow; the pipeline's depth gives each its own term."""
    from lagom_tune.backends.nccl_knobs import BUFFSIZES, CHANNELS, THREADS
    from lagom_tune.backends.sim import SimCluster
    from lagom_tune.backends.sim_clusters import CLUSTERS
    from lagom_tune.model.gpu_fit import fit_comm

    sim = SimCluster(CLUSTERS["h100-nvlink"])
    rows = []
    for nbytes in (12 << 20, 96 << 20):
        for ch in CHANNELS:
            for th in THREADS:
                for b in BUFFSIZES:
                    s = {"algo": "ring", "proto": "simple", "channels": ch, "threads": th, "buffsize": b}
                    rows.append({"group": "all_to_all|ring|simple|1", "bus_bytes": nbytes * 7 / 8, "nbytes": nbytes, "channels": ch,
                                 "threads": th, "buffsize": b, "depth": 7.0, "seconds": sim.comm_time("all_to_all", nbytes, 8, 1, s)})
    df = pd.DataFrame(rows)
    fit = fit_comm(df, warm=False)["all_to_all|ring|simple|1"]
    assert fit.latency_us == pytest.approx(5.0, rel=0.3) and fit.handshake_us == pytest.approx(3.5, rel=0.15)
    errors = [abs(fit.seconds(r.bus_bytes, r.nbytes, r.channels, r.threads, r.buffsize, depth=7) / r.seconds - 1) for r in df.itertuples()]
    assert np.mean(errors) < 0.015, np.mean(errors)
    # the switch's roll-off (fabric 800 GB/s) before the link's 450: one soft minimum missed by 4-6% at 16-24 channels
    assert fit.rolloff_GBps == pytest.approx(CLUSTERS["h100-nvlink"].fabric / 1e9, rel=0.2)


def test_the_huber_loss_is_the_textbook_one_and_leaves_its_input_alone():
    """The contention grid's loss is computed in place (on arrays of its own): squared up to
    HUBER_DELTA, linear beyond, either sign, the errors it was given untouched."""
    from lagom_tune.model.gpu import HUBER_DELTA
    from lagom_tune.model.gpu_fit import _huber

    r = np.random.default_rng(0).normal(0, 3 * HUBER_DELTA, size=(7, 50))
    before = r.copy()
    a = np.abs(r)
    expected = np.where(a <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))
    assert np.allclose(_huber(r), expected, rtol=1e-12, atol=0) and (r == before).all()
    assert (a > HUBER_DELTA).any() and (a <= HUBER_DELTA).any()  # both branches drawn


def test_repeat_noise_is_the_error_of_a_points_median_and_ignores_drift_between_points():
    """The floor under a held-out MAPE: how far a point's median of repeats lies from its true time.
    Here the truth is known: 3000 points of 7 repeats with 5% log-normal noise; a drift that scales
    whole points (another job on the machine) does not move it."""
    rng = np.random.default_rng(0)
    true = rng.uniform(10, 1000, 3000)
    times = true[:, None] * np.exp(0.05 * rng.standard_normal((len(true), 7)))
    rows = pd.DataFrame({"point": np.repeat(np.arange(len(true)).astype(str), 7), "kind": "gemm",
                         "repeat": np.tile(np.arange(7), len(true)), "time_us": times.ravel()})
    medians = np.median(times, axis=1)
    actual = float(np.mean(np.abs(medians - true) / medians))
    noise = repeat_noise(rows)
    assert set(noise) == {"gemm"} and noise["gemm"] == pytest.approx(actual, rel=0.1), (noise, actual)
    drifted = rows.assign(time_us=rows["time_us"] * np.repeat(rng.uniform(0.5, 2.0, len(true)), 7))
    assert repeat_noise(drifted)["gemm"] == pytest.approx(noise["gemm"], abs=1e-4)
    assert repeat_noise(rows.assign(time_us=np.repeat(true, 7)))["gemm"] == 0.0
    assert repeat_noise(rows[rows["repeat"] == 0]) == {}  # one repeat a point: nothing to tell noise by


def test_model_yaml_records_each_quantitys_repeat_noise_beside_its_mape():
    result = fit_model(synthetic(noise=0.03, seed=3))
    assert set(result.noise) == set(result.mape)
    assert all(0 < result.noise[k] < 0.03 for k in result.noise), result.noise
    clean = fit_model(synthetic(noise=0.0))
    assert all(v == 0.0 for v in clean.noise.values()) and clean.noise


def test_a_quantity_measured_again_later_shows_the_drift_its_repeats_cannot():
    """On a 2-core VM a GEMM point's median of 7 repeats sat 13% from the same GEMM timed again right
    before its overlapped pairs (repeat noise 1.5%): the drift behind the CPU model's 10.9% held-out
    GEMM error. Here a known drift is put between each GEMM point and its pairs' alone times; the
    gap is found, and only pairs timed the same way (``baseline`` paired) and of the same shape at
    the same thread count are read."""
    from lagom_tune.model.fit import remeasured_noise
    from lagom_tune.model.rows import remeasured_pairs

    df = synthetic(noise=0.0).assign(baseline=lambda d: np.where(d["kind"] == "overlap", "paired", None))
    pts = point_medians(df)
    assert remeasured_noise(pts)["gemm"] == {"gap": 0.0, "median_ratio": 1.0, "pairs": 18}  # no drift: no gap
    over = pts["kind"] == "overlap"
    drifted = pts.assign(compute_alone_us=np.where(over, pts["compute_alone_us"] * 1.25, pts["compute_alone_us"]))
    entry = remeasured_noise(drifted)["gemm"]
    assert entry["gap"] == pytest.approx(0.25 / 2.25, abs=1e-4) and entry["median_ratio"] == pytest.approx(1.25)
    # the synthetic pairs record their threads, the collective points none: they ran at the default
    assert "collective" not in remeasured_noise(pts)
    matched = remeasured_pairs(pts, {"threads": 1})
    coll = matched[matched["quantity"] == "collective"]
    assert len(coll) == 9 and np.allclose(coll["first_us"], coll["again_us"]), coll  # noiseless: the same time twice
    assert (remeasured_pairs(pts, {"threads": 2})["quantity"] == "collective").sum() == 9  # the other half of the pairs
    legacy = pts.assign(baseline=None)  # timed from single launches before 2026-11-30: not the same quantity
    assert remeasured_pairs(legacy).empty and remeasured_noise(legacy) == {}
    other_threads = pts.assign(threads=np.where(over, 3, pts["threads"]))
    assert remeasured_pairs(other_threads).empty


def test_model_yaml_records_the_remeasured_gap_and_show_names_an_offset(tmp_path):
    from lagom_tune.model.contention import accuracy_record
    from lagom_tune.render import mape_text, model_tables

    df = synthetic(noise=0.02, seed=4).assign(baseline=lambda d: np.where(d["kind"] == "overlap", "paired", None))
    result = fit_model(df)
    record = result.to_dict(df, simulated=False)["accuracy"]
    assert set(record["remeasured"]) == {"gemm"} and record["remeasured"]["gemm"]["pairs"] == 18, record["remeasured"]
    assert accuracy_record(record, "accuracy")["remeasured"] == record["remeasured"]
    with pytest.raises(UserError, match=r"accuracy.remeasured.gemm.*gap"):
        accuracy_record({**record, "remeasured": {"gemm": {"gap": -0.1, "median_ratio": 1.0, "pairs": 3}}}, "accuracy")
    assert mape_text({"gemm": 0.109, "collective": 0.3}, {"gemm": 0.015}, {"gemm": {"gap": 0.13, "median_ratio": 0.99, "pairs": 9}}) \
        == "gemm 10.9% (1.5%; remeasured 13.0%), collective 30.0%"
    shown = lambda ratio: [str(x) for x in model_tables({"family": "f", "accuracy": {
        "mape": {"gemm": 0.11}, "remeasured": {"gemm": {"gap": 0.063, "median_ratio": ratio, "pairs": 504}}}}) if isinstance(x, str)]
    assert any("the median ran 0.90x its first measurement (504 pairs;" in line for line in shown(0.8952)), shown(0.8952)
    assert not any("median ran" in line for line in shown(1.01))
    few = [str(x) for x in model_tables({"family": "f", "accuracy": {
        "mape": {"gemm": 0.11}, "remeasured": {"gemm": {"gap": 0.063, "median_ratio": 0.85, "pairs": 3}}}}) if isinstance(x, str)]
    assert not any("median ran" in line for line in few)  # three pairs on one side: 1 time in 4 by chance


def test_show_remeasured_lists_each_point_its_pairs_timed_again_most_offset_first():
    """The H200 run of 2026-11-30 (timed before GEMM points and pairs' baselines were timed alike):
    `show` says its GEMMs ran 0.90x their points' time before their pairs; `--remeasured` says
    which: the batched attention GEMMs most (0.73-0.80x), one square GEMM not at all."""
    import json

    run = ROOT / "bench" / "results" / "gpu_check-llama3-8b-fsdp8-run"
    shown = " ".join(cli("show", run, check=True).stdout.split())
    assert "gemm: measured again, the median ran 0.90x its first measurement (504 pairs;" in shown
    table = json.loads(cli("show", run, "--remeasured", "--json", check=True).stdout)
    gemms = [r for r in table if r["quantity"] == "gemm"]
    assert len(gemms) == 14 and sum(r["pairs"] for r in gemms) == 504 and {r["when"] for r in table} == {"before a pair"}, table
    offsets = [abs(r["ratio"] - 1) for r in table]
    assert offsets == sorted(offsets, reverse=True) and table[0]["point"] == "gemm|32x2048x2048x128:bf16", table[:2]
    assert all(r["remeasured_us"] == pytest.approx(r["point_us"] * r["ratio"], rel=2e-3) for r in table)
    assert not any(r["simulated"] for r in table)
    assert "32x2048x2048x128" in cli("show", run, "--remeasured", check=True).stdout


def test_show_heldout_lists_the_h200_points_the_model_misses_most_first():
    """`show RUN --heldout` on the H200 run of 2026-11-30: every prediction behind model.yaml's
    figures (as many as it scored, averaging to its MAPE), the largest error first."""
    import json

    import yaml

    run = ROOT / "bench" / "results" / "gpu_check-llama3-8b-fsdp8-run"
    accuracy = yaml.safe_load((run / "model.yaml").read_text())["accuracy"]
    table = pd.DataFrame(json.loads(cli("show", run, "--heldout", "--json", check=True).stdout))
    assert list(table.columns) == [*HELDOUT_COLUMNS[:-1], "ratio", "error", "simulated"] and not table["simulated"].any()
    assert table.groupby("quantity").size().to_dict() == accuracy["scored"]
    assert table.groupby("quantity")["error"].mean().to_dict() == pytest.approx(accuracy["mape"], abs=2e-4)
    assert list(table["error"]) == sorted(table["error"], reverse=True)
    assert np.allclose(table["ratio"], table["predicted_us"] / table["measured_us"], rtol=1e-2)


def test_the_rows_digest_reads_the_same_rows_alike_under_any_pandas():
    """pandas 2.0 and 3.1 read the same CSV's times a last bit apart, so a model fitted under one was
    called stale under the other: the digest reads times to 9 digits, in any row order; a model that
    recorded the old digest is still current."""
    from lagom_tune.model.contention import stale_reason
    from lagom_tune.model.rows import legacy_rows_digest, rows_digest

    rows = synthetic(noise=0.03, seed=1)[["point", "repeat", "time_us"]]
    digest = rows_digest(rows)
    last_bit = rows.assign(time_us=np.nextafter(rows["time_us"].to_numpy(), np.inf))
    assert rows_digest(last_bit) == digest and rows_digest(rows.iloc[::-1]) == digest
    moved = rows.copy()
    moved.loc[3, "time_us"] *= 1 + 1e-6
    assert rows_digest(moved) != digest
    old = {"rows": len(rows), "rows_digest": legacy_rows_digest(rows)}
    assert stale_reason(old, rows, "run") is None and stale_reason(old, moved, "run") is not None


def test_an_older_revision_of_the_fit_is_named_as_older(monkeypatch):
    """Once the fit's revision moves on, a model the one before made reads as older, with its
    number; this revision's own reads as current."""
    from lagom_tune.model import contention

    monkeypatch.setattr(contention, "FIT_REVISION", 3)
    said = contention.fit_revision_note({"fit_revision": 2}, "runs/x")
    assert "an older lagom-tune (fit revision 2); this one fits revision 3" in said and "`lagom-tune fit runs/x`" in said
    assert contention.fit_revision_note({"fit_revision": 3}, "runs/x") is None


def test_fit_never_writes_a_model_that_the_other_verbs_refuse(tmp_path):
    """The committed gloo profile with every GEMM point's time made 1e10 us (within a day): the
    model passed fit's check, but its accuracy record (GEMMs timed again before their pairs at a
    ratio that rounds to 0) did not pass show's, search's or report's, and was written over the good
    model.yaml (an audit, 2026-12-07). fit now checks the whole file as they read it."""
    run = tmp_path / "run"
    shutil.copytree(ROOT / "tests" / "data" / "gloo-2026-12-06-cpu-demo", run)
    df = pd.read_csv(run / "measurements.csv", low_memory=False)
    df.loc[df["kind"] == "gemm", "time_us"] = 1e10
    df.to_csv(run / "measurements.csv", index=False)
    with pytest.raises(UserError, match=r"the fit gave no usable model \(.*model.yaml.accuracy.remeasured.gemm.median_ratio"):
        fit_run(open_run(run))
    assert not (run / "model.yaml").exists()


def test_a_cpu_model_needs_a_slowdown_for_every_thread_count_it_fits():
    """`comm_slowdown: {}` passed show and report, and search then failed on it (an audit, 2026-12-07)."""
    model = replace(TRUE, comm={"all_reduce": Linear(150.0, (("per_mb", 700.0), ("per_call", 30.0)))})
    d = {"schema_version": 1, "kind": "lagom-model", **model.to_dict()}
    model_from_dict(d)
    d["params"]["comm_slowdown"] = {}
    with pytest.raises(UserError, match=r"params.comm_slowdown: thread counts \[\], but .*params.compute fits \[1, 2\]"):
        model_from_dict(d)
