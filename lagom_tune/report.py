"""`lagom-tune report`: one self-contained HTML page for a run folder or a plan.

It holds the fit's pictures (measured vs predicted, computation slowdown beside collectives),
the model's held-out accuracy, and for a plan a before/after timeline (Gantt) of the overlap
group that costs the iteration most, under the default settings and under the plan.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from rich.text import Text

from lagom_tune.artifact_io import atomic_write_text, check_writable
from lagom_tune.errors import UserError
from lagom_tune.model.contention import read_model_file, run_problems
from lagom_tune.plan.schema import Plan, load_plan
from lagom_tune.plan_check import STALE_REASON, plan_run_folder, predict_plan
from lagom_tune.precision import ms_text
from lagom_tune.profile.store import RunFolder, open_run
from lagom_tune.render import percent, remeasured_cell, remeasured_offsets, replay_rows
from lagom_tune.search.evaluate import Evaluation


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def gantt(default: Evaluation, plan: Evaluation, simulated: bool) -> str:
    """Both timelines of the most expensive group, one above the other, as a PNG (base64).

    Args:
        default: the evaluation under the default settings.
        plan: the evaluation under the plan.
        simulated: whether to mark the picture simulated.
    Returns:
        The PNG, base64-encoded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = max(range(len(default.timelines)), key=lambda i: default.timelines[i][0].repeat * default.timelines[i][1].makespan)
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, (label, ev) in zip(axes, (("default", default), ("plan", plan))):
        group, tl = ev.timelines[min(idx, len(ev.timelines) - 1)]
        for lane, stream, color in ((1, "compute", "tab:blue"), (0, "comm", "tab:orange")):
            spans = [(s.start * 1e3, s.duration * 1e3) for s in tl.spans if s.stream == stream]
            ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
        ax.set_yticks([0, 1], ["collectives", "GEMMs"])
        ax.set_title(f"{label}: group {group.name} × {group.repeat}, makespan {tl.makespan * 1e3:.2f} ms", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms" + (" (SIMULATED)" if simulated else " (predicted by the fitted model)"))
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data


def _ranking_html(accuracy: dict[str, Any]) -> list[str]:
    """The ranking figures (what the search relies on) and the fit's warnings, as HTML."""
    out = []
    ranking = accuracy.get("ranking") or {}
    if ranking.get("shapes"):
        rows = "".join(f"<tr><td>{html.escape(str(r['shape']))}</td><td>{html.escape(str(r.get('collective', '')))}</td>"
                       f"<td>{r['spearman']:.2f}</td><td>{r['best_gap']:.1%}</td><td>{r['points']}</td></tr>" for r in ranking["shapes"])
        out.append(f"<h2>Ranking of settings per GEMM shape and collective (median Spearman {ranking.get('median_spearman', float('nan')):.2f})</h2>"
                   "<table><tr><th>GEMM shape</th><th>beside</th><th>Spearman over channels</th><th>best-setting gap</th><th>points</th></tr>"
                   f"{rows}</table><p>{html.escape(str(ranking.get('method', '')))}</p>")
    for w in accuracy.get("warnings", []):
        out.append(f'<p class="warn">warning: {html.escape(str(w))}</p>')
    return out


def _sources(target: Path) -> tuple[Plan | None, RunFolder]:
    """What a report reads: the plan (None for a run folder) and the run folder.

    Raises:
        UserError: for a plan whose run folder is missing.
    """
    if not target.is_file():
        return None, open_run(target)
    plan = load_plan(target)
    try:
        return plan, open_run(plan_run_folder(plan, target))
    except UserError as e:
        raise UserError(f"{e}; the report needs the plan's run folder") from None


def build_report(target: str | Path) -> str:
    """The HTML page for a run folder or a plan file.

    Args:
        target: a run folder, or a plan whose run folder is here.
    Returns:
        One self-contained HTML page.
    Raises:
        UserError: for a plan whose run folder is missing.
    """
    return _page(*_sources(Path(target)))


REPORT_MARK = "<title>lagom-tune report"  # what every page holds (``report --out`` replaces only such a file)


def _page(plan: Plan | None, run: RunFolder) -> str:
    """The HTML page for ``run``, and for ``plan`` when given."""
    meta = run.read_meta()
    simulated = bool(meta.get("simulated"))
    model_doc: dict[str, Any] = read_model_file(run.model_path, run.fitted_as(meta)) if run.model_path.is_file() else {}
    title = f"{REPORT_MARK.removeprefix('<title>')} · {meta.get('workload', {}).get('name', '?')}" + (" · SIMULATED" if simulated else "")
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if simulated:
        parts.append('<p class="sim">Every number on this page comes from a <b>simulated</b> GPU cluster: a what-if result, not a measurement.</p>')
    fp = meta.get("fingerprint", {})
    df, health = run.read()
    parts += [f'<p class="warn">warning: {html.escape(p)}</p>' for p in run_problems(health, model_doc, df, run.path)]
    parts.append("<h2>Environment</h2><table>" + "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in fp.items()) + "</table>")
    accuracy = model_doc.get("accuracy", {})
    mape, noise, again = accuracy.get("mape", {}), accuracy.get("noise", {}), accuracy.get("remeasured", {})
    if mape:
        parts.append("<h2>Model accuracy (held-out)</h2><table><tr><th>quantity</th><th>MAPE</th><th>repeat noise</th>"
                     "<th>remeasured</th></tr>"
                     + "".join(f"<tr><td>{html.escape(k)}</td><td>{percent(v)}</td><td>{percent(noise[k]) if k in noise else '-'}</td>"
                               f"<td>{remeasured_cell(again[k]) if k in again else '-'}</td></tr>" for k, v in mape.items()) + "</table>"
                     + f"<p>{html.escape(accuracy.get('method', ''))}</p>"
                     + (f"<p>Repeat noise: {html.escape(accuracy.get('noise_method', ''))}.</p>" if noise else "")
                     + (f"<p>Remeasured: {html.escape(accuracy.get('remeasured_method', ''))}.</p>" if again else "")
                     + "".join(f'<p class="warn">{html.escape(line)}</p>' for line in remeasured_offsets(again)))
    parts += _ranking_html(accuracy)
    for f, alt in ((run.fit_plot_path, "measured vs predicted"), (run.slowdown_plot_path, "computation slowdown vs communication resources")):
        if f.is_file():
            parts.append(f"<h2>{html.escape(alt.capitalize())}</h2>" + _img(base64.b64encode(f.read_bytes()).decode(), alt))
    if plan is not None:
        now = predict_plan(plan, run)
        if now.drift:
            raise UserError(f"the plan's predictions are not what its run's model gives it now ({now.drift_text()}): {STALE_REASON}; "
                            "search again for a plan to report (or report the run folder)")
        d, p = now.default, now.plan
        parts.append(f"<h2>Before / after: predicted iteration {ms_text(d.iteration_s * 1e3)} → {ms_text(p.iteration_s * 1e3)} ms "
                     f"({d.iteration_s / p.iteration_s:.3f}×)</h2>" + _img(gantt(d, p, simulated), "timeline under default settings and under the plan"))
        if plan.validated:  # the rows `show` prints, not the record as Python writes a dict
            rows, caption = replay_rows(plan)
            # the console's colours are markup, not text; its lines, lines (HTML would run them together)
            caption = "<br>".join(html.escape(line) for line in Text.from_markup(caption).plain.splitlines())
            parts.append("<h2>Validation</h2><table><tr><th>settings</th><th>iteration ms</th><th>vs default</th></tr>"
                         + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
                         + f"</table><p>{html.escape(str(plan.validated.get('method', '')))}{'.<br>' + caption if caption else ''}</p>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}img{max-width:100%}.sim{background:#fde;padding:.5em}"
             ".warn{background:#ffd;padding:.3em}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{''.join(parts)}</body></html>"


def write_report(target: str | Path, out: str | Path) -> Path:
    """Write ``build_report``'s page.

    Args:
        target: a run folder or a plan file.
        out: the HTML file to write.
    Returns:
        The written path.
    """
    plan, run = _sources(Path(target))
    return atomic_write_text(check_writable(out, "report", [Path(target), *run.files], replaces=REPORT_MARK), _page(plan, run))
