import pytest

from lagom_tune.timeline import simulate
from lagom_tune.workload.spec import Collective, Gemm

G = Gemm("g", 8, 8, 8)


def colls(n, after=None):
    return [Collective(f"c{i}", "all_reduce", 1024, after=None if after is None else after[i]) for i in range(n)]


def no_contention(g, c):
    return 1.0, 1.0


def test_streams_without_contention_take_the_longer_stream():
    tl = simulate([G] * 3, [1.0, 1.0, 1.0], colls(2), [0.5, 0.5], no_contention)
    assert tl.makespan == pytest.approx(3.0)
    assert tl.compute_time == pytest.approx(3.0) and tl.comm_time == pytest.approx(1.0)


def test_contention_slows_both_while_they_overlap():
    # Collective of 1 s beside a 2 s GEMM, each at half speed while both run:
    # the collective ends at 2 s having slowed the GEMM by 1 s; the GEMM finishes at 3 s.
    tl = simulate([G], [2.0], colls(1), [1.0], lambda g, c: (2.0, 2.0))
    comm = [s for s in tl.spans if s.stream == "comm"][0]
    assert comm.end == pytest.approx(2.0)
    assert tl.makespan == pytest.approx(3.0)
    assert tl.stream_bound == pytest.approx(3.0)


def test_after_dependency_delays_the_collective():
    tl = simulate([G] * 2, [1.0, 1.0], colls(1, after=[0]), [1.5], no_contention)
    comm = [s for s in tl.spans if s.stream == "comm"][0]
    assert comm.start == pytest.approx(1.0) and comm.end == pytest.approx(2.5)
    assert tl.makespan == pytest.approx(2.5)


def test_cascade_a_slower_first_collective_shifts_the_next():
    fast = simulate([G] * 4, [1.0] * 4, colls(2, after=[0, 1]), [0.5, 0.5], lambda g, c: (1.5, 1.0))
    slow = simulate([G] * 4, [1.0] * 4, colls(2, after=[0, 1]), [1.5, 0.5], lambda g, c: (1.5, 1.0))
    second = lambda tl: [s for s in tl.spans if s.stream == "comm"][1]
    assert second(slow).start > second(fast).start
    assert slow.compute_time > fast.compute_time  # more time overlapped, more compute slowed


def test_empty_streams():
    assert simulate([], [], colls(1), [2.0], no_contention).makespan == pytest.approx(2.0)
    assert simulate([G], [2.0], [], [], no_contention).makespan == pytest.approx(2.0)
