"""NCCL's knobs at the scopes they can really be deployed at (DESIGN.md §9).

* ``algo``, ``proto``, ``channels`` per collective: rules our NCCL tuner plugin reads
  (``backends/lagom_tuner.c``, loaded through ``NCCL_TUNER_PLUGIN``), one rule per collective and
  byte range.
* ``threads`` (``NCCL_NTHREADS``) and ``buffsize`` (``NCCL_BUFFSIZE``) per process: NCCL reads its
  environment once, so one value for every communicator of a rank.

Per-communicator CTA limits (``ProcessGroupNCCL.Options().config.min_ctas/max_ctas``) are derived
from the chosen channels when a plan is written, so NCCL never overrides the tuner's choice.
"""

from __future__ import annotations

import math
from typing import Any

from lagom_tune.backends.sim_clusters import CLUSTERS, Cluster
from lagom_tune.errors import UserError
from lagom_tune.knobs import Knob, KnobSpace

ALGOS = ("ring", "tree")
NVLS = "nvls"  # NVLink SHARP: all-reduce within an NVSwitch node, Simple only; NCCL's default there
PROTOS = ("ll", "ll128", "simple")
# NCCL runs all-to-all as send/recv: NCCL_PROTO and a tuner plugin never reach it, so only the
# default protocol is measured, searched or planned for it.
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
CHANNELS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
THREADS = (64, 128, 256, 512)
BUFFSIZES = (1 << 20, 2 << 20, 4 << 20, 8 << 20)
MIB = 1 << 20
# NCCL enables LL128 by default only on GPUs of these compute capabilities, all alike, linked by
# NVLink within a node ("other cases are not tested and may cause silent data corruption",
# src/graph/tuning.cc, 2.19-2.28); elsewhere its cost table marks LL128 unavailable, so no tuner
# plugin can pick it. An A40 (8.6) or GPUs that reach each other over PCIe never run it.
LL128_CAPABILITIES = ((7, 0), (8, 0), (9, 0), (10, 0), (12, 0))
# What a channel of each protocol runs with. NCCL_NTHREADS sizes the CTAs of Simple and LL, never
# LL128's, which run NCCL_LL128_NTHREADS (640 unless set; tuning.cc's maxThreads[*][LL128]);
# NCCL_BUFFSIZE sizes Simple's buffer only, LL's and LL128's are NCCL's own, flags included
# (init.cc's DEFAULT_LL_BUFFSIZE, 8 lines per thread x 512 threads x 8 steps x 16 B, and
# DEFAULT_LL128_BUFFSIZE, 120 elements per thread x 640 threads x 8 steps x 8 B; DESIGN.md §10
# gives LL 655,360 B, the product with 640 threads, not LL's 512).
LL128_THREADS = 640
PROTOCOL_BUFFERS = {"ll": 8 * 512 * 8 * 16, "ll128": 120 * LL128_THREADS * 8 * 8}


def channel_run(proto: str, threads: float, buffsize: float) -> tuple[float, float]:
    """The threads and buffer bytes a channel of ``proto`` runs with under the threads and
    buffsize knobs (NCCL_NTHREADS, NCCL_BUFFSIZE), which size only some protocols' channels.

    Args:
        proto: the protocol.
        threads: the threads knob's value.
        buffsize: the buffsize knob's value.
    Returns:
        (threads, buffer bytes): the knobs' values for Simple; LL's threads and its own buffer;
        LL128's own 640 threads and buffer.
    """
    run_threads = threads if sized_by(proto, "threads") else LL128_THREADS
    return run_threads, (buffsize if sized_by(proto, "buffsize") else PROTOCOL_BUFFERS[proto])


def pipeline_steps(op: str, algo: str, ranks: int) -> int:
    """The steps one chunk of a collective takes around its communicator, as NCCL's algorithms
    move it: a ring all-reduce's reduce-scatter then all-gather, ``2 (n - 1)``; a tree all-reduce up
    and down, ``2 ceil(log2 n)``; NVLS a reduced load then a multicast store, 2; every other op
    (all-gather, reduce-scatter, all-to-all's sends) ``n - 1``, and a copy on one GPU 1. However
    few bytes a channel carries, it takes at least these steps, each with its handshake.

    Args:
        op: the collective (or the probe's copy).
        algo: NCCL's algorithm.
        ranks: the communicator's size.
    Returns:
        The steps, at least 1.
    """
    if algo == NVLS:
        return 2
    if op == "all_reduce":
        return 2 * max(1, math.ceil(math.log2(max(ranks, 2)))) if algo == "tree" else 2 * (ranks - 1)
    return max(1, ranks - 1)


def sized_by(proto: str, knob: str) -> bool:
    """Whether the process knob ``knob`` (threads or buffsize) sizes a channel of ``proto``: what a
    profile varies it for.

    Args:
        proto: the protocol.
        knob: ``threads`` (NCCL_NTHREADS: Simple and LL) or ``buffsize`` (NCCL_BUFFSIZE: Simple).
    Returns:
        The answer.
    """
    return proto != "ll128" if knob == "threads" else proto not in PROTOCOL_BUFFERS


# NCCL gives each channel at least this much of a call's traffic (scheduleCollTasksToPlan's
# MinTrafficPerChannel: 16 KiB in NCCL 2.2x, 32 KiB in newer releases, src/include/channel.h's
# ncclMinTrafficPerChannel), so a small call runs on fewer channels than its communicator has.
# The larger is taken: no NCCL's own trimming then reads as a rule not applied.
MIN_TRAFFIC_PER_CHANNEL = 32 << 10


def call_traffic(op: str, nbytes: int, proto: str) -> int:
    """The traffic NCCL spreads a call over its channels with (ncclFuncTrafficPerByte: an
    all-reduce's twice its bytes; LL's four times, flags included).

    Args:
        op: the collective.
        nbytes: its bytes (an all-gather's or reduce-scatter's: every rank's).
        proto: the protocol it runs.
    Returns:
        Bytes of traffic.
    """
    return nbytes * (2 if op == "all_reduce" else 1) * (4 if proto == "ll" else 1)


def channels_for_call(op: str, nbytes: int, proto: str, most: int) -> int:
    """The channels NCCL runs a call on: as many as give each :data:`MIN_TRAFFIC_PER_CHANNEL`, at
    most ``most`` (the communicator's), at least one.

    Args:
        op: the collective.
        nbytes: its bytes (every rank's).
        proto: the protocol it runs.
        most: the channels it may run on.
    Returns:
        The channel count.
    """
    return max(1, min(most, -(-call_traffic(op, nbytes, proto) // MIN_TRAFFIC_PER_CHANNEL)))


def ll128_offered(capabilities: list[tuple[int, int]], nvlink: bool) -> bool:
    """Whether NCCL offers the LL128 protocol on a job (what the knob space may then hold).

    Args:
        capabilities: every rank's GPU compute capability, (major, minor).
        nvlink: whether the GPUs of a node reach each other over NVLink (every pair).
    Returns:
        The answer: one capability NCCL enables it on, shared by all, and NVLink. Across nodes
        NCCL also wants each GPU's NIC near it (at most PCIe switches away), which is not checked
        here: where it fails, NCCL keeps its own choice and the plugin logs the rule it skipped.
    """
    return nvlink and len(set(capabilities)) == 1 and capabilities[0] in LL128_CAPABILITIES


def nccl_knob_space(max_channels: int = 64, default_channels: int = 16, nvls: bool = False, ll128: bool = True) -> KnobSpace:
    """The NCCL knobs for a GPU.

    Args:
        max_channels: the most channels worth offering (NCCL's limit, at most half the SMs).
        default_channels: NCCL's default channel count (rounded down to an offered value).
        nvls: whether the node's NVSwitch reduces (NVLS, Hopper): then ``nvls`` is an algorithm
            for all-reduce within a node, with the Simple protocol, and NCCL's default there.
        ll128: whether NCCL offers the LL128 protocol there (:func:`ll128_offered`).
    Returns:
        algo, proto, channels (collective scope), threads and buffsize (process scope).
    """
    protos = tuple(p for p in PROTOS if ll128 or p != "ll128")
    channels = tuple(c for c in CHANNELS if c <= max_channels)
    default_channels = max(c for c in channels if c <= default_channels)
    nvls_only = (NVLS, ("all_reduce",))
    return KnobSpace((
        Knob("algo", "collective", ALGOS + ((NVLS,) if nvls else ()), "ring", comm_direction=0,
             mechanism="lagom-tune NCCL tuner plugin (NCCL_TUNER_PLUGIN)", description="collective algorithm",
             only_for=(("tree", ("all_reduce",)),) + ((nvls_only,) if nvls else ()),
             within_node=(NVLS,) if nvls else (), default_where=(nvls_only,) if nvls else (),
             needs=((NVLS, "proto", ("simple",)),) if nvls else ()),
        Knob("proto", "collective", protos, "simple", comm_direction=0, mechanism="NCCL tuner plugin",
             description="protocol: LL (latency), LL128 (where NCCL offers it), Simple (bandwidth)",
             only_for=tuple((p, COLLECTIVE_OPS) for p in protos if p != "simple")),
        Knob("channels", "collective", channels, default_channels, mechanism="NCCL tuner plugin; communicator max_ctas",
             description="channels (one CTA, one SM each)"),
        Knob("threads", "process", THREADS, 512, mechanism="NCCL_NTHREADS", env="NCCL_NTHREADS",
             description="threads per channel CTA of Simple and LL (LL128 runs its own 640)"),
        Knob("buffsize", "process", BUFFSIZES, 4 * MIB, mechanism="NCCL_BUFFSIZE", env="NCCL_BUFFSIZE",
             description="per-channel staging buffer; a step moves buffsize/8 (Simple)"),
    ))


def knob_space_from_fingerprint(fingerprint: dict[str, Any]) -> KnobSpace:
    """The registry's knob-space function for NCCL-shaped backends (nccl, sim).

    Args:
        fingerprint: a run folder's fingerprint: a simulated cluster's name, or the channel bounds
            the nccl backend measured under (and whether NCCL offered NVLS); {} for the widest
            space any plan may hold.
    Returns:
        The NCCL knobs with that machine's channel bounds.
    Raises:
        UserError: for a cluster the simulator does not have.
    """
    name = fingerprint.get("cluster")
    cluster = CLUSTERS.get(name) if isinstance(name, str) else None
    if name is not None and cluster is None:  # read as another machine's space, it blamed the rows
        raise UserError(f"cluster {name!r} (a run folder's meta.yaml, a plan's target.hardware) is no simulated cluster: "
                        f"{', '.join(CLUSTERS)}; was the file edited?")
    if cluster:
        return cluster_knob_space(cluster)
    # NVLS where the nccl backend found NCCL would offer it (profiles before 2026-12-03 measured
    # none), LL128 unless it found NCCL would not (profiles before 2026-12-05 measured it
    # everywhere); the widest space, for a plan of any machine, holds both
    return nccl_knob_space(int(fingerprint.get("max_channels", 64)), int(fingerprint.get("default_channels", 16)),
                           bool(fingerprint.get("nvls", not fingerprint)), bool(fingerprint.get("ll128", True)))


def cluster_knob_space(c: Cluster) -> KnobSpace:
    """The NCCL knobs of a simulated cluster's GPUs (what its profile measures, a plan of it holds).

    Args:
        c: the cluster.
    Returns:
        Its channel bounds, NVLS where its NVSwitch reduces, LL128 where NCCL would offer it.
    """
    return nccl_knob_space(c.max_channels, c.default_channels, c.nvls, cluster_offers_ll128(c))


def cluster_offers_ll128(c: Cluster) -> bool:
    """Whether NCCL offers LL128 on a simulated cluster's GPUs (:func:`ll128_offered`).

    Args:
        c: the cluster.
    Returns:
        The answer, from its compute capability and NVLink.
    """
    return ll128_offered([c.compute_capability], c.nvlink)


def measured_pairs(space: KnobSpace, op: str, nodes: int) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs a profile times ``op`` alone with: every pair NCCL runs for
    it on ``nodes`` nodes (NVLS only within a node, with Simple).

    Args:
        space: the NCCL knobs on the profiled machine.
        op: a collective op.
        nodes: the nodes its communicator spans.
    Returns:
        The pairs, in domain order.
    """
    return [(a, p) for a in space["algo"].domain_for({op}, nodes) for p in space["proto"].domain_for({op})
            if not space.conflict({"algo": a, "proto": p})]


def overlap_algos(space: KnobSpace, op: str, nodes: int) -> tuple[str, ...]:
    """The algorithms a profile times ``op`` beside GEMMs with: the ring, and NCCL's own default
    for it where that is another (NVLS for an all-reduce within an NVSwitch node), so the model
    learns the contention of what runs when nothing is set.

    Args:
        space: the NCCL knobs on the profiled machine.
        op: a collective op.
        nodes: the nodes its communicator spans.
    Returns:
        One or two algorithms.
    """
    return tuple(dict.fromkeys((space["algo"].default, space.defaults(op, nodes)["algo"])))


def nccl_config(algo: str, proto: str, channels: int, threads: int, buffsize: int, nodes: int) -> tuple:
    """A measurement point's settings, in the one order every NCCL-shaped backend uses.

    Args:
        algo: NCCL algorithm.
        proto: NCCL protocol.
        channels: channels (CTAs).
        threads: threads per CTA.
        buffsize: staging buffer bytes.
        nodes: nodes the collective spans.
    Returns:
        The point's config: ``(name, value)`` pairs.
    """
    return (("algo", algo), ("proto", proto), ("channels", channels), ("threads", threads), ("buffsize", buffsize), ("nodes", nodes))


def categorical(knob: Knob) -> bool:
    """Knobs with no resource order (algorithm, protocol) span subspaces instead of being stepped.

    Args:
        knob: a knob.
    Returns:
        Whether it is categorical.
    """
    return knob.comm_direction == 0
