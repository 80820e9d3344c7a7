"""The order to run a side-by-side comparison in: interleaved rounds, each in the reverse order of
the one before (A B, B A, A B, ...).

Interleaving makes drift on the machine hit every arm alike; reversing the order does the same
for a run's position in its round, which is not neutral: with the default always first,
`bench/cpu_e2e.py` measured identical settings 0.94x apart (2026-11-29), the second run of each
pair slower in every round; alternated, 0.999x.
"""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

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
