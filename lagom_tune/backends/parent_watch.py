"""A spawned measuring process ends when the process that spawned it does.

A profile's ranks (gloo) and GPU workers (nccl) are ``multiprocessing`` children. A parent killed
outright (SIGKILL, the OOM killer) runs no clean-up, and its children, re-parented, would go on
holding cores and GPUs until their own timeouts, slowing the very rerun that resumes the profile.
"""

from __future__ import annotations

import os
import threading
import time

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
