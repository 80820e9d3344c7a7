"""Python objects exchanged between the ranks of a torchrun job through its rendezvous store.

The nccl backend's ranks agree on what to measure and gather every point's rows. ``torch.distributed``
offers ``broadcast_object_list`` and ``all_gather_object`` on a gloo group for this, but before torch
2.8 (pytorch/pytorch#154976) a gloo group's teardown deadlocks when one of its worker threads still
holds the last reference to a tensor made in Python, which those calls leave behind: a profile that
had written everything hung at exit, once in the suite (torch 2.5.1 under torchrun, the CPU stand-in). A store holds
bytes, not tensors, so the gloo group the ranks keep for the rendezvous runs no collective at all.
"""

from __future__ import annotations

import pickle
from typing import Any


class RankExchange:
    """Every rank's Python objects, through a ``torch.distributed`` store every rank reaches.

    Each rank calls :meth:`all_gather` and :meth:`share` in the same order (like a collective): the
    calls are numbered, and call ``n``'s keys are ``{n}/{rank}``. A rank deletes its key of call ``n``
    once it has read every rank's key of call ``n + 1``: each rank set that key after it had read
    everything of call ``n``, so the store holds two calls' objects at most, whatever the profile's length.
    """

    def __init__(self, store: Any, rank: int, world: int):
        """Args:
            store: a ``torch.distributed`` store (a ``PrefixStore`` keeps the keys apart from others').
            rank: this rank.
            world: how many ranks call.
        """
        self._store = store
        self.rank = rank
        self.world = world
        self._calls = 0

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, once every rank has given its own.

        Args:
            value: anything picklable.
        Returns:
            The ranks' values.
        Raises:
            Whatever the store raises when a rank's value does not come within its timeout.
        """
        n = self._calls
        self._calls += 1
        self._store.set(f"{n}/{self.rank}", pickle.dumps(value))
        out = [pickle.loads(self._store.get(f"{n}/{r}")) for r in range(self.world)]
        if n:
            self._store.delete_key(f"{n - 1}/{self.rank}")
        return out

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank; every rank waits for all, so none runs ahead.

        Args:
            value: rank 0's is shared; the others' are ignored.
        Returns:
            Rank 0's value.
        """
        return self.all_gather(value if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.all_gather(None)
