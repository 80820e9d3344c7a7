"""CPU end to end: the example training's step time with default settings and with a plan, as
``lagom-tune trial`` measures it.

The example (``examples/train_gpt.py``, DDP on gloo ranks under torchrun) runs in interleaved
rounds, each in the reverse order of the one before (``lagom_tune.comparison``: a run's position
in its round is not neutral here), each run timed by its optimizer steps (``runtime/steps.py``).
The table reports each configuration's median over rounds, its spread, and a 95% Student-t
interval of the geometric-mean per-round ratio with a plain verdict: faster, slower, or no
difference measurable on this machine. ``--grid`` also times one run of every bucket cap.

    python bench/cpu_e2e.py --plan plans/demo-cpu.yaml --rounds 4 --out bench/results/cpu_e2e.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.gloo_knobs import BUCKET_CAPS_MB
from lagom_tune.backends.registry import usable_cores
from lagom_tune.comparison import CI_LEVEL
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import Plan, load_plan
from lagom_tune.render import flat_settings, rounds_line
from lagom_tune.runtime.shim import ddp_role_of
from lagom_tune.runtime.trial import run_trial, slowest_step_ms, timed_run

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WARMUP = 2  # the example's own warm-up steps (--warmup 2), left out of the timing too


def training(steps: int, ranks: int) -> list[str]:
    """The example's command line."""
    return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", str(ROOT / "examples" / "train_gpt.py"),
            "--steps", str(steps), "--warmup", str(WARMUP)]


def settings_text(plan: Plan) -> str:
    """What the plan sets, in one cell."""
    return ", ".join(f"{k}={v}" for k, v in flat_settings(plan.settings).items()) or "nothing (gloo's own)"


def measure_grid(plan_path: Path, steps: int, ranks: int) -> dict[int, float]:
    """One run's step time (ms) for each bucket cap of the gloo knob space, the plan's other settings kept."""
    plan = load_plan(plan_path)
    role = ddp_role_of(plan)  # dp_replicate, or dp in older plans
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cap in BUCKET_CAPS_MB:
            variant = dataclasses.replace(plan, settings=Settings(plan.settings.process, {role: {"bucket_cap_mb": cap}}))
            path = variant.save(Path(tmp) / f"cap{cap}.yaml")
            code, steps_seen, _ = timed_run(training(steps, ranks), variant, path)
            if code:
                sys.exit(f"the example failed under bucket_cap_mb={cap} (exit status {code})")
            out[cap] = slowest_step_ms(steps_seen, WARMUP, f"bucket_cap_mb={cap}")[0]
            print(f"grid bucket_cap_mb={cap:3d}: {out[cap]:.2f} ms", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=4, help="even, so each configuration runs first equally often")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_e2e.md")
    p.add_argument("--grid", action="store_true", help="also measure every bucket cap (plan's threads), to show the plan's gap to the measured best")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    plan = load_plan(args.plan)
    with tempfile.TemporaryDirectory() as tmp:
        record, _ = run_trial(plan, args.plan, training(args.steps, args.ranks), args.rounds, WARMUP, Path(tmp) / "trial.json",
                                     on_run=lambda r: print(f"round {r.round}/{args.rounds} {r.arm:8s} {r.step_ms:.2f} ms a step", flush=True),
                                     on_warning=lambda line: print(f"lagom-tune: {line}", flush=True))
    reading = record.reading()
    lines = [
        "# CPU end to end: example training, default vs plan (measured)",
        "",
        f"{datetime.date.today()} · {platform.node()} · {usable_cores()} cores · {args.ranks} gloo ranks · "
        f"{args.rounds} interleaved rounds × {args.steps} steps (after {WARMUP} warm-up steps), each round's first run "
        f"alternating · plan `{args.plan}` · measured as `lagom-tune trial` measures: each run's slowest rank's mean "
        "interval between optimizer steps",
        "",
        "| settings | median step ms | fastest | slowest | what is set |",
        "|---|---:|---:|---:|---|",
    ]
    for arm, ms in reading.step_ms.items():
        low, high = reading.spread_ms[arm]
        lines.append(f"| {arm} | {ms:.2f} | {low:.2f} | {high:.2f} | {settings_text(plan) if arm == 'plan' else 'nothing'} |")
    ratio = reading.step_ms["default"] / reading.step_ms["plan"]
    # the headline is the estimate the interval is of: the paired rounds' geometric mean, not the ratio of medians
    lines += ["", f"**speedup (default / plan, geometric mean of per-round ratios): {reading.speedup:.3f}×, {CI_LEVEL:.0%} Student-t "
                  f"interval {reading.low:.3f}–{reading.high:.3f}×** ({rounds_line(reading.ratios)}; "
                  f"ratio of the medians {ratio:.3f}×): **{reading.verdict}**", ""]
    if record.same_settings:
        lines += ["The plan keeps the default settings (the model predicts no gain), so the two rows run the same",
                  "configuration and their difference is run-to-run noise on this machine.", ""]
    if args.grid:
        grid = measure_grid(args.plan, args.steps, args.ranks)
        best_cap, best_ms = min(grid.items(), key=lambda kv: kv[1])
        lines += ["## Measured grid (one run each, same steps)", "", "| bucket_cap_mb | step ms |", "|---:|---:|"]
        lines += [f"| {cap} | {ms:.2f} |" for cap, ms in grid.items()]
        lines += ["", f"Best measured: bucket_cap_mb={best_cap} at {best_ms:.2f} ms; the plan's median is "
                      f"{reading.step_ms['plan'] / best_ms:.3f}× that (1.000 = the plan found the measured optimum; single runs are noisy).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, "\n".join(lines))
    print()
    print(f"default {reading.step_ms['default']:.2f} ms | plan {reading.step_ms['plan']:.2f} ms | speedup {reading.speedup:.3f}x "
          f"(geometric mean of per-round ratios), {CI_LEVEL:.0%} interval {reading.low:.3f}-{reading.high:.3f}x over "
          f"{args.rounds} rounds; ratio of medians {ratio:.3f}x -> {args.out}")
    print(f"verdict: {reading.verdict}")


if __name__ == "__main__":
    main()
