"""The nccl backend's pure logic with fakes, its torchrun orchestration with a CPU stand-in, and
(only where a GPU exists) the real thing."""

import contextlib
import os
import shutil
import subprocess
import sys
import time
import types
from collections import Counter

import pytest
import torch
import yaml

from lagom_tune.backends.base import Point, reduce_ranks, trimmed_mean
from lagom_tune.backends.nccl import _nccl_version
from lagom_tune.backends.nccl_knobs import nccl_config, nccl_knob_space
from lagom_tune.backends.nccl_sweep import (
    OBSERVING, PROBE, batches, channel_options, check_layout, plan_collective_points, plan_probe_points, process_settings, subgroups,
    worker_env,
)
from lagom_tune.backends.nccl_worker import collective_call
from lagom_tune.backends.probe import BLOCK_WORDS, SLOTS, Placement, placement_summary, probe_geometry, steps_for
from lagom_tune.backends.sim_compute import Contention as SimContention
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import Collective, Gemm, OverlapGroup, Workload

from conftest import BIN, ROOT, cli

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the CPU side is covered by the fakes and the stand-in)")

G1 = Gemm("wgrad", 64, 64, 64)
G2 = Gemm("dgrad", 128, 64, 64)
ONE_PAIR = Workload("one-pair", (OverlapGroup("bwd", (G1, G2), (Collective("grads", "all_reduce", 1 << 18, ranks=2, after=0),)),))


class FakeOptions:
    def __init__(self):
        self.config = types.SimpleNamespace(min_ctas=-1, max_ctas=-1)


# -- sweep planning --------------------------------------------------------------------------------


def test_sweep_covers_every_factor_and_only_valid_algorithms():
    space = nccl_knob_space(32, 16)
    w = Workload("mixed", (OverlapGroup("g", (G1,), (Collective("ag", "all_gather", 1 << 24, ranks=8),
                                                         Collective("ar", "all_reduce", 1 << 22, ranks=8))),))
    pts = plan_collective_points(w, space, world=8, gpus_per_node=8)
    assert len({p.key for p in pts}) == len(pts)
    kinds = Counter(p.kind for p in pts)
    assert kinds["gemm"] == 1
    coll = [p for p in pts if p.kind == "collective"]
    assert not [p for p in coll if p.op == "all_gather" and p.settings["algo"] == "tree"]
    ar = [p for p in coll if p.op == "all_reduce" and p.nbytes == 1 << 22]
    assert {(p.settings["algo"], p.settings["proto"]) for p in ar} == {(a, b) for a in ("ring", "tree") for b in ("ll", "ll128", "simple")}
    assert {p.settings["channels"] for p in ar} == set(space["channels"].domain)
    assert {p.settings["threads"] for p in ar} == set(space["threads"].domain)
    assert {p.settings["buffsize"] for p in ar} == set(space["buffsize"].domain)
    # each pair's group in the fit sees the knobs that size its channels, and only those: NCCL_NTHREADS
    # sizes Simple's and LL's CTAs (LL128 runs its own 640), NCCL_BUFFSIZE Simple's buffer only
    for (a, b) in {(p.settings["algo"], p.settings["proto"]) for p in ar}:
        mine = [p for p in ar if (p.settings["algo"], p.settings["proto"]) == (a, b)]
        assert {p.settings["threads"] for p in mine} == (set(space["threads"].domain) if b != "ll128" else {512}), (a, b)
        assert {p.settings["buffsize"] for p in mine} == (set(space["buffsize"].domain) if b == "simple" else {4 << 20}), (a, b)
    # the fit needs a second, smaller size per collective
    assert {p.nbytes for p in coll if p.op == "all_gather"} == {1 << 24, 1 << 21}
    over = [p for p in pts if p.kind == "overlap"]
    assert len(over) == 2 * len(space["channels"].domain) * len(space["buffsize"].domain)


def test_batches_group_by_what_only_a_fresh_process_can_change():
    pts = plan_collective_points(ONE_PAIR, nccl_knob_space(8, 8), world=2, gpus_per_node=2)
    bs = batches(pts)
    assert bs[0].process == () and {p.kind for p in bs[0].points} == {"gemm"}
    assert len({b.process for b in bs}) == len(bs)
    for b in bs[1:]:
        assert {process_settings(p) for p in b.points} == {b.process}
    # channels never split a batch: they are per communicator. The GEMMs; the 6 (algorithm, protocol)
    # pairs of an all-reduce; 3 more thread counts for each of the 4 pairs NCCL_NTHREADS sizes (not
    # LL128's), 3 more buffer sizes for the 2 Simple ones; the workload's all-reduce with nothing set
    assert len(bs) == 1 + 6 + 4 * 3 + 2 * 3 + 1
    (observing,) = [b for b in bs if b.process == OBSERVING]
    assert [(p.kind, p.op, p.nbytes, p.ranks, p.settings) for p in observing.points] == [("default", "all_reduce", 1 << 18, 2, {"nodes": 1})]


def test_layout_checks_and_subgroups():
    check_layout(16, 8, 8, 1)
    check_layout(16, 8, 2, 2)
    with pytest.raises(UserError, match="16 ranks"):
        check_layout(16, 8, 6, 1)
    with pytest.raises(UserError, match="across 2 nodes"):
        check_layout(8, 8, 8, 2)
    with pytest.raises(UserError, match="within one node"):
        check_layout(16, 8, 16, 1)
    assert subgroups(16, 8, 1, 8) == [list(range(8)), list(range(8, 16))]  # tensor parallel within a node
    assert subgroups(16, 2, 2, 8) == [[i, i + 8] for i in range(8)]  # data parallel across nodes
    assert subgroups(4, 4, 1, 4) == [[0, 1, 2, 3]]
    # a group over 2 nodes in a 4-node job spans 2 nodes, not all 4 (its rows say nodes=2)
    assert subgroups(32, 16, 2, 8) == [list(range(16)), list(range(16, 32))]
    assert subgroups(32, 4, 2, 8) == [[(b * 2 + n) * 8 + p * 2 + r for n in range(2) for r in range(2)] for b in range(2) for p in range(4)]
    for world, ranks, nodes in ((32, 16, 2), (32, 4, 2), (16, 2, 2), (32, 8, 4)):
        check_layout(world, 8, ranks, nodes)
        groups = subgroups(world, ranks, nodes, 8)
        assert sorted(r for g in groups for r in g) == list(range(world)) and {len(g) for g in groups} == {ranks}
        assert {len({r // 8 for r in g}) for g in groups} == {nodes}
    with pytest.raises(UserError, match="cannot tile"):
        check_layout(24, 8, 4, 3)  # 4 ranks over 3 nodes: no equal slices
    with pytest.raises(UserError, match="cannot tile"):
        check_layout(24, 8, 6, 2)  # 3 ranks a node: 8 GPUs do not tile into slices of 3


def test_worker_env_per_op_syntax_and_overrides_removed():
    base = {"PATH": "/bin", "NCCL_MIN_CTAS": "32", "NCCL_ALGO": "Tree", "NCCL_DEBUG": "WARN"}
    proc = {"algo": "tree", "proto": "ll128", "threads": 256, "buffsize": 2 << 20}
    env, removed = worker_env(proc, {"all_reduce"}, (2, 26, 2), base)
    assert env["NCCL_ALGO"] == "allreduce:Tree" and env["NCCL_PROTO"] == "allreduce:LL128"
    assert env["NCCL_NTHREADS"] == "256" and env["NCCL_BUFFSIZE"] == str(2 << 20)
    assert "NCCL_MIN_CTAS" not in env and env["NCCL_DEBUG"] == "WARN" and env["PATH"] == "/bin"
    assert removed == ["NCCL_MIN_CTAS", "NCCL_ALGO"]  # dropped, and replaced: the user's value is not what runs
    assert worker_env(proc, {"all_reduce"}, (2, 26, 2), {"NCCL_ALGO": "allreduce:Tree"})[1] == []  # the same value kept
    env, _ = worker_env({"algo": "ring", "proto": "simple"}, {"all_gather", "reduce_scatter", "all_to_all"}, (2, 26, 2), {})
    assert env["NCCL_ALGO"] == "allgather:Ring;reducescatter:Ring"
    old, _ = worker_env(proc, {"all_reduce"}, (2, 21, 5), {})
    assert old["NCCL_ALGO"] == "Tree" and old["NCCL_PROTO"] == "LL128"
    plain, removed = worker_env({}, set(), (2, 26, 2), base)  # GEMMs and the probe: no NCCL settings
    assert "NCCL_ALGO" not in plain and set(removed) == {"NCCL_MIN_CTAS", "NCCL_ALGO"}
    assert base["NCCL_MIN_CTAS"] == "32"  # the caller's mapping is untouched
    # NCCL's own choices: nothing the sweep owns is set, and our plugin (no rules) replaces the user's
    theirs = {**base, "NCCL_TUNER_PLUGIN": "/opt/vendor/tuner.so", "LAGOM_TUNE_TUNER_RULES": "/tmp/old.rules", "NCCL_NTHREADS": "64"}
    own, removed = worker_env(dict(OBSERVING), {"all_reduce"}, (2, 26, 2), theirs, "/cache/libnccl-tuner-lagom-tune.so")
    assert own["NCCL_TUNER_PLUGIN"] == "/cache/libnccl-tuner-lagom-tune.so" and "LAGOM_TUNE_TUNER_RULES" not in own
    assert not {"NCCL_ALGO", "NCCL_PROTO", "NCCL_NTHREADS", "NCCL_BUFFSIZE", "NCCL_MIN_CTAS"} & set(own)
    assert set(removed) == {"NCCL_MIN_CTAS", "NCCL_ALGO", "NCCL_NTHREADS", "LAGOM_TUNE_TUNER_RULES", "NCCL_TUNER_PLUGIN"}
    unobserved, _ = worker_env(dict(OBSERVING), {"all_reduce"}, (2, 26, 2), theirs)  # no compiler: timed, not observed
    assert "NCCL_TUNER_PLUGIN" not in unobserved
    # ... and NCCL logs its set-up to a file of the batch's own (the channels it runs), not where the user's went
    logging = {**theirs, "NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "/home/me/nccl.log", "NCCL_DEBUG_SUBSYS": "NET"}
    logged, removed = worker_env(dict(OBSERVING), {"all_reduce"}, (2, 26, 2), logging, None, "/tmp/lagom-nccl-log-x")
    assert (logged["NCCL_DEBUG"], logged["NCCL_DEBUG_SUBSYS"], logged["NCCL_DEBUG_FILE"]) == \
        ("INFO", "TUNING", "/tmp/lagom-nccl-log-x/nccl.%p.log")
    assert {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"} <= set(removed)  # said: the user's logging is set aside there
    swept, _ = worker_env({"algo": "ring"}, {"all_reduce"}, (2, 26, 2), logging, None, "/tmp/lagom-nccl-log-x")
    assert swept["NCCL_DEBUG_FILE"] == "/home/me/nccl.log"  # other batches leave the user's logging alone


def test_channel_options_pin_the_communicator():
    opts = channel_options(FakeOptions, ranks=8, channels=4)
    assert (opts.config.min_ctas, opts.config.max_ctas) == (4, 4)


def test_probe_plan_and_geometry():
    space = nccl_knob_space(64, 16)
    pts = plan_probe_points(ONE_PAIR, space, sms=16)
    probe = [p for p in pts if p.op == PROBE]
    assert probe and all(p.settings["channels"] < 16 for p in probe)
    assert {p.nbytes for p in probe if p.kind == "overlap"} == {0}
    assert batches(pts)[0].process == () and len(batches(pts)) == 1  # one worker: nothing NCCL reads
    g = probe_geometry(32 << 20, channels=4, buffsize=4 << 20)
    assert g.chunk_words * 4 == (4 << 20) // SLOTS and g.chunk_words % BLOCK_WORDS == 0
    assert g.nbytes == 32 << 20 and g.stage_words == 4 * SLOTS * g.chunk_words
    big = probe_geometry(4 << 30, channels=2, buffsize=1 << 20, max_source_bytes=64 << 20)
    assert big.source_words * 4 <= 64 << 20 and big.nbytes >= 4 << 30
    assert steps_for(2e-3, 100, 1e-3) == 200
    with pytest.raises(ValueError):
        probe_geometry(1 << 20, channels=0, buffsize=1 << 20)


# -- result reduction, collectives, fingerprint helpers ---------------------------------------------


def test_reduce_ranks_keeps_the_slowest_rank_and_adds_bus_bandwidth():
    p = Point("collective", nccl_config("ring", "simple", 4, 512, 4 << 20, 1), op="all_reduce", nbytes=1 << 30, ranks=8)
    rows = reduce_ranks(p, [[{"time_us": 1000.0}, {"time_us": 900.0}], [{"time_us": 1100.0}, {"time_us": 800.0}]])
    assert [r["time_us"] for r in rows] == [1100.0, 900.0] and [r["repeat"] for r in rows] == [0, 1]
    assert rows[0]["algbw_GBps"] == pytest.approx((1 << 30) / 1100e-6 / 1e9)
    assert rows[0]["busbw_GBps"] == pytest.approx(rows[0]["algbw_GBps"] * 2 * 7 / 8)
    with pytest.raises(ValueError):
        reduce_ranks(p, [[{"time_us": 1.0}], []])
    assert trimmed_mean([1.0, 2.0, 3.0, 100.0]) == pytest.approx(2.0)


def test_collective_calls_use_the_new_names_with_a_fallback():
    calls = []

    def rec(name):
        return lambda *a, **k: calls.append((name, tuple(t.numel() for t in a if hasattr(t, "numel"))))

    new = types.SimpleNamespace(all_gather_single=rec("all_gather_single"), reduce_scatter_single=rec("reduce_scatter_single"),
                                all_reduce=rec("all_reduce"), all_to_all_single=rec("all_to_all_single"))
    collective_call(new, "all_gather", 4096, 4, None, "cpu", torch.float32)()
    collective_call(new, "reduce_scatter", 4096, 4, None, "cpu", torch.float32)()
    old = types.SimpleNamespace(all_gather_into_tensor=rec("all_gather_into_tensor"), reduce_scatter_tensor=rec("reduce_scatter_tensor"))
    collective_call(old, "all_gather", 4096, 4, None, "cpu", torch.float32)()
    assert calls == [("all_gather_single", (1024, 256)), ("reduce_scatter_single", (256, 1024)),
                     ("all_gather_into_tensor", (1024, 256))]


def test_nccl_version_from_torch():
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 26, 2))))
    assert _nccl_version(fake) == (2, 26, 2)
    suffixed = types.SimpleNamespace(cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 28, 9, "+cuda13.0"))))
    assert _nccl_version(suffixed) == (2, 28, 9)  # was a ValueError traceback when the backend started

    def broken():
        raise RuntimeError("no NCCL")

    fake.cuda.nccl.version = broken
    assert _nccl_version(fake) is None


@pytest.mark.skipif(GPU, reason="checks the message on a machine without a GPU")
def test_without_a_gpu_the_backend_says_so(tmp_path):
    proc = cli("profile", "--backend", "nccl", "--workload", "cpu-demo", "--out", tmp_path / "run")
    assert proc.returncode == 2 and "needs CUDA GPUs" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


# -- orchestration under real torchrun, CPU stand-in ------------------------------------------------


@pytest.mark.slow
def test_torchrun_profile_rank0_writes_all_ranks_agree_and_resume(tmp_path):
    wl = tmp_path / "one.yaml"
    ONE_PAIR.save(wl)
    run = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "lagom_tune", "profile", "--backend", "nccl",
           "--workload", str(wl), "--out", str(run), "--repeats", "2", "--timeout", "60"]
    env = {**os.environ, "LAGOM_NCCL_STANDIN": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    fp = meta["fingerprint"]
    assert meta["complete"] and meta["points_done"] == meta["points_total"]
    assert fp["backend"] == "nccl" and fp["ranks"] == 2 and fp["mode"] == "multi-gpu" and "standin" in fp
    assert fp["gemm_operands"] == "one pair (stand-in)"  # a GPU run says how its GEMMs were timed (gpu_timing.OPERANDS)
    import pandas as pd

    df = pd.read_csv(run / "measurements.csv")
    assert df.groupby("point").size().eq(2).all()  # one row per repeat: ranks merged, not appended
    assert set(df["kind"]) == {"gemm", "collective", "overlap", "default", "again"}
    assert (df["kind"].iloc[-df["point"].str.startswith("again|").sum():] == "again").all()  # measured last
    assert (df.loc[df["kind"].isin(("collective", "default")), "busbw_GBps"] > 0).all()
    # the workload's all-reduce with nothing set: gloo makes no choice the tuner plugin could observe
    own = df[df["kind"] == "default"]
    assert set(own["nbytes"]) == {1 << 18} and own[["algo", "channels", "chosen_algo", "chosen_proto"]].isna().all().all()
    assert "nothing set: all_reduce of 262144 B on 2 ranks ran in" in proc.stdout and "its choice not observed" in proc.stdout
    assert (run / "model.yaml").is_file()
    refused = cli("search", run, "--out", run / "plan.yaml")
    assert not (run / "plan.yaml").exists()
    assert refused.returncode == 2 and "stand-in" in refused.stderr and "Traceback" not in refused.stderr
    before = len(df)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(pd.read_csv(run / "measurements.csv")) == before  # resumed: nothing left to measure
    # rank 0's refusal reaches every rank (none waits for a sweep that will not come)
    other = subprocess.run([*cmd[:-4], "--repeats", "3", "--timeout", "60"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert other.returncode != 0 and other.stderr.count("resume with the same value") >= 2, other.stderr[-2000:]


# -- the real thing ---------------------------------------------------------------------------------


@pytest.mark.skipif(not GPU or torch.cuda.device_count() < 2 or shutil.which("cc") is None,
                    reason="needs two CUDA GPUs (NCCL runs one rank a GPU) and `cc` for the tuner plugin")
def test_a_two_gpu_profile_observes_nccls_own_choice(tmp_path):
    """Two ranks, real NCCL: the all-reduce timed with nothing set records the algorithm and
    protocol NCCL chose (the tuner plugin, loaded with no rules, saw its cost table) and the
    channels NCCL's log says it ran them on."""
    import pandas as pd

    wl = tmp_path / "one.yaml"
    ONE_PAIR.save(wl)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "lagom_tune", "profile", "--backend", "nccl",
           "--workload", str(wl), "--out", str(tmp_path / "run"), "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_csv(tmp_path / "run" / "measurements.csv")
    own = df[df["kind"] == "default"]
    print(own[["op", "nbytes", "ranks", "chosen_algo", "chosen_proto", "chosen_channels", "time_us", "busbw_GBps"]].to_string())  # -rP
    assert len(own) == 2 and own["chosen_algo"].notna().all() and own["chosen_proto"].isin(["ll", "ll128", "simple"]).all()
    assert (own["chosen_channels"] >= 1).all() and (own["chosen_channels"] <= 64).all()


PROBE_CHECK = """
import torch
from lagom_tune.backends.probe import SLOTS, Probe, probe_geometry
g = probe_geometry(8 << 20, channels=4, buffsize=1 << 20)
p = Probe(g, 128, torch.device(DEVICE))
p.src.copy_(torch.arange(g.source_words, dtype=torch.float32, device=DEVICE))
per = g.slice_chunks * g.chunk_words
for steps in (1, g.slice_chunks + 3):  # the last step lands in slot (step % 8), from chunk (step % slice)
    p.stage.zero_()
    p.launch(steps=steps)
    last = steps - 1
    for c in range(g.channels):
        got = p.stage[(c * SLOTS + last % SLOTS) * g.chunk_words:][:g.chunk_words]
        assert torch.equal(got, p.src[c * per + last % g.slice_chunks * g.chunk_words:][:g.chunk_words]), (steps, c)
print("probe ok")
"""


# A kernel that loops over a scalar argument, as the probe's does: Triton's interpreter (3.1-3.4
# seen) reads such an argument with int() on a one-element array, which NumPy 2.4 refuses.
SCALAR_LOOP = """
import torch
import triton
import triton.language as tl


@triton.jit
def count(out, steps):
    for _ in range(steps):
        tl.store(out, tl.load(out) + 1)


out = torch.zeros(1)
count[(1,)](out, 3)
assert out.item() == 3
"""


def test_probe_kernel_copies_chunks_into_its_staging_ring(tmp_path):
    """On a GPU, the compiled kernel; elsewhere Triton's interpreter, where Triton is installed
    and its interpreter can run a loop over a scalar argument at all."""
    pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; not installed here")
    device = "cuda" if GPU else "cpu"
    env = {**os.environ, **({} if GPU else {"TRITON_INTERPRET": "1"})}
    if not GPU:
        (tmp_path / "scalar_loop.py").write_text(SCALAR_LOOP)  # a file: Triton reads a kernel's source
        loop = subprocess.run([sys.executable, tmp_path / "scalar_loop.py"], capture_output=True, text=True, timeout=300, env=env)
        if loop.returncode:
            import numpy
            import triton

            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a scalar argument beside NumPy "
                        f"{numpy.__version__}: {loop.stderr.strip().splitlines()[-1]}")
    proc = subprocess.run([sys.executable, "-c", PROBE_CHECK.replace("DEVICE", repr(device))], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "probe ok" in proc.stdout, proc.stderr[-3000:]


def test_placement_counts_blocks_by_tpc():
    # SMs 0 and 1 share TPC 0; 2 and 3 TPC 1; ...: blocks on SMs 0, 1, 2, 4 of 8 leave TPC 3 free
    assert placement_summary([0, 1, 2, 4], 8) == Placement(blocks=4, sms_used=4, most_per_sm=1, tpcs_used=3, tpcs_half_used=2, free_tpcs=1)
    assert placement_summary([3, 3], 8) == Placement(blocks=2, sms_used=1, most_per_sm=2, tpcs_used=1, tpcs_half_used=1, free_tpcs=3)
    with pytest.raises(ValueError, match="1 of 2 blocks recorded no SM id"):
        placement_summary([5, -1], 8)


@needs_gpu
def test_probe_blocks_report_the_sms_they_ran_on():
    pytest.importorskip("triton")
    from lagom_tune.backends.probe import Probe

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for channels in (1, 8, 32):
        smids = Probe(probe_geometry(channels << 20, channels, 1 << 20), 512, torch.device("cuda")).placement()
        placed = placement_summary(smids, sms)  # raises if a block recorded nothing
        assert placed.blocks == channels and 1 <= placed.sms_used <= channels and placed.free_tpcs < sms // 2


@needs_gpu
def test_single_gpu_probe_profile_fits_the_compute_side(tmp_path):
    pytest.importorskip("triton")
    wl = tmp_path / "one.yaml"
    ONE_PAIR.save(wl)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lagom_tune", "profile", "--backend", "nccl", "--workload", str(wl),
                           "--out", str(run), "--repeats", "3"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = yaml.safe_load((run / "model.yaml").read_text())
    assert model["family"] == "lagom-gpu" and "overlap_compute" in model["accuracy"]["mape"]
    assert yaml.safe_load((run / "meta.yaml").read_text())["fingerprint"]["mode"] == "single-gpu-probe"
    refused = cli("search", run, "--out", run / "plan.yaml")
    assert refused.returncode == 2 and "single-GPU profile" in refused.stderr


# -- a single-GPU probe profile's rows, downstream: fit, refusal by search, gpu_check tables ---------


class ProbeShapedBackend:
    """The nccl backend's single-GPU plan, answered by a simple physics (not a GPU): checks that
    what the probe mode writes fits, and that bench/gpu_check.py can tabulate it."""

    name, simulated, writer = "nccl", False, True

    @property
    def info(self):
        from lagom_tune.backends.registry import backend_info

        return backend_info("nccl")

    def __init__(self):
        from lagom_tune.backends.sim import CLUSTERS, SimCluster

        self.sim = SimCluster(CLUSTERS["h100-nvlink"])
        self.knob_space = nccl_knob_space(64, 16)

    def share(self, value):
        return value

    def fingerprint(self):
        return {"backend": "nccl", "mode": "single-gpu-probe", "gpu": "fake", "device": "fake", "sms": 132, "hbm_GBps": 3350.0,
                "hbm_method": "assumed", "driver": None, "cuda": None, "nccl": None, "torch": "x", "host": "h", "ranks": 1}

    def plan_points(self, workload):
        return plan_probe_points(workload, self.knob_space, 132)

    def copy_time(self, nbytes, s):
        bw = min(s["channels"] * 40e9, 3.0e12) / (1 + (16 << 10) / (s["buffsize"] / 8))
        return 3e-6 + nbytes / bw, bw

    def measure(self, points, repeats, sink):
        for p in points:
            s = p.settings
            if p.kind == "gemm":
                row = {"time_us": self.sim.gemm_time(p.gemm) * 1e6}
            elif p.kind == "collective":
                row = {"time_us": self.copy_time(p.nbytes, s)[0] * 1e6}
            else:
                y = self.sim.gemm_time(p.gemm)
                n = max(1, round(1e-3 / y))
                nbytes = int(n * y * self.copy_time(1 << 30, s)[1])
                x, bw = self.copy_time(nbytes, s)
                y1 = self.sim.gemm_time(p.gemm, SimContention(s["channels"], 2 * bw, True)) * n
                x1 = x * 1.05
                t_comp, t_comm = (x1 + (1 - x1 / y1) * y * n, x1) if x1 <= y1 else (y1, y1 + (1 - y1 / x1) * x)
                row = {"time_us": t_comp * 1e6, "comm_us": t_comm * 1e6, "window_us": max(t_comp, t_comm) * 1e6, "n_compute": n,
                       "compute_alone_us": y * n * 1e6, "comm_alone_us": x * 1e6, "nbytes": nbytes}
            sink(p, [{**row, "repeat": r} for r in range(repeats)])


def test_probe_mode_rows_fit_are_refused_by_search_and_tabulate(tmp_path):
    from lagom_tune.model.fit import fit_run
    from lagom_tune.profile.campaign import run_profile

    big = Workload("probe-shapes", (OverlapGroup("bwd", (Gemm("a", 4096, 4096, 4096, "bf16"), Gemm("b", 8192, 2048, 4096, "bf16"),
                                                         Gemm("c", 2048, 2048, 8192, "bf16")),
                                                 (Collective("g", "all_reduce", 1 << 26, ranks=8),)),))
    run = run_profile(big, ProbeShapedBackend(), tmp_path / "run", repeats=2)
    fit = fit_run(run)
    assert fit.model.family == "lagom-gpu" and "probe|copy|copy|1" in fit.model.comm
    assert fit.mape["collective"] < 0.05 and fit.mape["overlap_compute"] < 0.10, fit.mape
    refused = cli("search", run.path, "--out", tmp_path / "plan.yaml")
    assert refused.returncode == 2 and "single-GPU profile" in refused.stderr
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import tables, write_report

    text = write_report(run.path, tmp_path / "results", "probe-shapes", 12.0)
    assert "MEASURED" in text and "single-gpu-probe" in text and (tmp_path / "results" / "gpu_check-probe-shapes_gemm.csv").is_file()
    assert "Where the probe's blocks run" in text and "not measured" in text  # measure_placement needs the GPU
    (tmp_path / "results" / "gpu_check-probe-shapes_probe_placement.csv").write_text(
        "channels,blocks,sms_used,most_per_sm,tpcs_used,tpcs_half_used,free_tpcs,sim_gpu,sim_free_tpcs,smids\n2,2,2,1,2,2,64,H100-SXM,64,0 70\n")
    placed = write_report(run.path, tmp_path / "results", "probe-shapes", 12.0)
    section = placed.split("Where the probe's blocks run")[1].split("##")[0]
    assert "sim_free_tpcs" in section and "H100-SXM" in section and "not measured" not in section and "0 70" not in section  # every SM id stays in the CSV
    # the placement is held against the simulated GPU of the kind measured: an H100's against the H100's
    from gpu_check import simulated_peer

    assert simulated_peer("NVIDIA H100 80GB HBM3").name == "h100-nvlink" and simulated_peer("NVIDIA H200").name == "h200-nvlink"
    assert simulated_peer("NVIDIA B200").name == "h200-nvlink"  # none simulated: the GPU the simulator was calibrated on
    out = tables(run.path)
    assert len(out["gemm"]) == 3 and (out["gemm"]["TFLOPs"] > 0).all()
    assert (out["gemm"]["point_over_baseline"] - 1).abs().max() < 1e-9  # this backend's points and baselines are one time
    assert out["probe_GBps"].notna().all().all() and len(out["probe_GBps"].columns) == 1 + 4  # every channels × buffsize cell
    assert len(out["windows"]) == 3 * len(out["probe_GBps"]) * 4 and out["windows"]["predicted_window_us"].gt(0).all()
    assert "Median-shape Spearman" in text and "Measured" in text
    assert list(out["probe_GBps"]["channels"]) == sorted(out["probe_GBps"]["channels"])
    slow = out["gemm_slowdown"].set_index("channels")
    assert (slow.to_numpy() >= 0.99).all() and slow.iloc[-1].mean() > slow.iloc[0].mean()  # more channels, more slowdown


def test_show_collectives_prints_nccl_tests_columns(tmp_path):
    from lagom_tune.profile.campaign import run_profile

    run = run_profile(ONE_PAIR, ProbeShapedBackend(), tmp_path / "run", repeats=4)
    proc = cli("show", run.path, "--collectives", "--json", check=True)
    import json

    rows = json.loads(proc.stdout)
    assert rows and {"op", "size_B", "channels", "buffsize", "time_us", "trimmed_us", "algbw_GBps", "busbw_GBps"} <= set(rows[0])
    first = rows[0]
    assert first["op"] == PROBE and isinstance(first["channels"], int) and first["repeats"] == 4
    assert first["algbw_GBps"] == pytest.approx(first["size_B"] / first["time_us"] / 1e3, rel=1e-2)
    assert "busbw" in cli("show", run.path, "--collectives", check=True).stdout


def test_a_failing_worker_ends_the_run_names_the_rank_and_keeps_what_was_measured(tmp_path):
    """Single process with the CPU stand-in: GEMMs measure, then the probe (which needs a GPU) fails."""
    wl = tmp_path / "one.yaml"
    ONE_PAIR.save(wl)
    run = tmp_path / "run"
    proc = cli("profile", "--backend", "nccl", "--workload", wl, "--out", run, "--repeats", "2", env={"LAGOM_NCCL_STANDIN": "cpu"})
    assert proc.returncode == 1 and "rank 0" in proc.stderr and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    import pandas as pd

    kept = pd.read_csv(run / "measurements.csv")
    assert set(kept["kind"]) == {"gemm"} and len(kept) == 2 * 2  # both GEMM shapes, every repeat
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    assert not meta["complete"] and meta["fingerprint"]["mode"] == "single-gpu-probe"
    # where NCCL logs to a file (the observing worker's always does), its last warnings come with the error
    log = tmp_path / "nccl.log"
    log.write_text("h:1:2 [0] NCCL INFO Bootstrap : Using lo\nh:1:2 [0] NCCL WARN Cuda failure 2 'out of memory'\n")
    again = cli("profile", "--backend", "nccl", "--workload", wl, "--out", run, "--repeats", "2",
                env={"LAGOM_NCCL_STANDIN": "cpu", "NCCL_DEBUG_FILE": str(log)})
    assert again.returncode == 1 and "needs a CUDA GPU; NCCL WARN Cuda failure 2 'out of memory'" in again.stderr, again.stderr


def test_the_overlapped_probe_copies_what_ncc_defaults_copy_in_the_gemms_time():
    from lagom_tune.backends.nccl_worker import CudaMeter

    meter = CudaMeter.__new__(CudaMeter)  # no GPU: only the sizing logic, with the launches faked
    trials = []

    def comm(point, nbytes=None, settings=None):
        s = settings or point.settings
        trials.append((nbytes, s["channels"], s["buffsize"]))
        return (lambda: None), types.SimpleNamespace(geometry=probe_geometry(nbytes, s["channels"], s["buffsize"]))

    meter.comm, meter.per_launch_us = comm, (lambda fn, warmup=3, count=5: 2000.0)  # the 16 MiB trial takes 2 ms
    p = Point("overlap", nccl_config("copy", "copy", 4, 512, 1 << 20, 1), gemm=G1, op=PROBE, nbytes=0, ranks=1)
    assert meter.probe_bytes_lasting(p, 0.006) == 48 << 20  # three trials' worth lasts 6 ms
    assert trials == [(16 << 20, 16, 4 << 20)]  # timed at NCCL's defaults, whatever the point's settings


def test_an_overlapped_job_is_the_same_at_every_setting_of_a_shape():
    from lagom_tune.backends.nccl_worker import CudaMeter

    meter = CudaMeter.__new__(CudaMeter)
    meter.jobs, meter.device = {}, "cpu"
    meter.dist = types.SimpleNamespace()
    sized = []
    meter.probe_bytes_lasting = lambda point, seconds: sized.append(seconds) or 7 << 20
    import lagom_tune.backends.tensors as tensors

    orig, tensors.slowest_rank = tensors.slowest_rank, (lambda dist, values, device="cpu": values)
    try:
        jobs = {meter.job(Point("overlap", nccl_config("copy", "copy", ch, 512, b, 1), gemm=G1, op=PROBE, nbytes=0, ranks=1), 40e-6)
                for ch in (1, 16, 64) for b in (1 << 20, 8 << 20)}
    finally:
        tensors.slowest_rank = orig
    assert jobs == {(25, 7 << 20)} and len(sized) == 1  # 25 GEMMs of 40 µs last 1 ms; sized once


def test_a_collectives_overlapped_job_is_sized_at_nccls_defaults_and_kept_by_later_workers(monkeypatch):
    """The GEMMs beside a collective were counted at the shape's first point, channels=1 (the
    collective at its slowest), and counted again in each buffer size's worker: the job changed
    with the setting, and at 32-64 channels the collective covered a small part of the window."""
    from lagom_tune.backends.nccl_sweep import JOB_REFERENCE, batches, job_key, plan_collective_points
    from lagom_tune.backends.nccl_worker import CudaMeter, WorkerSpec
    import lagom_tune.backends.tensors as tensors

    monkeypatch.setattr(tensors, "slowest_rank", lambda dist, values, device="cpu": values)
    space = nccl_knob_space(64, 16)
    points = plan_collective_points(ONE_PAIR, space, world=2, gpus_per_node=2)
    with_overlaps = [b for b in batches(points) if any(p.kind == "overlap" for p in b.points)]
    # the first worker to meet the overlaps runs NCCL's default buffer size: it sizes every job
    assert dict(with_overlaps[0].process)["buffsize"] == JOB_REFERENCE["buffsize"] == space["buffsize"].default
    collective_us = {1: 40_000.0, 16: 8_000.0, 64: 4_000.0}  # the collective alone at each channel count

    def meter(jobs=()):
        m = CudaMeter.__new__(CudaMeter)
        m.device, m.dist = "cpu", types.SimpleNamespace()
        m.jobs = {k: (n, b) for k, n, b in jobs}
        m.comm = lambda point, nbytes=None, settings=None: (("launch", point.settings["channels"]), None)
        m.per_launch_us = lambda fn, warmup=3, count=5: collective_us[fn[1]]
        return m

    first = meter()
    overlaps = [p for b in with_overlaps for p in b.points if p.kind == "overlap"]
    assert overlaps[0].settings["channels"] == 1  # the first setting met is the slowest
    jobs = {first.job(p, 50e-6) for p in overlaps}
    assert jobs == {(160, 0)}  # 8 ms at 16 channels / 50 µs GEMMs, at every setting
    passed = tuple((k, n, b) for k, (n, b) in first.jobs.items())
    later = meter(passed)
    later.per_launch_us = lambda fn, warmup=3, count=5: pytest.fail("a later worker sized a job again")
    assert later.job(overlaps[-1], 55e-6) == (160, 0) and job_key(overlaps[-1]) in later.jobs
    # never fewer GEMMs than the GEMM point's own 1 ms sample (the two are one measurement)
    short = meter()
    short.per_launch_us = lambda fn, warmup=3, count=5: 10.0
    assert short.job(overlaps[0], 50e-6) == (20, 0)
    # the worker hands its jobs on in its last message
    assert WorkerSpec(0, 2, 0, 2, "h", 0, "p/", (), 1, 60.0, jobs=passed).jobs == passed


def test_gemm_launches_cycle_operand_copies_past_the_l2():
    """The H200 ran MPT-7B's 4x128x2048x2048 at 4.7 TB/s of A, B and C moved once, more than the
    4.26 TB/s it copies: back to back on one pair of operands, a GEMM reads them from the L2 the
    launch before filled, which a training step (other kernels in between) does not find."""
    from lagom_tune.backends.gpu_timing import CACHE_SPAN, MAX_OPERAND_SETS, operand_sets
    from lagom_tune.backends.tensors import rotating_matmul

    l2 = 50 << 20
    assert operand_sets(Gemm("mpt", 128, 2048, 2048, "bf16", batch=4), l2) == 5  # 35.7 MB of A and B: 5 copies span 3 L2s
    assert operand_sets(Gemm("big", 2048, 4096, 28672, "bf16"), l2) == 1  # 352 MB: a launch evicts its own operands
    assert operand_sets(G1, l2) == MAX_OPERAND_SETS
    small = G1.m * G1.k * 4 + G1.k * G1.n * 4  # fp32
    assert operand_sets(G1, small) == CACHE_SPAN
    launch = rotating_matmul(G1, "cpu", small)
    products = [launch() for _ in range(2 * CACHE_SPAN)]
    assert all(not torch.equal(products[i], products[j]) for i in range(CACHE_SPAN) for j in range(i))  # a new pair each launch
    assert all(torch.equal(products[i], products[i + CACHE_SPAN]) for i in range(CACHE_SPAN))  # ... in a cycle


def test_the_hbm_copy_is_timed_on_its_own_devices_stream():
    """The events were recorded on the current device's stream (GPU 0 in every parent) while the
    copy ran on cuda:local_rank: on local ranks > 0 they timed nothing."""
    from lagom_tune.backends.nccl import _measured_copy_bandwidth

    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            recorded.append(stream)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    cuda = types.SimpleNamespace(Event=Event, current_stream=lambda device=None: ("stream of", device), empty_cache=lambda: None)
    fake = types.SimpleNamespace(cuda=cuda, empty=lambda n, dtype=None, device=None: torch.empty(4), empty_like=torch.empty_like,
                                 float32=torch.float32)
    assert _measured_copy_bandwidth(fake, "cuda:3") == pytest.approx(2 * (1 << 30) / 1e-3 / 1e9)
    assert recorded == [("stream of", "cuda:3")] * 10


def test_short_launches_are_replayed_from_a_cuda_graph_and_long_ones_launched():
    from lagom_tune.backends.gpu_timing import GRAPH_BELOW_US, launches

    captured = []

    class FakeGraph:
        def replay(self):
            captured.append("replay")

    cuda = types.SimpleNamespace(CUDAGraph=FakeGraph, graph=lambda g: contextlib.nullcontext(), synchronize=lambda: None)
    fake = types.SimpleNamespace(cuda=cuda)
    calls = []
    short = launches(fake, lambda: calls.append(1), 8, GRAPH_BELOW_US / 2)
    assert short.how == "graph" and len(calls) == 8 and captured == ["replay"]  # captured once, uploaded by one replay
    short()
    assert len(calls) == 8 and captured == ["replay", "replay"]  # replaying launches nothing from the CPU
    long = launches(fake, lambda: calls.append(1), 3, GRAPH_BELOW_US * 2)
    assert long.how == "stream" and long.graph is None
    long()
    assert len(calls) == 11
    assert launches(fake, lambda: None, 3, 1.0, capturable=False).how == "stream"  # NCCL collectives: never captured


class FakeCudaEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def fake_cuda_torch():
    """torch with its CUDA calls answered on the CPU (work is synchronous, so events time it)."""
    side = types.SimpleNamespace(wait_event=lambda event: None)
    cuda = types.SimpleNamespace(Event=FakeCudaEvent, Stream=lambda device=None: side, synchronize=lambda device=None: None,
                                 stream=lambda s: contextlib.nullcontext(), empty_cache=lambda: None,
                                 get_device_properties=lambda device=None: types.SimpleNamespace(L2_cache_size=50 << 20))
    return types.SimpleNamespace(device=lambda *a: torch.device("cpu"), matmul=torch.matmul, float32=torch.float32, tensor=torch.tensor,
                                 cuda=cuda)


def fake_nccl_dist(calls):
    def record(name):
        return lambda *a, **k: calls.append((name, k.get("group")))

    def subgroups(layout, backend=None, pg_options=None):
        if pg_options is None:  # NCCL's own channels
            calls.append(("new_subgroups", layout, backend, None, None))
            return "group-own", layout
        calls.append(("new_subgroups", layout, backend, pg_options.config.min_ctas, pg_options.config.max_ctas))
        return f"group-{pg_options.config.max_ctas}", layout

    return types.SimpleNamespace(
        barrier=lambda device_ids=None: None, all_reduce=record("all_reduce"), all_gather_single=record("all_gather"),
        reduce_scatter_single=record("reduce_scatter"), all_to_all_single=record("all_to_all"), broadcast=record("broadcast"),
        get_global_rank=lambda group, r: r, ReduceOp=types.SimpleNamespace(MAX="max"),
        ProcessGroupNCCL=types.SimpleNamespace(Options=FakeOptions), new_subgroups_by_enumeration=subgroups)


def test_gpu_meter_control_flow_with_cuda_and_nccl_faked():
    """The worker's GPU measurements end to end, CUDA events and NCCL answered by fakes on the CPU."""
    from lagom_tune.backends.nccl_worker import CudaMeter, WorkerSpec

    calls = []
    pts = plan_collective_points(ONE_PAIR, nccl_knob_space(8, 8), world=2, gpus_per_node=2)
    spec = WorkerSpec(0, 2, 0, 2, "127.0.0.1", 0, "p/", tuple(pts), 3, 60.0)
    meter = CudaMeter(spec, fake_cuda_torch(), fake_nccl_dist(calls))
    gemm = meter.measure(next(p for p in pts if p.kind == "gemm"), 3)
    assert len(gemm) == 3 and all(r["time_us"] > 0 and r["inner"] >= 1 for r in gemm)
    coll = [p for p in pts if p.kind == "collective"][:3]
    for p in coll:
        rows = meter.measure(p, 3)
        assert len(rows) == 3 and all(r["time_us"] > 0 for r in rows)
    channels = sorted({p.settings["channels"] for p in coll})
    made = [c for c in calls if c[0] == "new_subgroups"]
    assert [(c[3], c[4]) for c in made] == [(ch, ch) for ch in channels]  # one communicator per channel count, pinned
    assert made[0][1] == [[0, 1]] and made[0][2] == "nccl"
    over = next(p for p in pts if p.kind == "overlap")
    rows = meter.measure(over, 2)
    assert len(rows) == 2 and {"time_us", "comm_us", "window_us", "n_compute", "compute_alone_us", "comm_alone_us"} <= set(rows[0])
    assert rows[0]["window_us"] == max(rows[0]["time_us"], rows[0]["comm_us"]) and rows[0]["n_compute"] >= 1
    assert {r["baseline"] for r in rows} == {"paired"}  # alone times measured right before, every repeat
    assert rows[0]["compute_alone_us"] != rows[1]["compute_alone_us"]
    assert ("all_reduce", f"group-{over.settings['channels']}") in calls


def test_a_default_point_runs_nccls_own_choices_and_records_the_one_it_saw(monkeypatch, tmp_path):
    """A collective with nothing set runs on a communicator without CTA bounds, is timed as the sweep
    times collectives, and its rows carry the algorithm and protocol the worker's tuner plugin saw
    NCCL choose for its call (its size's bucket, its span), not another call's, and the channels
    NCCL's log says it ran them on."""
    from lagom_tune.backends import nccl_worker
    from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, NcclChoice

    calls = []
    dist = fake_nccl_dist(calls)
    # what the plugin counted: NCCL's barrier all-reduce (4 B, its own pick), and our 256 KiB all-reduce
    seen = lambda: (NcclChoice("all_reduce", False, 4, 7, "tree", "ll", 5 + len(calls)),  # noqa: E731
                    *((NcclChoice("all_reduce", False, 1 << 18, (1 << 19) - 1, "ring", "ll128", len(calls) - 1),) if len(calls) > 1 else ()))
    monkeypatch.setenv(PLUGIN_ENV, "/cache/libnccl-tuner-lagom-tune.so")
    monkeypatch.setattr(nccl_worker, "hold_tuner", lambda path: "the plugin")
    monkeypatch.setattr(nccl_worker, "read_nccl_choices", lambda lib: seen())
    pts = plan_collective_points(ONE_PAIR, nccl_knob_space(8, 8), world=2, gpus_per_node=2)
    own = next(p for p in pts if p.kind == "default")
    meter = nccl_worker.CudaMeter(nccl_worker.WorkerSpec(0, 2, 0, 2, "127.0.0.1", 0, "p/", (own,), 3, 60.0), fake_cuda_torch(), dist)
    rows = meter.measure(own, 3)
    assert calls[0] == ("new_subgroups", [[0, 1]], "nccl", None, None)  # no min/max CTAs: NCCL's own channels
    assert len(rows) == 3 and all(r["time_us"] > 0 and r["chosen_algo"] == "ring" and r["chosen_proto"] == "ll128" for r in rows)
    assert {r["chosen_channels"] for r in rows} == {None}  # no NCCL log to read them from
    # NCCL's log (this rank is its communicators' rank 0): the barrier's all-reduce, then the point's first call
    log = tmp_path / f"nccl.{os.getpid()}.log"
    said = lambda algo, proto, hi: f"h:1:2 [0] NCCL INFO AllReduce: 262144 Bytes -> Algo {algo} proto {proto} channel{{Lo..Hi}}={{0..{hi}}}\n"  # noqa: E731
    log.write_text("h:1:2 [0] NCCL INFO AllReduce: 4 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}\n" + said("RING", "LL128", 23))
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.%p.log"))
    meter = nccl_worker.CudaMeter(nccl_worker.WorkerSpec(0, 2, 0, 2, "127.0.0.1", 0, "p/", (own,), 3, 60.0), fake_cuda_torch(), dist)
    assert {(r["chosen_algo"], r["chosen_proto"], r["chosen_channels"]) for r in meter.measure(own, 2)} == {("ring", "ll128", 24)}
    with log.open("a") as f:  # the log ran another pair than the plugin saw: the channels are that pair's, not known
        f.write(said("TREE", "SIMPLE", 7))
    assert {(r["chosen_algo"], r["chosen_proto"], r["chosen_channels"]) for r in meter.measure(own, 2)} == {("ring", "ll128", None)}
    monkeypatch.delenv(PLUGIN_ENV)  # no plugin (no compiler): the log alone says what NCCL ran
    meter = nccl_worker.CudaMeter(nccl_worker.WorkerSpec(0, 2, 0, 2, "127.0.0.1", 0, "p/", (own,), 3, 60.0), fake_cuda_torch(), dist)
    assert {(r["chosen_algo"], r["chosen_proto"], r["chosen_channels"]) for r in meter.measure(own, 2)} == {("tree", "simple", 8)}
    monkeypatch.delenv("NCCL_DEBUG_FILE")  # neither: timed, the choice unknown
    meter = nccl_worker.CudaMeter(nccl_worker.WorkerSpec(0, 2, 0, 2, "127.0.0.1", 0, "p/", (own,), 3, 60.0), fake_cuda_torch(), dist)
    assert [(r["chosen_algo"], r["chosen_proto"], r["chosen_channels"]) for r in meter.measure(own, 2)] == [(None, None, None)] * 2


def test_nccls_choice_is_read_from_the_counts_of_its_own_calls():
    from lagom_tune.backends.nccl_tuner import NcclChoice, choice_between, size_bucket

    assert size_bucket(0) == (0, 1) and size_bucket(3 << 20) == (2 << 20, (4 << 20) - 1)
    mine = lambda calls, algo="ring", proto="ll": NcclChoice("all_gather", True, 2 << 20, (4 << 20) - 1, algo, proto, calls)  # noqa: E731
    before = (mine(7), NcclChoice("all_gather", False, 2 << 20, (4 << 20) - 1, "nvls", "simple", 3))
    after = (mine(7), mine(2, proto="ll128"), NcclChoice("all_gather", False, 2 << 20, (4 << 20) - 1, "nvls", "simple", 9))
    assert choice_between(before, after, "all_gather", 3 << 20, True) == ("ring", "ll128")  # not the earlier calls' LL
    assert choice_between(before, after, "all_gather", 3 << 20, False) == ("nvls", "simple")  # within a node
    assert choice_between(before, after, "all_gather", 1 << 20, True) is None  # another size: nothing seen
    assert choice_between((), (), "all_reduce", 1 << 20, False) is None


def rows_gemm(pts):
    return next(p for p in pts if p.kind == "overlap").gemm


def test_a_gemm_point_is_timed_as_the_baseline_of_its_overlapped_job(monkeypatch):
    """One count of back-to-back launches for a shape, alone and in its overlapped job: the H200's
    200 µs GEMM points ran 8-37% slower than the same shapes' 1 ms baselines (gpu_timing.launch_count)."""
    from lagom_tune.backends import tensors
    from lagom_tune.backends.gpu_timing import MAX_LAUNCHES, launch_count
    from lagom_tune.backends.nccl_worker import CudaMeter, WorkerSpec

    pts = plan_probe_points(ONE_PAIR, nccl_knob_space(64, 16), sms=132)
    meter = CudaMeter(WorkerSpec(0, 1, 0, 1, "127.0.0.1", 0, "p/", tuple(pts), 2, 60.0), fake_cuda_torch(), fake_nccl_dist([]))
    meter.per_launch_us = lambda fn, warmup=3, count=5: 40.0  # a 40 µs GEMM
    meter.probe_bytes_lasting = lambda point, seconds: 1 << 20
    monkeypatch.setattr(tensors, "slowest_rank", lambda dist, values, device="cpu": values)
    alone = meter.measure(next(p for p in pts if p.kind == "gemm"), 2)
    n, _ = meter.job(next(p for p in pts if p.kind == "overlap"), 40e-6)
    assert {r["inner"] for r in alone} == {n} == {launch_count(40e-6)} == {25}  # 1 ms of 40 µs launches, both ways
    assert launch_count(3e-3) == 1 and launch_count(8e-6) == 125 and launch_count(1e-7) == MAX_LAUNCHES


def test_gpu_meter_probe_points_with_the_kernel_faked(monkeypatch):
    from lagom_tune.backends import nccl_worker
    from lagom_tune.backends.gpu_timing import launch_count
    from lagom_tune.backends.nccl_worker import CudaMeter, WorkerSpec

    class FakeProbe:  # copies at 200 GB/s, in real time
        def __init__(self, geometry, threads, device):
            self.geometry = geometry

        def launch(self, steps=None):
            g = self.geometry
            time.sleep((steps or g.steps) * g.channels * g.chunk_words * 4 / 200e9)

    monkeypatch.setattr(nccl_worker, "Probe", FakeProbe)
    pts = plan_probe_points(ONE_PAIR, nccl_knob_space(64, 16), sms=132)
    meter = CudaMeter(WorkerSpec(0, 1, 0, 1, "127.0.0.1", 0, "p/", tuple(pts), 2, 60.0), fake_cuda_torch(), fake_nccl_dist([]))
    alone = meter.measure(next(p for p in pts if p.kind == "collective" and p.op == PROBE), 2)
    assert all(r["nbytes"] >= 4 << 20 for r in alone)
    # the job is sized from the meter's own estimates, recorded here: checking its wall time would
    # depend on how busy the machine is (a loaded CI runner once timed one small CPU GEMM at > 1 ms)
    estimates, sized = [], []
    per_launch_us, bytes_lasting = meter.per_launch_us, meter.probe_bytes_lasting
    meter.per_launch_us = lambda fn, warmup=3, count=5: estimates.append(per_launch_us(fn, warmup, count)) or estimates[-1]
    meter.probe_bytes_lasting = lambda point, seconds: sized.append((seconds, bytes_lasting(point, seconds))) or sized[-1][1]
    rows = meter.measure(next(p for p in pts if p.kind == "overlap"), 2)
    # n GEMMs lasting 1 ms at the GEMM's estimate; the probe sized to last as long at NCCL's defaults,
    # and its bytes are in the rows
    n = launch_count(estimates[0] / 1e6)
    assert {r["n_compute"] for r in rows} == {n} and sized[0][0] == pytest.approx(n * estimates[0] / 1e6)
    assert rows[0]["nbytes"] == pytest.approx(sized[0][1], rel=0.25) and rows[0]["nbytes"] > 0
    other = meter.measure(next(p for p in pts if p.kind == "overlap" and p.gemm == rows_gemm(pts) and p.settings["channels"] == 64), 2)
    # the same job: the same GEMMs, and the same bytes up to one step per channel (rows keep the exact bytes)
    assert other[0]["n_compute"] == rows[0]["n_compute"] and other[0]["nbytes"] == pytest.approx(rows[0]["nbytes"], rel=0.25)


def test_topology_keeps_no_terminal_escape_codes():
    from lagom_tune.backends.nccl import plain_text

    raw = "\x1b[4mGPU0\tCPU Affinity\x1b[0m\nGPU0\t X \t0-15"  # as nvidia-smi printed it on the H200
    assert plain_text(raw) == "GPU0\tCPU Affinity\nGPU0\t X \t0-15"
