"""Side-by-side comparisons on one machine: arms run in interleaved rounds, each round in the
reverse order of the one before (A B, B A, A B, ...), and the ratio of two arms read with a
bootstrap interval over the rounds.

Interleaving makes drift on the machine hit every arm alike; reversing the order does the same
for a run's position in its round, which is not neutral here: with the default always first,
`cpu_e2e.py` measured identical settings 0.94x apart (2026-11-29), the second run of each pair
slower in every round; alternated, 0.999x.
"""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


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


CI_LEVEL = 0.95
BOOTSTRAP = 10_000


def ratio_interval(ratios: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its 95% percentile-bootstrap interval (rounds resampled).

    Args:
        ratios: one arm's time over the other's, one per interleaved round.
        seed: the bootstrap's seed (the table is reproducible from the same rounds).

    Returns:
        (geometric mean, low, high).
    """
    logs = np.log(np.asarray(ratios, dtype=float))
    means = np.random.default_rng(seed).choice(logs, size=(BOOTSTRAP, len(logs)), replace=True).mean(axis=1)
    tail = (1 - CI_LEVEL) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))
