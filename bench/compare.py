"""Side-by-side comparisons on one machine: arms run in interleaved rounds, each in the reverse
order of the one before (``lagom_tune.interleave``), and the ratio of two arms read with a
bootstrap interval over the rounds.
"""

from __future__ import annotations

import numpy as np

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
