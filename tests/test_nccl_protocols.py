"""NCCL's protocols as NCCL runs them.

LL128 where NCCL offers it, and nowhere else: NCCL enables it by default only on GPUs of a
compute capability it tested (7.0, 8.0, 9.0, 10.0, 12.0), all alike, linked by NVLink. Elsewhere
its cost table marks LL128 unavailable and the tuner plugin cannot pick it, so a plan holding it
would say LL128 while NCCL ran something else: the profile does not measure it, the search never
proposes it and a plan holding it is refused.

The threads and buffsize knobs (NCCL_NTHREADS, NCCL_BUFFSIZE) size only some protocols' channels:
LL128 runs its own 640 threads, LL and LL128 their own buffers; the simulator, the fit and the
model all ask ``nccl_knobs.channel_run``."""

import pytest

from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.nccl import nvlink_between_gpus
from lagom_tune.backends.nccl_knobs import knob_space_from_fingerprint, ll128_offered
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.workload.presets import build_preset

# nvidia-smi topo -m as it prints (tab-separated; _run strips the header's leading tab)
DGX_H100 = "\n".join(
    ["GPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    + ["\t".join([f"GPU{i}"] + [" X " if i == j else "NV18" for j in range(4)] + ["PXB", "0-55", "0", "", "N/A"]) for i in range(4)]
    + ["NIC0\tPXB\tPXB\tPXB\tPXB\t X ", "", "Legend:", "", "  X    = Self", "  NV#  = Connection traversing a bonded set of # NVLinks"])
# A40s with NVLink bridges: GPU0-GPU1 and GPU2-GPU3 bridged, the pairs over PCIe
A40_BRIDGED = "\n".join([
    "GPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID",
    "GPU0\t X \tNV4\tNODE\tSYS\t0-31\t0\t\tN/A",
    "GPU1\tNV4\t X \tSYS\tNODE\t0-31\t0\t\tN/A",
    "GPU2\tNODE\tSYS\t X \tNV4\t32-63\t1\t\tN/A",
    "GPU3\tSYS\tNODE\tNV4\t X \t32-63\t1\t\tN/A",
])
ONE_GPU = "GPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n\nLegend:\n\n  X    = Self"  # the lent H200


def test_nvlink_is_read_from_the_topology_matrix():
    assert nvlink_between_gpus(DGX_H100)
    assert not nvlink_between_gpus(A40_BRIDGED)  # a ring of four crosses PCIe between the pairs
    assert not nvlink_between_gpus(ONE_GPU)  # no pair at all
    assert not nvlink_between_gpus(None) and not nvlink_between_gpus("")  # nvidia-smi did not run: unknown
    assert not nvlink_between_gpus(DGX_H100.replace("GPU3\tNV18", "GPU3\tSYS"))  # one pair over PCIe
    assert not nvlink_between_gpus("\n".join(DGX_H100.splitlines()[:3]))  # rows missing: not read as NVLink


@pytest.mark.parametrize("capabilities, nvlink, offered", [
    ([(9, 0)] * 8, True, True), ([(8, 0)] * 8, True, True), ([(10, 0)] * 4, True, True),
    ([(8, 6)] * 8, True, False),  # A40, RTX A6000: NCCL never tested LL128 there
    ([(8, 9)] * 8, True, False),  # L40S
    ([(9, 0)] * 8, False, False),  # PCIe H100s
    ([(9, 0)] * 4 + [(8, 0)] * 4, True, False),  # mixed GPUs
])
def test_ll128_is_offered_where_nccl_enables_it_by_default(capabilities, nvlink, offered):
    assert ll128_offered(capabilities, nvlink) is offered


@pytest.mark.parametrize("cluster, offered", [("a40-pcie", False), ("a40-nvlink", False), ("a100-nvlink", True),
                                              ("h100-nvlink", True), ("h200-nvlink", True)])
def test_a_simulated_cluster_offers_ll128_as_nccl_would_there(cluster, offered):
    assert ("ll128" in knob_space_from_fingerprint({"cluster": cluster})["proto"].domain) is offered


def test_the_nccl_backends_knob_space_follows_its_fingerprint():
    assert "ll128" not in knob_space_from_fingerprint({"max_channels": 32, "ll128": False})["proto"].domain
    assert "ll128" in knob_space_from_fingerprint({"max_channels": 32, "ll128": True})["proto"].domain
    # profiles before 2026-12-05 measured LL128 everywhere; their rows and plans still load
    assert "ll128" in knob_space_from_fingerprint({"max_channels": 32})["proto"].domain
    assert "ll128" in knob_space_from_fingerprint({})["proto"].domain  # the widest space


def test_the_simulated_a40_profile_measures_no_ll128_and_the_simulator_refuses_it():
    backend = get_backend("sim", BackendOptions(hardware="a40-nvlink"))
    protos = {dict(p.config).get("proto") for p in backend.plan_points(build_preset("phi-2-fsdp8"))}
    assert protos == {None, "ll", "simple"}  # None: the GEMMs
    s = {"algo": "ring", "proto": "ll128", "channels": 8, "threads": 512, "buffsize": 4 << 20}
    with pytest.raises(ValueError, match="NCCL does not offer LL128 on a40-nvlink"):
        SimCluster(CLUSTERS["a40-nvlink"]).comm_time("all_gather", 64 << 20, 8, 1, s)
    assert SimCluster(CLUSTERS["h100-nvlink"]).comm_time("all_gather", 64 << 20, 8, 1, s) > 0


def test_nccl_nthreads_sizes_simple_and_ll_but_never_ll128():
    """LL128's CTAs run NCCL_LL128_NTHREADS (640) whatever NCCL_NTHREADS says; the simulator slowed
    LL128 with the threads knob as if it were Simple's."""
    sim = SimCluster(CLUSTERS["h100-nvlink"])

    def seconds(proto: str, threads: int) -> float:
        s = {"algo": "ring", "proto": proto, "channels": 16, "threads": threads, "buffsize": 4 << 20}
        return sim.comm_time("all_gather", 256 << 20, 8, 1, s)

    assert seconds("ll128", 64) == seconds("ll128", 512)
    assert seconds("simple", 64) > 1.5 * seconds("simple", 512)
    assert seconds("ll", 64) > 1.5 * seconds("ll", 512)


def test_the_fitted_model_times_each_protocol_with_the_knobs_that_size_it(tmp_path):
    """Fitted on a simulated profile (LL and LL128 timed at the knobs' defaults only), the model
    used the threads knob in LL128's bandwidth and the buffsize knob in LL's and LL128's steps,
    and extrapolated both to values those protocols never run with."""
    from lagom_tune.model.fit import fit_model
    from lagom_tune.profile.campaign import run_profile
    from lagom_tune.workload.spec import Collective, Gemm, OverlapGroup, Workload

    w = Workload("one", (OverlapGroup("a", (Gemm("x", 4096, 4096, 4096, "bf16"),), (Collective("c", "all_gather", 32 << 20, ranks=8),)),))
    run = run_profile(w, get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=0.02)), tmp_path / "r", repeats=1)
    fp = run.read_meta()["fingerprint"]
    model = fit_model(run.measurements(), device={"sms": fp["sms"], "hbm_GBps": fp["hbm_GBps"]}, simulated=True).model
    coll = w.collectives()[0]

    def seconds(proto: str, threads: int, buffsize: int = 4 << 20) -> float:
        s = {"algo": "ring", "proto": proto, "channels": 16, "threads": threads, "buffsize": buffsize}
        assert model.hbm_taken(coll, s) > 0
        return model.comm_time(coll, s)

    assert seconds("ll128", 64) == seconds("ll128", 512) == seconds("ll128", 512, 1 << 20)
    assert seconds("ll", 512, 1 << 20) == seconds("ll", 512, 8 << 20)
    assert seconds("simple", 64) > 1.2 * seconds("simple", 512)  # measured: Simple's channels slow with fewer threads
    assert seconds("simple", 512, 1 << 20) > 1.1 * seconds("simple", 512, 8 << 20)  # and with smaller buffers
