"""The k-fold split's fits side by side: this process and spawned workers share them.

The folds' fits share nothing, and a GPU profile's take seconds each: a simulated 8-GPU llama3-8b
profile fits 11 models of about 2 s on one core (bench/results/fit_speed.md), several times its
seconds of measuring. A
worker costs a fresh interpreter that imports torch (about 2 s) before its first fit, so the
first fit runs here and is timed: a profile whose fits are quicker than :data:`POOL_WORTH_S` fits
them all here. A fit gives the same model wherever it runs (torch on one thread, the same rows)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from lagom_tune.backends.parent_watch import exit_with_parent, sigint_blocked
from lagom_tune.errors import RunError, UserError

POOL_WORTH_S = 1.0  # a first fit at least this long shares the rest with workers


def _start_worker(parent: int) -> None:
    """A worker leaves Ctrl-C to its parent, which stops it, and ends when the parent does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)


def _call(task: tuple[int, Callable[..., Any], tuple, dict[str, str]]) -> tuple[int, Any]:
    """One task, here or in a worker: its index and result (a :class:`UserError` as its result)."""
    index, fn, args, numpy_errors = task
    try:
        with np.errstate(**numpy_errors):
            return index, fn(*args)
    except UserError as e:  # the caller's to report: a fold that cannot be fitted is one line of its output
        return index, e


def run_each(fn: Callable[..., Any], calls: Sequence[tuple], *, workers: int, done: Callable[[int], None] | None = None,
             worth_s: float = POOL_WORTH_S) -> list[Any]:
    """``fn(*args)`` for each ``args`` of ``calls``: the first in this process; the others, if it
    took ``worth_s`` or longer, by this process and up to ``workers - 1`` spawned ones side by
    side, else here too.

    Spawned workers import the ``__main__`` module as Python's ``multiprocessing`` does: a script
    that asks for more than one worker must guard its top level (``if __name__ == "__main__"``).

    Args:
        fn: a module-level function (workers import it by name); its arguments and result pickle.
        calls: each call's positional arguments.
        workers: the most processes to run at once, this one included (1: all here).
        done: called with the number of calls finished, after each.
        worth_s: the first call's duration from which workers pay off.
    Returns:
        Each call's result in the order of ``calls``, computed under this process's numpy
        floating-point error handling; a call that raised :class:`UserError` has the error as its
        result. Any other exception is raised here, and the workers stopped.
    Raises:
        RunError: a worker ended without its result (killed, out of memory, or its ``__main__``
            could not be imported).
    """
    tick = done or (lambda n: None)
    if not calls:
        return []
    numpy_errors = np.geterr()  # a worker warns of overflows as this process would (fit_run: not at all)
    start = time.perf_counter()
    results = {0: _call((0, fn, calls[0], numpy_errors))[1]}
    tick(1)
    rest = [(i, fn, args, numpy_errors) for i, args in enumerate(calls) if i > 0]
    if workers < 2 or time.perf_counter() - start < worth_s:
        for task in rest:
            results[task[0]] = _call(task)[1]
            tick(len(results))
    elif rest:
        with closing(_alongside(rest, min(workers - 1, len(rest)))) as finished:  # an interrupt in tick stops them too
            for index, result in finished:
                results[index] = result
                tick(len(results))
    return [results[i] for i in range(len(calls))]


def _alongside(tasks: list[tuple], helpers: int) -> Iterator[tuple[int, Any]]:
    """Each task's ``(index, result)`` as it is finished, by this process and ``helpers`` spawned
    ones working through them together (a helper is given its next task as this process finishes
    one: with tasks of one length, none waits long).

    The helpers start with SIGINT blocked (a Ctrl-C while one imported torch printed its traceback
    after the parent's one line), and are stopped when this ends, by its last result or by an
    exception (a Ctrl-C here)."""
    pending = deque(tasks)
    # spawned: a fork would copy torch's and BLAS's thread pools in whatever state they were
    pool = ProcessPoolExecutor(helpers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                               initargs=(os.getpid(),))
    finished = False
    try:
        queued: set[Future] = set()

        def feed() -> None:
            while pending and len(queued) < helpers:
                queued.add(pool.submit(_call, pending.popleft()))

        with sigint_blocked():  # a Ctrl-C meanwhile is raised as it ends
            feed()  # the helpers start here
        while pending or queued:
            for future in [f for f in queued if f.done()]:
                queued.discard(future)
                yield future.result()
            feed()
            if pending:
                yield _call(pending.popleft())
            elif queued:
                wait(queued, return_when=FIRST_COMPLETED)
        finished = True
    except BrokenProcessPool:
        raise RunError("a worker process fitting the folds ended without its result (killed? out of memory?)",
                       "the measurements are kept: `lagom-tune fit RUN` fits them again") from None
    finally:
        if not finished:  # stopped now, not after the fits they are running (seconds each)
            for proc in list(pool._processes.values()):  # no public way before Python 3.14's terminate_workers
                proc.terminate()
        pool.shutdown(wait=finished, cancel_futures=True)
