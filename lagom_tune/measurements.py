"""A measurement row: the columns of a run folder's ``measurements.csv``, named once, and the
builders that assemble a row's parts: the backends, the campaign and the run folder that write
rows, and the readers that list their columns, take them from here. It imports nothing from
lagom-tune (a GEMM is anything with a workload ``Gemm``'s fields).

A row is one timed repeat of one point, and holds the groups its point has:

* identity: the point's key and kind, the backend that measured it, whether it is simulated;
* the GEMM's shape (``gemm`` and ``overlap`` points);
* the collective's op, size and ranks (``collective`` and ``overlap`` points);
* the settings it was taken at: knob values, and the nodes the collective spans (a layout no
  knob sets);
* timing and result: the repeat, its times (the overlapped ones, and the alone times measured
  right before them), the overlapped job's GEMM count, how its baseline and GEMMs were timed;
* bandwidth: nccl-tests' columns, for collective points;
* the backend's choice: for a ``default`` point (a collective timed with nothing set), the
  algorithm and protocol NCCL chose, as its tuner plugin saw them.

An ``again`` row is a point measured a second time at the profile's end: its key is the first
point's behind ``again|``, its columns are the first point's, and it is fitted to nothing (the
gap between the two is the machine's drift between moments).

The CSV lists columns in the order its rows first hold them (the groups a backend fills, in
the order it fills them), not in this module's order.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

IDENTITY_COLUMNS = ("point", "kind", "backend", "simulated")
GEMM_COLUMNS = ("gemm", "m", "n", "k", "batch", "dtype", "flops")
COLLECTIVE_COLUMNS = ("op", "nbytes", "ranks")
KNOB_COLUMNS = ("algo", "proto", "channels", "threads", "buffsize", "chunk_bytes")  # knob values a row was taken at
LAYOUT_COLUMNS = ("nodes",)  # where the collective ran: part of the point's settings, set by no knob
SETTING_COLUMNS = KNOB_COLUMNS + LAYOUT_COLUMNS
DESCRIBING_COLUMNS = IDENTITY_COLUMNS + GEMM_COLUMNS + COLLECTIVE_COLUMNS + SETTING_COLUMNS  # the same in every repeat

OVERLAPPED_COLUMNS = ("time_us", "comm_us", "window_us")  # when the compute stream, the collective and both ended
ALONE_COLUMNS = ("compute_alone_us", "comm_alone_us")  # the overlapped job's two halves, each timed alone
TIMED_COLUMNS = OVERLAPPED_COLUMNS + ALONE_COLUMNS  # a repeat takes as long as its slowest rank in each
MAX_TIME_US = 1e11  # a timed column's value, at most: about a day, a plan's longest iteration (1e300 us GEMMs were fitted)
RESULT_COLUMNS = ("repeat", *TIMED_COLUMNS,
                  "n_compute",  # GEMMs in an overlapped point's job
                  "baseline",  # PAIRED, or empty: how its alone times were measured
                  "inner",  # launches in one timed sample (a time is per launch)
                  "timing")  # how a GPU sample was launched (graph or stream)
BANDWIDTH_COLUMNS = ("algbw_GBps", "busbw_GBps")  # nccl-tests' bandwidth columns
# What the backend chose for a "default" row's collective: NCCL's own algorithm and protocol,
# observed by the tuner plugin (empty where it was not observed), and the channels NCCL ran it on,
# from its log (since 2026-12-05, second session; empty where not read); knob -> column.
CHOSEN = {"algo": "chosen_algo", "proto": "chosen_proto", "channels": "chosen_channels"}
CHOSEN_COLUMNS = tuple(CHOSEN.values())
# ... the values that make one choice, observed together or not at all (a row's choice is those;
# the others are kept where observed too)
CHOICE_KNOBS = ("algo", "proto")
CHOICE_COLUMNS = tuple(CHOSEN[k] for k in CHOICE_KNOBS)  # in every CSV holding default rows

COLUMNS = DESCRIBING_COLUMNS + RESULT_COLUMNS + BANDWIDTH_COLUMNS + CHOSEN_COLUMNS  # every column a row may hold
REQUIRED_COLUMNS = ("point", "kind", "repeat", "time_us")  # in every measurements.csv

# What a profile's row times (a replay's whole iterations are not kept). A "default" row times a
# collective with nothing set, at the backend's own choices (CHOICE_COLUMNS).
DEFAULT = "default"
AGAIN = "again"  # a point measured a second time, at the profile's end
ROW_KINDS = ("gemm", "collective", "overlap", DEFAULT, AGAIN)
# ... and the columns a CSV holding rows of a kind must have (filled or, in older profiles, empty)
KIND_COLUMNS = {
    "gemm": GEMM_COLUMNS[:-1],  # flops: derived
    "collective": COLLECTIVE_COLUMNS,
    DEFAULT: COLLECTIVE_COLUMNS + CHOICE_COLUMNS,
    "overlap": GEMM_COLUMNS[:-1] + COLLECTIVE_COLUMNS + ALONE_COLUMNS + ("n_compute",),
    AGAIN: (),  # its first point's, which that point's kind asks of the CSV
}
COUNT_COLUMNS = ("m", "n", "k", "batch", "nbytes", "ranks", "n_compute")  # whole numbers of at least 1, where filled
# ... and the columns of whole numbers, written as such ("4096", not "4096.0": pandas writes a
# column with an empty cell as floats, so flushes with and without one mixed the two in a file)
WHOLE_COLUMNS = COUNT_COLUMNS + ("flops", "repeat", "inner", "channels", "threads", "buffsize", "chunk_bytes", "nodes",
                                 CHOSEN["channels"])
TEXT_COLUMNS = ("point", "kind", "backend", "simulated", "gemm", "dtype", "op", "algo", "proto", "baseline", "timing") + CHOICE_COLUMNS
NUMERIC_COLUMNS = tuple(c for c in COLUMNS if c not in TEXT_COLUMNS)  # numbers where filled (checked on read)

# An overlapped row's ``baseline``: its alone times were measured right before it, the same way.
# Rows without it (profiles before 2026-11-30) are rebaselined by the fit from the GEMM points.
PAIRED = "paired"


def again_key(point: str) -> str:
    """The key of a point measured again (``Point.key`` of a point whose ``again`` is set).

    Args:
        point: the first point's key.
    Returns:
        ``again|`` and that key.
    """
    return f"{AGAIN}|{point}"


def first_of(point: str) -> str | None:
    """The key of the point an ``again`` row measured a second time, or None for any other row's key.

    Args:
        point: a row's point key.
    Returns:
        The first point's key, or None.
    """
    head, _, rest = point.partition("|")
    return rest if head == AGAIN and rest else None


def identity_columns(point: str, kind: str, backend: str, simulated: bool) -> dict[str, Any]:
    """A row's identity.

    Args:
        point: the point's key.
        kind: ``gemm``, ``collective``, ``overlap``, ``default``, ``again`` or ``iteration``.
        backend: the backend that measured it.
        simulated: whether its numbers come from a simulator.
    Returns:
        The identity columns, in :data:`IDENTITY_COLUMNS` order.
    """
    return dict(zip(IDENTITY_COLUMNS, (point, kind, backend, simulated)))


def gemm_columns(gemm: Any) -> dict[str, Any]:
    """The GEMM a row was taken with.

    Args:
        gemm: a workload ``Gemm`` (its ``shape_key``, ``m``, ``n``, ``k``, ``batch``, ``dtype``, ``flops``).
    Returns:
        The GEMM columns, in :data:`GEMM_COLUMNS` order.
    """
    return dict(zip(GEMM_COLUMNS, (gemm.shape_key, gemm.m, gemm.n, gemm.k, gemm.batch, gemm.dtype, gemm.flops)))


def collective_columns(op: str, nbytes: int, ranks: int) -> dict[str, Any]:
    """The collective a row was taken with.

    Args:
        op: the collective op.
        nbytes: its size (nccl-tests' convention).
        ranks: ranks in its communicator.
    Returns:
        The collective columns, in :data:`COLLECTIVE_COLUMNS` order.
    """
    return dict(zip(COLLECTIVE_COLUMNS, (op, nbytes, ranks)))


def chosen_settings(row: Mapping[str, Any]) -> dict[str, Any]:
    """What the backend chose for a ``default`` row's collective, as knob values.

    Args:
        row: a row (or point median) of kind ``default``.
    Returns:
        Knob name -> value: ``algo`` and ``proto``, with ``channels`` where that was observed too;
        empty unless both ``algo`` and ``proto`` were.
    """
    pair = {knob: row.get(CHOSEN[knob]) for knob in CHOICE_KNOBS}
    if not all(isinstance(val, str) for val in pair.values()):
        return {}
    channels = row.get(CHOSEN["channels"])
    observed = isinstance(channels, numbers.Real) and math.isfinite(channels) and channels >= 1
    return {**pair, **({"channels": int(channels)} if observed else {})}


def timed_columns(time_us: float, inner: int | None = None, timing: str | None = None) -> dict[str, Any]:
    """One repeat of a GEMM, a collective or a whole iteration.

    Args:
        time_us: its time (per launch when a sample held several).
        inner: launches in the timed sample, where the backend repeats short ones.
        timing: how the sample was launched, where a GPU backend says so.
    Returns:
        ``time_us``, then ``inner`` and ``timing`` where given.
    """
    row: dict[str, Any] = {"time_us": time_us}
    if inner is not None:
        row["inner"] = inner
    if timing is not None:
        row["timing"] = timing
    return row


def overlap_columns(time_us: float, comm_us: float, n_compute: int, compute_alone_us: float,
                    comm_alone_us: float) -> dict[str, Any]:
    """One repeat of an overlapped point: ``n_compute`` GEMMs and a collective started together.

    Args:
        time_us: when the compute stream ended (from the common start).
        comm_us: when the collective ended.
        n_compute: GEMMs in the job.
        compute_alone_us: the ``n_compute`` GEMMs' time alone.
        comm_alone_us: the collective's time alone.
    Returns:
        The overlapped times (``window_us``: whichever stream ended last), ``n_compute``, and
        the alone times.
    """
    return {"time_us": time_us, "comm_us": comm_us, "window_us": max(time_us, comm_us), "n_compute": n_compute,
            "compute_alone_us": compute_alone_us, "comm_alone_us": comm_alone_us}
