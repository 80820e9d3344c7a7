"""Rich renderings of artifacts: what `show`, `search` and `profile` print."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import pandas as pd
from rich.console import Console
from rich.measure import Measurement
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
import rich.table

from lagom_tune.backends.registry import backend_info
from lagom_tune.comparison import CI_LEVEL, by_first_arm, rounds_to_show, verdict
from lagom_tune.measurements import CHOICE_KNOBS
from lagom_tune.plan.schema import Plan
from lagom_tune.plan_check import STALE_REASON, PlanPredictions
from lagom_tune.precision import ms_round, ms_text
from lagom_tune.runtime.launch import describe, export_lines
from lagom_tune.runtime.nccl import RanReport
from lagom_tune.backends.nccl_tuner import RULES_ENV
from lagom_tune.runtime.trial import MAX_ROUNDS, TrialRecord, TrialRun
from lagom_tune.search import TIE_TOLERANCE
from lagom_tune.search.result import SearchResult
from lagom_tune.workload.spec import Collective, Gemm, Workload

# Wide enough for the comparison tables when output goes to a file or CI log (unless COLUMNS says
# otherwise); lines printed there are never hard-wrapped (a wrapped path or message breaks whoever
# reads the log). COLUMNS below MIN_WIDTH counts as MIN_WIDTH: at 0 nothing at all was printed,
# warnings included, and the verb still exited 0.
MIN_WIDTH = 40


def _width(stream) -> int | None:
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return max(int(columns), MIN_WIDTH)
    return None if stream.isatty() else 140


class Table(rich.table.Table):
    """A rich table whose cells fold onto more lines rather than end in "…": at 80 columns a cut
    setting (``buffsize=8…``) or GEMM shape (``1x10240x2560x…``) read as a different one."""

    def add_column(self, *args, overflow: str = "fold", **kwargs) -> None:
        super().add_column(*args, overflow=overflow, **kwargs)


console = Console(width=_width(sys.stdout), soft_wrap=not sys.stdout.isatty())
# What `apply` says while the user's command runs: on stderr, so the command's stdout is its own.
err_console = Console(stderr=True, width=_width(sys.stderr), soft_wrap=not sys.stderr.isatty())


class Bar(Progress):
    """A progress bar on :data:`console` that leaves nothing behind when its work fails: the
    one-line error says what happened (piped, a stale "fit model 0/?" line came before it)."""

    def __enter__(self) -> "Bar":
        if not self.disable:  # rich before 15 ended even a disabled bar with a blank line, piped
            self.start()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.disable:
            return
        if exc_type is None:
            super().__exit__(exc_type, exc_val, exc_tb)
            return
        # stopped transient, the live display writes no last frame (a terminal's is erased); and
        # not Progress.stop, which ends a piped bar with a blank line
        self.live.transient = True
        self.live.stop()


def progress(transient: bool = False) -> Bar:
    """A progress bar.

    Args:
        transient: gone once done (it only says the work goes on), so off where output is not a
            terminal (there it would leave nothing but a blank line).
    Returns:
        The bar, to use as a context manager.
    """
    return Bar(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn(), console=console, transient=transient, disable=transient and not console.is_terminal)


def simulated_tag(simulated: bool) -> str:
    """The mark every title of simulated numbers carries.

    Args:
        simulated: whether the numbers are simulated.
    Returns:
        `` (simulated)`` in rich markup, or "".
    """
    return " [bold magenta](simulated)[/]" if simulated else ""


def wrote(path: Any, detail: str = "") -> None:
    """Say that a verb wrote a file (its path escaped: a name holding ``[...]`` is no markup).

    Args:
        path: the file written.
        detail: what it holds, after a colon ("" for nothing).
    """
    console.print(f"[green]wrote[/] {escape(str(path))}" + (f": {escape(detail)}" if detail else ""))


def percent(value: float) -> str:
    """A fraction as a percentage with one decimal (a held-out MAPE of 0.1% is not 0%), "n/a" for
    NaN (a quantity with no points to hold out).

    Args:
        value: a fraction, e.g. 0.025.
    Returns:
        ``"2.5%"``, or ``"n/a"``.
    """
    return "n/a" if value != value else f"{value:.1%}"


def mape_text(mape: dict[str, float], noise: dict[str, float] | None = None,
              remeasured: dict[str, dict[str, float]] | None = None) -> str:
    """A model's held-out MAPE on one line: ``collective 2.5%, gemm 0.1%, ...``, each with its
    repeat noise in brackets where given (``collective 33.7% (14.2%)``) and the gap of the same
    quantity measured again later where there is one (``gemm 10.9% (1.5%; remeasured 13.0%)``):
    the floors under it, which say whether an error is the model's or the measurements'.

    Args:
        mape: quantity -> fraction.
        noise: quantity -> the repeat noise of its points (``model.yaml``'s ``accuracy.noise``), or None.
        remeasured: quantity -> ``accuracy.remeasured``'s entry (its ``gap``), or None.
    Returns:
        The line.
    """
    noise, remeasured = noise or {}, remeasured or {}
    return ", ".join(f"{k} {mape_cell(v, noise.get(k), (remeasured.get(k) or {}).get('gap'))}" for k, v in mape.items())


def mape_cell(mape: float, noise: float | None = None, remeasured_gap: float | None = None) -> str:
    """One held-out MAPE with its floors in brackets: ``10.9% (1.5%; remeasured 13.0%)``.

    Args:
        mape: the fraction.
        noise: its repeat noise, or None.
        remeasured_gap: the gap of its quantity measured again later, or None.
    Returns:
        The text.
    """
    floors = ([percent(noise)] if noise is not None else []) + ([f"remeasured {percent(remeasured_gap)}"] if remeasured_gap is not None else [])
    return percent(mape) + (f" ({'; '.join(floors)})" if floors else "")


def remeasured_cell(entry: dict[str, float]) -> str:
    """A quantity's remeasured gap and the pairs behind it: ``6.3% (504 pairs)``.

    Args:
        entry: its ``accuracy.remeasured`` entry.
    Returns:
        The text.
    """
    return f"{percent(entry['gap'])} ({int(entry['pairs'])} pairs)"


OFFSET_BAND = (0.97, 1.03)  # median ratios of a quantity measured again to its first measurement read as no offset
# ... and the pairs a median ratio outside it needs to be read as an offset, not scatter (a profile
# measures three points of each kind again at its end: three pairs on one side happen by chance 1 time in 4)
OFFSET_MIN_PAIRS = 6


def remeasured_offsets(remeasured: dict[str, dict[str, float]]) -> list[str]:
    """A line per quantity whose second measurements sit apart from its points as a whole, not
    only by scatter: an offset in when or how it was timed, which no model of it removes.

    Args:
        remeasured: ``accuracy.remeasured``.
    Returns:
        The lines (none when every median ratio lies in :data:`OFFSET_BAND`, or rests on fewer than
        :data:`OFFSET_MIN_PAIRS` pairs).
    """
    return [f"{k}: measured again, the median ran {e['median_ratio']:.2f}x its first measurement "
            f"({int(e['pairs'])} pairs; `show RUN --remeasured` lists them by point): an offset between the moments or the ways "
            "it was timed, not the model's error"
            for k, e in remeasured.items()
            if not OFFSET_BAND[0] <= e["median_ratio"] <= OFFSET_BAND[1] and e["pairs"] >= OFFSET_MIN_PAIRS]


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


GROUP_TABLES = 12  # a workload of more groups (an imported trace: thousands) is shown as a summary


def workload_tables(w: Workload) -> list[Table]:
    """One table per overlap group: its computations and collectives, in stream order; for more than
    :data:`GROUP_TABLES` groups, one summary table instead (its GEMM shapes and collectives, with
    the groups and repeats they appear in), since thousands of tables hide what a trace holds.

    Args:
        w: the workload.
    Returns:
        The tables.
    """
    if len(w.groups) > GROUP_TABLES:
        return [_workload_summary(w)]
    tables = []
    for g in w.groups:
        t = Table(title=f"{escape(w.name)} · group {escape(g.name)} × {g.repeat}", title_justify="left")
        for col in ("stream", "name", "shape / op", "GFLOP / bytes", "after"):
            t.add_column(col)
        for op in g.compute:
            t.add_row("compute", escape(op.name), _shape_text(op), f"{op.flops / 1e9:.3f}", "")
        for c in g.comm:
            t.add_row("comm", escape(c.name), _collective_text(c), _fmt_bytes(c.nbytes), "" if c.after is None else str(c.after))
        tables.append(t)
    return tables


def _shape_text(op: Gemm) -> str:
    return f"{op.batch}×{op.m}×{op.n}×{op.k} {op.dtype}" if op.batch > 1 else f"{op.m}×{op.n}×{op.k} {op.dtype}"


def _collective_text(c: Collective) -> str:
    return f"{c.op} on {escape(c.group)} ({c.ranks} ranks{f', {c.nodes} nodes' if c.nodes > 1 else ''})"


def _workload_summary(w: Workload) -> Table:
    """Each distinct GEMM shape and collective of ``w`` once (told apart by everything that times
    them, not by their rounded display): the groups it appears in and how many times an iteration
    runs it."""
    counts: dict[tuple, list[int]] = {}  # identity -> [groups, runs]
    shown: dict[tuple, tuple[str, str, str]] = {}  # identity -> (stream, shape / op, GFLOP / bytes)
    for g in w.groups:
        items = [(("compute", op.shape_key), ("compute", _shape_text(op), f"{op.flops / 1e9:.3f}")) for op in g.compute]
        items += [(("comm", c.op, c.group, c.ranks, c.nodes, c.nbytes), ("comm", _collective_text(c), _fmt_bytes(c.nbytes)))
                  for c in g.comm]
        for key, row in items:
            count = counts.setdefault(key, [0, 0])
            count[1] += g.repeat
            shown[key] = row
        for key in {key for key, _ in items}:
            counts[key][0] += 1
    t = Table(title=f"{escape(w.name)} · {len(w.groups)} groups, summarised (--json lists each)", title_justify="left")
    for col in ("stream", "shape / op", "GFLOP / bytes", "groups", "runs per iteration"):
        t.add_column(col, justify="right" if col in ("groups", "runs per iteration") else "left")
    for key in sorted(counts, key=lambda k: (k[0] != "compute", -counts[k][1])):
        t.add_row(*shown[key], str(counts[key][0]), str(counts[key][1]))
    return t


def plan_table(plan: Plan) -> Table:
    """A plan's settings, one row per setting at its scope.

    Args:
        plan: the plan.
    Returns:
        The table.
    """
    t = Table(title=f"plan for {escape(str(plan.workload.get('name', '?')))} on {plan.backend}{simulated_tag(plan.simulated)}", title_justify="left")
    t.add_column("scope")
    t.add_column("where")
    t.add_column("setting")
    for k, val in plan.settings.process.items():
        t.add_row("process", "every rank", f"{k} = {val}")
    for name, vals in plan.settings.communicators.items():
        for k, val in vals.items():
            t.add_row("communicator", escape(name), f"{k} = {val}")
    for r in plan.rules:
        t.add_row("collective", f"{r.op} on {escape(r.group)}, {r.min_bytes}..{r.max_bytes} B", ", ".join(f"{k}={val}" for k, val in r.set.items()))
    if not t.row_count:
        t.add_row("—", "every rank", f"nothing set: the {plan.backend} backend's own choices")
    return t


def plan_summary(plan: Plan) -> list[Any]:
    """What ``search`` prints of the plan it wrote and ``show`` of a plan file: its settings, its
    predicted (and replayed) times, and why it keeps the defaults when it does.

    Args:
        plan: the plan.
    Returns:
        Tables and lines, in the order to print them.
    """
    out: list[Any] = [plan_table(plan), prediction_table(plan)]
    front = plan.search.get("pareto")
    if front:
        if plan.search.get("kept_default"):  # the deployment rule, not the front, decided
            held = "the plan keeps the defaults instead, below"
        else:
            held = "the plan holds the fastest" + (", less the knobs left to the backend" if plan.search.get("left_to_backend") else "")
        t = Table(title=f"Pareto front of --multi-objective ({len(front)} points; {held}){simulated_tag(plan.simulated)}",
                  title_justify="left")
        t.add_column("iteration ms", justify="right")
        t.add_column("SMs for communication", justify="right")
        for point in front:
            t.add_row(ms_text(point['iteration_ms']), str(point["comm_sms"]))
        out.append(t)
    if plan.search.get("kept_default"):
        out.append(f"[yellow]the plan keeps the defaults:[/] {escape(plan.search['kept_default'])}")
    caution = gain_caution(plan)
    if caution:
        out.append(caution)
    if plan.search.get("left_to_backend"):
        out.append(f"left to the {plan.backend} backend (the search's value was predicted to gain under "
                   f"{TIE_TOLERANCE:.1%}, and such a knob reaches every collective of its scope): "
                   + escape(", ".join(plan.search["left_to_backend"])))
    if plan.backend_defaults:
        out.append(f"the defaults as the {plan.backend} backend chose them where the profile saw it (the predictions' "
                   "baseline there, its channels the nearest the knob space offers; never deployed): " + escape("; ".join(
                       f"{r.op} on {r.group}, {r.min_bytes} B: {_choice_text(r.set)}" for r in plan.backend_defaults)))
    return out


def gain_caution(plan: Plan) -> str | None:
    """A line for a plan predicted faster than the defaults by less than its model's held-out error
    on overlapped windows (the quantity an iteration is made of), and not yet replayed: the gain may
    be the model's error, so the line says how to measure it.

    Args:
        plan: the plan.
    Returns:
        The line, or None (no gain predicted, the error unknown or smaller, or the plan replayed).
    """
    speedup, error = plan.predicted_speedup, plan.model.get("mape", {}).get("overlap_window")
    if speedup is None or speedup <= 1 or error is None or speedup - 1 >= error or plan.validated:
        return None
    how = ("`lagom-tune search --validate N` replays it on the simulator" if plan.simulated
           else "`lagom-tune trial PLAN -- CMD` measures it on your training")
    return (f"[yellow]caution:[/] the plan is predicted {speedup - 1:.1%} faster, less than its model's held-out error on "
            f"overlapped windows ({percent(error)}): the gain may be the model's; {how} before you rely on it")


def nccl_ran_lines(report: RanReport) -> list[str]:
    """What NCCL ran each plan rule's calls with (``runtime.nccl.nccl_ran``), one line each, those
    not as planned marked; the rules no logged call matched, with the sizes of their op the log
    has; then the calls no rule matched.

    Args:
        report: the log held against the plan.
    Returns:
        Console lines.
    """
    out = [("as planned: " if c.as_planned else "[yellow]not as planned:[/] ") + escape(c.describe()) for c in report.checks]
    if not report.checks:
        out.append("[yellow]no logged call matched a rule of the plan[/] (was the log made under this plan?)")
    out += [f"[yellow]no logged call matched:[/] {escape(f'{r.op} on {r.role} {r.min_bytes}..{r.max_bytes} B{sizes}')}"
            for r, sizes in report.missed]
    return out + ([f"{report.unmatched} logged call(s) matched no rule: NCCL's own choice"] if report.unmatched else [])


def _choice_text(values: dict[str, Any]) -> str:
    """A backend's own choice for a collective: ``ring/ll128``, ``on 24 channels`` where those were seen."""
    on = f" on {values['channels']} channels" if "channels" in values else ""
    return "/".join(str(values[k]) for k in CHOICE_KNOBS if k in values) + on


def prediction_check_line(check: PlanPredictions | str) -> str:
    """What ``show`` says under a plan's predictions: that its run's model still gives them, that it
    does not (the plan edited or the model refitted since), or why they were not rechecked.

    Args:
        check: the plan's predictions now (``plan_check.predict_plan``), or why there are none.
    Returns:
        One line of console markup.
    """
    if isinstance(check, str):
        return f"[dim]predictions as `lagom-tune search` wrote them, not rechecked: {escape(check)}[/]"
    if check.drift:
        return (f"[yellow]warning:[/] the predictions above are not what the plan's run's model gives it now "
                f"({escape(check.drift_text())}): {escape(STALE_REASON)}; search again")
    return "[dim]predictions rechecked: the plan's run's model still gives them[/]"


def prediction_table(plan: Plan) -> Table:
    """A plan's predicted (and, when validated, measured) iteration times against the default's.

    Args:
        plan: the plan.
    Returns:
        The table.
    """
    it = plan.predicted.get("iteration_ms", {})
    t = Table(title="predicted iteration time" + simulated_tag(plan.simulated) + " (model MAPE "
              + mape_text(plan.model.get("mape", {})) + ")", title_justify="left")
    t.add_column("settings")
    t.add_column("iteration ms", justify="right")
    t.add_column("vs default", justify="right")
    base = it.get("default")
    for name, ms in it.items():
        t.add_row(name, ms_text(ms), f"{base / ms:.3f}×" if base and ms else "")
    if plan.predicted.get("bound_ms") is not None:
        t.add_row("contention-free bound", ms_text(plan.predicted['bound_ms']), "")
    if plan.validated:
        rows, caption = replay_rows(plan)
        for row in rows:
            t.add_row(*row)
        if caption:
            t.caption = caption
            t.caption_justify = "left"
    return t


def interval_text(low: float, high: float) -> str:
    """A speed-up's interval as ``trial`` and ``search --validate`` print it (``comparison.ratio_interval``).

    Args:
        low, high: the interval (0 and infinity from one round).
    Returns:
        "95% interval 1.015–1.143×", or that one round gives none.
    """
    return f"{CI_LEVEL:.0%} interval {low:.3f}–{high:.3f}×" if math.isfinite(high) else "no interval from one round"


def replay_rows(plan: Plan) -> tuple[list[tuple[str, str, str]], str]:
    """A validated plan's replays as rows (settings, iteration ms, vs default), and a caption ("" if none).

    Args:
        plan: a plan with a ``validated`` record.
    Returns:
        The rows and the caption.
    """
    validated = plan.validated
    kind = "simulated" if validated.get("simulated") else "measured"
    vbase = validated.get("iteration_ms", {}).get("default")
    same = validated.get("same_settings")
    rows = []
    for name, ms in validated.get("iteration_ms", {}).items():
        # the plan's is the recorded reading (the rounds' ratios), not the medians'; the same settings
        # replayed twice: a ratio would present the replay's noise as a speed-up
        x = validated.get("speedup") if name == "plan" and validated.get("speedup") is not None else vbase / ms if vbase and ms else None
        ratio = "same settings" if same and name != "default" else f"{x:.3f}×" if x is not None else ""
        rows.append((f"{kind} {name} (replay)", ms_text(ms), ratio))
    if same:
        caption = "the plan keeps the defaults: both replays ran the same settings, so their difference is noise"
    elif validated.get("speedup") is not None and validated.get("interval"):
        low, high = validated["interval"]
        rounds = f"the {validated['repeats']} rounds'" if validated.get("repeats") else "its rounds'"
        caption = (f"replayed speed-up {validated['speedup']:.3f}× (geometric mean of {rounds} ratios), "
                   f"{interval_text(low, high)}: {verdict(low, high, False)}")
        ratios = validated.get("ratios") or []
        if ratios:  # written since 2026-12-07: the rounds themselves, in the order the replay ran them (search.replay)
            caption += "\n" + rounds_line(by_first_arm(ratios, ("default", "plan")))
        if low <= 1.0 <= high:
            said = plan.predicted_speedup
            caption += "\n" + _unresolved_line(said, rounds_to_show(ratios, said, MAX_ROUNDS), len(ratios) > 1, "--validate")
    elif validated.get("speedup") is not None and validated.get("repeats") == 1:
        caption = f"replayed speed-up {validated['speedup']:.3f}× from one round: no interval (--validate 2 or more gives one)"
    else:  # a plan written before the replay recorded its interval
        caption = ""
    shortfall = replay_shortfall(plan)
    if shortfall:
        caption = f"[yellow]warning[/] {shortfall}" + (f"\n{caption}" if caption else "")
    return rows, caption


def replay_shortfall(plan: Plan) -> str:
    """What to say when a plan's own replay gained less than half the speed-up its model predicted
    ("" when it gained that much, kept the defaults or was not replayed): a plan written and shown
    with no remark replayed 0.999x on the noiseless simulator for 1.061x predicted (an audit,
    2026-12-04).

    Args:
        plan: the plan.
    Returns:
        One line, or "".
    """
    replay, said = plan.validated.get("iteration_ms", {}), plan.predicted_speedup
    if plan.validated.get("same_settings") or said is None or not (replay.get("default") and replay.get("plan")):
        return ""
    got = plan.validated.get("speedup") or replay["default"] / replay["plan"]
    if said <= 1 or got - 1 >= (said - 1) / 2:
        return ""
    kind = "simulated" if plan.validated.get("simulated") else "measured"
    return (f"the {kind} replay ran the plan {got:.3f}× the defaults' speed where the model predicted {said:.3f}×: "
            "the replay does not bear the predicted gain out (it may be within the model's error on this workload)")


def flat_settings(s: Any) -> dict[str, Any]:
    """Every knob value of a ``Settings`` at its scope: ``knob``, ``role.knob``, ``collective.knob``.

    Args:
        s: the settings.
    Returns:
        Flat name -> value.
    """
    return {**dict(s.process), **{f"{g}.{k}": val for g, kv in s.communicators.items() for k, val in kv.items()},
            **{f"{c}.{k}": val for c, kv in s.collectives.items() for k, val in kv.items()}}


def compare_rows(results: list[SearchResult]) -> list[dict[str, Any]]:
    """One row per optimizer; ``changes`` lists every setting (process, communicator or per-collective)
    that differs from the default optimizer's, which is where the speed-up comes from.

    Args:
        results: every optimizer's result (``search.run.compare``).
    Returns:
        The rows (what ``--compare --json`` prints).
    """
    base = next((r for r in results if r.optimizer == "default"), None)
    defaults = flat_settings(base.settings) if base else {}
    rows = []
    for r in results:
        flat = flat_settings(r.settings)
        rows.append({
            "optimizer": r.optimizer,
            "iteration_ms": ms_round(r.evaluation.iteration_s * 1e3),
            "speedup_vs_default": round(base.evaluation.iteration_s / r.evaluation.iteration_s, 4) if base else None,
            "evaluations": r.evaluations,
            "seconds": round(r.seconds, 4),
            "settings": {"process": dict(r.settings.process), "communicators": {k: dict(v) for k, v in r.settings.communicators.items()},
                         "collectives": {k: dict(v) for k, v in r.settings.collectives.items()}},
            "changes": {k: val for k, val in flat.items() if defaults.get(k) != val},
        })
    return rows


COMPARE_SHOWN = 6  # changes listed per optimizer in the table (--json has them all)


def compare_table(rows: list[dict[str, Any]], simulated: bool, skipped: dict[str, str] | None = None) -> Table:
    """``search --compare``'s table.

    Args:
        rows: ``compare_rows``'s rows.
        simulated: whether the run folder is simulated.
        skipped: optimizers left out, and why (a caption line each).
    Returns:
        The table.
    """
    t = Table(title="optimizers side by side (predicted)" + simulated_tag(simulated), title_justify="left")
    for col in ("optimizer", "iteration ms", "vs default", "evaluations", "seconds", "settings that differ from the defaults"):
        t.add_column(col, justify="left" if col in ("optimizer", "settings that differ from the defaults") else "right")
    for r in rows:
        changes = [f"{k}={val}" for k, val in r["changes"].items()]
        more = f" (+{len(changes) - COMPARE_SHOWN} more; --json lists all)" if len(changes) > COMPARE_SHOWN else ""
        desc = ", ".join(changes[:COMPARE_SHOWN]) + more if changes else ("the defaults" if r["optimizer"] == "default" else "none")
        t.add_row(r["optimizer"], ms_text(r['iteration_ms']), f"{r['speedup_vs_default']:.3f}×", str(r["evaluations"]), f"{r['seconds']:.3f}", escape(desc))
    if skipped:
        t.caption = "\n".join(f"{name} not run: {escape(why)}" for name, why in skipped.items())
        t.caption_justify = "left"
    return t


def print_whole(table: Table) -> None:
    """Print ``table`` on :data:`console`, as wide as its cells need when the output is not a
    terminal (a file or a pipe has no width to fit; numbers there are read, compared and diffed
    one row to a line, as nccl-tests' are).

    Args:
        table: the table.
    """
    if console.is_terminal:
        console.print(table)
        return
    width = max(console.width, Measurement.get(console, console.options.update_width(10 ** 4), table).maximum)
    Console(width=width, soft_wrap=True, file=console.file).print(table)


def frame_table(df: pd.DataFrame, title: str) -> Table:
    """A data frame as a rich table (numbers right-aligned; a cell too wide for the console folds,
    as every :class:`Table`'s: `show --collectives` cut sizes to ``4362240…``).

    Args:
        df: the frame.
        title: the table's title.
    Returns:
        The table.
    """
    t = Table(title=title, title_justify="left")
    for col in df.columns:
        t.add_column(str(col), justify="right" if pd.api.types.is_numeric_dtype(df[col]) else "left")
    for row in df.itertuples(index=False):
        t.add_row(*(escape(str(x)) for x in row))
    return t


def run_summary(meta: dict[str, Any], df: pd.DataFrame, model: dict[str, Any] | None, problems: list[str] = ()) -> list[Any]:
    """A run folder's tables; ``problems`` (from ``RunFolder.health``) print as warnings after them.

    Args:
        meta: its ``meta.yaml``.
        df: its measurements.
        model: its ``model.yaml``, or None before a fit.
        problems: lines about the CSV's health.
    Returns:
        Tables and lines, in the order to print them.
    """
    fp = meta.get("fingerprint", {})
    out: list[Any] = []
    workload = meta.get("workload")
    name = workload.get("name", "?") if isinstance(workload, dict) else "?"  # shown even when the rest is unreadable
    t = Table(title=f"run folder · {escape(str(name))}{simulated_tag(meta.get('simulated', False))}", title_justify="left")
    t.add_column("field")
    t.add_column("value")
    for k, val in fp.items():
        t.add_row(escape(str(k)), escape(str(val)))
    t.add_row("points", f"{meta.get('points_done')} / {meta.get('points_total')}" + ("" if meta.get("complete") else " (incomplete: rerun profile to resume)"))
    t.add_row("rows", f"{len(df)} ({df['point'].nunique() if len(df) else 0} complete points in measurements.csv)")
    out.append(t)
    if not df.empty:
        simulated = meta.get("simulated", False)
        k = Table(title=f"{'medians' if simulated else 'measured medians'} by kind{simulated_tag(simulated)}", title_justify="left")
        for col in ("kind", "points", "median µs", "p90 µs"):
            k.add_column(col)
        for kind, rows in df.groupby("kind"):
            med = rows.groupby("point").time_us.median()
            k.add_row(str(kind), str(len(med)), f"{med.median():.1f}", f"{med.quantile(0.9):.1f}")
        out.append(k)
    if model:
        out += model_tables(model)
    out += [f"[yellow]warning[/] {escape(p)}" for p in problems]
    return out


def fit_warnings(warnings: list[str] | tuple[str, ...]) -> list[str]:
    """A fit's warnings (points its held-out figures leave out, measurements it refused), one line
    each, as ``profile``, ``fit`` and ``show`` print them.

    Args:
        warnings: the fit's warning lines.
    Returns:
        Console lines.
    """
    return [f"[yellow]warning[/] {escape(str(w))}" for w in warnings]


def own_choice_lines(summary: pd.DataFrame) -> list[str]:
    """The collectives timed with nothing set, one line each: what the backend chose and how fast
    it ran (``profile`` prints them after an nccl profile).

    Args:
        summary: ``profile.summary.collective_summary`` of a run.
    Returns:
        Console lines; none without such collectives.
    """
    if "own" not in summary.columns:
        return []
    def chose(r: Any) -> str:
        if r.algo == "?":
            return "its choice not observed"
        on = f" on {r.channels} channels" if "channels" in summary.columns and not pd.isna(r.channels) else ""
        return f"{escape(str(r.algo))}/{escape(str(r.proto))}{on}"

    return [f"nothing set: {r.op} of {r.size_B} B on {r.ranks} ranks ran in {r.time_us} us (busbw {r.busbw_GBps} GB/s), "
            f"{chose(r)}" for r in summary[summary["own"]].itertuples()]


def model_tables(model: dict[str, Any]) -> list[Any]:
    """A model.yaml's measured accuracy: held-out MAPE, the ranking figures the search relies on,
    and warnings about measurements the fit refused.

    Args:
        model: the loaded ``model.yaml``.
    Returns:
        Tables and lines, in the order to print them.
    """
    acc = model.get("accuracy", {})
    out: list[Any] = []
    form = f" · form {model['form']}" if model.get("form") else ""
    tag = simulated_tag(bool(model.get("simulated")))
    m = Table(title=f"model {escape(str(model.get('family')))}{escape(form)} · held-out accuracy ({escape(str(acc.get('method', '')))}){tag}", title_justify="left")
    m.add_column("quantity")
    m.add_column("MAPE", justify="right")
    scored, noise, again = acc.get("scored", {}), acc.get("noise", {}), acc.get("remeasured", {})
    if scored:
        m.add_column("points held out", justify="right")
    if noise:
        m.add_column("repeat noise", justify="right")
    if again:
        m.add_column("remeasured", justify="right")
    for name, val in acc.get("mape", {}).items():
        m.add_row(escape(str(name)), percent(val), *([str(int(scored.get(name, 0)))] if scored else []),
                  *([percent(noise[name]) if name in noise else "-"] if noise else []),
                  *([remeasured_cell(again[name]) if name in again else "-"] if again else []))
    out.append(m)
    if noise:
        out.append(f"repeat noise: {escape(str(acc.get('noise_method', '')))}")
    if again:
        out.append(f"remeasured: {escape(str(acc.get('remeasured_method', '')))}")
        out += [escape(line) for line in remeasured_offsets(again)]
    ranking = acc.get("ranking")
    if ranking and ranking.get("shapes"):
        r = Table(title=f"ranking of settings per GEMM shape and collective ({ranking.get('method', '')}) · median Spearman "
                        f"{ranking.get('median_spearman', float('nan')):.2f}{tag}", title_justify="left")
        for col in ("GEMM shape", "beside", "Spearman (channels)", "best-setting gap", "points"):
            r.add_column(col, justify="left" if col in ("GEMM shape", "beside") else "right")
        for row in ranking["shapes"]:
            r.add_row(escape(str(row["shape"])), escape(str(row.get("collective", ""))), f"{row['spearman']:.2f}",
                      f"{row['best_gap']:.1%}", str(row["points"]))
        out.append(r)
    out += fit_warnings(acc.get("warnings", []))
    return out


def deployment_lines(plan: Plan, env: dict[str, str], tuner: Any = None) -> list[str]:
    """What `apply` would set: environment, NCCL communicator Options, the tuner plugin and its rules.

    Args:
        plan: the plan.
        env: the variables `apply` would export.
        tuner: the ``launch.TunerDeployment`` (plugin build and rules file), or None when the plan has no rules.
    Returns:
        Lines in rich markup, in the order to print them.
    """
    out = ["[bold]environment[/]", escape(export_lines(env))]
    if backend_info(plan.backend).deploys_nccl_options:
        for cfg in (tuner.bounds if tuner is not None else {}).values():  # no rules, no bounds
            out.append(f"[bold]ProcessGroupNCCL.Options[/] for {escape(cfg.role)} ({cfg.ranks} ranks): "
                       f"config.min_ctas={cfg.min_ctas}, config.max_ctas={cfg.max_ctas}")
    if tuner is not None and tuner.rules_file is not None:
        plugin = tuner.plugin
        where = (f"{escape(str(plugin.path))} ({'built now' if plugin.built else 'cached'})" if plugin.ok
                 else f"[yellow]not available[/]: {escape(plugin.reason)}")
        out.append(f"[bold]NCCL tuner plugin[/] (NCCL_TUNER_PLUGIN): {where}")
        out.append(f"[bold]tuner rules[/] ({RULES_ENV}): {escape(str(tuner.rules_file))}")
        out.append(escape(tuner.rules.text().rstrip()))
        if tuner.needs_plugin:
            out.append("[bold]rules that need the plugin[/] (CTA bounds alone cannot set them):")
            out += [f"  {escape(describe(r))}" for r in tuner.needs_plugin]
    return out


def trial_run_line(run: TrialRun, rounds: int) -> str:
    """One line for a trial run once it ends.

    Args:
        run: the run.
        rounds: the trial's rounds.
    Returns:
        The line.
    """
    return (f"round {run.round}/{rounds} {run.arm:7s} {ms_text(run.step_ms)} ms a step "
            f"(mean after the warm-up, slowest of {run.ranks} process(es), {run.steps} steps)")


def rounds_line(ratios: dict[str, tuple[float, ...]]) -> str:
    """Each round's ratio, grouped by the arm that ran first (``TrialReading.ratios``): the numbers
    the interval is read from, and where a run's place in its round would show."""
    groups = [f"{first} first " + " ".join(f"{x:.3f}" for x in xs) for first, xs in ratios.items() if xs]
    return "per round, default / plan: " + " · ".join(groups)


def _unresolved_line(predicted: float | None, rounds: int | None, spread_known: bool, option: str = "--rounds") -> str:
    """What to say of a comparison whose interval holds 1: a trial's (``TrialReading.rounds_to_show``)
    or a validated plan's replays (``option`` ``--validate``). ``rounds`` is ``comparison.rounds_to_show``
    of its rounds, which says something only where their spread is known (two rounds or more, recorded)."""
    if predicted is None or predicted == 1.0 or not spread_known:
        return f"the interval holds 1: more rounds ({option}) narrow it, if the difference is there to find"
    if rounds is None:
        return (f"the interval holds 1: at this spread between rounds the plan's predicted {predicted:.3f}× would not show "
                f"within {MAX_ROUNDS} rounds; the noise between runs is larger than the gain")
    return (f"the interval holds 1: at this spread between rounds the plan's predicted {predicted:.3f}× would show after "
            f"about {rounds} rounds ({option} {rounds}), a smaller true difference after more")


def trial_summary(record: TrialRecord) -> list[Any]:
    """What ``trial`` prints at the end, and ``show`` of a trial record: each arm's step times and
    the speed-up with its interval (a trial stopped midway: the rounds it finished).

    Args:
        record: the trial.
    Returns:
        A table and the lines under it.
    """
    reading = record.reading()
    t = Table(title=f"trial: your command's step time (measured, {escape(record.host)}, {record.date})", title_justify="left")
    for col in ("settings", "runs", "median step ms", "fastest", "slowest"):
        t.add_column(col, justify="left" if col == "settings" else "right")
    for arm, ms in reading.step_ms.items():
        low, high = reading.spread_ms[arm]
        t.add_row(arm, str(sum(r.arm == arm for r in record.runs)), ms_text(ms), ms_text(low), ms_text(high))
    out: list[Any] = [t, f"speed-up (default / plan, geometric mean of per-round ratios): {reading.speedup:.3f}×, "
                         f"{interval_text(reading.low, reading.high)}: [bold]{escape(reading.verdict)}[/]"]
    out.append(rounds_line(reading.ratios))
    if not record.same_settings and reading.low <= 1.0 <= reading.high:
        out.append(_unresolved_line(record.predicted, reading.rounds_to_show, math.isfinite(reading.high)))
    if not record.complete:
        out.append(f"[yellow]stopped after {len(record.runs)} of {record.planned_runs} runs[/]: the reading is of the rounds that ran both")
    out.append(f"command: {escape(record.command)} · warm-up {record.warmup} steps · plan {escape(record.plan)}")
    return out
