"""The gloo backend's knobs, apart from its torch code so that loading a gloo plan imports no torch.

Knobs are the ones a CPU data-parallel job really has, each verified to change measured time:
intra-op threads per rank (``torch.set_num_threads``), DDP's ``bucket_cap_mb`` (which sizes the
gradient all-reduces) and all-reducing in chunks.
"""

from __future__ import annotations

from typing import Any

from lagom_tune.backends.registry import max_threads_per_rank, usable_cores
from lagom_tune.knobs import Knob, KnobSpace
from lagom_tune.workload.bucketing import DDP_DEFAULT_CAP_MB

BUCKET_CAPS_MB = (1, 2, 4, 8, 16, 25, 50)
CHUNKS = (0, 1 << 18, 1 << 20, 1 << 22)  # 0: the whole tensor in one call
WIDEST_CORES = 1 << 10  # a fingerprint without ``cores``: every thread count a plan may hold


def gloo_knob_space(cores: int | None = None, ranks: int = 1) -> KnobSpace:
    """The gloo knobs for a machine.

    Args:
        cores: CPU cores per machine (default: those this process may use, ``registry.usable_cores``).
        ranks: ranks on the machine: thread counts that would oversubscribe its cores are left out
            (``registry.max_threads_per_rank``).
    Returns:
        threads (process), bucket_cap_mb and chunk_bytes (communicator).
    """
    most = max_threads_per_rank(cores or usable_cores(), ranks)
    threads = tuple(t for t in (1, 2, 4, 8, 16) if t <= most)
    return KnobSpace(
        (
            Knob(
                "threads", "process", threads, 1, comm_direction=-1, mechanism="torch.set_num_threads + OMP_NUM_THREADS",
                env="OMP_NUM_THREADS",
                description="intra-op threads per rank (torchrun's default is 1 per rank)",
            ),
            Knob(
                "bucket_cap_mb", "communicator", BUCKET_CAPS_MB, DDP_DEFAULT_CAP_MB, comm_direction=1, ops=("all_reduce",),
                mechanism="DistributedDataParallel(bucket_cap_mb=...)",
                description="DDP gradient bucket size: smaller buckets start communicating earlier",
            ),
            Knob(
                "chunk_bytes", "communicator", CHUNKS, 0, comm_direction=0, ops=("all_reduce",),
                mechanism="DDP comm hook / dist.all_reduce wrapper: all-reduce in chunks, all in flight",
                description="split each all-reduce into chunks of this size (0: one call)",
            ),
        )
    )


def knob_space_from_fingerprint(fingerprint: dict[str, Any]) -> KnobSpace:
    """The registry's knob-space function for gloo.

    Args:
        fingerprint: a run folder's fingerprint, or {} for the widest space any plan may hold.
    Returns:
        The knobs for the profiled machine's cores and ranks (all of a gloo profile's ranks run on it).
    """
    return gloo_knob_space(cores=fingerprint.get("cores", WIDEST_CORES), ranks=fingerprint.get("ranks", 1))
