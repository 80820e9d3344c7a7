"""What the SIMULATED NCCL runs a collective with when nothing is set: NCCL's own choice.

NCCL picks a call's algorithm and protocol with a cost model of its own, not by timing them: each
enabled (algorithm, protocol) pair gets a latency and a bandwidth when the communicator is made
(``ncclTopoTuneModel``, src/graph/tuning.cc), and a call runs the pair whose ``latency + bytes /
bandwidth`` is least (``ncclTopoGetAlgoTime``). Its constants below are NCCL's (2.2x), for the
pairs the simulator runs (ring, tree, NVLS). Its one input from the machine, the bandwidth NCCL's
topology search finds for a ring's channels, is here what the simulated cluster's default channels
carry over its link (``sim_comm``). Until 2026-12-05 the simulated NCCL ran the knob space's
defaults (Simple) at every size, while NCCL's model gives LL to small calls and LL128 (where
offered) to mid-sized ones: tuning a small collective then beat a "default" NCCL never runs.

The choice is NCCL's estimate, not the simulator's timing: like the real one, it can pick a pair
the simulated ground truth runs slower (AutoCCL's point). Not modelled: PAT, CollNet, NVLS-tree.
"""

from __future__ import annotations

import math

from lagom_tune.backends.sim_clusters import GB, Cluster
from lagom_tune.backends.sim_comm import NVLS_CHANNELS

# Latencies in microseconds (baseLat, hwLat), bandwidths in GB/s, as tuning.cc states them.
# NVLS runs Simple only (sim_comm refuses the rest), so it has no LL or LL128 entry.
BASE_LAT = {"tree": {"ll": 6.8, "ll128": 14.0, "simple": 8.4}, "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
            "nvls": {"simple": 0.0}}
HW_LAT = {  # per link kind: within a node over NVLink or PCIe, or between nodes
    "nvlink": {"tree": {"ll": 0.6, "ll128": 1.25, "simple": 4.0}, "ring": {"ll": 0.6, "ll128": 1.9, "simple": 3.4},
               "nvls": {"simple": 25.0}},
    "pci": {"tree": {"ll": 1.0, "ll128": 1.9, "simple": 4.0}, "ring": {"ll": 1.0, "ll128": 2.5, "simple": 5.7},
            "nvls": {"simple": 0.0}},
    "net": {"tree": {"ll": 5.0, "ll128": 8.5, "simple": 14.0}, "ring": {"ll": 2.7, "ll128": 4.0, "simple": 14.0},
            "nvls": {"simple": 18.0}},
}
# Per GPU generation (Volta, Ampere, Hopper) and node count (1, 2, 4 or more). LL's cap: within a
# node by the GPU, across nodes by the CPU (Intel's row, Volta's, is taken: x86 Intel hosts).
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0)}
PER_CH_MAX_RING_LL128_BW = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 36.7)}
PER_CH_MAX_TREE_BW = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
PER_CH_MAX_TREE_LL128_BW = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0)}
# Tree all-reduce's correction by size (powers of two from 64 B to 256 MiB), per protocol.
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
NET_OVERHEAD_US = 1.0  # an x86 Intel host's per-step network post overhead (AMD's: 2.0)
ORDER = {"algo": ("tree", "ring", "nvls"), "proto": ("ll", "ll128", "simple")}  # NCCL's loop order: a tie keeps the first


def _generation(c: Cluster) -> str:
    cc = c.compute_capability[0] * 10 + c.compute_capability[1]
    return "hopper" if cc >= 90 else "ampere" if cc >= 80 else "volta"


def _steps(op: str, ranks: int) -> int:
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1 if op in ("all_gather", "reduce_scatter") else ranks


def nccl_estimate_us(c: Cluster, op: str, nbytes: int, ranks: int, nodes: int, algo: str, proto: str,
                     ring_GBps: float) -> float:
    """NCCL's own estimate of a call's time (``ncclTopoGetAlgoTime``, one call in flight).

    Args:
        c: the simulated cluster.
        op: the collective.
        nbytes: its bytes as NCCL counts them (an all-gather's: every rank's).
        ranks: communicator size.
        nodes: nodes it spans.
        algo: ring, tree or nvls.
        proto: ll, ll128 or simple.
        ring_GBps: what NCCL's topology search finds its channels carry together (nChannels x bw).
    Returns:
        Microseconds.
    """
    gen, idx = _generation(c), nodes - 1 if nodes <= 2 else 2
    channels = NVLS_CHANNELS if algo == "nvls" else c.default_channels
    ll_max = LL_MAX_BW[gen if nodes == 1 else "volta"][idx]
    steps = _steps(op, ranks)
    bus = ring_GBps
    if algo == "ring" and proto == "ll":
        bus = min(ll_max, bus * 0.5)
    if algo == "ring" and proto == "ll128":
        bus = min(bus * 0.92, channels * PER_CH_MAX_RING_LL128_BW[gen][idx])
    if algo == "tree" and op == "all_reduce":
        bus = min(bus * 0.92, channels * PER_CH_MAX_TREE_BW[gen][idx])
    if algo == "tree" and proto == "ll":
        bus = min(bus / 3.8, ll_max)
    if algo == "tree" and proto == "ll128":
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), channels * PER_CH_MAX_TREE_LL128_BW[gen][idx])
    # bus bandwidth to algorithm bandwidth
    bw = bus * (ranks / steps if algo == "ring" else 5.0 / 6.0 if algo == "nvls" else 0.5)
    intra_kind = "nvlink" if c.nvlink else "pci"
    intra = HW_LAT[intra_kind][algo][proto]
    ppn = ranks / nodes
    inter = HW_LAT["net"]["tree" if ppn == 1 else algo][proto]
    lat = BASE_LAT[algo][proto]
    if algo == "ring":
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if proto == "simple" else 1))
        inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
        lat += (steps - inter_steps) * intra + inter_steps * inter
        if proto == "simple" and nodes > 1 and op == "all_reduce" and nbytes / (channels * ranks) >= 64:
            lat *= 1.4 if gen != "volta" else 1.9  # the ring's plateau
    elif algo == "tree":
        lat += 2 * ((ranks // nodes - 1) * intra + int(math.log2(nodes)) * inter)
        log_size = (nbytes >> 6).bit_length() - 1
        if 0 <= log_size < len(TREE_CORRECTION[proto]):
            bw *= TREE_CORRECTION[proto][log_size]
    else:  # NVLS within a node
        lat = intra
    return lat + nbytes / (1000 * bw)


def nccl_choice(c: Cluster, op: str, nbytes: int, ranks: int, nodes: int, pairs: list[tuple[str, str]],
                link_Bps: float) -> tuple[str, str]:
    """The (algorithm, protocol) NCCL's cost model gives a call, among the pairs it runs there.

    Args:
        c: the simulated cluster.
        op: the collective.
        nbytes: its bytes (an all-gather's or reduce-scatter's: every rank's).
        ranks: communicator size.
        nodes: nodes it spans.
        pairs: the pairs offered (``nccl_knobs.measured_pairs``).
        link_Bps: bytes/s of the link its channels share (``sim_comm.link_of``).
    Returns:
        The pair with the least estimate, NCCL's loop order breaking ties.
    """
    ring = min(c.default_channels * c.per_channel, link_Bps) / GB

    def rank(pair: tuple[str, str]) -> tuple:
        a, p = pair
        bandwidth = c.link / GB if a == "nvls" else ring
        return (nccl_estimate_us(c, op, nbytes, ranks, nodes, a, p, bandwidth), ORDER["algo"].index(a), ORDER["proto"].index(p))

    return min(pairs, key=rank)
