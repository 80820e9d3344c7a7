"""NCCL's own log, as the worker that observes NCCL's choices reads it: what NCCL ran each call with.

The tuner plugin sees the algorithm and protocol NCCL picks (``nccl_tuner.py``) but not its
channels, which NCCL sets after asking the plugin (``topoGetAlgoInfo`` in src/enqueue.cc). Under
``NCCL_DEBUG=INFO`` with the ``TUNING`` subsystem, a communicator's rank 0 logs every collective
it schedules, with what it runs it with (src/enqueue.cc of the NCCL 2.2x releases read, 2.28
among them; older ones log the algorithm and protocol as numbers and no channels):
``AllGather: 65536 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..23}``: the channels are
``Hi - Lo + 1``. The observing worker writes that log to ``NCCL_DEBUG_FILE``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from lagom_tune.backends.nccl_controls import TUNER_COLL
from lagom_tune.errors import UserError

FILE_ENV = "NCCL_DEBUG_FILE"
# What the observing worker's NCCL logs, and only to its file: each call's algorithm, protocol
# and channels. NCCL reads these once per process.
LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING"}
LOG_NAME = "nccl.%p.log"  # NCCL puts the process id for %p

_CALL = re.compile(r"NCCL INFO (\w{1,20}): (\d{1,20}) Bytes -> Algo (\w{1,20}) proto (\w{1,20}) channel\{Lo\.\.Hi\}=\{(\d{1,4})\.\.(\d{1,4})\}")
_OP_OF_FUNC = {func: op for op, func in TUNER_COLL.items()}


@dataclass(frozen=True)
class NcclCall:
    """One collective as NCCL logged it: what it ran it with."""

    op: str  # our op name (all_gather, ...), or NCCL's function name lowered for one we have none for
    nbytes: int  # NCCL's count times the element size (an all-gather's per-rank input)
    algo: str  # NCCL's algorithm, lowered (ring, tree, nvls, pat, ...)
    proto: str  # ll, ll128, simple
    channels: int


def calls(text: str) -> list[NcclCall]:
    """Every collective call logged in a stretch of NCCL's log, in order.

    Args:
        text: log lines.
    Returns:
        The calls (none from a rank that is no communicator's rank 0, or an NCCL that logs no such line).
    """
    out = []
    for m in _CALL.finditer(text):
        func, nbytes, algo, proto, lo, hi = m.groups()
        if int(hi) >= int(lo):
            out.append(NcclCall(_OP_OF_FUNC.get(func.lower(), func.lower()), int(nbytes), algo.lower(), proto.lower(),
                                int(hi) - int(lo) + 1))
    return out


def last_call(text: str, op: str) -> NcclCall | None:
    """The last call of ``op`` in a stretch of the log (what a collective's first call ran with,
    read right after it), or None when none was logged."""
    mine = [c for c in calls(text) if c.op == op]
    return mine[-1] if mine else None


def read_logs(paths: list[Path]) -> list[NcclCall]:
    """The calls logged in NCCL log files: each path a file, or a folder whose files are read.

    Args:
        paths: files or folders (``NCCL_DEBUG_FILE``'s).
    Returns:
        The calls, file by file.
    Raises:
        UserError: a path that is neither, or no call logged in any of them.
    """
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"--nccl-log {p}: no such file or folder")
    out = [c for f in files for c in calls(f.read_text(errors="replace"))]
    if not out:
        raise UserError(f"no collective call in {', '.join(map(str, paths))}: NCCL logs each call on a communicator's "
                        "rank 0 under NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=TUNING (set NCCL_DEBUG_FILE to keep it)")
    return out


def warnings(text: str, last: int = 3) -> list[str]:
    """NCCL's last warnings in a stretch of its log (what a failing worker adds to its error: the
    observing worker's NCCL writes them to its file, not to the terminal).

    Args:
        text: log lines.
        last: how many to keep.
    Returns:
        The warnings' text, oldest first.
    """
    return [line.split("NCCL WARN", 1)[1].strip() for line in text.splitlines() if "NCCL WARN" in line][-last:]


def log_path(pattern: str) -> Path:
    """The file NCCL writes for ``NCCL_DEBUG_FILE=pattern`` in this process (%p its id, %h its
    host name up to the first dot, as NCCL substitutes them)."""
    return Path(pattern.replace("%p", str(os.getpid())).replace("%h", socket.gethostname().split(".")[0]))


class LogReader:
    """This process's NCCL log, read in stretches: what NCCL wrote since the last reading."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_text(self) -> str:
        """The log written since the last call (empty where there is no log)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        self.offset += len(data)
        return data.decode(errors="replace")
