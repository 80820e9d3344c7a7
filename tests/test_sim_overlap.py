"""The simulated streams played CTA group by CTA group (backends/sim_overlap.py; all SIMULATED)."""

import math

import pytest

from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.backends.sim_compute import IDLE, gemm_run
from lagom_tune.backends.sim_overlap import CommRun, play
from lagom_tune.timeline import simulate
from lagom_tune.workload.spec import Gemm

H100 = CLUSTERS["h100-nvlink"]
SIMPLE = dict(algo="ring", proto="simple", channels=16, threads=512, buffsize=4 << 20)
ONE_WAVE = Gemm("one_wave", 2048, 2048, 2048, "bf16")
LARGE = Gemm("large", 8192, 4096, 4096, "bf16")


def ends(timeline):
    return {stream: max((s.end for s in timeline.spans if s.stream == stream), default=0.0) for stream in ("compute", "comm")}


def all_gather(sim, nbytes, after=None, name="ag"):
    return sim.comm_run(name, after, "all_gather", nbytes, 8, 1, SIMPLE)


def test_alone_each_stream_takes_its_time_alone():
    sim = SimCluster(H100)
    compute = play(H100, [ONE_WAVE, LARGE], [])
    assert compute.makespan == pytest.approx(gemm_run(H100, ONE_WAVE)[0] + gemm_run(H100, LARGE)[0], rel=1e-12)
    comm = play(H100, [], [all_gather(sim, 64 << 20)])
    assert comm.makespan == pytest.approx(sim.comm_time("all_gather", 64 << 20, 8, 1, SIMPLE), rel=1e-12)


@pytest.mark.parametrize("g", [ONE_WAVE, LARGE])
def test_beside_a_collective_for_its_whole_run_a_kernel_takes_its_contended_time(g):
    """The co-simulation under a load that never changes is the kernel's contended run."""
    sim = SimCluster(H100)
    x = all_gather(sim, 1 << 30)
    played = play(H100, [g], [x])
    assert ends(played)["compute"] == pytest.approx(gemm_run(H100, g, x.load)[0], rel=1e-12)


def test_a_group_keeps_the_pace_it_started_at():
    """A one-wave GEMM beside a collective that ends early in its run: its CTAs started beside the
    channel blocks, so it ends late, later than two rates switched at once would have it."""
    sim = SimCluster(H100)
    x = all_gather(sim, 16 << 20)
    played = play(H100, [ONE_WAVE] * 2, [x])
    y = gemm_run(H100, ONE_WAVE)[0]
    fluid = simulate([ONE_WAVE] * 2, [y, y], [x], [x.alone_s],
                     lambda g, c: sim.slowdowns(g, "all_gather", 16 << 20, 8, 1, SIMPLE))
    assert ends(played)["compute"] > 1.03 * max(s.end for s in fluid.spans if s.stream == "compute")


def test_waiting_groups_start_when_the_channel_blocks_leave():
    """A kernel beside a collective that ends part way: sooner than beside one for all its run,
    later than alone."""
    sim = SimCluster(H100)
    short, whole = all_gather(sim, 64 << 20), all_gather(sim, 1 << 30)
    part = ends(play(H100, [LARGE], [short]))["compute"]
    assert gemm_run(H100, LARGE)[0] < part < gemm_run(H100, LARGE, whole.load)[0]


def test_a_collective_waits_for_the_computation_that_readies_it():
    sim = SimCluster(H100)
    played = play(H100, [LARGE, ONE_WAVE], [all_gather(sim, 64 << 20, after=0)])
    large, comm = (next(s for s in played.spans if s.name == n) for n in ("large", "ag"))
    assert comm.start == large.end


def test_the_collective_slows_only_while_computation_runs_beside_it():
    sim = SimCluster(H100)
    x = all_gather(sim, 1 << 30)
    beside = ends(play(H100, [ONE_WAVE], [x]))["comm"]
    assert x.alone_s < beside < x.alone_s * x.slowdown(gemm_run(H100, ONE_WAVE, x.load)[1])


@pytest.mark.parametrize("alone,slowdown", [(math.nan, 1.0), (math.inf, 1.0), (-1e-3, 1.0), (1e-3, math.nan), (1e-3, 0.0)])
def test_each_bad_number_is_refused(alone, slowdown):
    bad = CommRun("c", None, alone, IDLE, lambda drawn: slowdown)
    with pytest.raises(ValueError, match="positive numbers"):
        play(H100, [ONE_WAVE], [bad])


def test_channel_blocks_wait_for_sms_the_gemm_holds():
    """A collective that becomes ready while a GEMM's CTAs fill the device cannot run until enough of
    them finish: its blocks never share the SMs with more CTAs than the device has room for."""
    sim = SimCluster(H100)
    small = sim.comm_run("a", None, "all_gather", 8 << 20, 8, 1, {**SIMPLE, "channels": 4})
    big = sim.comm_run("b", None, "all_gather", 64 << 20, 8, 1, {**SIMPLE, "channels": 32})
    huge = Gemm("huge", 16384, 16384, 8192, "bf16")
    played = play(H100, [huge], [small, big])
    a, b = (next(s for s in played.spans if s.name == n) for n in ("a", "b"))
    assert b.start == a.end
    # beside the GEMM for all its run, b would take its contended time; waiting for SMs, longer
    assert b.duration > 1.05 * big.alone_s * big.slowdown(gemm_run(H100, huge, big.load)[1])


def test_a_collective_waiting_for_a_computation_the_group_lacks_is_refused():
    sim = SimCluster(H100)
    with pytest.raises(ValueError, match="does not have"):
        play(H100, [ONE_WAVE], [all_gather(sim, 8 << 20, after=3)])


def test_a_huge_kernel_plays_in_a_few_events():
    """One run of groups however many tiles: a million-tile GEMM beside a collective ending part way
    plays in well under a second (it was a list of a million groups)."""
    sim = SimCluster(H100)
    g = Gemm("wide", 8192, 8192, 128, "bf16", 512)
    played = play(H100, [g], [all_gather(sim, 16 << 20)])
    assert ends(played)["compute"] > gemm_run(H100, g)[0]
