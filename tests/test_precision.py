"""Iteration times: one rounding for what artifacts record and what verbs print."""

import math
import random

from lagom_tune.precision import ROUNDING_REL, ms_round, ms_text


def test_a_recorded_time_prints_as_the_time_it_was_recorded_from():
    """`show` prints a plan's recorded time, `search` and `report` the model's: the same digits,
    decade boundaries (9.9999996 -> 10.0000) included."""
    rng = random.Random(0)
    values = [10 ** rng.uniform(-4, 8) for _ in range(20000)] + [9.9999996, 99.999996, 0.0999999996, 111.5446, 111.545]
    for x in values:
        assert ms_text(ms_round(x)) == ms_text(x), x
        assert math.isclose(ms_round(x), x, rel_tol=ROUNDING_REL / 2), x


def test_significant_digits_keep_a_microsecond_iterations_ratios():
    """Times recorded to 0.001 ms made a 1-byte all-reduce's 1.832x speed-up read 1.714x from its two
    recorded times (an audit, 2026-12-04); six significant digits keep such a ratio to 1e-5."""
    default, plan = 0.1010234, 0.0551234
    assert math.isclose(ms_round(default) / ms_round(plan), default / plan, rel_tol=2e-5)
    assert ms_text(0.0551234) == "0.0551234" and ms_text(1039.84372) == "1039.84" and ms_text(12345678.9) == "12345679"
