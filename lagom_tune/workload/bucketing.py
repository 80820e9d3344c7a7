"""DDP-style gradient bucketing: how ``bucket_cap_mb`` turns per-tensor all-reduces into buckets.

Mirrors DDP's assignment (``compute_bucket_assignment_by_size``): tensors are taken in the order
their gradients become ready; a bucket closes once it holds at least its limit; later buckets'
limit is ``bucket_cap_mb``, and the first bucket's 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
only when DDP runs with its default cap: given one, DDP sizes its first bucket as the rest
(``_BucketCapacityConfig``; with a cap of 25 or 50 MiB the demo model's gradients were one bucket,
modelled as two until 2026-12-02). The runtime shim leaves a plan's 25 MiB, DDP's default, to
DDP, so 25 MiB here means DDP's defaults. A bucket can start only when its last tensor is ready.
"""

from __future__ import annotations

from dataclasses import replace

from lagom_tune.workload.spec import Collective, OverlapGroup

FIRST_BUCKET_BYTES = 1 << 20
MIB = 1 << 20
DDP_DEFAULT_CAP_MB = 25  # DDP's bucket_cap_mb when it is given none


def first_bucket_limit(cap_mb: float) -> int:
    """Bytes DDP's first bucket holds at least before it closes, under ``bucket_cap_mb`` (see the module docstring).

    Args:
        cap_mb: the cap (:data:`DDP_DEFAULT_CAP_MB`: DDP's defaults).
    Returns:
        The limit in bytes.
    """
    return FIRST_BUCKET_BYTES if cap_mb == DDP_DEFAULT_CAP_MB else int(cap_mb * MIB)


def bucket_collectives(comm: tuple[Collective, ...], cap_mb: float, group: str) -> tuple[Collective, ...]:
    """Coalesce consecutive all-reduces on communicator ``group`` into DDP buckets.

    Args:
        comm: a group's collectives, in stream order.
        cap_mb: ``bucket_cap_mb``.
        group: the communicator whose all-reduces are bucketed.
    Returns:
        The collectives with those all-reduces bucketed (others unchanged, in order).
    """
    out: list[Collective] = []
    pending: list[Collective] = []
    limit = first_bucket_limit(cap_mb)

    def close() -> None:
        nonlocal limit, pending
        if pending:
            names = pending[0].name if len(pending) == 1 else f"bucket[{pending[0].name}..{pending[-1].name}]"
            afters = [c.after for c in pending if c.after is not None]
            out.append(replace(pending[-1], name=names, nbytes=sum(c.nbytes for c in pending), after=max(afters) if afters else None))
            pending = []
            limit = int(cap_mb * MIB)

    for c in comm:
        if c.group != group or c.op != "all_reduce":
            close()
            out.append(c)
            continue
        pending.append(c)
        if sum(p.nbytes for p in pending) >= limit:
            close()
    close()
    return tuple(out)


def bucket_group(g: OverlapGroup, caps: dict[str, float]) -> OverlapGroup:
    """Apply each communicator's bucket cap (MiB) in ``caps`` to the group.

    Args:
        g: an overlap group.
        caps: communicator -> ``bucket_cap_mb``.
    Returns:
        The group with bucketed collectives (``g`` itself when nothing changed).
    """
    comm = g.comm
    for name, cap in caps.items():
        comm = bucket_collectives(comm, cap, name)
    return g if comm == g.comm else replace(g, comm=comm)
