"""lagom-tune's NCCL tuner plugin (``lagom_tuner.c`` beside this file) as a process sees it: the
environment NCCL and the plugin read, and the plugin's counts of NCCL's calls in this process.

Both the profile (NCCL's own choice for each collective it times with nothing set) and `apply`
(what reached NCCL of a plan's rules) read the counts of the plugin loaded in their process,
through ctypes; ``tuner_build.py`` builds it.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass
from typing import Mapping

from lagom_tune.backends.nccl_controls import TUNER_COLL

# The contract with lagom_tuner.c: keep these in step with its RULES_ENV and PLUGIN_NAME.
RULES_ENV = "LAGOM_TUNE_TUNER_RULES"
PLUGIN_ENV = "NCCL_TUNER_PLUGIN"  # NCCL loads the tuner plugin this names
PLUGIN_NAME = "lagom-tune"


@dataclass(frozen=True)
class NcclChoice:
    """NCCL's own choice for some of a process's calls: the cheapest entry of the cost table NCCL
    handed the plugin, before any rule (what NCCL runs where no rule applies)."""

    op: str  # our op name (all_gather, ...), or NCCL's for a collective we have none for (reduce)
    across_nodes: bool  # the calls' communicator spans several nodes
    min_bytes: int  # the calls' power-of-two size bucket (NCCL's nBytes, as the rules match them)
    max_bytes: int
    algo: str
    proto: str
    calls: int

    def describe(self) -> str:
        """One line: which calls, NCCL's choice, how many."""
        span = "across nodes" if self.across_nodes else "within a node"
        return f"{self.op} {self.min_bytes}..{self.max_bytes} B {span}: {self.algo}/{self.proto} x{self.calls}"


@dataclass(frozen=True)
class TunerCounts:
    """What the tuner plugin loaded in a process did with NCCL's calls there (its
    ``lagom_tuner_counts``): per rule of its rules file, in file order, the calls it was applied
    to and those whose algorithm or protocol it skipped (not available for the call); per
    collective, the calls no rule matched (left to NCCL); and NCCL's own choice for every call
    that came with a cost table (``lagom_tuner_nccl_choices``; NCCL 2.22 and newer)."""

    applied: tuple[int, ...]
    skipped: tuple[int, ...]
    unmatched: Mapping[str, int]  # NCCL's collective name (allgather, ...) -> calls
    nccl_choices: tuple[NcclChoice, ...] = ()


# The plugin's numbering (lagom_tuner.c's FUNC_NAMES, ALGO_NAMES, PROTO_NAMES: NCCL's ncclFunc_t,
# NCCL_ALGO_* and NCCL_PROTO_* orders) and the shape of its NCCL's-own-choice counts (g_own:
# [within a node, across nodes][collective][size bucket 2^b..2^(b+1)-1][algorithm][protocol]).
TUNER_FUNCS = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
TUNER_ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
TUNER_PROTOS = ("ll", "ll128", "simple")
SIZE_BUCKETS = 48
OP_OF_FUNC = {name: op for op, name in TUNER_COLL.items()}


def hold_tuner(library: str) -> ctypes.CDLL | None:
    """Load the tuner plugin in this process before NCCL does, so that its counts outlive NCCL's
    own handle (``destroy_process_group`` makes NCCL unload its plugin); NCCL's later load of the
    same path is the same library.

    Args:
        library: the plugin's path (``NCCL_TUNER_PLUGIN``).
    Returns:
        The library, or None where it cannot be loaded here (NCCL then says so itself).
    """
    try:
        return ctypes.CDLL(library)
    except OSError:
        return None


def read_tuner_counts(lib: ctypes.CDLL, rules: int) -> TunerCounts | None:
    """The counts of the tuner plugin in this process.

    Args:
        lib: the plugin (:func:`hold_tuner`).
        rules: the rules its file holds (``len(TunerRules.rules)``).
    Returns:
        The counts, or None when NCCL never started the plugin here (no communicator made), it read
        another rules file, or it is one without counts (built before 2026-12-05).
    """
    try:
        counts = lib.lagom_tuner_counts
    except AttributeError:
        return None
    u64, size = ctypes.c_ulonglong, max(rules, 1)
    applied, skipped, unmatched = (u64 * size)(), (u64 * size)(), (u64 * len(TUNER_FUNCS))()
    counts.restype = ctypes.c_int
    n = counts(rules, None, applied, skipped, unmatched)  # the rules' file lines: not needed, they are in order
    if n != rules or not rules:
        return None
    return TunerCounts(tuple(applied[:n]), tuple(skipped[:n]), dict(zip(TUNER_FUNCS, unmatched)), read_nccl_choices(lib))


def read_nccl_choices(lib: ctypes.CDLL) -> tuple[NcclChoice, ...]:
    """NCCL's own choices for the calls the tuner plugin in this process was asked about.

    Args:
        lib: the plugin (:func:`hold_tuner`).
    Returns:
        One entry per (span, collective, size bucket, algorithm, protocol) with calls, in that
        order; none from a plugin without these counts (an older build) or of another shape.
    """
    try:
        choices = lib.lagom_tuner_nccl_choices
    except AttributeError:
        return ()
    shape = (2, len(TUNER_FUNCS), SIZE_BUCKETS, len(TUNER_ALGOS), len(TUNER_PROTOS))
    size = math.prod(shape)
    choices.restype = ctypes.c_int
    if choices(None, ctypes.c_size_t(0)) != size:
        return ()
    out = (ctypes.c_ulonglong * size)()
    choices(out, ctypes.c_size_t(size))
    return tuple(NcclChoice(OP_OF_FUNC.get(TUNER_FUNCS[f], TUNER_FUNCS[f]), bool(span), *bucket_bounds(b),
                            TUNER_ALGOS[a], TUNER_PROTOS[p], calls)
                 for (span, f, b, a, p), calls in zip(itertools.product(*map(range, shape)), out) if calls)


def size_bucket(nbytes: int) -> tuple[int, int]:
    """The plugin's power-of-two size bucket holding ``nbytes`` (lagom_tuner.c's ``size_bucket``).

    Args:
        nbytes: a call's size, as NCCL hands it to the tuner.
    Returns:
        (smallest, largest) size of the bucket.
    """
    return bucket_bounds(min(max(int(nbytes), 1).bit_length() - 1, SIZE_BUCKETS - 1))


def bucket_bounds(b: int) -> tuple[int, int]:
    """The sizes of the plugin's bucket ``b``: 2^b .. 2^(b+1)-1, and 0 B too in bucket 0."""
    return (1 << b if b else 0), (2 << b) - 1


def choice_between(before: tuple[NcclChoice, ...], after: tuple[NcclChoice, ...], op: str, nbytes: int,
                   across_nodes: bool) -> tuple[str, str] | None:
    """NCCL's own choice for the calls of one collective made between two readings of the counts
    (:func:`read_nccl_choices`): what NCCL ran it with when nothing was set.

    Args:
        before: the counts before the calls.
        after: the counts after them.
        op: the collective's op (all_gather, ...).
        nbytes: its size, as NCCL hands it to the tuner (an all-gather's output, a reduce-scatter's input).
        across_nodes: whether its communicator spans several nodes.
    Returns:
        (algorithm, protocol) of most of those calls, or None when NCCL asked the tuner about none
        (a plugin NCCL did not load, or an NCCL without cost tables: 2.21 and older).
    """
    lo, hi = size_bucket(nbytes)

    def calls(choices: tuple[NcclChoice, ...]) -> dict[tuple[str, str], int]:
        return {(c.algo, c.proto): c.calls for c in choices
                if (c.op, c.across_nodes, c.min_bytes, c.max_bytes) == (op, across_nodes, lo, hi)}

    start = calls(before)
    made = {pair: n - start.get(pair, 0) for pair, n in calls(after).items() if n > start.get(pair, 0)}
    return max(made, key=made.__getitem__) if made else None
