"""The simulated cluster reproduces published observations; the fitted model recovers it."""

import time

import pytest
import yaml

from lagom_tune.backends.base import BackendOptions, bus_factor, get_backend
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.model.fit import fit_run
from lagom_tune.profile.campaign import run_profile
from lagom_tune.workload.presets import build_preset
from lagom_tune.workload.spec import Gemm

from conftest import cli

SIMPLE = dict(algo="ring", proto="simple", threads=512, buffsize=4 << 20)


def busbw(sim, op, nbytes, ranks, channels, **kw):
    s = {**SIMPLE, **kw, "channels": channels}
    return nbytes * bus_factor(op, ranks) / sim.comm_time(op, nbytes, ranks, 1, s) / 1e9


def test_a40_pcie_more_channels_same_comm_slower_ffn():
    """Lagom §2: 32 MB all-reduce beside an FFN on 8xA40 PCIe, NT=128: NC 16 -> 32 barely changes
    communication but slows the computation by about 30%."""
    sim = SimCluster(CLUSTERS["a40-pcie"])
    ffn = Gemm("ffn", 4096, 10240, 2560, "bf16")
    times = {}
    for ch in (16, 32):
        s = {**SIMPLE, "threads": 128, "channels": ch}
        times[ch] = (sim.comm_time("all_reduce", 32 << 20, 8, 1, s),
                     sim.gemm_time(ffn, ch, sim.comm_hbm_demand("all_reduce", 32 << 20, 8, 1, s)))
    assert abs(times[32][0] / times[16][0] - 1) < 0.05
    assert times[32][1] / times[16][1] > 1.20


def test_h200_all_reduce_bus_bandwidth_grows_with_channels_then_saturates():
    """8xH200, 128 MB all-reduce with CTAs capped: 2 -> ~74, 4 -> ~134, 8 -> ~234 GB/s busbw."""
    sim = SimCluster(CLUSTERS["h200-nvlink"])
    bw = {ch: busbw(sim, "all_reduce", 128 << 20, 8, ch) for ch in (1, 2, 4, 8, 16, 32, 64)}
    for ch, published in ((2, 74), (4, 134), (8, 234)):
        assert bw[ch] == pytest.approx(published, rel=0.15)
    assert 25 < bw[1] < 50  # roughly 30-40 GB/s per channel while the link is far
    assert bw[8] / bw[2] > 2.5  # close to linear up to 8
    assert bw[64] / bw[16] < 1.4  # saturating at the link
    assert bw[64] < 400


def test_protocols_trade_latency_for_bandwidth():
    sim = SimCluster(CLUSTERS["h100-nvlink"])
    small = {p: sim.comm_time("all_reduce", 16 << 10, 8, 1, {**SIMPLE, "proto": p, "channels": 8}) for p in ("ll", "simple")}
    large = {p: sim.comm_time("all_reduce", 256 << 20, 8, 1, {**SIMPLE, "proto": p, "channels": 8}) for p in ("ll", "simple")}
    assert small["ll"] < small["simple"] and large["simple"] < large["ll"]


def test_infiniband_bounds_multi_node_collectives():
    one = SimCluster(CLUSTERS["h100-nvlink"], nodes=1)
    slow = SimCluster(CLUSTERS["h100-nvlink"], nodes=2, ib_gbps=100)
    fast = SimCluster(CLUSTERS["h100-nvlink"], nodes=2, ib_gbps=400)
    s = {**SIMPLE, "channels": 16}
    t1, t100, t400 = (c.comm_time("all_gather", 256 << 20, 16, c.nodes, s) for c in (one, slow, fast))
    assert t1 < t400 < t100


def test_simulated_noise_is_deterministic_for_a_seed(tmp_path):
    w = build_preset("olmoe-1b-7b-ep8")
    runs = []
    for i, seed in enumerate((1, 1, 2)):
        b = get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=0.02, seed=seed))
        runs.append(run_profile(w, b, tmp_path / f"r{i}", repeats=2).measurements()["time_us"].tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.fixture(scope="module")
def llama_sim(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "run"
    r = cli("profile", "--backend", "sim", "--hardware", "h100-nvlink", "--noise", "0.02", "--workload", "llama3-8b-fsdp8",
            "--out", out, "--repeats", "3", check=True)
    assert "(simulated)" in r.stdout
    return out


def test_fit_recovers_the_simulator_within_5_percent(llama_sim):
    model = yaml.safe_load((llama_sim / "model.yaml").read_text())
    mape = model["accuracy"]["mape"]
    assert model["family"] == "lagom-gpu" and model["simulated"] is True
    assert mape["overlap_window"] <= 0.05 and mape["collective"] <= 0.05 and mape["gemm"] <= 0.05, mape
    assert (llama_sim / "fit.png").stat().st_size > 0 and (llama_sim / "slowdown.png").stat().st_size > 0


@pytest.mark.parametrize("hardware,name", [("a40-nvlink", "phi-2-fsdp16"), ("a40-pcie", "mpt-7b-tp8-dp2"),
                                            ("h200-nvlink", "olmoe-1b-7b-ep8")])
def test_fit_within_5_percent_on_the_other_benchmarked_workloads(tmp_path, hardware, name):
    from lagom_tune.model.fit import fit_model

    w = build_preset(name)
    b = get_backend("sim", BackendOptions(hardware=hardware, noise=0.02))  # nodes sized to the workload
    run = run_profile(w, b, tmp_path / "run", repeats=3)
    fp = run.read_meta()["fingerprint"]
    mape = fit_model(run.measurements(), device={"sms": fp["sms"], "hbm_GBps": fp["hbm_GBps"]}, simulated=True).mape
    assert mape["overlap_window"] <= 0.05 and mape["collective"] <= 0.05 and mape["gemm"] <= 0.05, mape


def test_every_sim_artifact_says_simulated(llama_sim, tmp_path):
    meta = yaml.safe_load((llama_sim / "meta.yaml").read_text())
    assert meta["simulated"] is True and "simulated" in meta["fingerprint"]["device"]
    header, first = (llama_sim / "measurements.csv").read_text().splitlines()[:2]
    assert first.split(",")[header.split(",").index("simulated")] == "True"
    assert "simulated" in cli("show", llama_sim, check=True).stdout
    plan = tmp_path / "p.yaml"
    out = cli("search", llama_sim, "--out", plan, check=True).stdout
    assert "simulated" in out and yaml.safe_load(plan.read_text())["target"]["simulated"] is True


def test_fitting_2000_rows_takes_under_30_seconds(tmp_path):
    w = build_preset("olmoe-1b-7b-ep8")
    run = run_profile(w, get_backend("sim", BackendOptions(hardware="a100-nvlink", noise=0.02)), tmp_path / "r", repeats=2)
    assert len(run.measurements()) >= 2000
    t0 = time.perf_counter()
    fit_run(run)
    assert time.perf_counter() - t0 < 30


def test_unknown_hardware_is_a_user_error(tmp_path):
    r = cli("profile", "--backend", "sim", "--hardware", "b200", "--workload", "phi-2-fsdp8", "--out", tmp_path / "x")
    assert r.returncode == 2 and "unknown --hardware 'b200'" in r.stderr


def test_a_simulated_cluster_is_sized_to_the_workload_and_says_its_default(tmp_path):
    """phi-2-fsdp16 without --nodes was recorded as 8 ranks on one node, and its plan said world_size 8."""
    run = tmp_path / "run"
    r = cli("profile", "--backend", "sim", "--hardware", "a40-nvlink", "--workload", "phi-2-fsdp16", "--out", run, check=True)
    fp = yaml.safe_load((run / "meta.yaml").read_text())["fingerprint"]
    assert (fp["nodes"], fp["ranks"]) == (2, 16) and "hardware_note" not in fp and "note" not in r.stdout
    plan = tmp_path / "plan.yaml"
    cli("search", run, "--out", plan, check=True)
    assert yaml.safe_load(plan.read_text())["target"]["world_size"] == 16
    few = cli("profile", "--backend", "sim", "--workload", "phi-2-fsdp16", "--nodes", "1", "--out", tmp_path / "few")
    assert few.returncode == 2 and "needs 2 nodes" in few.stderr and not (tmp_path / "few" / "measurements.csv").exists()
    default = cli("profile", "--backend", "sim", "--workload", "cpu-demo", "--out", tmp_path / "d", check=True)
    assert "--hardware not given: the default h100-nvlink" in default.stdout
    assert "h100" in cli("profile", "--help", check=True).stdout.replace("\n", " ")
