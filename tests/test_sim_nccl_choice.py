"""The simulated NCCL's own choice of algorithm and protocol when nothing is set (every number
SIMULATED): NCCL's cost model (src/graph/tuning.cc) on the simulated topology, recorded by a
simulated profile as a real one records NCCL's, and taken by `search` as the defaults."""

import pandas as pd
import pytest

from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.nccl_knobs import MIN_TRAFFIC_PER_CHANNEL, channels_for_call, cluster_knob_space, measured_pairs
from lagom_tune.backends.sim import CLUSTERS, SimCluster
from lagom_tune.backends.sim_nccl_choice import nccl_estimate_us
from lagom_tune.measurements import DEFAULT
from lagom_tune.profile.campaign import run_profile
from lagom_tune.profile.summary import backend_choices
from lagom_tune.search.space import default_settings, variables
from lagom_tune.workload.presets import build_preset

KiB, MiB = 1 << 10, 1 << 20


def choice(cluster: str, op: str, nbytes: int, nodes: int = 1) -> str:
    c = CLUSTERS[cluster]
    s = SimCluster(c, nodes).own_choice(cluster_knob_space(c), op, nbytes, 8 * nodes, nodes)
    return f"{s['algo']}/{s['proto']}"


def test_nccls_estimate_is_its_published_formula():
    """Ring LL all-reduce, 8 GPUs of one NVLink Hopper node: latency baseLat 6.6 + 14 steps x 0.6 us;
    bus bandwidth half the ring's 450 GB/s capped at LL's 141, times 8/14 for the algorithm's."""
    c = CLUSTERS["h100-nvlink"]
    expected = 6.6 + 14 * 0.6 + MiB / (1000 * 141 * 8 / 14)
    assert nccl_estimate_us(c, "all_reduce", MiB, 8, 1, "ring", "ll", 450) == pytest.approx(expected)
    # Simple: 8.4 + 14 x 3.4 us, the whole ring
    assert nccl_estimate_us(c, "all_reduce", MiB, 8, 1, "ring", "simple", 450) == pytest.approx(8.4 + 14 * 3.4 + MiB / (1000 * 450 * 8 / 14))


@pytest.mark.parametrize("cluster, op, nbytes, nodes, expected", [
    ("h100-nvlink", "all_reduce", 64 * KiB, 1, "ring/ll"),  # small: LL's latency
    ("h100-nvlink", "all_reduce", 64 * MiB, 1, "nvls/simple"),  # large, one NVSwitch node: NVLS
    ("h100-nvlink", "all_gather", 16 * MiB, 1, "ring/ll128"),  # mid-sized where LL128 is enabled
    ("h100-nvlink", "all_gather", 256 * MiB, 1, "ring/simple"),
    ("a100-nvlink", "reduce_scatter", 4 * MiB, 1, "ring/ll128"),
    ("a40-nvlink", "all_gather", 4 * MiB, 1, "ring/simple"),  # no LL128 on compute capability 8.6
    ("a40-nvlink", "all_reduce", 64 * KiB, 1, "ring/ll"),
    ("h100-nvlink", "all_reduce", 8 * KiB, 2, "tree/ll"),  # across nodes the tree's log steps win tiny calls
    ("h100-nvlink", "all_reduce", 256 * MiB, 2, "ring/simple"),
])
def test_the_simulated_nccl_chooses_as_nccls_cost_model_does(cluster, op, nbytes, nodes, expected):
    assert choice(cluster, op, nbytes, nodes) == expected


def test_a_choice_is_one_the_knob_space_offers():
    for name, c in CLUSTERS.items():
        space = cluster_knob_space(c)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nodes in (1, 2):
                for nbytes in (4 * KiB, MiB, 64 * MiB, 1 << 30):
                    s = SimCluster(c, nodes).own_choice(space, op, nbytes, 8 * nodes, nodes)
                    assert (s["algo"], s["proto"]) in measured_pairs(space, op, nodes), (name, op, nodes, nbytes)


def test_a_small_collectives_default_is_not_the_simple_protocol_nccl_would_not_run():
    """Until 2026-12-05 the simulated defaults ran Simple at every size: a 64 KiB all-reduce took
    twice what NCCL's own LL takes on the same simulated ground truth, a gain for any tuner."""
    c = CLUSTERS["a100-nvlink"]
    sim, space = SimCluster(c), cluster_knob_space(c)
    own = sim.nothing_set(space, "all_reduce", 64 * KiB, 8, 1)
    assert sim.comm_time("all_reduce", 64 * KiB, 8, 1, own) < 0.6 * sim.comm_time("all_reduce", 64 * KiB, 8, 1, space.defaults("all_reduce"))


def test_a_simulated_profile_records_the_choices_and_search_starts_from_them(tmp_path):
    """One ``default`` row set per workload collective, with the chosen columns a GPU profile's
    carry; ``backend_choices`` reads them back and the search's defaults are them."""
    w = build_preset("phi-2", parallel="tp=8")
    backend = get_backend("sim", BackendOptions(hardware="h100-nvlink", noise=0.0, seed=0))
    run = run_profile(w, backend, tmp_path / "run", repeats=1)
    df, _ = run.read()
    own = df[df["kind"] == DEFAULT]
    assert len(own) == len({(c.op, c.nbytes, c.ranks, c.nodes) for c in w.collectives()})
    assert own["chosen_proto"].notna().all() and own["simulated"].astype(str).str.lower().eq("true").all()
    chosen = backend_choices(df, w)
    space = cluster_knob_space(CLUSTERS["h100-nvlink"])
    sim = SimCluster(CLUSTERS["h100-nvlink"])
    assert chosen.by_rule == sim.own_choices(w, space).by_rule
    defaults = default_settings(variables(w, space, chosen))
    for c in w.collectives():
        want = chosen.for_collective(c)
        got = defaults.for_collective(c)
        assert (got["algo"], got["proto"]) == (want["algo"], want["proto"]), (c.name, got, want)
    assert pd.api.types.is_numeric_dtype(own["time_us"])


def test_a_small_call_runs_on_fewer_channels_as_nccl_schedules_it():
    """NCCL gives each channel at least MIN_TRAFFIC_PER_CHANNEL of a call's traffic (an all-reduce's
    twice its bytes, LL's four times): the simulated NCCL's small calls run on fewer channels, and
    its DEFAULT rows say so as NCCL's log does."""
    assert channels_for_call("all_reduce", 4, "ll", 16) == 1
    assert channels_for_call("all_gather", 3 * MIN_TRAFFIC_PER_CHANNEL, "simple", 16) == 3
    assert channels_for_call("all_reduce", 3 * MIN_TRAFFIC_PER_CHANNEL, "simple", 16) == 6
    assert channels_for_call("all_reduce", 3 * MIN_TRAFFIC_PER_CHANNEL, "ll", 16) == 16  # LL: 24 wanted, capped
    assert channels_for_call("all_gather", 256 * MiB, "simple", 16) == 16
    c = CLUSTERS["h100-nvlink"]
    small = SimCluster(c).own_choice(cluster_knob_space(c), "all_gather", 64 * KiB, 8, 1)
    assert (small["proto"], small["channels"]) == ("ll", 8)  # 256 KiB of LL traffic over 32 KiB a channel
