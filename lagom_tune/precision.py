"""The precision iteration times are recorded at (plans' predictions and replays) and printed at by
every verb: one rounding, so that ``search``, ``show`` and ``report`` print the same digits for the
same quantity, and significant digits rather than decimals, so that a 0.055 ms iteration keeps
the ratios a 1000 ms one does (three decimals printed a 1.832x speed-up as 1.714x; an audit,
2026-12-04)."""

from __future__ import annotations

import math

MS_DIGITS = 6  # significant digits of an iteration time in ms
ROUNDING_REL = 1.1 * 10 ** (1 - MS_DIGITS)  # two times rounded so may differ by this share and agree


def _decimals(ms: float) -> int:
    return max(0, MS_DIGITS - 1 - math.floor(math.log10(abs(ms)))) if ms and math.isfinite(ms) else 0


def ms_round(ms: float) -> float:
    """An iteration time in ms as artifacts record it.

    Args:
        ms: the time in ms.
    Returns:
        ``ms`` to :data:`MS_DIGITS` significant digits.
    """
    return round(ms, _decimals(ms))


def ms_text(ms: float) -> str:
    """An iteration time in ms as every verb prints it: the digits :func:`ms_round` records (so a
    time read back from a plan prints as it did when the plan was written).

    Args:
        ms: the time in ms.
    Returns:
        e.g. ``"1039.84"``, ``"0.0551234"``.
    """
    r = ms_round(ms)
    return f"{r:.{_decimals(r)}f}"
