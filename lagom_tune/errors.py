"""The two kinds of failure the CLI distinguishes: bad input (exit 2) and runtime failure (exit 1);
and a stop asked for by a signal."""

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator


def one_line(text: str) -> str:
    """``text`` with its line breaks written as ``\\n`` (a name read from a file may hold one, and
    an error must stay one line)."""
    return text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r")


class UserError(Exception):
    """The user's input is wrong (file, flag, value). Rendered as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(one_line(str(message)))


class RunError(Exception):
    """Something failed while running (a rank died, a child crashed). Exit code 1, with a hint."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(one_line(str(message)))
        self.hint = hint


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a scheduler's stop, a closed terminal


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a scheduler's stop, a closed terminal) raised as Ctrl-C is, so that the
    same clean-up runs: spawned ranks stopped, a profile left to resume. Exit code 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


REDELIVER_S = 0.01  # how long after a lost stop it is delivered again: the callback that lost it has returned
_received: list[int] = []
# stopping: set by stopping(); depth: stops_deferred blocks open; pending: the stop they hold back
_stops: dict = {"stopping": False, "depth": 0, "pending": None}


def _stop_exception(signum: int) -> KeyboardInterrupt:
    """What a stop by ``signum`` raises: Ctrl-C's KeyboardInterrupt, else :class:`Interrupted`."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def stop_signal() -> int:
    """The signal that stopped this process: the last of :data:`STOP_SIGNALS` received, else SIGINT."""
    return _received[-1] if _received else signal.SIGINT


def raise_on_stop_signals() -> None:
    """Turn SIGTERM and SIGHUP into :class:`Interrupted` in this (the main) thread, and note each
    (and Ctrl-C's SIGINT, unless it is ignored) as it arrives, for :func:`interrupts_kept`. A stop
    raised inside a callback that cannot pass it on (a finalizer) is delivered again after it."""

    def stop(signum: int, _frame) -> None:
        _received.append(signum)  # typer returns an interrupt as exit code 130, whatever stopped it
        if _stops["depth"]:
            _stops["pending"] = signum
        elif not _stops["stopping"]:
            raise _stop_exception(signum)

    _stops["stopping"] = False
    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a job started with SIGINT ignored keeps ignoring it
        signal.signal(signal.SIGINT, stop)
    previous = sys.unraisablehook

    def stop_again(unraisable) -> None:
        # A stop raised where Python cannot pass it on (a weakref finalizer or __del__ run as an
        # object is collected: a multiprocessing queue closed mid-profile) was printed as "Exception
        # ignored ... KeyboardInterrupt" and lost, and the profile went on: deliver it again, to be
        # raised once the callback has returned: from another thread, a moment later, since any
        # way of raising it from here (signal.raise_signal, os.kill, _thread.interrupt_main) runs
        # the handler before this hook returns, where its exception is lost the same way.
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _received:
            again = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), _received[-1]))
            again.daemon = True
            again.start()
        else:
            previous(unraisable)

    if not getattr(previous, "stops_again", False):  # installed once, however often the CLI runs in one process
        stop_again.stops_again = True
        sys.unraisablehook = stop_again


@contextmanager
def stops_deferred() -> Iterator[None]:
    """Hold back the stops :func:`raise_on_stop_signals` raises while the block runs, then raise the
    last one as it would have been: the last rows of an interrupted profile are written whole,
    however many more Ctrl-Cs follow the first (a burst of them cut the final write short: 43
    points shown measured, 14 kept). Held in the handlers, not the signal mask: a process with
    other threads (torch's, a queue's) has the signal delivered to one of them, and Python runs
    the handler in the main thread all the same."""
    _stops["depth"] += 1
    try:
        yield
    except BaseException:
        _stops["pending"] = None  # the block's own exception goes first; the stop was noted
        raise
    finally:
        _stops["depth"] -= 1
    if not _stops["depth"] and _stops["pending"] is not None:  # an outer block raises it, when nested
        signum, _stops["pending"] = _stops["pending"], None
        raise _stop_exception(signum)


def stopping() -> None:
    """Say the process is ending on a stop it has reported: more stops are noted, not raised (one
    arriving as the interpreter exits was raised inside an atexit callback, a traceback printed)."""
    _stops["stopping"] = True


@contextmanager
def interrupts_kept() -> Iterator[None]:
    """Raise a stop signal that arrived while the block ran as the interrupt it is, when a library
    turned it into an error of its own: pandas' C parser reports a KeyboardInterrupt raised in its
    read callback as a ParserError, which read as a corrupt measurements file (exit 2, not 130)."""
    seen = len(_received)
    try:
        yield
    except Exception:
        if len(_received) > seen:
            raise _stop_exception(_received[-1]) from None
        raise
