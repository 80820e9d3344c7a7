"""`lagom-tune apply`: check a plan against this machine, set the environment, run the command.

Every Python process the command starts (torchrun's workers included) loads the shim through a
``sitecustomize`` folder put first on ``PYTHONPATH``; the training script is not changed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.errors import UserError
from lagom_tune.plan.schema import Plan, knob_space_for

SITE_DIR = Path(__file__).resolve().parent / "site"
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


TORCHRUN_FLAGS = {"standalone", "no-python", "module", "run-path", "m"}  # options that take no value


def launcher_world_size(cmd: list[str], env: dict[str, str]) -> int | None:
    """World size a torchrun-style command line asks for, or None when it cannot be known."""
    start = None
    if cmd and Path(cmd[0]).name == "torchrun":
        start = 1
    else:
        for i in range(len(cmd) - 1):
            if cmd[i] == "-m" and cmd[i + 1] in TORCHRUN_MODULES:
                start = i + 2
                break
    if start is None:
        return int(env["WORLD_SIZE"]) if env.get("WORLD_SIZE", "").isdigit() else None
    opts: dict[str, str] = {}
    i = start
    while i < len(cmd) and cmd[i].startswith("-"):  # the first positional is the training script
        name, eq, value = cmd[i].lstrip("-").partition("=")
        name = name.replace("_", "-")
        if not eq and name not in TORCHRUN_FLAGS and i + 1 < len(cmd):
            value = cmd[i + 1]
            i += 1
        opts[name] = value
        i += 1
    nproc = opts.get("nproc-per-node", "1")
    nnodes = opts.get("nnodes", "1").split(":")[-1]
    if not (nproc.isdigit() and nnodes.isdigit()):
        return None
    return int(nproc) * int(nnodes)


def check_fit(plan: Plan, cmd: list[str], env: dict[str, str]) -> list[str]:
    """Refuse a plan that does not fit this machine (UserError); return notes on what was checked."""
    notes = []
    if plan.simulated:
        raise UserError("this plan was searched on a simulated cluster (a what-if result); profile the real machine to get one to apply")
    if plan.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UserError("the plan is for the nccl backend but this machine has no CUDA GPU")
        want, have = plan.hardware.get("gpu"), torch.cuda.get_device_name()
        if want and want != have:
            raise UserError(f"the plan was made on {want}, this machine has {have}")
    threads = plan.settings.process.get("threads") if plan.backend == "gloo" else None
    cores = os.cpu_count() or 1
    if threads is not None and int(threads) > cores:
        raise UserError(f"the plan asks for {threads} threads per rank but this machine has {cores} cores")
    world = launcher_world_size(cmd, env)
    if world is None:
        notes.append(f"world size not known from the command; the plan expects {plan.world_size}")
    elif world != plan.world_size:
        raise UserError(f"the plan was made for world size {plan.world_size}, the command starts {world} ranks")
    else:
        notes.append(f"world size {world} matches")
    return notes


def tuner_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.stem + ".tuner.csv")


def write_tuner_file(plan: Plan, plan_path: Path) -> Path | None:
    """Render the plan's collective rules for NCCL's tuner plugin, beside the plan."""
    if plan.backend != "nccl" or not plan.rules:
        return None
    from lagom_tune.runtime.nccl import tuner_csv

    return atomic_write_text(tuner_path(plan_path), tuner_csv(plan))


def plan_environment(plan: Plan, plan_path: Path, applied_dir: str, base: dict[str, str],
                     tuner_plugin: str | None = None) -> dict[str, str]:
    """The variables `apply` sets: process-level settings, the plan's location, the shim's path,
    and for NCCL the tuner file (and plugin, when one is named)."""
    env = {"LAGOM_TUNE_PLAN": str(plan_path.resolve()), "LAGOM_TUNE_APPLIED_DIR": applied_dir}
    if plan.backend == "nccl" and plan.rules:
        env["NCCL_TUNER_CONFIG_FILE"] = str(tuner_path(plan_path).resolve())
        if tuner_plugin:
            env["NCCL_TUNER_PLUGIN"] = tuner_plugin
    space = knob_space_for(plan.backend)
    for name, value in plan.settings.process.items():
        if space[name].env:  # e.g. OMP_NUM_THREADS (which also stops torchrun forcing 1), NCCL_NTHREADS
            env[space[name].env] = str(value)
    paths = [str(SITE_DIR)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@dataclass(frozen=True)
class ApplyResult:
    exit_code: int
    applied_json: Path
    ranks: dict[str, dict]


def merge_applied(applied_dir: str, out: Path) -> dict[str, dict]:
    ranks = {}
    for f in sorted(Path(applied_dir).glob("rank-*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        ranks[str(data.get("rank"))] = data
    atomic_write_text(out, json.dumps({"ranks": ranks}, indent=1))
    return ranks


def apply(plan: Plan, plan_path: Path, cmd: list[str], applied_json: Path | None = None,
          tuner_plugin: str | None = None) -> ApplyResult:
    """Run ``cmd`` with the plan in effect; return its exit code and what each rank applied."""
    if not cmd:
        raise UserError("nothing to run: give the command after `--`, e.g. `lagom-tune apply plan.yaml -- torchrun ...`")
    check_fit(plan, cmd, dict(os.environ))
    applied_json = applied_json or plan_path.with_name("applied.json")
    write_tuner_file(plan, plan_path)
    with tempfile.TemporaryDirectory(prefix="lagom-applied-") as applied_dir:
        env = {**os.environ, **plan_environment(plan, plan_path, applied_dir, dict(os.environ), tuner_plugin)}
        try:
            code = _run(cmd, env)
        except FileNotFoundError:
            raise UserError(f"command not found: {cmd[0]}") from None
        except PermissionError:
            raise UserError(f"command not executable: {cmd[0]}") from None
        ranks = merge_applied(applied_dir, applied_json)
    return ApplyResult(code, applied_json, ranks)


def _run(cmd: list[str], env: dict[str, str]) -> int:
    """Run the command; on Ctrl-C (which the command's process group also receives) wait for it to end."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def export_lines(env: dict[str, str]) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
