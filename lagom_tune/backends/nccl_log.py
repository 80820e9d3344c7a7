"""NCCL's own log, as the worker that observes NCCL's choices reads it: the channels each
communicator was set up with, and the channels NCCL then runs one collective on.

The tuner plugin sees the algorithm and protocol NCCL picks (``nccl_tuner.py``) but not its
channels: NCCL sets those after asking the plugin (``topoGetAlgoInfo`` in src/enqueue.cc, 2.19 to
2.28). A ring or tree starts from the communicator's channels and drops one while the collective
is smaller than ``channels x threads x threshold`` bytes; NVLS runs the communicator's NVLS
channels. The communicator's counts and thresholds are what NCCL logs at set-up under
``NCCL_DEBUG=INFO`` (src/init.cc: ``N coll channels, N collnet channels, N nvls channels, ...``;
src/graph/tuning.cc: ``threadThresholds ...`` and, on a communicator's rank 0, the ``Max NThreads``
rows of its tuning table), written to ``NCCL_DEBUG_FILE``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from lagom_tune.backends.nccl_tuner import TUNER_ALGOS, TUNER_PROTOS

FILE_ENV = "NCCL_DEBUG_FILE"
# What the observing worker's NCCL logs, and only to its file: its set-up (channels, thresholds)
# and tuning table (threads). NCCL reads these once per process.
LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING"}
LOG_NAME = "nccl.%p.log"  # NCCL puts the process id for %p
# NCCL's defaults where a log line is missing: the most threads a channel of each protocol runs
# (src/include/device.h: NCCL_LL_MAX_NTHREADS, NCCL_LL128_MAX_NTHREADS, NCCL_SIMPLE_MAX_NTHREADS)
# and the bytes per thread below which a ring or tree drops a channel (NCCL_*_THREAD_THRESHOLD;
# a ring's LL one times the communicator's ranks).
DEFAULT_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
DEFAULT_THRESHOLDS = {"ll": 8, "ll128": 8, "simple": 64}
ALGOS_PER_ROW = 3  # the tuning table prints algorithms three to a row, in NCCL's order

_CHANNELS = re.compile(r"NCCL INFO (\d{1,6}) coll channels, (?:\d{1,6} collnet channels, )?(?:(\d{1,6}) nvls channels, )?")
_THRESHOLDS = re.compile(r"NCCL INFO threadThresholds (\d{1,12})/(\d{1,12})/(\d{1,12}) \| (\d{1,12})/(\d{1,12})/(\d{1,12})")
_THREADS = re.compile(r"NCCL INFO\s+Max NThreads \|((?:\s*\d{1,6} \|){1,9})")


@dataclass(frozen=True)
class CommChannels:
    """One communicator's channel set-up as NCCL logged it."""

    coll: int  # comm->nChannels: where a ring or tree starts
    nvls: int = 0  # comm->nvlsChannels: what NVLS runs (0: not logged, no NVLS)
    thresholds: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (algo, proto) -> bytes per thread: tree, ring
    threads: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (algo, proto) -> most threads (rank 0's table)

    def channels_for(self, algo: str, proto: str, nbytes: int) -> int | None:
        """The channels NCCL runs a collective of ``nbytes`` on with ``algo`` and ``proto``, as
        ``topoGetAlgoInfo`` sets them when no tuner sets any.

        Args:
            algo: NCCL's algorithm (``nccl_tuner.TUNER_ALGOS``).
            proto: its protocol.
            nbytes: the collective's size as NCCL counts it (the larger of send and receive).
        Returns:
            The channel count; None for CollNet (its own rule, not followed here) or an NVLS count
            the log did not give.
        """
        if algo in ("nvls", "nvls_tree"):
            return self.nvls or None
        if algo.startswith("collnet"):
            return None
        nc = self.coll
        per_channel = self.threads.get((algo, proto), DEFAULT_THREADS[proto]) * \
            self.thresholds.get((algo, proto), DEFAULT_THRESHOLDS[proto])
        while nbytes < nc * per_channel and nc >= 2:
            nc -= 1
        return nc


def communicators(text: str) -> list[CommChannels]:
    """Every communicator set up in a stretch of NCCL's log, in order: each ``coll channels``
    line with the thresholds and threads NCCL logged before it.

    Args:
        text: log lines.
    Returns:
        One entry per communicator.
    """
    out = []
    thresholds: dict[tuple[str, str], int] = {}
    threads: dict[tuple[str, str], int] = {}
    row = 0
    for line in text.splitlines():
        if m := _THREADS.search(line):
            values = [int(v) for v in m.group(1).split("|") if v.strip()]
            for i, n in enumerate(values):
                a = row * ALGOS_PER_ROW + i // len(TUNER_PROTOS)
                if a < len(TUNER_ALGOS):
                    threads[(TUNER_ALGOS[a], TUNER_PROTOS[i % len(TUNER_PROTOS)])] = n
            row += 1
        elif m := _THRESHOLDS.search(line):
            values = [int(v) for v in m.groups()]
            thresholds = {(algo, proto): values[i * len(TUNER_PROTOS) + j]
                          for i, algo in enumerate(("tree", "ring")) for j, proto in enumerate(TUNER_PROTOS)}
        elif m := _CHANNELS.search(line):
            out.append(CommChannels(int(m.group(1)), int(m.group(2) or 0), thresholds, threads))
            thresholds, threads, row = {}, {}, 0
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
