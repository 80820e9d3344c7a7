"""`lagom-tune apply`: check a plan against this machine, set the environment, run the command.

Every Python process the command starts (torchrun's workers included) loads the shim through a
``sitecustomize`` folder put first on ``PYTHONPATH``; the training script is not changed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import functools
import importlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping
from unittest import mock

from lagom_tune.artifact_io import atomic_write_text, check_writable
from lagom_tune.backends.nccl_controls import NET_PLUGIN_ENV, RESTRICTING_ENV, CommunicatorConfig, overriding_env
from lagom_tune.backends.registry import THREAD_COUNT, backend_info, max_threads_per_rank, usable_cores
from lagom_tune.errors import Interrupted, UserError
from lagom_tune.plan.schema import Plan, knob_space_for
from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, RULES_ENV
from lagom_tune.runtime.nccl import TunerRule, TunerRules, ambiguous_roles, communicator_configs, tuner_rules
from lagom_tune.runtime.shim import APPLIED_ENV, PLAN_ENV, rank_reports
from lagom_tune.backends.tuner_build import PluginBuild, ensure_plugin, rules_path

SITE_DIR = Path(__file__).resolve().parent / "site"
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True)
class LaunchLayout:
    """How many ranks a command starts: per node and over how many nodes."""

    ranks_per_node: int
    nodes: int
    nodes_known: bool = True  # False: WORLD_SIZE without LOCAL_WORLD_SIZE (every rank counted on one node)
    elastic: bool = False  # torchrun --nnodes MIN:MAX: as many nodes as join, ``nodes`` at most

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes


def launcher_layout(cmd: list[str], env: dict[str, str]) -> LaunchLayout | None:
    """The ranks a torchrun-style command line starts, or None when they cannot be known.

    Args:
        cmd: the command after ``--``.
        env: the environment (``WORLD_SIZE``, and ``LOCAL_WORLD_SIZE`` if set, when the command
            is no launcher).
    Returns:
        The layout, or None.
    """
    start, launcher = None, TORCHRUN_MODULES[0]  # the torchrun command runs torch.distributed.run
    if cmd and Path(cmd[0]).name == "torchrun":
        start = 1
    else:
        for i in range(len(cmd) - 1):
            if cmd[i] == "-m" and cmd[i + 1] in TORCHRUN_MODULES:
                start, launcher = i + 2, cmd[i + 1]
                break
    if start is None:
        world, local = _count_of(env, "WORLD_SIZE"), _count_of(env, "LOCAL_WORLD_SIZE")
        if world is None:
            return None
        known = local is not None and world % local == 0
        per_node = local if known else world
        return LaunchLayout(per_node, world // per_node, known)
    args = _torchrun_arguments(launcher, cmd[start:], env)
    if args is None:
        return None
    nproc, bounds = str(args.nproc_per_node), str(args.nnodes).split(":")  # nnodes "1:2": one or two nodes
    if not (COUNT.fullmatch(nproc) and all(COUNT.fullmatch(b) for b in bounds)):  # "gpu", "auto": known only where it runs
        return None
    elastic = len(set(bounds)) > 1
    return LaunchLayout(int(nproc), int(bounds[-1]), nodes_known=not elastic, elastic=elastic)


COUNT = re.compile(r"[1-9][0-9]*")  # a count of ranks or nodes as a launcher writes it (str.isdigit took "²" and "0")


def _count_of(env: dict[str, str], name: str) -> int | None:
    """``env[name]`` as a count of ranks (at least 1); None when unset or not one."""
    value = env.get(name, "").strip()
    return int(value) if COUNT.fullmatch(value) else None


def _torchrun_arguments(launcher: str, argv: list[str], env: dict[str, str]) -> argparse.Namespace | None:
    """The launcher module's arguments as it reads them itself (its ``parse_args``: every flag it
    has, and its ``PET_*`` environment defaults, which Kubeflow's PyTorchJob sets); None for a
    command line it would refuse."""
    module = importlib.import_module(launcher)  # at run time: torch takes a second to import; only a launch needs it
    # The parser reads its defaults from the environment, and on a bad command line prints its usage and exits.
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stderr(io.StringIO()):
        try:
            return module.parse_args(argv)
        except SystemExit:
            return None


def check_fit(plan: Plan, cmd: list[str], env: dict[str, str]) -> list[str]:
    """Refuse a plan that does not fit this machine (UserError); return notes on what was checked.

    Args:
        plan: the plan.
        cmd: the command after ``--``.
        env: the environment.
    Returns:
        One line per check that passed or could not be made.
    Raises:
        UserError: for a simulated plan, or one made for other hardware, world size or roles.
    """
    notes = []
    check_deployable(plan)
    info = backend_info(plan.backend)
    if info.needs_cuda:
        import torch  # only here: apply's own process checks the GPU; the ranks import torch themselves

        if not torch.cuda.is_available():
            raise UserError(f"the plan is for the {plan.backend} backend but this machine has no CUDA GPU")
        want, have = plan.hardware.get("gpu"), torch.cuda.get_device_name()
        if want and want != have:
            raise UserError(f"the plan was made on {want}, this machine has {have}")
    layout = launcher_layout(cmd, env)
    if layout is None:
        notes.append(f"world size not known from the command; the plan expects {plan.world_size}")
    elif layout.elastic:  # the world is as large as the nodes that join
        notes.append(f"world size not known from the command (elastic --nnodes, {layout.ranks_per_node} ranks per node); "
                     f"the plan expects {plan.world_size} on {plan.nodes} node(s)")
    elif layout.world_size != plan.world_size:
        raise UserError(f"the plan was made for world size {plan.world_size}, the command starts {layout.world_size} ranks")
    elif layout.nodes_known and layout.nodes != plan.nodes:  # its rules match NCCL communicators by node count too
        raise UserError(f"the plan was made for {plan.world_size} ranks on {plan.nodes} node(s), the command starts "
                        f"{layout.ranks_per_node} ranks on each of {layout.nodes} node(s)")
    else:
        notes.append(f"world size {layout.world_size} matches" + (f" on {layout.nodes} node(s)" if layout.nodes_known else ""))
    threads = plan.settings.process.get("threads") if info.deploys_capability(THREAD_COUNT) else None
    if threads is not None:
        check_threads(int(threads), layout.ranks_per_node if layout is not None else 1, usable_cores())
    return notes


def check_deployable(plan: Plan) -> None:
    """Refuse what no machine may run (UserError): a simulated plan (a what-if result), or one
    whose communicator roles the runtime could not tell apart. What ``--print-env`` checks, where
    the machine that will run the job may not be this one."""
    plan.refuse_if_simulated()
    check_roles(plan)


def check_threads(threads: int, ranks_per_node: int, cores: int) -> None:
    """Refuse intra-op threads that oversubscribe the node (UserError): ``ranks_per_node`` ranks
    of ``threads`` threads each on ``cores`` cores (``registry.max_threads_per_rank``)."""
    if threads > max_threads_per_rank(cores, ranks_per_node):
        per = f"{threads} threads per rank" + (f" x {ranks_per_node} ranks on this node" if ranks_per_node > 1 else "")
        raise UserError(f"the plan asks for {per} but this process may run on {cores} core{'s' if cores != 1 else ''} "
                        "(its CPU affinity: a container's or a job's share of the machine)")


def check_roles(plan: Plan) -> None:
    """Refuse a plan whose communicator roles the runtime could not tell apart (UserError, exit 2):
    the shim would otherwise give none of them its settings, silently.

    Args:
        plan: the plan to check.
    """
    clashes = ambiguous_roles(plan)
    if clashes:
        names = "; ".join(" and ".join(c) for c in clashes)
        raise UserError(f"ambiguous communicator roles in the plan: {names} cannot be told apart by mesh "
                        "dimension, rank set or size; name them after the DeviceMesh dimensions that make their groups "
                        "(e.g. dp_shard, tp) or give their ranks in target.group_ranks")


@dataclass(frozen=True)
class TunerDeployment:
    """How a plan's per-collective rules reach NCCL: our tuner plugin and its rules file.

    ``plugin`` is None when the plan has no rule for the plugin; ``rules_file`` is written (in the
    cache, or a temporary folder where the cache is read-only; named by its content's hash)
    whenever there are rules, so it can be inspected even when the plugin could not be built.
    """

    rules: TunerRules
    rules_file: Path | None
    plugin: PluginBuild | None
    needs_plugin: tuple[TunerRule, ...]  # rules that CTA bounds alone cannot deploy
    bounds: Mapping[str, CommunicatorConfig] = field(default_factory=dict)  # the roles' CTA bounds as deployed (communicator_configs)

    @property
    def deployed(self) -> bool:
        return bool(self.plugin and self.plugin.ok and self.rules_file)

    def env(self) -> dict[str, str]:
        """``NCCL_TUNER_PLUGIN`` (absolute path) and the rules-file variable, when the plugin is deployed."""
        if not self.deployed:
            return {}
        return {PLUGIN_ENV: str(self.plugin.path), RULES_ENV: str(self.rules_file)}

    def warnings(self) -> list[str]:
        """One line per thing that will not reach NCCL (empty when everything does)."""
        out = []
        if self.plugin is not None and not self.plugin.ok:
            out.append(f"{self.plugin.reason}; falling back to per-communicator CTA bounds "
                       "(ProcessGroupNCCL.Options min_ctas/max_ctas)")
            out += [f"not deployed without the plugin: {describe(r)}" for r in self.needs_plugin]
        for r, why in self.rules.not_deployable:
            bounds = self.bounds.get(r.group)
            reach = (f"; its channels reach NCCL only as {r.group}'s CTA bounds ({bounds.min_ctas}..{bounds.max_ctas}), "
                     f"which cap every collective on {r.group}" if bounds and "channels" in r.set else "")
            out.append(f"not deployable as a rule: {r.op} on {r.group} {r.min_bytes}..{r.max_bytes} B ({why}){reach}")
        return out


def describe(rule: TunerRule) -> str:
    """A rule in one line, for messages.

    Args:
        rule: a tuner rule.
    Returns:
        The line.
    """
    sets = ", ".join(f"{k}={v}" for k, v in (("algo", rule.algo), ("proto", rule.proto), ("channels", rule.channels))
                     if v is not None)
    return f"{rule.op} on {rule.role} ({rule.n_ranks or 'any'} ranks) {rule.min_bytes}..{rule.max_bytes} B: {sets}"


def rules_needing_plugin(rules: TunerRules, configs: Mapping[str, CommunicatorConfig]) -> tuple[TunerRule, ...]:
    """Rules that per-communicator CTA bounds cannot deploy on their own: an algorithm or protocol,
    or a channel count the role's bounds (min..max over its rules) do not pin down.

    Args:
        rules: a plan's tuner rules.
        configs: its roles' CTA bounds (``communicator_configs``).
    Returns:
        The rules only the tuner plugin deploys.
    """
    out = []
    for r in rules.rules:
        cfg = configs.get(r.role)  # the rule's own role: its bounds, whatever other role shares its size
        pinned = cfg is not None and cfg.min_ctas == cfg.max_ctas == r.channels
        if r.algo is not None or r.proto is not None or (r.channels is not None and not pinned):
            out.append(r)
    return tuple(out)


def prepare_tuner(plan: Plan, cache: Path | None = None) -> TunerDeployment | None:
    """Write the plan's rules file and build the plugin (once; reused after), for NCCL-shaped plans.

    Args:
        plan: the plan; gloo plans and plans without collective rules need no plugin (None).
        cache: the cache root (default ``$XDG_CACHE_HOME/lagom-tune``).
    Returns:
        The deployment, or None when there is nothing to deploy through NCCL's tuner.
    """
    if not backend_info(plan.backend).deploys_tuner_rules or not plan.rules:
        return None
    rules, alone = tuner_rules(plan), communicator_configs(plan)  # the bounds without the plugin
    if not rules.rules:
        return TunerDeployment(rules, None, None, (), alone)
    text = rules.text()
    path = _write_rules(text, cache)
    plugin = ensure_plugin(cache)
    try:
        refusal = plugin.refusal(path) if plugin.ok else ""
    except OSError as e:  # a cached library this version did not build (each build is load-tested first)
        plugin, refusal = PluginBuild(None, f"cannot load the NCCL tuner plugin {plugin.path}: {e}; delete it to rebuild"), ""
    if refusal:  # NCCL would load the plugin, which would then drop every rule
        raise UserError(f"the tuner plugin would refuse the plan's rules and NCCL would use none of them: {refusal} of {path}")
    return TunerDeployment(rules, path, plugin, rules_needing_plugin(rules, alone), communicator_configs(plan, plugin.ok))


def _write_rules(text: str, cache: Path | None) -> Path:
    """The rules file for ``text``, written once: in the cache, or where the cache cannot be
    written (a shared, read-only one holding a prebuilt plugin) in this user's temporary folder.

    Args:
        text: the rules.
        cache: the cache root (default ``$XDG_CACHE_HOME/lagom-tune``).
    Returns:
        Its path.
    Raises:
        UserError: when neither place can be written.
    """
    fallback = Path(tempfile.gettempdir()) / f"lagom-tune-{os.getuid()}"
    errors = []
    for root in (cache, fallback):
        if root is fallback and not _private_folder(fallback):  # another user's folder would choose our rules
            errors.append(f"{fallback} is not a folder of this user's alone")
            continue
        path = rules_path(text, root)
        if _holds(path, text):
            return path
        try:
            return atomic_write_text(path, text)
        except (OSError, UserError) as e:  # the folder (UserError), or the file itself
            errors.append(str(e) if isinstance(e, UserError) else f"cannot write {path}: {e.strerror}")
    raise UserError(f"the tuner rules file: {'; '.join(errors)}")


def _private_folder(folder: Path) -> bool:
    """Whether ``folder`` is (or is made, mode 700) a folder this user owns that no one else may write."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return False
    return folder.is_dir() and not folder.is_symlink() and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except (OSError, UnicodeDecodeError):
        return False


def plan_environment(plan: Plan, plan_path: Path, applied_dir: str | None, base: dict[str, str],
                     tuner: TunerDeployment | None = None) -> dict[str, str]:
    """The variables `apply` sets: process-level settings, the plan's location, the shim's path,
    and for NCCL the tuner plugin and its rules file (when the plugin could be built).

    Args:
        plan: the plan.
        plan_path: its file.
        applied_dir: where ranks write their records (None: they only log).
        base: the current environment (its ``PYTHONPATH`` is kept after the shim's).
        tuner: the tuner plugin's deployment, if any.
    Returns:
        The variables to set.
    """
    # Without an applied folder (--print-env, --dry-run) ranks only log what they apply.
    env = {PLAN_ENV: str(plan_path.resolve()), **({APPLIED_ENV: applied_dir} if applied_dir else {})}
    if tuner is not None:
        env.update(tuner.env())
    space = knob_space_for(plan.backend)
    for name, value in plan.settings.process.items():
        if space[name].env:  # e.g. OMP_NUM_THREADS (which also stops torchrun forcing 1), NCCL_NTHREADS
            env[space[name].env] = str(value)
    env["PYTHONPATH"] = site_pythonpath(base)
    return env


def site_pythonpath(base: Mapping[str, str]) -> str:
    """``PYTHONPATH`` with the runtime's ``sitecustomize`` folder first, so every Python process a
    command starts loads it (the shim where a plan is set, the step clock where a trial times steps).

    Args:
        base: the current environment (its ``PYTHONPATH`` is kept after the folder).
    Returns:
        The value.
    """
    user = base.get("PYTHONPATH")  # kept as it is: an empty entry ("a:" or "a::b") is the working folder
    return os.pathsep.join([str(SITE_DIR)] + ([user] if user else []))


def deployment_warnings(plan: Plan, env: dict[str, str], base: dict[str, str], tuner: TunerDeployment | None) -> list[str]:
    """One line per thing of the plan that will not reach the command as planned: what the tuner
    cannot deploy, the user's own variables the plan replaces, those a plan may set that this one
    leaves as they are, and those that narrow what NCCL may pick (the plugin then skips every rule
    asking for something else).

    Args:
        plan: the plan.
        env: what the plan sets (:func:`plan_environment`).
        base: the user's environment.
        tuner: the tuner plugin's deployment, if any.
    Returns:
        The lines (empty when the plan reaches the command whole).
    """
    out = tuner.warnings() if tuner else []
    if plan.search.get("kept_default") and (plan.settings.process or plan.settings.communicators or plan.rules):
        out.append("this plan keeps the defaults but pins them as the model knew them (written before 2026-12-01); "
                   "rerun `lagom-tune search` for one that leaves them to the backend")
    out += [f"{k}={base[k]} from your environment is replaced by the plan's {v}" for k, v in env.items()
            if k != "PYTHONPATH" and k in base and base[k] != v]  # PYTHONPATH is kept, after the shim's folder
    # what a plan may set, left in the environment (by an earlier plan's `eval "$(apply --print-env)"`, say)
    info = backend_info(plan.backend)
    owned = [k.env for k in knob_space_for(plan.backend).knobs if k.env] + ([PLUGIN_ENV, RULES_ENV] if info.deploys_tuner_rules else [])
    out += [f"{k}={base[k]} from your environment stays in effect: this plan does not set it" for k in owned
            if base.get(k) and k not in env]
    if tuner is not None and tuner.deployed:
        out += [f"{k}={base[k]} from your environment narrows NCCL's choices: the plan's rules asking for anything "
                "else are skipped" for k in RESTRICTING_ENV if base.get(k)]
        if base.get(NET_PLUGIN_ENV):  # NCCL looks for a tuner in the net plugin only when NCCL_TUNER_PLUGIN fails to load
            out.append(f"{NET_PLUGIN_ENV}={base[NET_PLUGIN_ENV]}: a tuner that net plugin ships (aws-ofi-nccl's) is replaced "
                       "by lagom-tune's; collectives no rule matches get NCCL's own choice, not that tuner's")
    if communicator_configs(plan):
        out += [f"{k}={base[k]} from your environment overrides every communicator's CTA bounds the plan sets"
                for k in overriding_env(base)]
    return out


@dataclass(frozen=True)
class ApplyResult:
    exit_code: int
    applied_json: Path
    ranks: dict[str, dict]
    unwritten: str = ""  # why applied_json could not be written after the run ("" when it was, or nothing was due)
    stop: KeyboardInterrupt | None = None  # the stop signal passed on to the command while it ran, if one was


APPLIED_MARK = r'\A\{\s*"ranks": '  # how an applied record begins (the only file `--applied` may replace)


def files_among(cmd: list[str]) -> list[str]:
    """The command's arguments that name existing files (the script it runs, its config): never an applied record."""
    out = []
    for arg in cmd:
        try:
            if Path(arg).is_file():
                out.append(arg)
        except (OSError, ValueError):  # a name too long, a NUL: no file
            continue
    return out


def apply(plan: Plan, plan_path: Path, cmd: list[str], applied_json: Path | None = None,
          on_warning: Callable[[str], None] | None = None, on_note: Callable[[str], None] | None = None,
          extra_env: Mapping[str, str] | None = None) -> ApplyResult:
    """Run ``cmd`` with the plan in effect; return its exit code and what each rank applied.

    Args:
        plan, plan_path: the plan and its file (every rank's shim reads the file).
        cmd: the command to run, e.g. torchrun and its arguments.
        applied_json: where to merge each rank's report (default: ``applied.json`` beside the plan).
        on_warning: called with each one-line note on what will not reach NCCL (no compiler, ...).
        on_note: called with each check made against the machine, or that could not be made (a
            world size no launcher on the command line tells).
        extra_env: variables for this run besides the plan's (a trial's step clock).
    Returns:
        The command's exit code, where the report went, and each rank's records.
    """
    if not cmd:
        raise UserError("nothing to run: give the command after `--`, e.g. `lagom-tune apply plan.yaml -- torchrun ...`")
    check_command(cmd[0])
    # checked before the run, not after it: a record that cannot be written must not end a long job with an error
    applied_json = check_writable(applied_json or default_applied_path(plan, plan_path), "--applied record",
                                  [plan_path, *files_among(cmd)], replaces=APPLIED_MARK)
    for note in check_fit(plan, cmd, dict(os.environ)):
        if on_note:
            on_note(note)
    tuner = prepare_tuner(plan)
    with tempfile.TemporaryDirectory(prefix="lagom-applied-") as applied_dir:
        planned = plan_environment(plan, plan_path, applied_dir, dict(os.environ), tuner)
        for line in deployment_warnings(plan, planned, dict(os.environ), tuner):
            if on_warning:
                on_warning(line)
        env = {**os.environ, **planned, **(extra_env or {})}
        try:
            code, ended, stop = run_command(cmd, env)
        except OSError as e:  # found and executable (check_command), yet the system cannot start it
            raise UserError(_exec_failure(cmd[0], e)) from None
        if ended and on_warning:
            on_warning(f"the command died from signal {code - 128}; ended the {ended} process(es) it left running "
                       "(torchrun's workers outlive a killed torchrun)")
        ranks, unwritten = rank_reports(applied_dir), ""
    if ranks:  # none reported (the command failed before any rank started): the last run's record stays
        try:
            atomic_write_text(applied_json, json.dumps({"ranks": ranks}, indent=1))
        except UserError as e:  # the folder changed during the run: the command's exit code still counts
            unwritten = str(e)
        except OSError as e:  # ... or the disk filled up
            unwritten = f"cannot write {applied_json}: {e.strerror or e}"
    return ApplyResult(code, applied_json, ranks, unwritten, stop)


def default_applied_path(plan: Plan, plan_path: Path) -> Path:
    """Where `apply` records what each rank applied: :func:`record_path`'s ``applied.json``.

    Args:
        plan: the plan.
        plan_path: its file.
    Returns:
        The record's path.
    """
    return record_path(plan, plan_path, "applied")


def record_path(plan: Plan, plan_path: Path, stem: str) -> Path:
    """Where a record of running the plan goes: ``STEM.json`` beside the plan, or for a plan of
    several nodes ``STEM.HOST.json`` (each node runs its own `apply`, which sees only its own
    ranks: on a shared file system one file was each node's in turn, the last one's left).

    Args:
        plan: the plan.
        plan_path: its file.
        stem: what the record is (``applied``, ``trial``).
    Returns:
        The record's path.
    """
    return plan_path.with_name(f"{stem}.{socket.gethostname()}.json" if plan.nodes > 1 else f"{stem}.json")


def check_command(program: str) -> None:
    """Refuse (UserError) a command that is not there or not executable, before anything runs.

    Args:
        program: the command's first word, a path or a name looked up on ``PATH``.
    """
    found = shutil.which(program)
    if found is None:
        if os.sep in program and os.path.isdir(program):
            raise UserError(f"command is a directory, not a program: {program}")
        if os.sep in program and os.path.isfile(program):
            raise UserError(f"command not executable: {program}")
        raise UserError(f"command not found: {program}")


def _exec_failure(program: str, e: OSError) -> str:
    """Why the system could not start ``program`` though it is an executable file."""
    if e.errno == errno.ENOEXEC:
        return f"cannot run {program}: not a program this system can start (a script needs a #! line)"
    if isinstance(e, FileNotFoundError):  # the file is there: its #! interpreter is not
        return f"cannot run {program}: the interpreter its #! line names (or a binary's dynamic loader) is not found"
    return f"cannot run {program}: {e.strerror or e}"


STOP_GRACE_S = 30  # after a stop signal, how long the command may take to end before it is killed
ORPHAN_GRACE_S = 5  # how long processes a killed command left running have, after SIGTERM, before SIGKILL
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans below this process are reparented to it, not to init


def _adopt_orphans(on: bool = True) -> bool:
    """Make this process the reaper of the command's orphans (Linux; ``on`` False: no longer):
    torchrun killed from outside (the OOM killer, ``kill -9``) leaves its workers running, and
    reparented to init nothing links them to the command any more. Returns whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    return False


def _end_orphans(spare: set[int]) -> int:
    """End what the command left running once it died from a signal: SIGTERM to every process
    below this one but ``spare`` (those below it before the command started), :data:`ORPHAN_GRACE_S`
    to exit, then SIGKILL; each reaped. Returns how many."""
    left = [pid for pid in _descendants(os.getpid()) if pid not in spare]
    if not left:
        return 0
    for sig, grace in ((signal.SIGTERM, ORPHAN_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while (running := _reap(left)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not running:
            break
    return len(left)


def _reap(pids: list[int]) -> bool:
    """Reap those of ``pids`` that are this process's exited children (the others are gone, or
    their own parents' to reap); return whether any of them still runs."""
    running = False
    for pid in pids:
        try:
            running |= os.waitpid(pid, os.WNOHANG)[0] == 0
        except ChildProcessError:  # not (or no longer) a child here: alive while it is still listed in /proc
            running |= Path(f"/proc/{pid}").exists()
    return running


def run_command(cmd: list[str], env: dict[str, str]) -> tuple[int, int, KeyboardInterrupt | None]:
    """Run the command and return its exit status as a shell reports it (killed by signal N:
    128 + N). A stop signal sent to lagom-tune alone (SIGTERM, SIGHUP, and SIGINT sent by a process:
    ``kill -INT``, ``timeout -s INT``) is passed on to it; Ctrl-C, which the terminal sends its
    whole process group, is not sent twice. Then it has :data:`STOP_GRACE_S` to end. A command that
    died from a signal (sent by whoever: the OOM killer, ``kill -9``) has the processes it left
    running ended (:func:`_end_orphans`; on Linux, where this process adopts them).

    Returns:
        The exit status, how many processes the command left running were ended, and the stop
        that ended the wait (passed on as above), if one did.
    """
    # SIGINT blocked from before the command starts, the command started with the mask lagom-tune
    # had: one sent between the two stays pending for _wait to read its sender (blocked only in
    # _wait, one landing in that instant was taken as a terminal's, never passed on, and the
    # command killed 30 s later)
    adopted, spare = _adopt_orphans(), set(_descendants(os.getpid()))
    restore = None
    if _reads_sigint_sender():
        restore = functools.partial(signal.pthread_sigmask, signal.SIG_SETMASK, signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}))
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=restore)
    except BaseException:
        if restore is not None:
            restore()
        if adopted:
            _adopt_orphans(False)
        raise
    try:
        stop = None
        try:
            code = _wait(proc)
        except KeyboardInterrupt as e:
            code, stop = _wait_grace(proc, e), e
        ended = _end_orphans(spare) if code < 0 and adopted else 0
    finally:  # only while the command runs: a caller in-process (a test run) keeps its own orphans' fate
        if adopted:
            _adopt_orphans(False)
    return (code if code >= 0 else 128 - code), ended, stop


def _wait_grace(proc: subprocess.Popen, stop: KeyboardInterrupt) -> int:
    """After a stop signal (``stop``): pass it and any further one sent to lagom-tune on, as
    :func:`_wait` does, wait :data:`STOP_GRACE_S` for the command, then kill it and every process
    it started (torchrun's workers outlive a killed torchrun): lagom-tune never ends before its
    command."""
    if isinstance(stop, Interrupted):
        proc.send_signal(stop.signum)
    deadline = time.monotonic() + STOP_GRACE_S
    while True:
        try:
            code = _wait(proc, deadline)
        except KeyboardInterrupt as e:
            if isinstance(e, Interrupted):
                proc.send_signal(e.signum)
            continue
        if code is not None:
            return code
        _kill_tree(proc)
        return proc.wait()


def _wait(proc: subprocess.Popen, deadline: float | None = None) -> int | None:
    """Wait for ``proc`` until ``deadline`` (``time.monotonic()``; None: for as long as it runs);
    on SIGINT, pass it on when a process sent it (the terminal's Ctrl-C has no sender and reached
    the command itself), then raise KeyboardInterrupt. Where the sender cannot be known (no
    ``sigtimedwait``: macOS), SIGINT is not passed on.

    Returns:
        The exit status, or None at the deadline.
    """
    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    if not _reads_sigint_sender():
        try:  # (ignored, as a job started with & from a script: the command ignores it too)
            return proc.wait(timeout=left())
        except subprocess.TimeoutExpired:
            return None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # already, the first time (run_command)
    try:
        while (code := proc.poll()) is None:
            if left() == 0.0:
                return None
            info = signal.sigtimedwait({signal.SIGINT}, min(0.1, left() or 0.1))
            if info is not None:
                if info.si_pid:  # sent by kill(2): the kernel's own (a terminal's) have no sender
                    proc.send_signal(signal.SIGINT)
                raise KeyboardInterrupt
        return code
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _reads_sigint_sender() -> bool:
    """Whether SIGINT is waited for with its sender here (``sigtimedwait``; not on macOS) rather
    than left alone (ignored, as a job started with & from a script: the command ignores it too)."""
    return hasattr(signal, "sigtimedwait") and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and its descendants, found (on Linux, from ``/proc``) before any is killed:
    once the parent dies, its children belong to init and nothing links them to the command."""
    family = _descendants(proc.pid)
    for pid in [proc.pid, *family]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from ``/proc/*/stat``; none where there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def export_lines(env: dict[str, str]) -> str:
    """Shell ``export`` lines for ``--print-env``.

    Args:
        env: the variables.
    Returns:
        One quoted ``export NAME=value`` per variable.
    """
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
