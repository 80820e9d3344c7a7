"""The runtime shim: applies a plan inside a rank without any change to the training script.

It imports nothing heavy at start-up. Settings are applied when the module they concern is
imported (a post-import hook on ``torch`` and on DDP's module), so processes that never use
torch (launchers, tools) pay nothing. Each rank records every setting it applied and every one it
could not apply, with the reason, in ``rank-N.PID.json`` in the applied folder, and logs them to
stderr (the ranks other than 0 only what they could not apply, unless :data:`LOG_ENV` says otherwise)
(:func:`rank_reports` reads them back: a rank's helper processes, which inherit its ``RANK``, write
their own files and never pass for the rank).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.chunking import chunked_all_reduce
from lagom_tune.backends.nccl_controls import build_options, overriding_env
from lagom_tune.backends.registry import (
    CHUNKED_ALL_REDUCE, DDP_BUCKET_CAP, NCCL_ENVIRONMENT, NCCL_TUNER_RULES, THREAD_COUNT, backend_info,
)
from lagom_tune.errors import UserError
from lagom_tune.plan.schema import Plan, knob_space_for, load_plan
from lagom_tune.runtime.after_import import when_imported
from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, RULES_ENV, hold_tuner, read_tuner_counts
from lagom_tune.runtime.nccl import (GroupIdentity, communicator_configs, defaults_record, match_role, plan_roles, rule_reach,
                                     tuner_rules)
from lagom_tune.runtime.ranks import process_rank
from lagom_tune.workload.bucketing import DDP_DEFAULT_CAP_MB
from lagom_tune.workload.spec import mesh_dim_of

PLAN_ENV = "LAGOM_TUNE_PLAN"  # the plan every process `apply` starts loads (site/sitecustomize.py reads it too)
APPLIED_ENV = "LAGOM_TUNE_APPLIED_DIR"  # where each rank writes what it applied
# "all": every rank logs what it applied to stderr; "failures": none does (a trial's plan runs after
# its first); otherwise rank 0 alone does. Every rank logs what it could not apply, and its whole
# record is in applied.json either way (16 ranks logging 4 lines each in every run of a trial buried
# the training's own output).
LOG_ENV = "LAGOM_TUNE_LOG"
LOG_ALL, LOG_FAILURES = "all", "failures"
RANK_PID_ENV = "LAGOM_TUNE_RANK_PID"  # set by a rank's shim: a process that inherits RANK and it is the rank's helper
DDP_MODULE = "torch.nn.parallel.distributed"
C10D_MODULE = "torch.distributed.distributed_c10d"
MESH_MODULE = "torch.distributed.device_mesh"
# The plan communicator whose settings DDP's gradient reduction takes: torchtitan's name for the
# replicated data-parallel dimension, or "dp" in plans made before roles were named so.
DDP_ROLES = ("dp_replicate", "dp")
DDP_ROLE = DDP_ROLES[0]
DDP_KNOBS = ("bucket_cap_mb", "chunk_bytes")  # the per-communicator knobs the runtime sets through DDP
# Group-making functions the shim wraps, in c10d and wherever a module imported them by name.
GROUP_MAKERS = ("init_process_group", "new_group", "split_group", "new_subgroups", "new_subgroups_by_enumeration")
# The argument of each group maker that takes a group's ProcessGroupNCCL.Options.
OPTIONS_ARGUMENT = "pg_options"
# torch process-group backends (not lagom-tune backends) whose groups take ProcessGroupNCCL.Options
# (tests on CPU add "gloo" to drive the same path).
NCCL_BACKENDS = ("nccl",)


def nccl_options_class(c10d) -> Any:
    """``ProcessGroupNCCL.Options`` of this torch, or None when it was built without NCCL.

    Args:
        c10d: the ``torch.distributed.distributed_c10d`` module.
    Returns:
        The Options class, or None.
    """
    return getattr(getattr(c10d, "ProcessGroupNCCL", None), "Options", None)


@dataclass
class CommunicatorRecord:
    """One process group this rank is a member of: how it was made, the role it plays, and what of
    the role's per-communicator settings reached it (or why not)."""

    via: str  # the call that made it: init_process_group, new_group, split_group, ...
    ranks: list[int]  # global ranks, sorted
    mesh_dim: str | None  # the DeviceMesh dimension that made (or reused) it
    role: str | None
    matched_by: str  # "mesh dim", "rank set", "size" or "" (no role)
    backend: str = ""
    group: str | None = None  # torch's group name, once made
    applied: dict[str, Any] = field(default_factory=dict)  # setting -> value set on the communicator
    not_applied: dict[str, str] = field(default_factory=dict)  # setting -> why not
    note: str = ""  # how the role was matched, or why none was

    def line(self) -> str:
        """The record as one log line."""
        where = f"mesh dim {self.mesh_dim}, " if self.mesh_dim else ""
        parts = [f"communicator {self.ranks} ({where}{self.via}): {self.note}"]
        if self.applied:
            parts.append("applied " + ", ".join(f"{k}={v}" for k, v in self.applied.items()))
        parts += [f"NOT applied {k}: {why}" for k, why in self.not_applied.items()]
        return "; ".join(parts)


@dataclass(frozen=True)
class GroupMaking:
    """A group this rank is about to make, as read from the creating call's arguments."""

    ident: GroupIdentity
    backend: str
    is_nccl: bool
    name_of: Callable[[Any], Any]  # the made process group -> its name, for the record
    parent: Any = None  # CommunicatorRecord of the group a split was made from


class Shim:
    """One process's appliers, and its record of what was applied and what could not be, and why."""

    def __init__(self, plan: Plan, plan_path: str, applied_dir: str | None):
        self.plan = plan
        self.info = backend_info(plan.backend)  # what to deploy for this plan's backend
        self.plan_path = plan_path
        self.applied_dir = applied_dir
        self.records: list[dict[str, Any]] = []
        self.logged = 0
        self.communicators: list[CommunicatorRecord] = []
        self.logged_communicators = 0
        self.by_group: dict[str, CommunicatorRecord] = {}  # torch group name -> its record
        self.making: str | None = None  # the group-making call in progress (inner calls pass through)
        self.via_outer: str | None = None  # new_subgroups*, whose groups new_group makes
        self.mesh_rows: list[tuple[tuple[int, ...], str]] = []  # a mesh's groups to come, on a torch whose DeviceMesh names none
        self.c10d: Any = None
        self.late = False  # installed after the script imported torch.distributed (an explicit install())
        self.roles: tuple = ()
        self.configs: dict = {}
        self.overridden: list[str] = []
        self.built_ddp = False
        self.users_bounds: dict[int, tuple] = {}  # id(the script's Options) -> (them, their own min_ctas, max_ctas)
        self.joined_rank: int | None = None  # the rank this process gave init_process_group itself
        self.tuner: Any = None  # the NCCL tuner plugin, held from torch's import on (its counts are read at exit)
        # a DataLoader worker, a tool a rank runs: it inherits the rank's RANK, and its settings are the rank's to report
        self.helper = "RANK" in os.environ and os.environ.get(RANK_PID_ENV, str(os.getpid())) != str(os.getpid())
        self.started = time.time()
        self.ddp_role = ddp_role_of(plan)
        self.pending = {}
        for knob in DDP_KNOBS:
            if plan.settings.communicators.get(self.ddp_role, {}).get(knob):
                self.pending[knob] = "no DistributedDataParallel model was built in this process"
        for role, knobs in plan.settings.communicators.items():  # DDP's knobs reach DDP's communicator alone
            for knob in (k for k in DDP_KNOBS if knobs.get(k) and role != self.ddp_role):
                self.records.append({"setting": f"{knob}[{role}]", "value": knobs[knob], "applied": False,
                                     "how": f"set on DistributedDataParallel, whose gradients the {self.ddp_role} role "
                                            f"reduces: the runtime has no way to set it on {role}'s communicators"})

    @property
    def rank(self) -> str:
        return process_rank(self.joined_rank)

    @property
    def is_rank(self) -> bool:
        """A training rank (launched by torchrun, or took part, :attr:`took_part`), not a launcher;
        possibly a rank's helper (a DataLoader worker, a tool it runs), which inherits its ``RANK``."""
        return "RANK" in os.environ or self.took_part

    @property
    def took_part(self) -> bool:
        """Joined a process group itself, was in one when the shim was installed late, or built a
        DDP model: what a rank does and its helpers do not."""
        return self.joined_rank is not None or self.built_ddp or self._my_rank() is not None

    def record(self, setting: str, value: Any, applied: bool, how: str) -> None:
        self.records.append({"setting": setting, "value": value, "applied": applied, "how": how})
        self.pending.pop(setting, None)
        self.flush()

    def amend(self, setting: str, note: str) -> None:
        """Add ``note`` to the latest record of ``setting`` (once per note) and log the record again."""
        r = next((r for r in reversed(self.records) if r["setting"] == setting), None)
        if r is None or note in r["how"]:
            return
        r["how"] += f", {note}"
        if self.is_rank and self._logs(r["applied"]):
            sys.stderr.write(self._line(r))
        self.flush()

    def _logs(self, applied: bool) -> bool:
        """Whether this process logs a record to stderr (:data:`LOG_ENV`): what it could not apply
        always; what it applied under ``all``, never under ``failures``, else on rank 0 or a process
        whose rank is not known."""
        mode, rank = os.environ.get(LOG_ENV), self.rank
        return not applied or mode == LOG_ALL or (mode != LOG_FAILURES and (rank == "0" or not rank.isdigit()))

    def _line(self, r: dict[str, Any]) -> str:
        return f"[lagom-tune rank {self.rank}] {'applied' if r['applied'] else 'NOT applied'} {r['setting']}={r['value']} ({r['how']})\n"

    def flush(self) -> None:
        """Log new records to stderr (:meth:`_logs`) and rewrite this rank's file (silent outside ranks)."""
        if not self.is_rank:
            return
        for r in self.records[self.logged:]:
            if self._logs(r["applied"]):
                sys.stderr.write(self._line(r))
        self.logged = len(self.records)
        for c in self.communicators[self.logged_communicators:]:
            if self._logs(not c.not_applied):
                sys.stderr.write(f"[lagom-tune rank {self.rank}] {c.line()}\n")
        self.logged_communicators = len(self.communicators)
        if not self.applied_dir:
            return
        out = {"rank": self.rank, "pid": os.getpid(), "started": self.started, "took_part": self.took_part,
               "plan": self.plan_path, "records": self.records, "communicators": [asdict(c) for c in self.communicators]}
        try:
            atomic_write_text(os.path.join(self.applied_dir, f"rank-{self.rank}.{os.getpid()}.json"), json.dumps(out, indent=1))
        except (UserError, OSError) as e:  # a full disk must not end the user's training: say so once, go on
            sys.stderr.write(f"[lagom-tune rank {self.rank}] not recorded for applied.json ({e}); the training goes on\n")
            self.applied_dir = None

    def at_exit(self) -> None:
        if not self.is_rank:
            return
        if self.took_part or not self.helper:  # a helper that did nothing itself leaves the rank's settings to the rank
            for setting, why in list(self.pending.items()):
                self.record(setting, self.plan.settings.communicators.get(self.ddp_role, {}).get(setting), False, why)
        if self.tuner is not None:  # what NCCL's calls in this process got of the plan's rules
            rules = tuner_rules(self.plan)
            counts = read_tuner_counts(self.tuner, len(rules.rules))
            records = [*rule_reach(rules, counts), defaults_record(self.plan, counts.nccl_choices)] if counts else []
            for setting, value, applied, how in filter(None, records):
                self.record(setting, value, applied, how)
        self.flush()  # records made before any flush (settings no applier reaches)

    def appliers(self) -> list[tuple[str, Callable[[Any], None]]]:
        """What to run when each module is imported, from what the runtime deploys for the plan's
        backend (its registry record), in order: per module, the earlier entry runs first.

        Returns:
            (module name, applier) pairs.
        """
        deploys = self.info.deploys_capability
        out: list[tuple[str, Callable[[Any], None]]] = []
        if deploys(THREAD_COUNT):
            out.append(("torch", self.on_torch))
        if deploys(NCCL_ENVIRONMENT) or deploys(NCCL_TUNER_RULES):
            out.append(("torch", self.on_torch_nccl))
        if deploys(DDP_BUCKET_CAP) or deploys(CHUNKED_ALL_REDUCE):
            out.append((DDP_MODULE, self.on_ddp))
        if deploys(CHUNKED_ALL_REDUCE):  # synchronous dist.all_reduce calls on the DDP role's groups, in chunks
            out.append((C10D_MODULE, self.on_c10d_gloo))
        out.append((C10D_MODULE, self.on_c10d))  # every group recorded with its role
        out.append((MESH_MODULE, self.on_device_mesh))
        return out

    # -- appliers ------------------------------------------------------------------------------

    def on_torch(self, torch) -> None:
        threads = self.plan.settings.process.get("threads")
        if threads is None:
            return
        planned, original, shim, rank_pid = int(threads), torch.set_num_threads, self, os.getpid()
        original(planned)
        self.record("threads", planned, torch.get_num_threads() == planned, "torch.set_num_threads")
        if self.helper:  # a DataLoader worker sets its own (one thread): the rank's plan is not its to keep
            return

        @functools.wraps(original)
        def set_num_threads(n):
            # the plan's count stands in the rank, as its DDP buckets do (a forked worker's call passes)
            original(n)  # what torch refuses (0 threads) it still refuses
            if os.getpid() != rank_pid or n == planned:
                return
            original(planned)
            shim.amend("threads", f"replacing the script's torch.set_num_threads({n!r})")

        torch.set_num_threads = set_num_threads

    def on_ddp(self, module) -> None:
        role = self.plan.settings.communicators.get(self.ddp_role, {})
        cap, chunk = role.get("bucket_cap_mb"), int(role.get("chunk_bytes") or 0)
        if cap is None and not chunk:
            return
        ddp = module.DistributedDataParallel
        original = ddp.__init__
        signature = inspect.signature(original)
        shim = self

        def __init__(self, *args, **kwargs):
            bound = signature.bind_partial(self, *args, **kwargs)
            group, mesh = bound.arguments.get("process_group"), bound.arguments.get("device_mesh")
            if group is None and mesh is not None:  # DDP(device_mesh=...), replicate(): the mesh's one dimension
                group = mesh.get_group()
            elsewhere = shim._not_ddp_role(group)
            if elsewhere:  # a DDP model on another communicator: the script's settings stand
                original(self, *args, **kwargs)
                shim.built_ddp = True
                for knob, value in (("bucket_cap_mb", cap), ("chunk_bytes", chunk)):
                    if value:
                        shim.record(knob, value, False, elsewhere)
                return
            previous = bound.arguments.get("bucket_cap_mb")
            # DDP's own cap left to DDP: given explicitly, DDP sizes its first bucket as the rest
            # instead of 1 MiB, which is not the defaults the plan was searched against
            left = cap == DDP_DEFAULT_CAP_MB and previous is None
            if cap is not None and not left:
                bound.arguments["bucket_cap_mb"] = cap
            original(*bound.args, **bound.kwargs)
            shim.built_ddp = True
            if cap is not None:
                in_effect = getattr(self, "bucket_bytes_cap", None)
                how = ("DDP's default, left to it (its first bucket 1 MiB)" if left else "DistributedDataParallel(bucket_cap_mb=...)"
                       + (f", replacing the script's {previous}" if previous is not None else ""))
                shim.record("bucket_cap_mb", cap, in_effect == int(cap * 1024 * 1024), how)
            if chunk:
                sparse = _sparse_gradients(self.module)
                if sparse:
                    shim.record("chunk_bytes", chunk, False, f"the model has sparse gradients ({sparse}), which no chunked hook splits")
                else:  # registered at the first forward: DDP takes one comm hook, and the script may register its own first
                    self.__dict__[CHUNK_PENDING] = chunk
                    shim.pending["chunk_bytes"] = "the DDP model never ran forward (the chunked hook is registered at its first)"

        def register_comm_hook(self, *args, **kwargs):
            if self.__dict__.pop(CHUNK_PENDING, None):
                shim.record("chunk_bytes", chunk, False, "the script registers its own DDP comm hook, which DDP takes alone")
            return original_hook(self, *args, **kwargs)

        def _register_builtin_comm_hook(self, *args, **kwargs):
            if self.__dict__.pop(CHUNK_PENDING, None):
                shim.record("chunk_bytes", chunk, False, "the script registers a built-in DDP comm hook, which DDP takes alone")
            return original_builtin(self, *args, **kwargs)

        def forward(self, *args, **kwargs):
            pending = self.__dict__.pop(CHUNK_PENDING, None)
            if pending:
                try:
                    original_hook(self, self.process_group, chunked_allreduce_hook(pending))
                    shim.record("chunk_bytes", pending, True, "DDP comm hook: each bucket all-reduced in chunks, all in flight")
                except RuntimeError as e:  # a hook DDP was given some other way
                    shim.record("chunk_bytes", pending, False, f"DDP comm hook not registered: {e}")
            return original_forward(self, *args, **kwargs)

        __init__.__wrapped__ = original
        ddp.__init__ = __init__
        if chunk:
            original_hook, original_builtin, original_forward = ddp.register_comm_hook, ddp._register_builtin_comm_hook, ddp.forward
            for name, wrapper, wrapped in (("register_comm_hook", register_comm_hook, original_hook),
                                           ("_register_builtin_comm_hook", _register_builtin_comm_hook, original_builtin),
                                           ("forward", forward, original_forward)):
                wrapper.__wrapped__ = wrapped
                setattr(ddp, name, wrapper)

    def _not_ddp_role(self, group: Any) -> str:
        """Why ``group`` (None: the default group) is not a communicator of the plan's DDP role, or
        "" when it is: by the role its record matched, else by its size (a plan naming no roles: the
        world's). DDP's knobs, and the chunked all-reduce, reach only the role's communicators."""
        c10d = self.c10d or sys.modules.get(C10D_MODULE)
        if c10d is None:
            return ""
        try:
            group = group if group is not None else c10d._get_default_group()
            size = int(c10d.get_world_size(group))
        except Exception:  # a fake or an uninitialised default group: DDP itself will say
            return ""
        rec = self.by_group.get(str(getattr(group, "group_name", None)))
        if rec is not None and rec.role is not None:
            return "" if rec.role == self.ddp_role else f"the process group plays role {rec.role}, not {self.ddp_role}"
        want = self.plan.groups.get(self.ddp_role, self.plan.world_size)  # a group of no one role: by its size
        return "" if size == want else f"the process group has {size} ranks; the plan's {self.ddp_role} has {want}"

    def on_c10d_gloo(self, c10d) -> None:
        """Chunk synchronous ``all_reduce`` calls on the DDP role's communicators."""
        chunk = int(self.plan.settings.communicators.get(self.ddp_role, {}).get("chunk_bytes") or 0)
        if not chunk:
            return
        original = c10d.all_reduce
        shim = self

        def all_reduce(tensor, op=c10d.ReduceOp.SUM, group=None, async_op=False):
            if (async_op or not tensor.is_contiguous() or tensor.numel() * tensor.element_size() <= chunk
                    or shim._not_ddp_role(group)):
                return original(tensor, op=op, group=group, async_op=async_op)
            for work in chunked_all_reduce(original, tensor, chunk, op=op, group=group):
                work.wait()
            return None

        all_reduce.__wrapped__ = original
        c10d.all_reduce = all_reduce
        self.record("chunk_bytes[all_reduce]", chunk, True,
                    f"dist.all_reduce wrapper: synchronous calls above {chunk} B on the {self.ddp_role} role's groups, in chunks")

    # -- NCCL plans: environment, tuner rules, per-communicator Options ------------------------

    def tuner_env(self) -> tuple[str | None, str | None, list[str]]:
        """The tuner plugin and rules file this process's environment names, and those of them
        that are no file here."""
        plugin, rules = os.environ.get(PLUGIN_ENV), os.environ.get(RULES_ENV)
        return plugin, rules, [f"{var}={path}" for var, path in ((PLUGIN_ENV, plugin), (RULES_ENV, rules))
                               if path and not os.path.isfile(path)]

    def tuner_deployed(self) -> bool:
        """Whether NCCL in this process runs the plan's rules through the tuner plugin."""
        plugin, rules, missing = self.tuner_env()
        return bool(self.plan.rules and plugin and rules) and not missing

    def on_torch_nccl(self, torch) -> None:
        if self.plan.rules:
            plugin, rules, missing = self.tuner_env()
            ok = self.tuner_deployed()
            self.tuner = hold_tuner(plugin) if ok else None
            self.record("collective_rules", len(self.plan.rules), ok,
                        f"NCCL_TUNER_PLUGIN={plugin} reads {RULES_ENV}={rules}" if ok else
                        f"{' and '.join(missing)}: no such file on this node (`--print-env` names files on the host "
                        "that ran it; put them where every node sees them): only per-communicator CTA bounds apply"
                        if missing else
                        "no tuner plugin in the environment (no C compiler when `apply` ran, or not run under "
                        "`lagom-tune apply`): only per-communicator CTA bounds apply")
        space = knob_space_for(self.plan.backend)  # the knob modules import no torch, numpy or pandas
        for name, value in self.plan.settings.process.items():
            var = space[name].env
            if var:
                self.record(name, value, os.environ.get(var) == str(value), f"{var} in the environment")

    # -- process groups: every communicator this rank joins, its role, its per-communicator settings --

    def on_c10d(self, c10d) -> None:
        """Wrap the functions that make process groups, in c10d and wherever a loaded module
        imported them by name, so that every group this rank joins is matched to a plan role and,
        for NCCL, made with the role's CTA bounds. Groups made before this ran are recorded as such.

        ``new_subgroups`` and ``new_subgroups_by_enumeration`` make their groups through c10d's
        ``new_group`` and DeviceMesh through ``new_group`` or ``split_group`` (see ``on_device_mesh``
        for the groups a mesh reuses), so all of them pass through these wrappers.

        Args:
            c10d: the ``torch.distributed.distributed_c10d`` module (or a fake with its functions).
        """
        self.c10d = c10d
        self.roles = plan_roles(self.plan)
        self.configs = communicator_configs(self.plan, self.tuner_deployed()) if self.info.deploys_nccl_options else {}
        self.overridden = overriding_env(os.environ) if self.configs else []
        self._record_existing(c10d)
        replaced: dict[int, tuple[Any, Any]] = {}
        for name in GROUP_MAKERS:
            fn = getattr(c10d, name, None)
            if fn is None or getattr(fn, "_lagom_tune", False):
                continue
            wrapper = getattr(self, f"_wrap_{name}")(fn)
            wrapper.__wrapped__, wrapper._lagom_tune = fn, True
            wrapper.__name__, wrapper.__doc__ = getattr(fn, "__name__", name), getattr(fn, "__doc__", None)
            setattr(c10d, name, wrapper)
            replaced[id(fn)] = (fn, wrapper)
        _rebind(replaced, skip=c10d, by_value=self.late)

    def on_device_mesh(self, module) -> None:
        """Record the groups a DeviceMesh reuses for a dimension instead of making them (the world
        group, for a dimension that spans every rank): its communicator was made earlier, for
        whatever role that call matched.

        Args:
            module: ``torch.distributed.device_mesh``.
        """
        mesh_cls = getattr(module, "DeviceMesh", None)
        original = getattr(mesh_cls, "_init_one_process_group", None) if mesh_cls is not None else None
        if original is None:
            self._label_mesh_groups(mesh_cls)
            return
        if getattr(original, "_lagom_tune", False):
            return
        signature = inspect.signature(original)
        shim = self

        def _init_one_process_group(*args, **kwargs):
            name = original(*args, **kwargs)
            dim = signature.bind_partial(*args, **kwargs).arguments.get("dim_name")
            if name is not None and dim is not None:
                shim._mesh_dim_made(str(name), str(dim))
            return name

        _init_one_process_group.__wrapped__, _init_one_process_group._lagom_tune = original, True
        mesh_cls._init_one_process_group = staticmethod(_init_one_process_group)

    def _label_mesh_groups(self, mesh_cls) -> None:
        """On a torch whose DeviceMesh makes its groups with no ``group_desc`` (before 2.6), tell
        ``new_group`` which mesh dimension each is for: ``_init_process_groups`` makes them dimension
        by dimension, each dimension's groups the rows of the mesh with that dimension last (every
        rank makes every row), so the mesh gives their order; and record the groups it reuses."""
        original = getattr(mesh_cls, "_init_process_groups", None) if mesh_cls is not None else None
        if original is None or getattr(original, "_lagom_tune", False):
            return  # another torch: its mesh groups still pass through new_group and split_group
        shim = self

        def _init_process_groups(mesh, *args, **kwargs):
            names = getattr(mesh, "mesh_dim_names", None) or ()
            try:
                shim.mesh_rows = [(tuple(sorted(int(r) for r in row)), str(name)) for dim, name in enumerate(names)
                                  for row in mesh.mesh.swapdims(-1, dim).reshape(-1, mesh.mesh.size(dim)).tolist()]
            except Exception:  # a mesh of another shape than torch 2.4's: its groups go unnamed, the mesh is made
                shim.mesh_rows = []
            try:
                made = original(mesh, *args, **kwargs)
            finally:
                shim.mesh_rows = []
            for info, name in zip(getattr(mesh, "_dim_group_infos", None) or (), names):
                if isinstance(info, (tuple, list)) and len(info) == 3:  # (tag, ranks, group name) in torch 2.4
                    shim._mesh_dim_made(str(info[2]), str(name))
            return made

        _init_process_groups.__wrapped__, _init_process_groups._lagom_tune = original, True
        mesh_cls._init_process_groups = _init_process_groups

    def _mesh_row(self, ranks: tuple[int, ...]) -> str | None:
        """The mesh dimension of the group ``new_group`` is making for a mesh (``_label_mesh_groups``),
        or None: not the row the mesh makes next."""
        if self.mesh_rows and self.mesh_rows[0][0] == ranks:
            return self.mesh_rows.pop(0)[1]
        return None

    def _wrapping(self, fn, via: str, describe: Callable[[dict], "GroupMaking | None"]):
        """``fn`` (a c10d function that makes a group) wrapped: ``describe`` reads its arguments and
        says which group this rank is about to make (None: not a member, or arguments torch itself
        will refuse, so the call passes through untouched); ``_make`` then gives it its options."""
        signature, shim = inspect.signature(fn), self

        def wrapper(*args, **kwargs):
            if shim.making:  # made inside another wrapped call (split via new_group, ...): recorded there
                return fn(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            made = describe(bound.arguments)
            if made is None:
                return fn(*args, **kwargs)
            return shim._make(via, fn, bound, made)

        return wrapper

    def _wrap_init_process_group(self, fn):
        def describe(a: dict) -> GroupMaking:
            # a process started without torchrun (mpirun, a plain script) is a rank too; its rank and
            # world size may be in the arguments, in init_method's URL (tcp://h:p?rank=0&world_size=2), or in the environment
            query = urllib.parse.parse_qs(urllib.parse.urlparse(str(a.get("init_method") or "")).query)

            def given(name: str):
                value = a.get(name)
                return value if value not in (None, -1) else (query.get(name) or [None])[0]

            rank, world = given("rank"), given("world_size")
            self.joined_rank = int(rank) if rank is not None else -1
            world = int(world) if world is not None else int(os.environ.get("WORLD_SIZE", 0) or 0)
            backend = str(a.get("backend") or "")
            return GroupMaking(GroupIdentity(tuple(range(world))), backend, _is_nccl(backend) or (not backend and _cuda_available()),
                               lambda pg: self._default_group_name())

        return self._wrapping(fn, "init_process_group", describe)

    def _wrap_new_group(self, fn):
        def describe(a: dict) -> GroupMaking | None:
            ranks = a.get("ranks")
            try:
                ranks = tuple(sorted(int(r) for r in (ranks if ranks is not None else range(self.c10d.get_world_size()))))
            except Exception:  # not initialized, odd ranks: torch itself reports it
                return None
            dim = mesh_dim_of(a.get("group_desc")) or self._mesh_row(ranks)  # every rank makes every row: taken even by a non-member
            me = self._my_rank()
            if me is not None and me not in ranks:  # a non-member makes no communicator
                return None
            backend = str(a.get("backend") or self._default_backend())
            return GroupMaking(GroupIdentity(ranks, dim), backend,
                               _is_nccl(backend) or (not backend and _cuda_available()), lambda pg: getattr(pg, "group_name", None))

        return self._wrapping(fn, "new_group", describe)

    def _wrap_split_group(self, fn):
        def describe(a: dict) -> GroupMaking | None:
            c10d = self.c10d
            try:  # split_ranks are ranks in the parent group: this rank's split, in global ranks
                parent = a.get("parent_pg") or c10d._get_default_group()
                members = list(c10d.get_process_group_ranks(parent))
                mine = members.index(c10d.get_rank())
                split = next((s for s in a.get("split_ranks") or () if mine in s), None)
                backend = str(c10d.get_backend(parent))
                parent_name = getattr(parent, "group_name", None)
            except Exception:  # bad arguments or no default group: split_group itself says so
                return None
            if split is None:
                return None
            ident = GroupIdentity(tuple(sorted(members[r] for r in split)), mesh_dim_of(a.get("group_desc")))
            return GroupMaking(ident, backend, _is_nccl(backend), lambda pg: getattr(pg, "group_name", None),
                               parent=self.by_group.get(parent_name))

        return self._wrapping(fn, "split_group", describe)

    def _wrap_new_subgroups(self, fn, name: str = "new_subgroups"):
        shim = self

        def wrapper(*args, **kwargs):
            if shim.making or shim.via_outer:
                return fn(*args, **kwargs)
            shim.via_outer = name  # its groups are made by c10d's new_group, wrapped too
            try:
                return fn(*args, **kwargs)
            finally:
                shim.via_outer = None

        return wrapper

    def _wrap_new_subgroups_by_enumeration(self, fn):
        return self._wrap_new_subgroups(fn, "new_subgroups_by_enumeration")

    def _make(self, via: str, fn, bound, made: GroupMaking):
        """Make a group this rank is a member of, with the options its role asks for; record it."""
        ident, backend, is_nccl, name_of, parent = made.ident, made.backend, made.is_nccl, made.name_of, made.parent
        via = f"{self.via_outer} -> {via}" if self.via_outer else via
        takes_options = OPTIONS_ARGUMENT in bound.signature.parameters
        rec, opts = self._decide(via, ident, backend, is_nccl, bound.arguments.get(OPTIONS_ARGUMENT), takes_options)
        if opts is None and takes_options and parent is not None and parent.applied and bound.arguments.get(OPTIONS_ARGUMENT) is None:
            # split_group copies the parent's options, CTA bounds included: a group of no role of
            # the plan gets NCCL's defaults instead of another role's bounds.
            cls = nccl_options_class(self.c10d)
            if cls is not None and is_nccl:
                opts = cls()
                rec.note += f"; NCCL's default CTA bounds, not those of the parent group ({parent.role})"
        if opts is not None:
            bound.arguments[OPTIONS_ARGUMENT] = opts
        self.making = via
        try:
            pg = fn(*bound.args, **bound.kwargs)
        finally:
            self.making = None
        try:
            rec.group = name_of(pg)
        except Exception:  # a fake or an odd return value: the record stands without the name
            rec.group = None
        self._add(rec)
        return pg

    def _decide(self, via: str, ident, backend: str, is_nccl: bool, existing: Any,
                takes_options: bool) -> tuple[CommunicatorRecord, Any]:
        """The group's role and the ProcessGroupNCCL.Options to make it with (None: leave as given);
        ``takes_options``: whether the call that makes it has a ``pg_options`` argument."""
        if existing is not None and id(existing) in self.users_bounds:
            # Options the script reuses for another group: that group starts from the script's own bounds
            _, existing.config.min_ctas, existing.config.max_ctas = self.users_bounds[id(existing)]
        match = match_role(self.roles, ident)
        rec = CommunicatorRecord(via, list(ident.ranks), ident.mesh_dim, match.role, match.by, backend,
                                 note=match.describe(ident))
        if match.role is None:
            bounded = [r for r in match.ambiguous if r in self.configs]
            if bounded:
                why = f"{', '.join(match.ambiguous)} all match this group of {ident.size} ranks; name them after " \
                      "the DeviceMesh dimensions or give their rank sets in the plan's target.group_ranks"
                rec.not_applied["ctas"] = why
                self.record(f"ctas[{'|'.join(bounded)}]", "?", False, why)
            return rec, None
        cfg = self.configs.get(match.role)
        if cfg is None:
            return rec, None
        bounds = f"{cfg.min_ctas}..{cfg.max_ctas}"
        if not is_nccl:
            rec.not_applied["ctas"] = f"{bounds}: a {backend or 'non-NCCL'} group; CTA bounds are NCCL's"
            return rec, None
        why = ""
        cls = nccl_options_class(self.c10d)
        if self.overridden:
            why = f"{', '.join(self.overridden)} in the environment silently override every communicator's config"
        elif cls is None:
            why = "this torch has no ProcessGroupNCCL"
        elif not takes_options:  # set as an argument it lacks, the bounds would be dropped without a word
            why = f"this torch's {via.split(' -> ')[-1]} takes no {OPTIONS_ARGUMENT}"
        if why:
            rec.not_applied["ctas"] = f"{bounds}: {why}"
            self.record(f"ctas[{cfg.role}]", bounds, False, why)
            return rec, None
        if existing is not None:
            self.users_bounds.setdefault(id(existing), (existing, existing.config.min_ctas, existing.config.max_ctas))
        opts = build_options(cls, cfg, existing)
        rec.applied = {"min_ctas": opts.config.min_ctas, "max_ctas": opts.config.max_ctas}  # as passed on
        self.record(f"ctas[{cfg.role}]", bounds, True,
                    f"ProcessGroupNCCL.Options for a group of {ident.size} ranks ({via}, role by {match.by})")
        return rec, opts

    def _mesh_dim_made(self, group_name: str, dim: str) -> None:
        """A mesh dimension got ``group_name``: record it when the mesh reused a group made for
        something else (its communicator keeps the settings it was made with)."""
        made = self.by_group.get(group_name)
        if made is None or made.mesh_dim == dim:
            return  # made for this dimension (recorded then), or not a group this shim saw made
        ident = GroupIdentity(tuple(made.ranks), dim)
        match = match_role(self.roles, ident)
        rec = CommunicatorRecord(f"DeviceMesh, reusing a group ({made.via})", list(made.ranks), dim, match.role,
                                 match.by, made.backend, group_name, note=match.describe(ident))
        cfg = self.configs.get(match.role) if match.role is not None else None
        if match.role == made.role:
            rec.applied, rec.not_applied = dict(made.applied), dict(made.not_applied)
        elif cfg is not None:
            why = (f"mesh dim {dim} reuses a group ({made.via}) whose communicator has "
                   f"{'role ' + made.role if made.role else 'no role'}'s settings")
            rec.not_applied["ctas"] = f"{cfg.min_ctas}..{cfg.max_ctas}: {why}"
            self.record(f"ctas[{cfg.role}]", f"{cfg.min_ctas}..{cfg.max_ctas}", False, why)
        self._add(rec, index=False)

    def _record_existing(self, c10d) -> None:
        """Record the groups this rank joined before the shim was installed (an explicit install()
        late in a script): their communicators exist, so their settings cannot change."""
        try:
            if not c10d.is_initialized():
                return
            me, groups = c10d.get_rank(), list(c10d._world.pg_group_ranks.items())
        except Exception:  # a fake, or a torch without this bookkeeping
            return
        for pg, mapping in groups:
            if me not in mapping:
                continue
            ident = GroupIdentity(tuple(sorted(mapping)), mesh_dim_of(getattr(pg, "group_desc", None)))
            match = match_role(self.roles, ident)
            rec = CommunicatorRecord("made before the plan was installed", list(ident.ranks), ident.mesh_dim, match.role,
                                     match.by, group=getattr(pg, "group_name", None), note=match.describe(ident))
            cfg = self.configs.get(match.role) if match.role is not None else None
            if cfg is not None:
                why = "made before lagom-tune's shim was installed; its communicator's settings are fixed"
                rec.not_applied["ctas"] = f"{cfg.min_ctas}..{cfg.max_ctas}: {why}"
                self.record(f"ctas[{cfg.role}]", f"{cfg.min_ctas}..{cfg.max_ctas}", False, why)
            self._add(rec)

    def _add(self, rec: CommunicatorRecord, index: bool = True) -> None:
        self.communicators.append(rec)
        if index and rec.group is not None:
            self.by_group[str(rec.group)] = rec
        self.flush()

    def _my_rank(self) -> int | None:
        if self.c10d is None:  # torch.distributed not imported yet: no group to be in
            return None
        try:
            return int(self.c10d.get_rank()) if self.c10d.is_initialized() else None
        except Exception:  # a fake without them: treat this process as a member
            return None

    def _default_backend(self) -> str:
        try:
            return str(self.c10d.get_backend()) if self.c10d.is_initialized() else ""
        except Exception:
            return ""

    def _default_group_name(self) -> str | None:
        try:
            return self.c10d._get_default_group().group_name
        except Exception:
            return None


def ddp_role_of(plan: Plan) -> str:
    """The role whose communicators DDP's gradient reduction uses in ``plan``: torchtitan's
    ``dp_replicate``, or ``dp`` in plans made before roles were named so.

    Args:
        plan: any plan.
    Returns:
        The role's name (``dp_replicate`` when the plan names neither).
    """
    return next((r for r in DDP_ROLES if r in plan.settings.communicators or r in plan.groups), DDP_ROLE)


def rank_reports(applied_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Each rank's report, from the files its processes wrote to ``applied_dir``: of the processes
    that claimed a rank, the last started of those that took part (a restarted rank's last attempt),
    else the first started (the rank itself, which starts its helpers). Unreadable files are skipped
    (a process killed mid-write leaves none: files are written atomically).

    Args:
        applied_dir: the folder given to :func:`install`.
    Returns:
        The reports by rank (as written by :meth:`Shim.flush`).
    """
    claims: dict[str, list[dict[str, Any]]] = {}
    for f in Path(applied_dir).glob("rank-*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        claims.setdefault(str(data.get("rank")), []).append(data)
    out = {}
    for rank, reports in sorted(claims.items()):
        took_part = [r for r in reports if r.get("took_part")]
        out[rank] = max(took_part, key=lambda r: r.get("started", 0)) if took_part else min(reports, key=lambda r: r.get("started", 0))
    return out


def _is_nccl(backend: str) -> bool:
    """Whether a group of this backend (``nccl``, ``cuda:nccl,cpu:gloo``, ...) takes NCCL Options."""
    return any(b in backend.lower() for b in NCCL_BACKENDS)


def _rebind(replaced: dict[int, tuple[Any, Any]], skip: Any, by_value: bool = False) -> None:
    """Point every loaded module's name for a wrapped function at its wrapper: torch.distributed,
    device_mesh, and modules that imported e.g. ``new_group`` before the shim was installed.

    Args:
        replaced: id of each original function -> (original, wrapper).
        skip: the module already patched (c10d).
        by_value: look at every global of every module, so that ``from torch.distributed import
            new_group as ng`` is found too; only worth its cost after a late install, since at
            start-up no module can have imported c10d's names before c10d itself was patched.
    """
    for module in list(sys.modules.values()):
        if module is None or module is skip:
            continue
        try:
            names = vars(module)
        except TypeError:
            continue
        items = list(names.items()) if by_value else [(n, names.get(n)) for n in GROUP_MAKERS]
        for name, fn in items:
            hit = replaced.get(id(fn)) if fn is not None else None
            if hit is not None and hit[0] is fn:
                try:
                    setattr(module, name, hit[1])
                except (AttributeError, TypeError):  # a read-only module: its calls keep the original
                    pass

CHUNK_PENDING = "_lagom_tune_chunk_bytes"  # a DDP model's chunked hook, registered at its first forward


def _sparse_gradients(module: Any) -> str:
    """The first submodule of ``module`` that makes sparse gradients (as DDP finds them: an
    Embedding or EmbeddingBag with ``sparse=True``), by name; "" for none."""
    import torch

    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            return f"{name or type(m).__name__} with sparse=True"
    return ""


def chunked_allreduce_hook(chunk_bytes: int):
    """A DDP comm hook that averages each gradient bucket in chunks of ``chunk_bytes``.

    Args:
        chunk_bytes: bytes per all-reduce call.
    Returns:
        The hook, for ``DistributedDataParallel.register_comm_hook``.
    """

    def hook(process_group, bucket):
        import torch
        import torch.distributed as dist

        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        futures = [w.get_future() for w in chunked_all_reduce(dist.all_reduce, buf, chunk_bytes, group=group)]
        return torch.futures.collect_all(futures).then(lambda _: buf)

    return hook


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def _chain(appliers: list[tuple[str, Callable[[Any], None]]]) -> dict[str, Callable[[Any], None]]:
    """One post-import callback per module, running that module's appliers in order.

    Args:
        appliers: (module name, applier) pairs, in the order they are to run.
    Returns:
        Module name -> callback, in the order the modules first appear.
    """
    by_module: dict[str, list[Callable[[Any], None]]] = {}
    for name, fn in appliers:
        by_module.setdefault(name, []).append(fn)

    def run_all(fns: list[Callable[[Any], None]]) -> Callable[[Any], None]:
        if len(fns) == 1:
            return fns[0]

        def run(module: Any) -> None:
            for fn in fns:
                fn(module)

        return run

    return {name: run_all(fns) for name, fns in by_module.items()}


def install(plan_path: str, applied_dir: str | None = None) -> Shim:
    """Install the plan's settings in this process: a post-import hook per module the plan's
    backend deploys through (torch, DDP, c10d, DeviceMesh), run at once for modules already loaded.

    Loading and checking the plan imports no torch, numpy or pandas; torch is touched only once the
    user's code imports it.

    Args:
        plan_path: the plan file.
        applied_dir: where each rank writes its report (None: only log to stderr; read back with
            :func:`rank_reports`).
    Returns:
        The shim (its ``records`` and ``communicators`` say what happened).
    Raises:
        UserError: for a simulated plan (a what-if result, never deployed).
    """
    plan = load_plan(plan_path)
    plan.refuse_if_simulated()
    shim = Shim(plan, plan_path, applied_dir)
    if "RANK" in os.environ and not shim.helper:  # the processes this rank starts are its helpers
        os.environ[RANK_PID_ENV] = str(os.getpid())
    hooks = _chain(shim.appliers())
    shim.late = C10D_MODULE in sys.modules
    when_imported(hooks)  # at once for modules already imported (an explicit install() late in a script)
    atexit.register(shim.at_exit)
    return shim


def check_no_plan_in_effect(env: Mapping[str, str], verb: str) -> None:
    """Refuse to measure under a plan: a plan left in the shell (``eval "$(lagom-tune apply plan.yaml
    --print-env)"``) reaches every Python process, lagom-tune's own measuring ranks among them (a
    "default" replay ran the plan's chunked all-reduce).

    Args:
        env: the environment (``os.environ``).
        verb: what would measure, for the message.
    Raises:
        UserError: naming the variable, when a plan is in effect.
    """
    if env.get(PLAN_ENV):
        raise UserError(f"{PLAN_ENV}={env[PLAN_ENV]} is set (an `eval \"$(lagom-tune apply ... --print-env)\"`?): "
                        f"the plan would apply to {verb}'s own measurements; `unset {PLAN_ENV}` first")


def install_from_env() -> Shim:
    """Install the plan :data:`PLAN_ENV` names (what ``sitecustomize`` does in every process ``apply`` starts).

    Returns:
        The shim.
    """
    return install(os.environ[PLAN_ENV], os.environ.get(APPLIED_ENV))
