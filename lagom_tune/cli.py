"""The `lagom-tune` command line: parse, call one library function per verb, render."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from lagom_tune import __version__, render
from lagom_tune.artifact_io import check_writable
from lagom_tune.backends.base import MAX_NOISE, BackendOptions, get_backend
from lagom_tune.backends.nccl_log import read_logs
from lagom_tune.backends.registry import backend_help, backend_info
from lagom_tune.errors import Interrupted, RunError, UserError, raise_on_stop_signals, stop_signal, stopping
from lagom_tune.model.contention import read_model_file, run_problems
from lagom_tune.model.rows import recorded_defaults, remeasured_points
from lagom_tune.plan.schema import FILE_MARK as PLAN_FILE_MARK, SEARCH_OPTIONS, Plan, load_plan
from lagom_tune.plan_check import PlanPredictions, plan_run_folder, predict_plan
from lagom_tune.profile.campaign import run_profile
from lagom_tune.profile.store import RunFolder, open_run
from lagom_tune.profile.summary import collective_summary
from lagom_tune.report import write_report
from lagom_tune.runtime import launch
from lagom_tune.runtime.nccl import nccl_ran
from lagom_tune.runtime.shim import LOG_ENV, check_no_plan_in_effect
from lagom_tune.runtime.trial import KIND as TRIAL_KIND, MAX_ROUNDS, MIN_ROUNDS, TrialRecord, run_trial
from lagom_tune.search import DEFAULT_MIN_GAIN
from lagom_tune.workload.presets import GPUS_PER_NODE, MAX_MBS, MAX_SEQ, PARALLEL_EXAMPLES, PRESETS, resolve_workload
from lagom_tune.workload.spec import FILE_MARK as WORKLOAD_FILE_MARK, Workload
from lagom_tune.workload.trace import import_trace, summary
from lagom_tune.yaml_io import read_yaml

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Give each collective just enough of the machine while it overlaps computation.\n\n"
                       "profile → search → apply: measure, decide, run your unchanged training with the plan.")
workload_app = typer.Typer(no_args_is_help=True, help="List, inspect and build workloads.")
app.add_typer(workload_app, name="workload")
_state = {"verbose": False}


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """Typer >= 0.2x vendors click; older releases raise click's own exceptions."""
    types: list[type[BaseException]] = []
    try:
        from typer.exceptions import TyperException

        types.append(TyperException)
    except ImportError:
        pass
    try:
        from click.exceptions import ClickException

        types.append(ClickException)
    except ImportError:
        pass
    return tuple(types)


def _number(low: float, high: float | None = None, *, below: bool = False):
    """A parser for a float option: a finite number from ``low`` to ``high`` (``below``: less than
    ``high``), refused with the range otherwise (typer's own range check lets NaN through to a
    message about the wrong bound, and takes infinity where there is no upper one)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise typer.BadParameter(f"expected a finite number, got {text!r}")
        if value < low or (high is not None and (value >= high if below else value > high)):
            upper = "" if high is None else f" and {'below' if below else 'at most'} {high:g}"
            raise typer.BadParameter(f"expected a number at least {low:g}{upper}, got {text}")
        return value

    return parse


def _path(text: str | Path) -> Path:
    """A parser for a path option or argument: ``""`` is refused (``Path("")`` is the current folder,
    so ``--out ""`` profiled into it, and other verbs named ``.`` for what the user left empty). A
    default (already a Path) passes as it is."""
    if isinstance(text, Path):
        return text
    if not text.strip():
        raise typer.BadParameter(f"{text!r} is empty: give a file or folder")
    return Path(text)


def _file_path(text: str | Path) -> Path:
    """:func:`_path` for a file to write: a path ending in ``/`` names a folder (``Path`` drops the
    slash, so ``--out new/`` wrote a file called ``new``)."""
    if isinstance(text, str) and text.endswith(("/", os.sep)):
        raise typer.BadParameter(f"{text!r} names a folder (it ends in /): give a file name in it")
    return _path(text)


def _print_version(value: bool) -> None:
    if value:
        print(f"lagom-tune {__version__}")
        raise typer.Exit()


@app.callback()
def _global(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks for errors (before or after the verb)."),
            version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                         help="Print the version and exit.")) -> None:
    """Options of every verb. ``--verbose`` is declared here for ``--help`` only: ``main`` takes it
    out of the arguments wherever it stands (see ``_take_verbose``), so typer never sees it."""


VERBOSE_FLAGS = ("--verbose", "-v")
PARALLEL_HELP = f"Model presets' parallelism: {PARALLEL_EXAMPLES} (a Table 2 preset fixes its own)."
REDUCE_DTYPE_HELP = ("Model presets: the dtype gradients are reduced in, fp32 | bf16 | fp16 (default: the compute dtype for "
                     "fsdp and ddp, as FSDP2 with only param_dtype set; fp32 for tp's dp, as Megatron). torchtitan reduces in "
                     "fp32: give fp32, or the plan's reduce-scatter rules match no call.")


def _take_verbose(argv: list[str]) -> list[str]:
    """``argv`` without ``--verbose``/``-v`` anywhere before ``--`` (the command after ``--`` is the
    user's), which sets verbose mode: errors tell users to rerun with it, wherever they put it."""
    cut = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:cut] if a not in VERBOSE_FLAGS]
    if len(head) < cut:
        _state["verbose"] = True
    return head + argv[cut:]


@app.command()
def profile(
    workload: str = typer.Option("cpu-demo", "--workload", "-w", help="Preset name (see `workload list`) or workload YAML file."),
    backend: str = typer.Option("gloo", help=backend_help()),
    ranks: Optional[int] = typer.Option(None, min=2, help="Ranks to spawn (gloo; default 2), or cpu-demo's DDP world."),
    hardware: Optional[str] = typer.Option(None, help="sim: a40-pcie, a40-nvlink, a100-nvlink, h100-nvlink, h200-nvlink "
                                           "(default h100-nvlink, said in the output)."),
    nodes: Optional[int] = typer.Option(None, min=1, help="sim: nodes of 8 GPUs, joined by InfiniBand (default: as many as "
                                        "the workload's largest communicator needs)."),
    ib_gbps: Optional[int] = typer.Option(None, help="sim: InfiniBand speed per GPU, 100 or 400 Gb/s (default 400)."),
    noise: Optional[float] = typer.Option(None, parser=_number(0.0, MAX_NOISE), help=f"sim: multiplicative noise (sigma) from 0 to {MAX_NOISE}, "
                                         "e.g. 0.02 (default 0)."),
    seed: Optional[int] = typer.Option(None, min=0, help="sim: noise seed (default 0)."),
    out: Path = typer.Option(..., "--out", "-o", parser=_path, help="Run folder to create or resume."),
    repeats: int = typer.Option(7, min=1, max=1000, help="Timed repeats per point (every one is kept)."),
    parallel: Optional[str] = typer.Option(None, help=PARALLEL_HELP),
    seq: Optional[int] = typer.Option(None, min=1, max=MAX_SEQ, help="Sequence length for presets."),
    mbs: Optional[int] = typer.Option(None, min=1, max=MAX_MBS, help="Micro-batch size for presets."),
    reduce_dtype: Optional[str] = typer.Option(None, help=REDUCE_DTYPE_HELP),
    timeout: Optional[float] = typer.Option(None, parser=_number(1.0, 86400.0), help="gloo, nccl: seconds (1 to 86400; default 60) "
                                           "a rank may go without progress before the run is ended."),
) -> None:
    """Measure GEMMs, collectives and overlapped pairs; fit the contention model into RUN_DIR/model.yaml.

    Rerunning the same command resumes an interrupted profile where it stopped; on a finished one
    it measures nothing, and refits only a model another lagom-tune made or one fitted to other rows.
    """
    from lagom_tune.model.fit import fit_run_unless_current  # local: fitting imports torch; other verbs start without it

    check_no_plan_in_effect(os.environ, "profile")
    check_writable(out / "meta.yaml", "run folder")
    RunFolder(out).check_files()
    own = {k: val for k, val in dict(hardware=hardware, nodes=nodes, ib_gbps=ib_gbps, noise=noise, seed=seed, ranks=ranks,
                                     timeout=timeout).items() if val is not None}
    sized = workload in PRESETS and PRESETS[workload].sized_by_ranks  # --ranks is its world, whatever the backend
    backend_info(backend, "--backend: ").check_options(set(own) - ({"ranks"} if sized else set()))
    w = resolve_workload(workload, parallel=parallel, seq=seq, mbs=mbs, reduce_dtype=reduce_dtype, ranks=ranks)
    extra = {"ib_gbps": own.pop("ib_gbps")} if "ib_gbps" in own else {}
    if "timeout" in own:
        own["timeout_s"] = own.pop("timeout")
    b = get_backend(backend, BackendOptions(extra=extra, **own))
    if not b.writer:  # another rank of a torchrun job: measure, and leave the run folder to rank 0
        run_profile(w, b, out, repeats=repeats)
        return
    with render.progress() as bar:
        task = bar.add_task(f"profile {w.name} on {backend}{' (simulated)' if b.simulated else ''}", total=None)
        note = b.fingerprint().get("hardware_note")
        if note:
            render.console.print(f"[yellow]note[/] {escape(note)}{render.simulated_tag(b.simulated)}")
        def measured(done: int, total: int, what: str) -> None:
            if what == "resuming":  # the campaign says so once, before measuring what is left
                render.console.print(f"resuming {escape(str(out))}: {done} of {total} points measured before, {total - done} to go",
                                     highlight=False)
            bar.update(task, completed=done, total=total)

        run = run_profile(w, b, out, repeats=repeats, progress=measured)
        fitting = bar.add_task("fit model (k-fold)", total=None)
        accuracy, fitted = fit_run_unless_current(run, progress=lambda done, total: bar.update(fitting, completed=done, total=total))
        if not fitted:
            bar.update(fitting, description="fit model: model.yaml already fits these rows", total=1, completed=1)
    noise, again = accuracy.get("noise"), accuracy.get("remeasured")
    render.console.print(f"[green]profiled[/] {escape(str(run.path))}{render.simulated_tag(b.simulated)} · model's held-out MAPE"
                         + (f" (its repeat noise{'; remeasured: its gap when measured again' if again else ''})" if noise else "")
                         + ": " + render.mape_text(accuracy["mape"], noise, again))
    if not fitted:
        render.console.print(f"model.yaml is this lagom-tune's fit of these measurements: not refitted (`lagom-tune fit "
                             f"{escape(str(run.path))}` refits it anyway)", highlight=False)
    for line in render.own_choice_lines(collective_summary(run.measurements())):
        render.console.print(line, highlight=False)
    for line in render.fit_warnings(accuracy["warnings"]):
        render.console.print(line)


@app.command()
def fit(run_dir: Path = typer.Argument(..., parser=_path, help="A run folder with measurements.")) -> None:
    """Refit RUN_DIR/model.yaml from its measurements, measuring nothing (any machine, GPU or not)."""
    from lagom_tune.model.fit import fit_run  # local: fitting imports torch; other verbs start without it

    run = open_run(run_dir)
    with render.progress() as bar:
        task = bar.add_task("fit model (k-fold)", total=None)
        fit_run(run, progress=lambda done, total: bar.update(task, completed=done, total=total))
    for item in render.model_tables(read_yaml(run.model_path, "model file")):
        render.console.print(item)
    render.wrote(run.model_path)
    unfinished = run.unfinished()
    if unfinished:
        render.console.print(f"[yellow]note[/] {escape(unfinished)}: this model is for a look; `search` waits for the rest")


@app.command()
def search(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., parser=_path, help="A profiled run folder."),
    optimizer: str = typer.Option("lagom", help="lagom, optuna, autoccl, default or exhaustive."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_file_path, help="Plan YAML to write."),
    compare: bool = typer.Option(False, "--compare", help="Run every optimizer and print them side by side."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    n_trials: int = typer.Option(200, min=SEARCH_OPTIONS["n_trials"][1], max=SEARCH_OPTIONS["n_trials"][2], help="Optuna trial budget."),
    timeout: Optional[float] = typer.Option(None, parser=_number(SEARCH_OPTIONS["timeout"][1]), help="Optuna time budget in seconds (at least 0.1)."),
    seed: int = typer.Option(0, min=SEARCH_OPTIONS["seed"][1], max=SEARCH_OPTIONS["seed"][2], help="Optuna sampler seed."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL, e.g. sqlite:///study.db (resumable)."),
    study_name: Optional[str] = typer.Option(None, help="Optuna study name (resume with the same name)."),
    multi_objective: bool = typer.Option(False, "--multi-objective",
                                         help="Optuna: iteration time vs SMs for communication; the plan records the Pareto front."),
    min_gain: float = typer.Option(DEFAULT_MIN_GAIN, "--min-gain", parser=_number(*SEARCH_OPTIONS["min_gain"][1:], below=True), help="Keep the defaults unless the plan is predicted faster by more "
                                   "than this fraction, in [0, 1) (smaller gains are within the model's error)."),
    validate: int = typer.Option(0, "--validate", min=0, max=1000, help="Measure default and plan on the backend, N interleaved repeats each."),
) -> None:
    """Search the fitted model for the settings that finish an iteration first; write a plan."""
    # local: the search imports optuna; other verbs start without it
    from lagom_tune.planning import load_search_inputs, plan_from_run
    from lagom_tune.search.run import OPTIMIZERS, check_storage_apart, compare as compare_all, option_names, taken_options

    # The optimizers' flags, offered whichever optimizer runs; each optimizer gets the ones it takes.
    flag_options = dict(n_trials=n_trials, timeout=timeout, seed=seed, storage=storage, study_name=study_name,
                        multi_objective=multi_objective)
    def given(name: str) -> bool:  # on the command line, not by default
        # (ParameterSource by name: typer >= 0.2x vendors click's enum, older typer uses click's own)
        return getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"

    if compare:  # --compare writes no plan and runs every optimizer: what shapes or checks a plan has nothing to act on
        taken = [f for f, on in (("--out", out is not None), ("--optimizer", given("optimizer")), ("--min-gain", given("min_gain")),
                                 ("--validate", given("validate"))) if on]
        if taken:
            raise UserError(f"{', '.join(taken)}: not taken by --compare (it prints every optimizer side by side "
                            "and writes no plan); run search without --compare to write one")
    if study_name is not None and storage is None:
        raise UserError("--study-name names a study in --storage; without one the study lives in memory and the name does nothing")
    if storage is not None and study_name is None:  # Optuna names an unnamed study anew each run: it never resumed
        raise UserError("--storage keeps a study to resume: name it with --study-name (the same name resumes it)")
    if not compare:  # a flag the chosen optimizer does not take would be silently ignored
        ignored = [p for p in flag_options if given(p) and p not in option_names(optimizer)]
        if ignored:
            flags = ", ".join("--" + p.replace("_", "-") for p in ignored)
            raise UserError(f"{flags}: not taken by --optimizer {optimizer} (it would be ignored); "
                            f"taken by {', '.join(n for n in OPTIMIZERS if set(ignored) <= option_names(n))}")

    bar = render.progress(transient=True)  # the plan's table says what the trials found
    trials = bar.add_task("optuna trials", total=n_trials, visible=False)

    def on_trial(done: int, total: int) -> None:
        bar.update(trials, completed=min(done, total), visible=True)

    opts = taken_options(list(OPTIMIZERS) if compare else ["default", "autoccl", optimizer],
                         {**flag_options, "on_trial": None if as_json else on_trial})

    def warn(line: str) -> None:  # on stderr: --json's stdout stays one document
        render.err_console.print(f"[yellow]warning[/] {escape(line)}", highlight=False)

    if compare:
        inputs = load_search_inputs(run_dir)
        for line in inputs.notes:
            warn(line)
        with bar:
            results, skipped = compare_all(inputs.workload, inputs.model, inputs.space, chosen=inputs.chosen, **opts)
            rows = render.compare_rows(results)
        if as_json:
            print(json.dumps([{**r, "simulated": inputs.simulated} for r in rows]
                             + [{"optimizer": name, "skipped": why, "simulated": inputs.simulated} for name, why in skipped.items()], indent=1))
        else:
            render.console.print(render.compare_table(rows, inputs.simulated, skipped))
        return
    if out is None:
        raise UserError("--out PLAN.yaml is required (or use --compare)")
    check_writable(out, "plan", open_run(run_dir).files, replaces=PLAN_FILE_MARK)
    check_storage_apart(storage, out)
    if validate:
        check_no_plan_in_effect(os.environ, "search --validate")
    with bar:
        plan, _ = plan_from_run(run_dir, optimizer, validate_repeats=validate, on_note=warn, min_gain=min_gain, **opts)
    plan.save(out)
    if as_json:
        print(json.dumps({"plan": str(out), **plan.to_dict()}, indent=1))
        return
    for item in render.plan_summary(plan):
        render.console.print(item)
    render.wrote(out)


class _CommandAfterDashes(typer.core.TyperCommand):
    """A command whose extra arguments must follow ``--``: records how many did."""

    def parse_args(self, ctx, args):  # click's hook, before its parser has dropped the "--"
        ctx.meta["after_dashes"] = len(args) - args.index("--") - 1 if "--" in args else 0
        return super().parse_args(ctx, args)


def _command(ctx: typer.Context, verb: str, plan_file: Path, paths: dict[str, Optional[Path]]) -> list[str]:
    """The command given after ``--`` to a verb of :class:`_CommandAfterDashes`.

    Args:
        ctx: the verb's context.
        verb: its name, for the message.
        plan_file: the PLAN argument.
        paths: the verb's path options by flag: one that took ``--`` as its value swallowed it.
    Returns:
        The command (empty when none was given).
    Raises:
        UserError: the plan or part of the command on the wrong side of ``--``.
    """
    cmd = list(ctx.args)
    if ctx.meta.get("after_dashes", 0) > len(cmd):  # PLAN itself was taken from after "--"
        raise UserError(f"put the plan before `--` (`lagom-tune {verb} PLAN [OPTIONS] -- CMD ...`); {str(plan_file)!r} "
                        "came after it")
    before = cmd[:len(cmd) - ctx.meta.get("after_dashes", 0)]
    swallowed = next((flag for flag, value in paths.items() if str(value) == "--"), None)
    if before or swallowed:  # without "--" the command's own options were taken as the verb's
        taken = f"got {shlex.join(before)!r} before it" if before else f"{swallowed} took it as its path"
        raise UserError(f"put the command after `--` (`lagom-tune {verb} PLAN [OPTIONS] -- CMD ...`); {taken}")
    return cmd


@app.command(cls=_CommandAfterDashes, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def apply(
    ctx: typer.Context,
    plan_file: Path = typer.Argument(..., metavar="PLAN", parser=_path, help="Plan YAML from `lagom-tune search`."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the plan, build the NCCL tuner plugin and print what would be set; run nothing."),
    print_env: bool = typer.Option(False, "--print-env", help="Print shell export lines (for Slurm and other launchers)."),
    applied: Optional[Path] = typer.Option(None, parser=_path, help="Where to write applied.json (default: beside the plan; applied.HOST.json for a plan of several nodes)."),
) -> None:
    """Run `-- CMD [ARGS...]` with the plan in effect in every Python rank it starts; exit with its code.

    NCCL plans' per-collective rules reach NCCL through lagom-tune's own tuner plugin, built with
    the system C compiler on first use (`NCCL_TUNER_PLUGIN`, `LAGOM_TUNE_TUNER_RULES`).
    """
    cmd = _command(ctx, "apply", plan_file, {"--applied": applied})
    if print_env and (dry_run or cmd):  # it prints settings for a job started elsewhere: it runs and checks nothing here
        raise UserError(f"--print-env takes no {'--dry-run' if dry_run else 'command'}: it prints export lines for a job "
                        "you start yourself (eval them, then launch)")
    plan = load_plan(plan_file)

    out = render.console if dry_run else render.err_console  # a run's own lines leave the command's stdout to it

    def warn(line: str) -> None:
        out.print(f"[yellow]lagom-tune:[/] {escape(line)}", highlight=False)

    if print_env:  # the job may start on other machines (Slurm): refuse only what no machine may run
        launch.check_deployable(plan)
    if dry_run or print_env:
        tuner = launch.prepare_tuner(plan)
        env = launch.plan_environment(plan, plan_file, None, dict(os.environ), tuner)
        if print_env:
            for line in launch.deployment_warnings(plan, env, dict(os.environ), tuner):
                print(f"lagom-tune: {line}", file=sys.stderr)  # stdout stays `eval`-able
            print(launch.export_lines(env))
            return
        render.console.print(render.plan_table(plan))
        for line in render.deployment_lines(plan, env, tuner):
            render.console.print(line, highlight=False)
        for line in launch.deployment_warnings(plan, env, dict(os.environ), tuner):
            warn(line)
        if plan.simulated:  # a what-if plan: shown, never run
            render.console.print("check: simulated plan; `apply` will refuse to run it (profile the real cluster)")
            return
        # checked after it is shown: an NCCL plan is inspected on a login node without GPUs too (refused there, exit 2)
        if not cmd:
            launch.check_roles(plan)  # check_fit checks them too, with the command
        notes = launch.check_fit(plan, cmd, dict(os.environ)) if cmd else ["no command given: world size not checked"]
        for n in notes:
            render.console.print(f"check: {n}", markup=False)
        return
    result = launch.apply(plan, plan_file, cmd, applied, on_warning=warn,
                          on_note=lambda n: out.print(f"[lagom-tune] check: {n}", style="dim", highlight=False, markup=False))
    applied_n = sum(r["applied"] for rank in result.ranks.values() for r in rank["records"])
    missed = [f"rank {k}: {r['setting']} ({r['how']})" for k, rank in result.ranks.items() for r in rank["records"] if not r["applied"]]
    if result.unwritten:
        summary = f"{len(result.ranks)} rank(s) reported, {applied_n} setting(s) applied; not recorded: {result.unwritten}"
    elif result.ranks:
        summary = f"{len(result.ranks)} rank(s) reported, {applied_n} setting(s) applied; see {result.applied_json}" + (
            f" (above, rank 0's lines and any rank's not applied; {LOG_ENV}=all logs every rank's)" if len(result.ranks) > 1 else "")
    elif result.applied_json.exists():
        summary = f"no rank reported; {result.applied_json} keeps the last run's record"
    else:
        summary = f"no rank reported; nothing written to {result.applied_json}"
    out.print(f"[lagom-tune] {summary}", style="dim", highlight=False, markup=False)  # "[...]" is text here
    for m in missed:
        out.print(f"[yellow]not applied[/] {escape(m)}")
    sys.exit(result.exit_code)  # not typer.Exit: typer returns an interrupt as Exit(130), and this 130 is the command's


@app.command(cls=_CommandAfterDashes, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def trial(
    ctx: typer.Context,
    plan_file: Path = typer.Argument(..., metavar="PLAN", parser=_path, help="Plan YAML from `lagom-tune search`."),
    rounds: int = typer.Option(4, min=MIN_ROUNDS, max=MAX_ROUNDS, help="Rounds; each runs the command with the defaults and with the plan, "
                               "in turn first (an even number runs each first equally often)."),
    warmup: int = typer.Option(3, min=0, max=1_000_000, help="Optimizer steps of each run left out before the timing starts."),
    out: Optional[Path] = typer.Option(None, parser=_file_path, help="The trial record (default: trial.json beside the plan; "
                                       "trial.HOST.json for a plan of several nodes)."),
) -> None:
    """Run `-- CMD [ARGS...]` with the defaults and with the plan, interleaved, and measure the speed-up.

    Each run is timed by its own optimizer steps (torch.optim's step hook in every Python process
    it starts; the script is not changed): the slowest rank's mean step after --warmup. The plan's
    runs are what `apply` runs. Every run is recorded as it ends.
    """
    cmd = _command(ctx, "trial", plan_file, {"--out": out})
    plan = load_plan(plan_file)
    out_console = render.err_console  # the command's stdout stays its own, as under apply

    def say(line: str, style: str = "dim") -> None:
        out_console.print(f"[lagom-tune] {line}", style=style, highlight=False, markup=False)

    record, path = run_trial(plan, plan_file, cmd, rounds, warmup, out,
                             on_run=lambda run: say(render.trial_run_line(run, rounds), "bold"),
                             on_warning=lambda line: say(line, "yellow"), on_note=lambda n: say(f"check: {n}"))
    for item in render.trial_summary(record):
        out_console.print(item)
    say(f"recorded in {path}")


@app.command()
def show(
    target: str = typer.Argument(..., help="A plan YAML, a workload YAML or preset name, or a run folder."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    collectives: bool = typer.Option(False, "--collectives", help="Run folder: every collective point in nccl-tests' "
                                     "columns (time median and trimmed mean, algbw, busbw)."),
    remeasured: bool = typer.Option(False, "--remeasured", help="Run folder: every point measured again (at the profile's "
                                    "end, or a GEMM or collective its overlapped pairs timed alone right before them), the most "
                                    "offset first (both medians, their ratio)."),
    heldout: bool = typer.Option(False, "--heldout", help="Run folder: every prediction behind the model's accuracy "
                                 "figures (each point predicted by the fold's model that held it out), the most off first "
                                 "(measured, predicted, their ratio; refits, measuring and writing nothing)."),
    nccl_log: Optional[list[Path]] = typer.Option(None, "--nccl-log", parser=_path, help="nccl plan: NCCL log files or "
                                                  "folders of a run under it (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=TUNING): "
                                                  "what NCCL ran each rule's calls with."),
) -> None:
    """Pretty-print a plan, a workload, or a run folder (with its model's accuracy)."""
    path = Path(target)
    tables = [flag for flag, given in (("--collectives", collectives), ("--remeasured", remeasured), ("--heldout", heldout)) if given]
    for flag in tables:
        if not path.is_dir():
            raise UserError(f"{flag} applies to a run folder; {target} is not one")
    if len(tables) > 1:
        raise UserError(f"{' and '.join(tables)} each list a table of their own; give one")
    if nccl_log:
        plan = load_plan(path)
        if not backend_info(plan.backend).deploys_tuner_rules:
            raise UserError(f"--nccl-log checks an nccl plan's rules; {target} is a {plan.backend} plan")
        for line in render.nccl_ran_lines(nccl_ran(plan, read_logs(nccl_log))):
            render.console.print(line)
        return
    if path.is_dir():
        run = open_run(path)
        meta = run.read_meta()
        model = read_model_file(run.model_path, run.fitted_as(meta)) if run.model_path.is_file() else None
        df, health = run.read()
        if tables:
            if heldout:
                from lagom_tune.model.fit import held_out_points  # local: fitting imports torch; other verbs start without it

                table, title = held_out_points(run), "predictions behind the model's accuracy (ratio: predicted over measured)"
            elif collectives:
                table, title = collective_summary(df), "collectives"
            else:
                table, title = (remeasured_points(df, recorded_defaults(run.knob_space(meta))),
                                "points measured again (ratio: the later median over the point's)")
            if as_json:  # each record says it is simulated, as search --compare --json's do
                print(table.assign(simulated=bool(meta.get("simulated", False))).to_json(orient="records", indent=1))
            else:
                render.print_whole(render.frame_table(table, f"{title}{render.simulated_tag(meta.get('simulated', False))}"))
            return
        problems = run_problems(health, model, df, path)
        if as_json:
            print(json.dumps({"meta": {k: v for k, v in meta.items() if k != "workload"}, "rows": len(df), "problems": problems,
                              "model": model}, indent=1, default=str))
            return
        for item in render.run_summary(meta, df, model, problems):
            render.console.print(item)
        return
    if target in PRESETS:
        w = resolve_workload(target)
        _print_workload(w, as_json)
        return
    if not path.exists() and not path.suffix and len(path.parts) == 1:  # a name, not a path: what `workload show` says of it
        raise UserError(f"file not found: {target}, nor a preset (see `lagom-tune workload list`) or a run folder")
    data = read_yaml(path, "file")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == TRIAL_KIND:
        record = TrialRecord.from_dict(data, str(path))
        if as_json:
            print(json.dumps(record.to_dict(), indent=1))
            return
        for item in render.trial_summary(record):
            render.console.print(item)
    elif kind == "lagom-plan":
        plan = Plan.from_dict(data, str(path))
        if as_json:  # the recheck the table's last line gives, beside the plan
            print(json.dumps({"plan": plan.to_dict(), "predictions_check": PlanPredictions.record(_recheck(plan, path))}, indent=1))
            return
        for item in render.plan_summary(plan):  # as search printed it, the reason it kept the defaults too
            render.console.print(item)
        render.console.print(render.prediction_check_line(_recheck(plan, path)))
    elif kind == "lagom-workload" or (kind is None and isinstance(data, dict) and "groups" in data):  # kind is optional in one
        w = Workload.from_dict(data, str(path))
        _print_workload(w, as_json)
    else:
        found = (f"its kind is {kind!r}" if kind is not None else "it has no `kind` field" if isinstance(data, dict)
                 else f"its top level is a {type(data).__name__}, not a YAML mapping")
        raise UserError(f"{path}: not a plan, workload, trial record or run folder ({found})")


def _recheck(plan: Plan, path: Path) -> PlanPredictions | str:
    """The plan's predictions as its run's model gives them now, or why they could not be rechecked."""
    try:
        return predict_plan(plan, open_run(plan_run_folder(plan, path)))
    except UserError as e:
        return str(e)


@app.command()
def report(
    target: Path = typer.Argument(..., parser=_path, help="A run folder or a plan YAML."),
    out: Path = typer.Option(Path("report.html"), "--out", "-o", parser=_file_path, help="HTML file to write."),
) -> None:
    """One self-contained HTML page: fit pictures, accuracy, and for a plan a before/after timeline."""
    render.wrote(write_report(target, out))


@workload_app.command("list")
def workload_list(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Every preset and built-in workload, with a one-line description."""
    if as_json:
        print(json.dumps([{"name": name, "description": p.description} for name, p in PRESETS.items()], indent=1))
        return
    t = render.Table(title="workload presets", title_justify="left")
    t.add_column("name")
    t.add_column("description")
    for name, p in PRESETS.items():
        t.add_row(name, p.description)
    render.console.print(t)


@workload_app.command("show")
def workload_show(
    name: str = typer.Argument(..., help="Preset name or workload YAML."),
    parallel: Optional[str] = typer.Option(None, help=PARALLEL_HELP),
    seq: Optional[int] = typer.Option(None, min=1, max=MAX_SEQ, help="Sequence length."),
    mbs: Optional[int] = typer.Option(None, min=1, max=MAX_MBS, help="Micro-batch size."),
    reduce_dtype: Optional[str] = typer.Option(None, help=REDUCE_DTYPE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Overlap groups of a workload: GEMM shapes and FLOPs, collective ops and bytes, repeats."""
    _print_workload(resolve_workload(name, parallel=parallel, seq=seq, mbs=mbs, reduce_dtype=reduce_dtype), as_json)


def _print_workload(w: Workload, as_json: bool) -> None:
    """A workload as JSON (a date in its free-form meta as text: it was an internal error) or as tables."""
    if as_json:
        print(json.dumps(w.to_dict(), indent=1, default=str))
        return
    for t in render.workload_tables(w):
        render.console.print(t)


@workload_app.command("import")
def workload_import(
    trace: Path = typer.Argument(..., parser=_path, help="torch.profiler Chrome trace (export_chrome_trace, record_shapes=True)."),
    out: Path = typer.Option(..., "--out", "-o", parser=_file_path, help="Workload YAML to write."),
    name: Optional[str] = typer.Option(None, help="Workload name (default: the trace's file name)."),
    ranks: Optional[int] = typer.Option(None, min=2, help="World size of the collectives (default: from the trace)."),
    gpus_per_node: int = typer.Option(GPUS_PER_NODE, min=1, help="Ranks per node of the traced job: the nodes each "
                                      "communicator spans, from the ranks the trace lists for it."),
) -> None:
    """Build a workload from a trace: where GEMMs overlap collectives, and what runs alone."""
    check_writable(out, "workload", [trace], replaces=WORKLOAD_FILE_MARK)  # `--out TRACE` replaced the trace
    w = import_trace(trace, name=name, ranks=ranks, gpus_per_node=gpus_per_node)
    w.save(out)
    s = summary(w)
    render.wrote(out, f"{s['groups']} groups from {s['gemms']} GEMMs and {s['collectives']} collectives; "
                      f"groups cover {s['groups_ms']:.1f} of {s['traced_step_ms']:.1f} traced ms, {s['exposed_ms']:.1f} ms exposed")


def _interrupted(e: BaseException | None, argv: list[str] | None) -> None:
    """Exit as a shell reports a stop by a signal: 128 + its number (Ctrl-C: 130, SIGTERM: 143);
    say how to resume where the verb can (a profile, a search whose Optuna study is stored)."""
    signum = e.signum if isinstance(e, Interrupted) else stop_signal()
    by = f" by {signal.Signals(signum).name}" if signum != signal.SIGINT else ""
    argv = argv or []
    verb = _verb(argv)
    resumes = verb == "profile" or (verb == "search" and any(a.split("=")[0] == "--storage" for a in argv))
    stopping()
    print(f"lagom-tune: interrupted{by}" + ("; rerun the same command to resume" if resumes else ""), file=sys.stderr)
    sys.exit(128 + signum)


def _verb(argv: list[str]) -> str:
    """The verb of a command line: its first word that is no option ("" for none)."""
    return next((a for a in argv if not a.startswith("-")), "")


class _StdoutUntilClosed:
    """``sys.stdout`` until its reader goes away (``| head -1``), then nowhere: the verb finishes its
    work and exits with its own code (click ended it with exit 1 and no word, the files written)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        # the descriptor itself, so that what the stream still buffers (flushed at exit) goes there too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors (exit 2 for bad input, 1 for runtime failures).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    stdout, sys.stdout = sys.stdout, _StdoutUntilClosed(sys.stdout)
    try:
        _main(argv)
    finally:
        sys.stdout = stdout


def _main(argv: list[str] | None) -> None:
    if threading.current_thread() is threading.main_thread():
        raise_on_stop_signals()
    try:
        argv = _take_verbose(list(sys.argv[1:] if argv is None else argv))
        code = app(args=argv, standalone_mode=False)  # an Exit raised inside a command comes back as its code
        if code == 130:  # typer turns an interrupt into Exit(130)
            _interrupted(None, argv)
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort as e:  # click wraps the interrupt
        _interrupted(e.__cause__ or e.__context__, argv)
    except _usage_error_types() as e:
        message = e.format_message()
        if message:  # empty when help was shown for a bare command
            print(f"lagom-tune: error: {message}", file=sys.stderr)
        sys.exit(2)
    except UserError as e:
        if _state["verbose"]:
            traceback.print_exc()
        print(f"lagom-tune: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        if _state["verbose"]:
            traceback.print_exc()
        print(f"lagom-tune: failed: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        _interrupted(e, argv)
    except OSError as e:  # the machine, not lagom-tune: a disk full, a file made read-only or a folder while it ran
        if _state["verbose"]:
            traceback.print_exc()
        where = f": {e.filename}" if e.filename else ""
        resumes = " (rerun the same command to resume)" if _verb(argv or []) == "profile" else ""
        print(f"lagom-tune: failed: {e.strerror or e}{where}{resumes}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a bug: still one line unless --verbose
        if _state["verbose"]:
            traceback.print_exc()
        print(f"lagom-tune: internal error: {type(e).__name__}: {e} (rerun with --verbose for the traceback)", file=sys.stderr)
        sys.exit(1)
