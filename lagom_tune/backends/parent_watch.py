"""A spawned measuring process is stopped by the process that spawned it, and ends when it does.

A profile's ranks (gloo) and GPU workers (nccl) are ``multiprocessing`` children. A parent killed
outright (SIGKILL, the OOM killer) runs no clean-up, and its children, re-parented, would go on
holding cores and GPUs until their own timeouts, slowing the very rerun that resumes the profile.
A terminal's Ctrl-C reaches the whole process group; the parent, told once, stops its children.
A child on gloo that has reported everything ends without tearing its process group down
(:func:`end_reported`).
"""

from __future__ import annotations

import os
import signal
import threading
import sys
import time
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any, Iterator, NoReturn

POLL_S = 0.5  # how often a child looks for its parent


def exit_with_parent(parent: int, poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this process (exit code 1) once its parent has gone.

    Args:
        parent: the parent's pid, as the parent gave it (a child that read its own ``getppid``
            after a slow start, importing torch, would read init's once the parent had died).
        poll_s: seconds between looks.
    Returns:
        The thread (started).
    """

    def watch() -> None:
        while os.getppid() == parent:  # once the parent dies, the child is re-parented
            time.sleep(poll_s)
        os._exit(1)  # no clean-up to wait for: nothing it would report has anyone to read it

    thread = threading.Thread(target=watch, name="lagom-parent-watch", daemon=True)
    thread.start()
    return thread


def end_reported(results: Any) -> NoReturn:
    """End a spawned measuring process on gloo once it has reported everything and passed its
    group's last barrier: its reports flushed to the parent, then out at once, its process group
    never torn down.

    Before torch 2.8 (pytorch/pytorch#154976) a gloo group is destroyed holding the GIL while it
    joins the group's worker threads, and a worker thread still freeing the last reference to a
    tensor's Python object waits for that GIL: ``destroy_process_group`` hung (torch 2.4.1: a
    stand-in NCCL worker's every batch), and the interpreter's own teardown can abort. Past the
    last barrier no peer waits for anything more from this process.

    Args:
        results: the ``multiprocessing`` queue the process reported on.
    """
    results.close()
    results.join_thread()  # its feeder thread has written every report to the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block, so that processes started in it inherit the
    mask; a Ctrl-C meanwhile is pending, and raised as the block ends."""
    # Started first: starting the resource tracker (spawn's first child does) unblocks SIGINT after.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_shielded(proc) -> None:
    """Start ``proc`` (a spawned ``multiprocessing`` process) with SIGINT blocked, for its whole life.

    A child that took Ctrl-C itself printed a traceback after the parent's one "interrupted" line
    now and then: a second Ctrl-C of a burst landed in multiprocessing's exit finalizers, or the
    first in the spawn bootstrap while it imported torch. The blocked mask is inherited through
    fork and exec and Python leaves it so; its parent stops it (``terminate``) on the way out.

    Args:
        proc: the process, not yet started.
    """
    with sigint_blocked():
        proc.start()
