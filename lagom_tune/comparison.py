"""Side-by-side comparisons on one machine: the order to run the arms in, and how to read the
rounds.

Arms run in interleaved rounds, each in the reverse order of the one before (A B, B A, A B, ...).
Interleaving makes drift on the machine hit every arm alike; reversing the order does the same
for a run's position in its round, which is not neutral: with the default always first,
`bench/cpu_e2e.py` measured identical settings 0.94x apart (2026-11-29), the second run of each
pair slower in every round; alternated, 0.999x. Two arms are then read as the geometric mean of
their per-round ratios, with a bootstrap interval over the rounds.
"""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

CI_LEVEL = 0.95
BOOTSTRAP = 10_000


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


def ratio_interval(ratios: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its percentile-bootstrap interval at
    :data:`CI_LEVEL` (rounds resampled).

    Args:
        ratios: one arm's time over the other's, one per interleaved round (positive).
        seed: the bootstrap's seed (the reading is reproducible from the same rounds).

    Returns:
        (geometric mean, low, high); one round gives an interval of that round alone.
    """
    logs = np.log(np.asarray(ratios, dtype=float))
    means = np.random.default_rng(seed).choice(logs, size=(BOOTSTRAP, len(logs)), replace=True).mean(axis=1)
    tail = (1 - CI_LEVEL) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


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
