"""The step clock: when each optimizer step ends, in every process of a training run, with no
change to the training script; what ``lagom-tune trial`` times a run by.

A process started with :data:`STEPS_ENV` naming a folder (``trial`` sets it, and
``site/sitecustomize.py`` installs the clock) registers torch.optim's global step hook once
``torch.optim`` is imported: every optimizer of ``torch.optim`` calls it after each ``step()``.
The process writes ``steps-RANK.PID.json`` to the folder at exit, and while it steps at most every
:data:`FLUSH_S` (a process ended by ``os._exit`` or killed keeps what it had). A script with
several optimizers steps each once per iteration: the clock keeps the one stepped most often.
Nothing heavy is imported before the script imports torch itself.

On a GPU the hook runs when the CPU has queued a step, not when the GPU has run it; the mean
interval over many steps is the GPU's step time all the same once the CPU is paced by the GPU,
as it is when the script waits for it each step (``loss.item()``, a log line) or, failing that,
once CUDA's launch queue is full. The clock never synchronises, so both arms of a trial run
exactly the script's own schedule.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.errors import UserError
from lagom_tune.runtime.after_import import when_imported
from lagom_tune.runtime.ranks import process_rank

STEPS_ENV = "LAGOM_TUNE_STEPS_DIR"  # the folder each process of a timed run writes its step times to
FLUSH_S = 5.0  # a stepping process rewrites its file at most this often (and at exit)
HOOKED_MODULE = "torch.optim.optimizer"  # where register_optimizer_step_post_hook lives (torch >= 2.0)


class StepClock:
    """One process's optimizer steps: the ``time.perf_counter()`` at the end of each, per optimizer."""

    def __init__(self, folder: str):
        self.folder = folder
        self.times: dict[int, list[float]] = {}  # id(optimizer) -> its steps' end times
        self.written = time.perf_counter()

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch.optim's global post-step hook."""
        now = time.perf_counter()
        self.times.setdefault(id(optimizer), []).append(now)
        if now - self.written > FLUSH_S:
            self.write()

    def write(self) -> None:
        """Write this process's steps (nothing when it stepped no optimizer: a launcher, a helper)."""
        if not self.times:
            return
        self.written = time.perf_counter()
        times = max(self.times.values(), key=len)  # the first of the most stepped: dicts keep insertion order
        record = {"rank": process_rank(), "pid": os.getpid(), "times": [round(t - times[0], 7) for t in times]}
        try:
            atomic_write_text(Path(self.folder) / f"steps-{record['rank']}.{os.getpid()}.json", json.dumps(record))
        except (UserError, OSError) as e:  # a full disk must not end the user's training: say so once, go on
            sys.stderr.write(f"[lagom-tune] step times not recorded in pid {os.getpid()} ({e}); the training goes on\n")
            self.times.clear()


def install_step_clock(folder: str) -> StepClock:
    """Time this process's optimizer steps into ``folder`` (see the module's docstring).

    Args:
        folder: where to write ``steps-RANK.PID.json``.
    Returns:
        The clock.
    """
    clock = StepClock(folder)
    when_imported({HOOKED_MODULE: lambda module: module.register_optimizer_step_post_hook(clock.on_step)})
    atexit.register(clock.write)
    return clock


def read_steps(folder: str | Path) -> dict[str, list[float]]:
    """Each rank's step end times (seconds from its first), from the files the run's processes
    wrote: per rank, the process with the most steps (a restarted rank's longest attempt).
    Unreadable files are skipped (files are written whole, atomically).

    Args:
        folder: the folder given to :func:`install_step_clock`.
    Returns:
        Rank -> its step end times.
    """
    out: dict[str, list[float]] = {}
    for f in sorted(Path(folder).glob("steps-*.json")):
        try:
            data = json.loads(f.read_text())
            rank, times = str(data["rank"]), [float(t) for t in data["times"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if len(times) > len(out.get(rank, [])):
            out[rank] = times
    return out


def step_seconds(times: list[float], warmup: int) -> float:
    """The mean step time after ``warmup`` steps: the time from the end of step ``warmup + 1`` to the
    end of the last, over the steps in between (step 1 is never timed: its start is not seen).

    Args:
        times: one process's step end times, in order.
        warmup: steps left out before the timing starts.
    Returns:
        Seconds per step.
    Raises:
        UserError: fewer than ``warmup + 2`` steps, so no step was timed.
    """
    if len(times) < warmup + 2:
        raise UserError(f"{len(times)} optimizer step(s) seen, too few to time any after --warmup {warmup}: "
                        f"run at least {warmup + 2} steps, or lower --warmup")
    return (times[-1] - times[warmup]) / (len(times) - 1 - warmup)
