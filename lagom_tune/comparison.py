"""Side-by-side comparisons on one machine: the order to run the arms in, and how to read the
rounds.

Arms run in interleaved rounds, each in the reverse order of the one before (A B, B A, A B, ...).
Interleaving makes drift on the machine hit every arm alike; reversing the order does the same
for a run's position in its round, which is not neutral: with the default always first,
`bench/cpu_e2e.py` measured identical settings 0.94x apart (2026-11-29), the second run of each
pair slower in every round; alternated, 0.999x. Two arms are then read as the geometric mean of
their per-round ratios, with the Student-t interval of the mean log ratio over the rounds.

Why t and not a bootstrap: with the few rounds a trial runs, a percentile bootstrap over the rounds
is too narrow. Measured on normal log ratios (400 draws each, 2026-12-07), its nominal 95% interval
held the true ratio 74% of the time with 3 rounds, 79% with 4 (the trial's default), 86% with 6,
91% with 10, so one trial in five of a plan that changes nothing read "faster" or "slower". The t
interval held it 94-97% of the time at every count from 2 rounds, and on heavy-tailed (t, 3 degrees
of freedom) log ratios too. A run's place in its round biases each round's ratio one way or the
other in turn; read as scatter, that widens the interval (it errs wide, never narrow).
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

CI_LEVEL = 0.95
ARMS = ("default", "plan")  # what `trial` and `search --validate` compare, in their first round's order


def interleaved(arms: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """The runs of a comparison in the order to run them.

    Args:
        arms: what is compared (two or more), in the first round's order.
        rounds: rounds; an even number gives each order of two arms equally often.

    Returns:
        An iterator of (round, arm), round counted from 0.
    """
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            yield r, arm


def order_note(arms: Sequence[str], rounds: int, option: str) -> str | None:
    """What an odd number of rounds of two arms leaves unbalanced, as one line for the user.

    Args:
        arms: the two arms, in the first round's order (:func:`interleaved`).
        rounds: the rounds asked for.
        option: the option that set them, as the user typed it (``--rounds``).
    Returns:
        The line, or None for an even count (each arm runs first equally often) or a single round.
    """
    if rounds % 2 == 0 or rounds < 2 or len(arms) != 2:
        return None
    return (f"{option} {rounds} is odd: the {arms[0]} runs first in {rounds // 2 + 1} rounds, the {arms[1]} in {rounds // 2}; "
            "an even count runs each first equally often (the second run of a round may be slower)")


def by_first_arm(ratios: Sequence[float], arms: Sequence[T]) -> dict[T, tuple[float, ...]]:
    """Per-round ratios grouped by the arm :func:`interleaved` ran first in each round: where a
    run's place in its round matters, one group's ratios sit above the other's.

    Args:
        ratios: one per round, in round order.
        arms: the arms, in the first round's order.
    Returns:
        Each arm (in ``arms``' order) -> the ratios of the rounds it ran first in.
    """
    first: dict[int, T] = {}
    for r, arm in interleaved(arms, len(ratios)):
        first.setdefault(r, arm)
    return {arm: tuple(x for r, x in enumerate(ratios) if first[r] == arm) for arm in arms}


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its Student-t interval at :data:`CI_LEVEL`.

    Args:
        ratios: one arm's time over the other's, one per interleaved round (positive).

    Returns:
        (geometric mean, low, high): the t interval of the mean log ratio, mapped back to ratios.
        One round gives no interval: (the ratio, 0.0, inf).
    """
    logs = np.log(np.asarray(ratios, dtype=float))
    mean = float(logs.mean())
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = _half_width(float(logs.std(ddof=1)), len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _half_width(spread: float, rounds: int) -> float:
    """The t interval's half-width in log ratio, at :data:`CI_LEVEL`, for ``rounds`` (two or more)
    whose log ratios have sample standard deviation ``spread``."""
    # scipy only here: the CLI starts without it, and a GPU machine that lacks it still profiles.
    from scipy.special import stdtrit

    return float(stdtrit(rounds - 1, 1 - (1 - CI_LEVEL) / 2)) * spread / math.sqrt(rounds)


def rounds_to_show(ratios: Sequence[float], effect: float | None, most: int) -> int | None:
    """Rounds after which a ratio of ``effect`` would show, at the spread these rounds have: the
    fewest at which the interval's half-width (:func:`ratio_interval`, the same sample standard
    deviation of log ratios) is narrower than ``log(effect)``, so an interval centred on it would
    leave 1 out (about even odds that a trial of that many rounds does).

    Args:
        ratios: the rounds so far (positive).
        effect: the ratio to resolve (a plan's predicted speed-up), or None.
        most: the most rounds to consider.
    Returns:
        The rounds, from 2; None when more than ``most`` would be needed, and when nothing can be
        said: fewer than two rounds (no spread yet), or no effect (None or 1).
    """
    if len(ratios) < 2 or effect is None or effect == 1.0:
        return None
    spread = float(np.log(np.asarray(ratios, dtype=float)).std(ddof=1))
    return next((n for n in range(2, most + 1) if _half_width(spread, n) < abs(math.log(effect))), None)


def verdict(low: float, high: float, same_settings: bool) -> str:
    """The plain reading of an interval of default / plan time ratios.

    Args:
        low, high: the interval (:func:`ratio_interval`).
        same_settings: whether the plan keeps the defaults (both arms run the same settings).

    Returns:
        "the plan is faster", "the plan is slower", "no difference measurable on this machine",
        or, for the same settings, that any difference is noise.
    """
    if same_settings:
        return "same settings: the plan keeps the defaults, any difference is noise"
    if low > 1.0:
        return "the plan is faster"
    if high < 1.0:
        return "the plan is slower"
    return "no difference measurable on this machine"
