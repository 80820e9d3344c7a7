"""Which rank a process of the user's job is, as the runtime's records name it (the shim's
``rank-N.PID.json``, the step clock's ``steps-N.PID.json``)."""

from __future__ import annotations

import os
import sys


def process_rank(joined: int | None = None) -> str:
    """This process's rank: torchrun's ``RANK``, else the rank it gave ``init_process_group``
    (``joined``), else its rank in the default process group, else ``pidN``. Imports nothing.

    Args:
        joined: the rank this process joined a group as, where the caller saw it (None: not seen).
    Returns:
        The rank, as text.
    """
    if "RANK" in os.environ:
        return os.environ["RANK"]
    if joined is not None and joined >= 0:
        return str(joined)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return f"pid{os.getpid()}"
