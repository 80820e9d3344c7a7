"""DDP-style gradient bucketing: how ``bucket_cap_mb`` turns per-tensor all-reduces into buckets.

Mirrors DDP's assignment (``compute_bucket_assignment_by_size``): tensors are taken in the order
their gradients become ready; a bucket closes once it holds at least its limit; the first bucket's
limit is 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), later ones ``bucket_cap_mb``.
A bucket can start only when its last tensor is ready.
"""

from __future__ import annotations

from dataclasses import replace

from lagom_tune.workload.spec import Collective, OverlapGroup

FIRST_BUCKET_BYTES = 1 << 20
MIB = 1 << 20


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
    limit = FIRST_BUCKET_BYTES

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
