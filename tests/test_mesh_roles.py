"""Every communicator a training framework makes (init_process_group, new_group, new_subgroups*,
split_group, DeviceMesh) reaches the shim, matched to a plan role by mesh dimension, rank set or
size; ambiguous plans are refused. NCCL's Options are faked, as in test_nccl_runtime.py."""

import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import CollectiveRule, Plan, load_plan
from lagom_tune.runtime import nccl
from lagom_tune.runtime.launch import check_roles
from lagom_tune.runtime.nccl import GroupIdentity, Role, match_role
from lagom_tune.runtime.shim import Shim, rank_reports

from conftest import BIN, ROOT, cli

# torch's DeviceMesh since _init_one_process_group (2.10) gives a dimension that spans every rank
# the world group; before, a mesh of two or more dimensions made a new group for it (2.4.1).
REUSES_WORLD = hasattr(DeviceMesh, "_init_one_process_group")

ROLES = (Role("dp_shard", 2), Role("tp", 2, ((0, 1), (2, 3))), Role("cp", 2), Role("world", 4))

# An NCCL plan for a 2x2 (dp_shard x tp) mesh, with a third role of the same size (cp) that only a
# mesh dimension's name can tell from dp_shard, and tp's rank sets for groups no mesh makes.
MESH_PLAN = Plan(
    backend="nccl", world_size=4, hardware={"gpu": "NVIDIA H100 80GB HBM3"},
    groups={"dp_shard": 2, "tp": 2, "cp": 2}, group_ranks={"tp": ((0, 1), (2, 3))}, settings=Settings({}),
    rules=(CollectiveRule("all_gather", "dp_shard", 0, 1 << 30, {"channels": 2}),
           CollectiveRule("reduce_scatter", "dp_shard", 0, 1 << 30, {"channels": 4}),
           CollectiveRule("all_reduce", "tp", 0, 1 << 30, {"channels": 8}),
           CollectiveRule("all_reduce", "cp", 0, 1 << 30, {"channels": 16})))


@pytest.mark.parametrize("group, role, by", [
    (GroupIdentity((0, 2), "dp_shard"), "dp_shard", "mesh dim"),  # the mesh dimension's name decides
    (GroupIdentity((0, 1), "cp"), "cp", "mesh dim"),  # even where tp's rank sets hold the ranks
    (GroupIdentity((2, 3)), "tp", "rank set"),
    (GroupIdentity((0, 1, 2, 3)), "world", "size"),  # the only role of 4 ranks
    (GroupIdentity((0, 1, 2, 3), "mesh_dim_0"), "world", "size"),  # a dimension no role names
])
def test_roles_match_by_mesh_dim_then_rank_set_then_unique_size(group, role, by):
    m = match_role(ROLES, group)
    assert (m.role, m.by) == (role, by)


def test_same_size_roles_without_a_name_or_rank_set_are_ambiguous():
    m = match_role(ROLES, GroupIdentity((0, 2)))  # tp's rank sets exclude it; dp_shard and cp remain
    assert m.role is None and m.ambiguous == ("dp_shard", "cp")
    assert "dp_shard, cp all match a group of 2 ranks" in m.describe(GroupIdentity((0, 2)))


def test_a_mesh_dim_of_another_size_than_its_role_gets_no_role():
    m = match_role(ROLES, GroupIdentity((0, 1, 2, 3), "dp_shard"))  # a 4x1 mesh against a 2x2 plan
    assert m.role is None and "mesh dim dp_shard has 4 ranks" in m.describe(GroupIdentity((0, 1, 2, 3), "dp_shard"))


def test_plans_whose_roles_cannot_be_told_apart_are_refused():
    assert nccl.ambiguous_roles(MESH_PLAN) == []  # dp_shard and cp are mesh dimensions; tp has rank sets
    shard = Plan(backend="gloo", world_size=4, hardware={}, settings=Settings({}), groups={"shard": 2, "tp": 2})
    assert nccl.ambiguous_roles(shard) == [("shard", "tp")]
    with pytest.raises(UserError, match="shard and tp cannot be told apart"):
        check_roles(shard)
    same_set = Plan(backend="gloo", world_size=4, hardware={}, settings=Settings({}), groups={"a": 2, "b": 2},
                    group_ranks={"a": ((0, 1), (2, 3)), "b": ((0, 1),)})
    assert nccl.ambiguous_roles(same_set) == [("a", "b")]
    told = Plan(backend="gloo", world_size=4, hardware={}, settings=Settings({}), groups={"a": 2, "b": 2},
                group_ranks={"a": ((0, 1), (2, 3)), "b": ((0, 2), (1, 3))})
    check_roles(told)


def test_apply_refuses_an_ambiguous_plan_with_one_line_and_exit_2(tmp_path):
    plan = Plan(backend="gloo", world_size=2, hardware={"device": "cpu"}, settings=Settings({"threads": 1}),
                groups={"replicas": 1, "experts": 1}).save(tmp_path / "p.yaml")
    for args in (("--", "true"), ("--dry-run",)):  # a dry run without a command checks the roles too
        r = cli("apply", plan, *args)
        assert r.returncode == 2, r.stderr
        assert "experts and replicas cannot be told apart" in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_rank_sets_round_trip_and_are_checked(tmp_path):
    path = MESH_PLAN.save(tmp_path / "p.yaml")
    assert load_plan(path).group_ranks == {"tp": ((0, 1), (2, 3))}
    assert "group_ranks" not in Plan(backend="gloo", world_size=2, hardware={}, settings=Settings({}),
                                     groups={"dp": 2}).to_dict()["target"]  # older plans' shape unchanged
    for bad, message in [({"tp": [[0, 1, 2]]}, "3 ranks, but role tp has 2"), ({"tp": [[0, 7]]}, "distinct ranks from 0 to 3"),
                         ({"ep": [[0, 1]]}, "no role 'ep'"), ({"tp": "0,1"}, "list of rank lists"),
                         ({"tp": [[0, 1], [1, 0]]}, r"tp\[1\]: rank 1 is in .*tp\[0\] too")]:  # was accepted
        d = MESH_PLAN.to_dict()
        d["target"]["group_ranks"] = bad
        with pytest.raises(UserError, match=message):
            Plan.from_dict(d)


class FakeOptions:
    def __init__(self):
        self.config = types.SimpleNamespace(min_ctas=-1, max_ctas=-1)


def fake_c10d(rank: int, world: int = 4):
    """c10d's group-making functions, recording the options each group is made with."""
    calls = []
    default = types.SimpleNamespace(group_name="0", group_desc="default_pg")
    mod = types.SimpleNamespace(ProcessGroupNCCL=types.SimpleNamespace(Options=FakeOptions), calls=calls)

    def init_process_group(backend=None, world_size=-1, rank=-1, pg_options=None, device_id=None):
        calls.append(("init", tuple(range(world_size)), pg_options))

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, group_desc=None):
        calls.append(("new_group", tuple(ranks or range(world)), pg_options))
        return types.SimpleNamespace(group_name=f"g{len(calls)}")

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
        mine = next(s for s in split_ranks if rank in s)
        calls.append(("split_group", tuple(mine), pg_options))
        return types.SimpleNamespace(group_name=f"s{len(calls)}")

    mod.init_process_group, mod.new_group, mod.split_group = init_process_group, new_group, split_group
    mod.is_initialized, mod.get_rank, mod.get_world_size = lambda: True, lambda: rank, lambda group=None: world
    mod.get_backend = lambda group=None: "nccl"
    mod._get_default_group = lambda: default
    mod.get_process_group_ranks = lambda group: list(range(world))
    return mod


def test_split_groups_get_their_roles_options(tmp_path, monkeypatch):
    """DeviceMesh on a device-bound NCCL world splits its groups (ncclCommSplit): split_group sees
    the mesh dimension in group_desc, and a split of no role does not inherit the parent's bounds."""
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    monkeypatch.delenv("NCCL_MIN_CTAS", raising=False)
    import dataclasses

    plan = dataclasses.replace(MESH_PLAN, groups={**MESH_PLAN.groups, "world": 4}, rules=MESH_PLAN.rules + (
        CollectiveRule("all_reduce", "world", 0, 1 << 30, {"channels": 32}),))
    shim = Shim(plan, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d(rank=2)
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", world_size=4, rank=2)
    c10d.split_group(split_ranks=[[0, 2], [1, 3]], group_desc="mesh_dp_shard")
    c10d.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="mesh_tp")
    c10d.split_group(split_ranks=[[0, 3], [1, 2]])  # dp_shard or cp: ambiguous, and not the world's bounds either
    (_, _, world), (_, shard_ranks, shard), (_, tp_ranks, tp), (_, _, other) = c10d.calls
    assert (world.config.min_ctas, world.config.max_ctas) == (32, 32)
    assert shard_ranks == (0, 2) and (shard.config.min_ctas, shard.config.max_ctas) == (2, 4)
    assert tp_ranks == (2, 3) and (tp.config.min_ctas, tp.config.max_ctas) == (8, 8)
    assert isinstance(other, FakeOptions) and (other.config.min_ctas, other.config.max_ctas) == (-1, -1)
    recs = shim.communicators
    assert [(c.via, c.mesh_dim, c.role, c.matched_by) for c in recs] == [
        ("init_process_group", None, "world", "size"), ("split_group", "dp_shard", "dp_shard", "mesh dim"),
        ("split_group", "tp", "tp", "mesh dim"), ("split_group", None, None, "")]
    assert recs[3].ranks == [1, 2] and recs[3].not_applied["ctas"].startswith("dp_shard, cp all match")
    assert [(r["setting"], r["applied"]) for r in shim.records] == [
        ("ctas[world]", True), ("ctas[dp_shard]", True), ("ctas[tp]", True), ("ctas[dp_shard|cp]", False)]


def torch24_device_mesh(c10d):
    """torch 2.4's DeviceMesh as far as the shim sees it: no _init_one_process_group, and groups made
    with no group_desc, dimension by dimension, every rank making every row; a 1-D mesh over every
    rank reuses the world group."""

    class DeviceMesh:
        def __init__(self, shape, names):
            self.mesh, self.mesh_dim_names = torch.arange(4).view(*shape), names
            self._init_process_groups()

        def _init_process_groups(self):
            if self.mesh.ndim == 1 and self.mesh.numel() == c10d.get_world_size():
                self._dim_group_infos = [("", list(range(4)), c10d._get_default_group().group_name)]
                return
            self._dim_group_infos = []
            for dim in range(self.mesh.ndim):
                for row in self.mesh.swapdims(-1, dim).reshape(-1, self.mesh.size(dim)).tolist():
                    group = c10d.new_group(ranks=row)
                    if c10d.get_rank() in row:
                        self._dim_group_infos.append(("", row, group.group_name))

    return types.SimpleNamespace(DeviceMesh=DeviceMesh)


def test_a_torch_24_mesh_gets_each_dims_settings_without_group_descriptions(tmp_path):
    """Before torch 2.6 DeviceMesh gives its groups no group_desc: the shim names each dimension's
    groups from the mesh (rank 2 of a 2x2 mesh: dp_shard [0, 2], tp [2, 3]), and records the world
    group a 1-D mesh reuses."""
    shim = Shim(MESH_PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d(rank=2)
    shim.on_c10d(c10d)
    mesh_module = torch24_device_mesh(c10d)
    shim.on_device_mesh(mesh_module)
    c10d.init_process_group("nccl", world_size=4, rank=2)
    mesh_module.DeviceMesh((2, 2), ("dp_shard", "tp"))
    mesh_module.DeviceMesh((4,), ("dp_shard",))
    made = [(c.via, c.ranks, c.mesh_dim, c.role, c.matched_by) for c in shim.communicators]
    assert made == [("init_process_group", [0, 1, 2, 3], None, None, ""),
                    ("new_group", [0, 2], "dp_shard", "dp_shard", "mesh dim"), ("new_group", [2, 3], "tp", "tp", "mesh dim"),
                    ("DeviceMesh, reusing a group (init_process_group)", [0, 1, 2, 3], "dp_shard", None, "")]
    options = {ranks: opts for kind, ranks, opts in c10d.calls if kind == "new_group" and opts is not None}
    assert {r: (o.config.min_ctas, o.config.max_ctas) for r, o in options.items()} == {(0, 2): (2, 4), (2, 3): (8, 8)}
    assert shim.mesh_rows == []  # nothing left to name a later group by


def test_non_members_make_no_communicator_and_are_not_recorded(tmp_path):
    shim = Shim(MESH_PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d(rank=0)
    shim.on_c10d(c10d)
    c10d.new_group(ranks=[2, 3], group_desc="mesh_tp")  # rank 0 takes part in the call only
    c10d.new_group(ranks=[0, 1], group_desc="mesh_tp")
    assert c10d.calls[0][2] is None and c10d.calls[1][2].config.max_ctas == 8
    assert [c.ranks for c in shim.communicators] == [[0, 1]]


WORKER = r"""
import json, os, sys, types

from lagom_tune.runtime import shim as shim_mod


class FakeOptions:
    def __init__(self):
        self.config = types.SimpleNamespace(min_ctas=-1, max_ctas=-1)


# CPU stand-in for NCCL: gloo groups take the NCCL path, with fake Options (gloo ignores them).
shim_mod.NCCL_BACKENDS = ("nccl", "gloo")
shim_mod.nccl_options_class = lambda c10d: FakeOptions
shim_mod.install(sys.argv[1], sys.argv[2])  # before torch is imported, as sitecustomize does

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp_shard", "tp"))  # dp_shard reuses the world group
dist.new_subgroups(group_size=2)  # [0, 1], [2, 3]: tp's rank sets
dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])  # no name, no rank set: dp_shard or cp?
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_2x2_mesh_on_gloo_gets_each_dims_settings(tmp_path):
    plan = MESH_PLAN.save(tmp_path / "p.yaml")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    applied = tmp_path / "applied"
    applied.mkdir()
    r = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", str(script), str(plan), str(applied)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(4):
        comms = rank_reports(applied)[str(rank)]["communicators"]
        seen = [(c["via"], c["ranks"], c["mesh_dim"], c["role"], c["matched_by"], c["applied"]) for c in comms]
        shard, tp = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
        assert seen[:3] == [
            ("init_process_group", [0, 1, 2, 3], None, None, "", {}),
            ("new_group", shard, "dp_shard", "dp_shard", "mesh dim", {"min_ctas": 2, "max_ctas": 4}),
            ("new_group", tp, "tp", "tp", "mesh dim", {"min_ctas": 8, "max_ctas": 8})]
        reuse, single, sub, enum = comms[3:]
        via = "DeviceMesh, reusing a group (init_process_group)" if REUSES_WORLD else "new_group"
        assert reuse["via"] == via and reuse["mesh_dim"] == "dp_shard"
        assert reuse["ranks"] == [0, 1, 2, 3] and reuse["role"] is None  # a 4-rank dp_shard is not the plan's
        assert single["ranks"] == [rank] and single["mesh_dim"] == "tp" and single["role"] is None
        assert (sub["via"], sub["ranks"], sub["role"], sub["matched_by"], sub["applied"]) == (
            "new_subgroups -> new_group", tp, "tp", "rank set", {"min_ctas": 8, "max_ctas": 8})
        assert enum["via"] == "new_subgroups_by_enumeration -> new_group" and enum["role"] is None
        assert "dp_shard, cp" in enum["not_applied"]["ctas"] and enum["applied"] == {}
    assert "NOT applied ctas: dp_shard, cp all match this group of 2 ranks" in r.stderr


LATE = r"""
import os, sys
import torch.distributed as dist
from torch.distributed import new_group as early_new_group  # bound before the shim is installed
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)
init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))  # a mesh built before the plan

from lagom_tune.runtime.shim import install

install(sys.argv[1], sys.argv[2])
early_new_group([0], group_desc="mesh_dp_shard")
init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))  # a mesh built after it
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_late_install_records_earlier_groups_and_reaches_early_imports(tmp_path):
    plan = Plan(backend="gloo", world_size=1, hardware={}, settings=Settings({}), groups={"dp_shard": 1, "tp": 1}
                ).save(tmp_path / "p.yaml")
    script = tmp_path / "late.py"
    script.write_text(LATE)
    r = subprocess.run([sys.executable, str(script), str(plan), str(tmp_path), str(tmp_path / "store")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    comms = rank_reports(tmp_path)["0"]["communicators"]
    before = [c for c in comms if c["via"] == "made before the plan was installed"]
    after = [c for c in comms if c["via"] != "made before the plan was installed"]
    # The world group (which the 1-rank mesh reused for tp) was made before the plan.
    assert before and all(c["ranks"] == [0] for c in before)
    # the 1x1 mesh built after it: both dimensions span the world, so DeviceMesh reuses that group (or,
    # before torch 2.10, makes one for each)
    via = "DeviceMesh, reusing a group (made before the plan was installed)" if REUSES_WORLD else "new_group"
    assert [(c["via"], c["mesh_dim"], c["role"]) for c in after] == [
        ("new_group", "dp_shard", "dp_shard"),  # through the name imported before the shim was installed
        (via, "dp_shard", "dp_shard"), (via, "tp", "tp")]


FSDP2_ON_CPU = """
import os, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # before FSDP2 left _composable
    from torch.distributed._composable.fsdp import fully_shard
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
    try:
        fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))(torch.ones(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()
"""
# HSDP's all-reduce averages fp32 gradients with ReduceOp.AVG
GLOO_AVERAGES = """
import os, tempfile
import torch
import torch.distributed as dist
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG)
    finally:
        dist.destroy_process_group()
"""


@functools.cache
def refusal(script: str) -> str | None:
    """What this torch says when it cannot run ``script`` (one gloo rank on the CPU, in a fresh
    process): its last line, or None when it runs."""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def cpu_refusal(roles: dict) -> str | None:
    """Why this torch cannot run the FSDP2 example with ``roles`` on a CPU, or None. Seen: 2.4.1 and
    2.5.1 make FSDP2's streams with ``torch.cuda.Stream`` ("FSDP requires CUDA for streams" in 2.5);
    2.6.0 makes CPU streams that lack ``record_event``; 2.7.0's gloo refuses ReduceOp.AVG (HSDP);
    2.8, 2.9 and 2.13 train both meshes."""
    if refusal(FSDP2_ON_CPU):
        return f"torch {torch.__version__}'s FSDP2 does not train on a CPU: {refusal(FSDP2_ON_CPU)}"
    if "dp_replicate" in roles and refusal(GLOO_AVERAGES):
        return f"torch {torch.__version__}'s gloo cannot average, which HSDP's all-reduce does: {refusal(GLOO_AVERAGES)}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mesh, roles", [
    (["--tp", "2"], {"world": 4, "dp_shard": 2, "tp": 2}),
    # HSDP: FSDP2 on a (dp_replicate, dp_shard) mesh; its replicas' all-reduce group has a role of its own
    (["--replicate", "2", "--tp", "1"], {"world": 4, "dp_replicate": 2, "dp_shard": 2, "tp": 1}),
], ids=["fsdp2-tp", "hsdp"])
def test_apply_records_every_group_of_the_fsdp2_example_with_its_role(tmp_path, mesh, roles):
    """The acceptance run: the FSDP2 + DeviceMesh example under `apply`, unmodified."""
    if not torch.cuda.is_available() and cpu_refusal(roles):
        pytest.skip(cpu_refusal(roles))
    plan = Plan(backend="gloo", world_size=4, hardware={"device": "cpu"}, settings=Settings({"threads": 1}),
                groups=roles).save(tmp_path / "p.yaml")
    metrics = tmp_path / "m.json"
    r = cli("apply", plan, "--", BIN / "torchrun", "--standalone", "--nproc-per-node", "4",
            ROOT / "examples" / "train_fsdp2_mesh.py", *mesh, "--steps", "2", "--metrics", metrics, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    groups = json.loads(metrics.read_text())["groups"]  # what rank 0's script itself sees
    applied = json.loads((tmp_path / "applied.json").read_text())
    assert set(applied["ranks"]) == {"0", "1", "2", "3"}
    seen = {tuple(c["ranks"]): c["role"] for c in applied["ranks"]["0"]["communicators"]}
    assert {tuple(g["ranks"]): g["group"] for g in groups} == seen  # every group, each with its role
    for rank, data in applied["ranks"].items():
        assert {c["role"] for c in data["communicators"]} == set(roles)


# Makes this torch's gloo refuse ReduceOp.AVG, as torch 2.7.0's does, in every process it starts.
REFUSE_AVERAGES = """
import torch.distributed as dist
_all_reduce = dist.all_reduce
def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
    if op == dist.ReduceOp.AVG:
        raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")
    return _all_reduce(tensor, op, *args, **kwargs)
dist.all_reduce = all_reduce
"""


@pytest.mark.slow
def test_the_fsdp2_example_says_once_why_hsdp_cannot_run_on_a_gloo_that_cannot_average(tmp_path):
    """torch 2.7.0's gloo refuses ReduceOp.AVG, which FSDP2's HSDP all-reduce uses: the example says so
    in one line (rank 0's) before its first step, rather than four ranks' tracebacks mid-step."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REFUSE_AVERAGES)
    r = subprocess.run([BIN / "torchrun", "--standalone", "--nproc-per-node", "4", ROOT / "examples" / "train_fsdp2_mesh.py",
                        "--replicate", "2", "--tp", "1", "--steps", "1"], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(site), "GLOO_SOCKET_IFNAME": "lo"})
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if "cannot average" in line]
    assert said == [f"torch {torch.__version__}'s gloo cannot average (ReduceOp.AVG), which FSDP2's HSDP all-reduce uses: "
                    "run without --replicate, on torch 2.8 or later, or on GPUs (--device cuda)"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr.split("cannot average")[0]  # nothing of ours before it; torchrun's own report follows
    assert "median step" not in r.stdout
