"""The simulator against each observation it is calibrated from (every number SIMULATED).

Inputs, not outputs: the H200 slowdown table (tests/data/h200-2026-11-30), published nccl-tests
bus bandwidths, AutoCCL's isolated-collective gain, Lagom's §10 observations (DESIGN.md) and a
published H100 measurement of a one-wave GEMM beside an all-gather. The end-to-end speedups
(bench/paper_sim.py) are outputs and nothing here looks at them.
"""

import itertools
import sys

import pandas as pd
import pytest

from lagom_tune.backends.base import BackendOptions, bus_factor, get_backend
from lagom_tune.backends.registry import usable_cores
from lagom_tune.backends.nccl_knobs import cluster_knob_space, nccl_knob_space
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.backends.sim_comm import NVLS_ALL_REDUCE_BUSBW, REFERENCE_BUSBW
from lagom_tune.backends.sim_compute import Kernel, choose_kernel, gemm_run, kernel_run
from lagom_tune.knobs import Settings
from lagom_tune.model.fit import fit_device, fit_model
from lagom_tune.profile.campaign import run_profile
from lagom_tune.workload.presets import build_preset
from lagom_tune.workload.spec import Gemm

from conftest import ROOT

SIMPLE = dict(algo="ring", proto="simple", threads=512, buffsize=4 << 20)
sys.path.insert(0, str(ROOT / "bench"))
from calibrate_sim import AIM, ALONE_AIM, AUTOCCL_CLUSTER, AUTOCCL_GAIN, COPY_AIM, WORKLOADS, autoccl_gains, errors, measured, ring_busbw  # noqa: E402  (the table bench/results/sim_calibration.md shows)
from paper_sim import LEE_CLUSTERS, WORKLOADS as PAPER_WORKLOADS, lee_workloads, overlap_costs  # noqa: E402  (paper_sim.md's tables)


def busbw(sim, op, nbytes, ranks, **s):
    s = {**SIMPLE, **s}
    return nbytes * bus_factor(op, ranks) / sim.comm_time(op, nbytes, ranks, 1, s) / 1e9


@pytest.fixture(scope="module")
def h200():
    """Simulated minus measured, per workload and block count (bench/calibrate_sim.py): the H200's
    GEMMs beside a copy kernel of 1-64 blocks (tests/data/h200-2026-11-30)."""
    return errors(SimCluster(CLUSTERS["h200-nvlink"]), {w: measured(w) for w in WORKLOADS})


def MPT_48(df: pd.DataFrame) -> pd.Series:
    """The one cell of the H200 table the simulator misses: mpt-7b's GEMMs beside 48 blocks."""
    return (df["workload"] == "mpt-7b-tp8-dp1") & (df["blocks"] == 48)


def test_h200_gemm_slowdown_beside_copy_blocks(h200):
    """The measured slowdown table (1.07 at one block, ~1.9 from 4, ~3 at 64 for mpt-7b), median
    over shapes: within 0.1 at every block count of both workloads (mpt-7b's 48 blocks apart, the
    known miss below)."""
    rest = h200[~MPT_48(h200)]
    assert (rest["gemm_error"].abs() <= AIM).all(), rest[rest["gemm_error"].abs() > AIM].round(3).to_dict("records")


@pytest.mark.xfail(strict=True, reason="open (issue 16): +0.30 (2026-11-30, sixth session); the measured slowdown steps up "
                   "1.25x from 48 to 64 blocks, a step the simulated SMs and HBM spread over 32-64; the device's "
                   "block placement table would settle it")
def test_h200_gemm_slowdown_at_48_blocks_for_mpt7b(h200):
    cell = h200[MPT_48(h200)]
    assert len(cell) == 1 and (cell["gemm_error"].abs() <= AIM).all(), cell.round(3).to_dict("records")


def test_h200_copy_slowdown_beside_gemms(h200):
    """The other direction: the probe's copy slowed 1.14-1.26x beside the GEMMs (median over
    shapes); simulated, the copy's HBM share and latency beside each GEMM, within 0.12 at every
    block count."""
    assert h200["copy_error"].abs().max() <= COPY_AIM, h200.round(3).to_dict("records")


def test_h200_gemm_times_alone(h200):
    """GEMMs alone, from tiles in waves: the median shape within 15% of its measured time."""
    assert (h200["alone_ratio"] - 1).abs().max() <= ALONE_AIM, h200.groupby("workload")["alone_ratio"].first().to_dict()


def test_a_skinny_gemm_runs_a_narrow_tile_and_saves_the_wasted_math():
    """A 64-wide output (a MoE router's experts) runs a 64-wide tile, as cuBLAS's do; a wider one
    keeps the 128-wide tiles the H200 table was calibrated with."""
    c = CLUSTERS["a40-nvlink"]
    router, attention = Gemm("r", 4096, 64, 2048, "bf16"), Gemm("a", 128, 2048, 2048, "bf16", 4)
    assert 64 in choose_kernel(c, router).tile and 64 not in choose_kernel(CLUSTERS["h200-nvlink"], attention).tile
    wide = kernel_run(c, router, Kernel((128, 128), 1, 32, 32, True))[0]
    assert gemm_run(c, router)[0] < 0.9 * wide  # half the 128-wide tile's math was zeros


def test_h200_all_reduce_with_ctas_capped():
    """8xH200, 128 MB all-reduce: 2 -> 74, 4 -> 134, 8 -> 234 GB/s busbw (DESIGN.md §10), within 10%."""
    sim = SimCluster(CLUSTERS["h200-nvlink"])
    for ch, published in ((2, 74), (4, 134), (8, 234)):
        assert busbw(sim, "all_reduce", 128 << 20, 8, channels=ch) == pytest.approx(published, rel=0.10)


@pytest.mark.parametrize("cluster,op", [(c, op) for c, ref in sorted(REFERENCE_BUSBW.items()) for op in ref.ops])
def test_nccl_tests_ring_bus_bandwidth(cluster, op):
    """A ring collective at NCCL's other defaults, on as many GPUs and at the size the published
    nccl-tests run used, within its figure (10% margin). 2026-12-03: A100 218 GB/s against
    230-250; H100 and H200 356 against the ring's ~370 (the maintainer's figure for NCCL_ALGO=RING
    and for non-all-reduce operations); 2026-12-04: A40 NVLink 38.6 against a bit above ~36.6 (4
    GPUs, 32 MiB). The A40 PCIe cluster has no published figure here (none found)."""
    ref = REFERENCE_BUSBW[cluster]
    bw = ring_busbw(CLUSTERS[cluster], op)
    assert ref.lo * 0.9 <= bw <= ref.hi * 1.1, (bw / 1e9, ref.source)


@pytest.mark.parametrize("cluster", ["h100-nvlink", "h200-nvlink"])
def test_nccl_tests_all_reduce_at_nccl_defaults_on_hopper(cluster):
    """NCCL's default all-reduce on 8 Hoppers with NVSwitch is NVLS, ~480 GB/s busbw at large sizes
    (within 10%); the ring beside it stays near its ~370."""
    published, source = NVLS_ALL_REDUCE_BUSBW
    c = CLUSTERS[cluster]
    defaults = cluster_knob_space(c).defaults("all_reduce")
    assert defaults["algo"] == "nvls"
    bw = busbw(SimCluster(c), "all_reduce", 1 << 30, 8, **defaults) * 1e9
    assert published * 0.9 <= bw <= published * 1.1, (bw / 1e9, source)


def test_nvls_takes_less_hbm_than_the_ring_beside_a_gemm():
    """The switch reduces: an NVLS all-reduce reads and writes each byte of its buffer once, a
    ring's CTAs read, reduce into and write it, over more bus bytes; so at NCCL's defaults NVLS
    draws less HBM per second while moving more, and a GEMM beside it slows less."""
    sim, ffn = SimCluster(CLUSTERS["h100-nvlink"]), Gemm("ffn", 8192, 8192, 8192, "bf16")
    run = {a: sim.contention("all_reduce", 256 << 20, 8, 1, {**SIMPLE, "algo": a, "channels": 16}) for a in ("ring", "nvls")}
    assert run["nvls"].hbm < run["ring"].hbm
    assert sim.gemm_time(ffn, run["nvls"]) < sim.gemm_time(ffn, run["ring"])


@pytest.mark.parametrize("algo, proto, nodes", [("nvls", "ll", 1), ("nvls", "simple", 2)])
def test_nvls_outside_what_nccl_offers_is_refused(algo, proto, nodes):
    """NVLS runs Simple within one node: the simulator refuses anything else rather than time it."""
    with pytest.raises(ValueError, match="NVLS"):
        SimCluster(CLUSTERS["h100-nvlink"], nodes=2).comm_time("all_reduce", 64 << 20, 8 * nodes, nodes, {**SIMPLE, "algo": algo, "proto": proto, "channels": 16})


# The two A40 observations pull the simulated channel opposite ways: AutoCCL's gain comes almost
# wholly from NCCL's 8 default channels falling short of the link (gain ~ link / (8 per_channel)),
# Lagom's NC=2 needs two channels near it. A grid (2026-12-03) of per_channel 4-12 GB/s, link 22-60
# GB/s and InfiniBand 100/400 Gb/s satisfies both nowhere (gain 1.01-1.89x; Lagom's setting
# 0.58-1.02x, at least 1.0 only with 10-12 GB/s channels, a 22 GB/s link and 400 Gb/s, where the
# gain is 1.01x). Since 2026-12-03 the A40 NVLink link is solved for AutoCCL's gain (a published
# figure; the link had none), so Lagom's NC=2 is the one that misses: two simulated channels carry
# 10 GB/s, and beside the GEMMs they still slow them 1.23x (NC=8: 1.40x; Lagom reports 1.35x on the
# pattern), the L2 evicted as soon as a collective streams, whatever its rate.
A40_CHANNEL_TENSION = ("open (issue 16): AutoCCL's gain and Lagom's NC=2 pull the simulated A40 channel opposite ways "
                       "(see the comment above)")


def test_autoccl_isolated_collective_gain_over_nccl_defaults():
    """AutoCCL (NSDI'25): tuned settings 1.24-1.29x the bandwidth of NCCL's defaults for collectives
    alone, on A40s: the median gain in the published range (the A40 NVLink link is solved for its
    middle, bench/calibrate_sim.py; 1.265x on 2026-12-03)."""
    gains = autoccl_gains(CLUSTERS[AUTOCCL_CLUSTER])
    assert AUTOCCL_GAIN[0] <= pd.Series(gains).median() <= AUTOCCL_GAIN[1], gains


def test_autoccl_tuning_gains_over_nccl_defaults_for_every_large_collective():
    """Not only the median: every large collective alone gains from tuning (1.25-1.28x on
    2026-12-03), none by far more than the published range."""
    gains = autoccl_gains(CLUSTERS[AUTOCCL_CLUSTER])
    assert 1.15 <= min(gains) and max(gains) <= 1.35, gains


def phi2_fsdp_iteration(all_gather: int, reduce_scatter: int, chunk: int) -> float:
    """Phi-2 FSDP over 16 A40s (2 NVLink nodes): the simulated iteration with the all-gathers and
    reduce-scatters at the given channels and one chunk size. NCCL's ring chunk (the C that
    AutoCCL and Lagom tune) is 4 of a buffer's 8 steps, so the buffer is twice the chunk: the
    default C of 2 MB is NCCL_BUFFSIZE's 4 MiB (until 2026-12-03 the buffer was set to C)."""
    w = build_preset("phi-2-fsdp16")
    sim = SimCluster(CLUSTERS["a40-nvlink"], nodes=2)
    per = {c.rule_key: {"channels": all_gather if c.op == "all_gather" else reduce_scatter} for c in w.collectives()}
    return sim.iteration(w, Settings(process={**SIMPLE, "buffsize": 2 * chunk, "channels": 8}, collectives=per))


@pytest.mark.xfail(strict=True, reason=f"{A40_CHANNEL_TENSION}; the simulated A40 channel (5 GB/s) carries 10 GB/s at "
                   "NC=2; Lagom's setting runs 0.73x the defaults here, not faster (2026-12-03; 0.67x with the buffer "
                   "set to C and the link at 48 GB/s)")
def test_lagom_phi2_fsdp_a40_fewer_channels_beat_the_defaults():
    """Lagom §10 (DESIGN.md): Phi-2 FSDP on A40 NVLink, NCCL's defaults NC=8, C=2 MB; Lagom's
    all-gather at NC=2, C=684 KB is 1.35x faster on its pattern, its reduce-scatter at NC=4,
    C=1366 KB 1.43x. Read on the whole simulated iteration, the all-gather's chunk for both (the
    buffer is one per process): Lagom's setting must not be slower than the defaults (its gain on
    an iteration is below its gain on the pattern)."""
    default = phi2_fsdp_iteration(8, 8, 2 << 20)
    assert default / phi2_fsdp_iteration(2, 4, 684 << 10) >= 1.0


def test_autoccl_on_phi2_fsdp_a40_is_slower_than_the_defaults():
    """Lagom §10: AutoCCL's NC=61 on the same job runs 0.87x NCCL's defaults (simulated: the nearest
    offered count, 64, 0.887x on 2026-12-03)."""
    ratio = phi2_fsdp_iteration(8, 8, 2 << 20) / phi2_fsdp_iteration(64, 64, 2 << 20)
    assert 0.8 <= ratio <= 0.95, ratio


def test_lagom_a40_pcie_more_channels_same_comm_slower_ffn():
    """Lagom §2: 8xA40 PCIe, 32 MB all-reduce beside an FFN, NT=128: NC 16 and 32 give almost the
    same communication time, yet computation differs by 30.2%."""
    sim = SimCluster(CLUSTERS["a40-pcie"])
    ffn = Gemm("ffn", 4096, 10240, 2560, "bf16")
    comm, comp = {}, {}
    for ch in (16, 32):
        s = {**SIMPLE, "threads": 128, "channels": ch}
        comm[ch] = sim.comm_time("all_reduce", 32 << 20, 8, 1, s)
        comp[ch] = sim.gemm_time(ffn, sim.contention("all_reduce", 32 << 20, 8, 1, s))
    assert abs(comm[32] / comm[16] - 1) < 0.05
    assert 1.15 < comp[32] / comp[16] < 1.45


@pytest.mark.parametrize("cluster", ["a40-nvlink", "a40-pcie"])
def test_lagom_a40_contention_slows_computation_by_up_to_35_percent(cluster):
    """Lagom §2 (DESIGN.md §10): on its A40 testbeds, communication contention slows the
    bottlenecked computation by up to 35%. Read as the worst, over the paper's workloads at NCCL's
    defaults, of the iteration's GEMM time beside its collectives over alone (paper_sim.md's second
    Lee-style table), within 0.1 as the H200 table is. 2026-11-30: a40-nvlink 1.298 (phi-2
    tp8-dp2), a40-pcie 1.392 (the same); none of the calibration saw this figure."""
    costs = overlap_costs(cluster, {name: build_preset(name) for name in PAPER_WORKLOADS})
    assert abs(costs["compute_slowdown"].max() - 1.35) <= 0.1, costs
    assert (costs["compute_slowdown"] > 1).all(), costs


def test_h100_one_wave_gemm_nearly_doubles_beside_an_all_gather():
    """A published H100 measurement independent of the H200 tables the simulator is calibrated on
    (NVIDIA Developer Forums, "Compute-Communication Overlap Causes Severe GEMM Performance
    Degradation because of Tail Effect", forums.developer.nvidia.com/t/337991): a GEMM of one wave
    (132 CTAs, ~80% MFU alone) beside an NCCL all-gather of 24 blocks "nearly doubles" (MFU ~47%,
    1.7x), the CTAs the channel blocks push out running as a second wave. Simulated (2026-11-30, sixth session):
    1.93-1.99x for one-round GEMMs fully overlapped with a 24-channel all-gather."""
    sim = SimCluster(CLUSTERS["h100-nvlink"])
    load = sim.contention("all_gather", 256 << 20, 8, 1, {**SIMPLE, "channels": 24})
    for g in (Gemm("a", 2048, 2048, 2048, "bf16"), Gemm("b", 2048, 4096, 8192, "bf16"), Gemm("c", 1024, 4096, 8192, "bf16")):
        assert 1.6 <= sim.gemm_time(g, load) / sim.gemm_time(g) <= 2.1, g


def _default_overlaps():
    """Every GEMM beside every collective of three paper workloads, NCCL's defaults, H100 cluster."""
    sim = SimCluster(CLUSTERS["h100-nvlink"])
    s = nccl_knob_space(64, 16).defaults()
    for name in ("llama3-8b-tp8-dp2", "mpt-7b-fsdp16", "phi-2-tp8-dp2"):
        for grp in build_preset(name).groups:
            for g, c in itertools.product(grp.compute, grp.comm):
                yield sim.slowdowns(g, c.op, c.nbytes, c.ranks, 1, s)[0], sim.overlap(g, 1, c.op, c.nbytes, c.ranks, 1, s)


def test_overlap_slows_compute_yet_beats_serial():
    """Lee et al. 2025, qualitatively: overlap slows computation yet beats running serially. (The
    bounds were "slower at all" and "shorter than serial", which a simulator with no contention
    passed too: a channel block's launch delay alone made every GEMM slower, and max(y, x) is below
    y + x. Lee measured 18.9% on average; here on 16 H100s, 2026-12-01: median 1.80, least 1.28,
    every window at least 1.6% past the longer stream alone.)"""
    pairs = list(_default_overlaps())
    slowdowns = [sd for sd, _ in pairs]
    assert min(slowdowns) > 1.1 and sorted(slowdowns)[len(slowdowns) // 2] > 1.15, slowdowns
    assert all(max(o["compute_alone_us"], o["comm_alone_us"]) * 1.01 < o["window_us"] < o["compute_alone_us"] + o["comm_alone_us"]
               for _, o in pairs)


@pytest.mark.parametrize("cluster", LEE_CLUSTERS)
def test_overlap_slows_training_computation_as_lee_et_al_measured(cluster):
    """Lee et al. 2025 (GPT and LLaMA training on 4 A100s, H100s, MI250s and MI210s): overlapping
    slows the computation by 18.9% on average and 40.0% at worst, against the same computation with
    no communication beside it, and running serially is 10.2% (26.6%) slower than overlapped. The
    same quantities under their conditions (``paper_sim.LEE_WORKLOADS``: 4 GPUs of one node, phi-2,
    llama3-8b and mpt-7b, FSDP or tensor-parallel; ``bench/results/paper_sim.md``): each workload's
    GEMM time over an iteration at NCCL's defaults, played beside its collectives, over its time
    alone. Bounds as before this comparison was made per iteration: a mean within 1.05-1.35, every
    workload below 1.6; serial over overlapped above 1 everywhere, its mean below 1.3 and its worst
    below 1.47 (Lee's worst, 26.6%, with the computation bound's 20-point margin). (2026-11-30,
    sixth session: 1.065/1.101 and 1.108/1.164 on the A100, 1.216/1.340 and 1.176/1.280 on the
    H100; the 16-GPU paper workloads give the H100 1.42/1.61, a strict expected failure before the
    comparison followed Lee's conditions.)"""
    costs = overlap_costs(cluster, lee_workloads())
    slow, serial = costs["compute_slowdown"], costs["serial_over_overlapped"]
    assert 1.05 <= slow.mean() <= 1.35 and slow.max() < 1.6, costs
    assert (serial > 1).all() and serial.mean() < 1.3 and serial.max() < 1.47, costs


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
    t1, t100, t400 = (c.comm_time("all_gather", 256 << 20, 16, n, s) for c, n in ((one, 1), (slow, 2), (fast, 2)))
    assert t1 < t400 < t100


@pytest.mark.parametrize("hardware,name,noise", [("h100-nvlink", "llama3-8b-fsdp8", 0.0), ("a40-nvlink", "phi-2-fsdp16", 0.02),
                                                  ("h200-nvlink", "olmoe-1b-7b-ep8", 0.02)])
def test_the_model_is_not_the_simulator_and_earns_its_accuracy(tmp_path, hardware, name, noise):
    """Held-out (5-fold) error of the fitted model on the simulator: non-zero for every quantity even
    without noise (its equations are not the simulator's); every quantity within the 5% aim.
    Isolated GEMM points on h200 olmoe, whose attention and router shapes are profiled only alone
    (a held-out point is a shape the model never saw): 2.3% since 2026-12-01 (64-wide tiles for the
    router's 64-wide outputs, the residuals of measured shapes near a new one), 6.1% before, 8.1%
    before a never-measured shape ran as the cheapest candidate kernel; bench/results/paper_sim.md
    has every cluster."""
    b = get_backend("sim", BackendOptions(hardware=hardware, noise=noise))
    run = run_profile(build_preset(name), b, tmp_path / "run", repeats=1 if noise == 0 else 3)
    fp = run.read_meta()["fingerprint"]
    fit = fit_model(run.measurements(), device=fit_device(fp), simulated=True,
                    workers=usable_cores())  # as `profile` fits: the folds side by side
    mape = fit.mape
    assert all(c.warm_gain == 0 for c in fit.model.comm.values())  # the simulator times collectives alone cold
    assert all(v > 0.001 for v in mape.values()), mape
    assert max(mape.values()) <= 0.05, mape
    # the placement of channel blocks is the simulated hardware's: Hopper's 2-CTA GEMMs lose whole
    # TPCs over its 8 GPCs, Ampere's lose one SM per block
    cluster = CLUSTERS[hardware]
    assert fit.model.contention.gpcs == (cluster.gpcs if cluster.cta_cluster == 2 else 0), fit.model.contention


def test_nccl_buffsize_sizes_only_the_simple_protocols_buffer():
    """NCCL_BUFFSIZE is Simple's buffer; LL's and LL128's are NCCL's own (nccl_knobs.PROTOCOL_BUFFERS), so only
    Simple's time moves with it (a large all-gather, 8 channels, H100)."""
    sim = SimCluster(CLUSTERS["h100-nvlink"])

    def t(proto, buffsize):
        return sim.comm_time("all_gather", 64 << 20, 8, 1, {**SIMPLE, "proto": proto, "channels": 8, "buffsize": buffsize})

    assert t("simple", 1 << 20) > 1.05 * t("simple", 8 << 20)
    for proto in ("ll", "ll128"):
        assert t(proto, 1 << 20) == t(proto, 8 << 20)
