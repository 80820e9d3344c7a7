"""The simulated clusters' hardware figures (DESIGN.md §10 and public specs), apart from the
simulator so that a sim plan's knob space (its channel bounds) loads without numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
HBM_EFFICIENCY = 4.26 / 4.8  # measured device-to-device copy over the data-sheet figure (one H200, 2026-11-30)


@dataclass(frozen=True)
class MemoryCalibration:
    """How a GEMM's tiles and a collective share L2 and HBM in the simulated mechanism
    (``sim_compute.tile_seconds``, ``sim_comm.copy_slowdown``): constants no data sheet gives, fitted
    to one H200's slowdown table by ``bench/calibrate_sim.py`` (Optuna, 2026-11-30, sixth session; how they were
    found in its docstring, the table and the constants in ``bench/results/sim_calibration.md``) and used for every simulated device."""

    in_wave_reuse: float = 4.82  # CTAs running together share A and B panels through L2
    cross_wave_hits: float = 0.593  # share of a later wave's panel loads that hit what the wave before left in L2
    evicted_misses: float = 1.7  # panel-load misses per tile, relative to a first wave's, of a non-persistent kernel once a collective streams through L2
    eviction_per_utilisation: float = 3.74  # more misses as the collective's share u of HBM bandwidth grows, as u ** eviction_power
    eviction_power: float = 3.82  # (the H200's slowdown rises late, past half its bandwidth)
    miss_stall: float = 0.223  # a tile's mainloop runs this much longer when all its panel loads miss L2 (latency not hidden)
    queue_delay: float = 0.0584  # HBM latency grows with utilisation rho as 1 + queue_delay * rho / (1 - rho) (a queue) ...
    max_utilisation: float = 0.745  # ... up to this rho (the memory controllers' queues are finite)


@dataclass(frozen=True)
class Cluster:
    """One simulated node type's figures (every node has 8 GPUs)."""

    name: str
    device: str
    sms: int
    hbm: float  # bytes/s
    tflops: float  # dense bf16, achievable
    link: float  # intra-node bytes/s per direction a ring's channels share (NVLink: its line rate)
    per_channel: float  # bytes/s one channel moves before the link saturates
    l2: int  # bytes
    default_channels: int
    max_channels: int = 64
    fabric: float = math.inf  # bytes/s at which the switch fabric's contention halves what channels offer
    gpcs: int = 7  # graphics processing clusters: the block scheduler spreads CTAs across them
    cta_cluster: int = 1  # CTAs a GEMM kernel co-schedules on one TPC (Hopper's thread-block clusters: 2)
    memory: MemoryCalibration = MemoryCalibration()
    nvls: bool = False  # NVLink SHARP: the NVSwitch reduces (Hopper); NCCL's default all-reduce within a node
    compute_capability: tuple[int, int] = (9, 0)
    nvlink: bool = True  # every pair of a node's GPUs linked by NVLink (an NVSwitch); bridged pairs are not
    # A GPU's memory: the H200's as torch reported it (139.8 GiB); the others their data sheets' GB
    # read as 10^9 bytes, a lower bound (the H200's "141 GB" would read 131 GiB). None: not checked.
    memory_GiB: float | None = None

    @property
    def hbm_effective(self) -> float:
        """HBM bandwidth a streaming kernel reaches: the H200 copied 4.26 of its 4.8 TB/s."""
        return self.hbm * HBM_EFFICIENCY


# link: NVLink's line rate per direction (NVLink 3 300 GB/s, NVLink 4 450 GB/s, DESIGN.md §10): a
# Simple step's handshake (sim_comm.PROTOCOLS) and the fabric take NCCL's ~20% protocol overhead
# off it (370 GB/s ring busbw on 8xH100, sim_comm.REFERENCE_BUSBW); until 2026-12-03 the link was
# already derated to 0.85 of the line rate and the handshakes took a second share. The A40s' links
# are achieved figures: PCIe 4.0 x16 ~22 GB/s (a user's A40s copy 49.5-50.4 GB/s both ways together
# between GPUs of one socket and 39.2-41.6 across sockets, p2pBandwidthLatencyTest's copy engines,
# github.com/NVIDIA/nccl-tests issue 74); NVLink bridge pairs plus PCIe solved for AutoCCL's
# published gain (the middle of 1.24-1.29x, NCCL's 8 default channels short of the link:
# ``bench/calibrate_sim.py``'s link_for_autoccl_gain, 49.6 GB/s on 2026-12-03; a guess of 48 until
# then, which gave 1.22x).
# per_channel and fabric: calibrated to published observations (sim_comm.py, DESIGN.md §10):
# 8xH200 all-reduce with CTAs capped (2/4/8 -> 74/134/234 GB/s busbw), 8xA100 nccl-tests
# 230-250 GB/s at NCCL's defaults, and AutoCCL's 1.24-1.29x over NCCL's defaults on A40s; the
# A40's 5 GB/s a channel is what NCCL's 8 default channels read in the one published A40 run
# (sim_comm.REFERENCE_BUSBW: 38.6 GB/s against a bit above ~36.6; 4.5-5.5 GB/s would pass, if
# NCCL ran its 8 default channels there, which the run does not say).
CLUSTERS = {
    "a40-pcie": Cluster("a40-pcie", "A40", 84, 696 * GB, 150e12 * 0.7, 22 * GB, 5.0 * GB, 6 << 20, 8, 32, memory_GiB=44.7,
                        compute_capability=(8, 6), nvlink=False),
    "a40-nvlink": Cluster("a40-nvlink", "A40", 84, 696 * GB, 150e12 * 0.7, 49.6 * GB, 5.0 * GB, 6 << 20, 8, 64, memory_GiB=44.7,
                          compute_capability=(8, 6), nvlink=False),  # NVLink bridges join pairs; the ring crosses PCIe
    "a100-nvlink": Cluster("a100-nvlink", "A100-SXM4-80GB", 108, 2.0e12, 312e12 * 0.75, 300 * GB, 24 * GB, 40 << 20, 16,
                           fabric=640 * GB, memory_GiB=74.5, compute_capability=(8, 0)),
    "h100-nvlink": Cluster("h100-nvlink", "H100-SXM", 132, 3.35e12, 989e12 * 0.95, 450 * GB, 55 * GB, 50 << 20, 16,
                           fabric=800 * GB, gpcs=8, cta_cluster=2, memory_GiB=74.5, nvls=True),
    "h200-nvlink": Cluster("h200-nvlink", "H200", 132, 4.8e12, 989e12 * 0.95, 450 * GB, 55 * GB, 50 << 20, 16,
                           fabric=800 * GB, gpcs=8, cta_cluster=2, memory_GiB=139.8, nvls=True),
}
DEFAULT_CLUSTER = "h100-nvlink"  # --hardware left out: said in the fingerprint and the profile's output
