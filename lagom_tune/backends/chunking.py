"""All-reducing a tensor in chunks: the one chunking the gloo profile, the DDP comm hook and the
shim's ``dist.all_reduce`` wrapper share.

It imports nothing (not even torch): the runtime shim imports it at start-up, in every rank.
"""

from __future__ import annotations

from typing import Any, Callable


def chunked_all_reduce(all_reduce: Callable[..., Any], buf: Any, chunk_bytes: int, **kwargs: Any) -> list:
    """All-reduce a contiguous ``buf`` in chunks of ``chunk_bytes``, all in flight at once.

    Args:
        all_reduce: ``dist.all_reduce`` (or the original one a wrapper replaced).
        buf: a contiguous torch tensor.
        chunk_bytes: bytes per call; 0 for the whole tensor in one call.
        **kwargs: passed on to every call (``op``, ``group``).
    Returns:
        The works of the calls, in order (each started with ``async_op=True``).
    """
    step = max(1, chunk_bytes // buf.element_size()) if chunk_bytes else buf.numel()
    flat = buf.view(-1)
    return [all_reduce(flat[i:i + step], async_op=True, **kwargs) for i in range(0, flat.numel(), step)]
