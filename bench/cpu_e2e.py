"""CPU end to end: the example training's median step time with default settings and with a plan.

Runs are interleaved, each round in the reverse order of the one before (``lagom_tune.interleave``:
a run's position in its round is not neutral here). The table reports each configuration's
median over rounds, its spread, the ratio, and a 95% bootstrap confidence interval of the
geometric-mean per-round ratio with a plain verdict: faster, slower, or no difference measurable
on this machine.

    python bench/cpu_e2e.py --plan plans/demo-cpu.yaml --rounds 4 --out bench/results/cpu_e2e.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from compare import CI_LEVEL, ratio_interval

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.registry import usable_cores
from lagom_tune.interleave import interleaved

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_once(plan: Path | None, steps: int, ranks: int, extra_env: dict[str, str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        metrics = Path(f.name)
    train = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", str(ROOT / "examples" / "train_gpt.py"),
             "--steps", str(steps), "--metrics", str(metrics)]
    cmd = train if plan is None else [str(BIN / "lagom-tune"), "apply", str(plan), "--applied", str(metrics) + ".applied", "--", *train]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **extra_env}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    out = json.loads(metrics.read_text())
    metrics.unlink()
    Path(str(metrics) + ".applied").unlink(missing_ok=True)
    return out


def measure_grid(plan_path: Path, steps: int, ranks: int) -> dict[int, float]:
    """Median step time for each bucket cap of the gloo knob space, the plan's other settings kept."""
    import dataclasses

    from lagom_tune.backends.gloo_knobs import BUCKET_CAPS_MB
    from lagom_tune.knobs import Settings
    from lagom_tune.plan.schema import load_plan
    from lagom_tune.runtime.shim import ddp_role_of

    plan = load_plan(plan_path)
    role = ddp_role_of(plan)  # dp_replicate, or dp in older plans
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cap in BUCKET_CAPS_MB:
            variant = dataclasses.replace(plan, settings=Settings(plan.settings.process, {role: {"bucket_cap_mb": cap}}))
            path = variant.save(Path(tmp) / f"cap{cap}.yaml")
            out[cap] = run_once(path, steps, ranks, {})["median_step_ms"]
            print(f"grid bucket_cap_mb={cap:3d}: {out[cap]:.2f} ms", flush=True)
    return out


def verdict(low: float, high: float, same_settings: bool) -> str:
    """The plain reading of an interval of default / plan ratios."""
    if same_settings:
        return "same settings: the plan keeps the defaults, any difference is noise"
    if low > 1.0:
        return "the plan is faster"
    if high < 1.0:
        return "the plan is slower"
    return "no difference measurable on this machine"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=4, help="even, so each configuration runs first equally often")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_e2e.md")
    p.add_argument("--grid", action="store_true", help="also measure every bucket cap (plan's threads), to show the plan's gap to the measured best")
    args = p.parse_args()

    runs: dict[str, list[dict]] = {"default": [], "plan": []}
    for r, (name, plan) in interleaved((("default", None), ("plan", args.plan)), args.rounds):
        m = run_once(plan, args.steps, args.ranks, {})
        runs[name].append(m)
        print(f"round {r + 1}/{args.rounds} {name:8s} median step {m['median_step_ms']:.2f} ms "
              f"(bucket cap {m['bucket_cap_bytes'] / 2**20:g} MiB, {m['threads']} thread(s))", flush=True)

    def summary(name: str) -> tuple[float, float, float]:
        meds = [m["median_step_ms"] for m in runs[name]]
        return statistics.median(meds), min(meds), max(meds)

    d, p_ = summary("default"), summary("plan")
    ratio = d[0] / p_[0]
    ratios = [a["median_step_ms"] / b["median_step_ms"] for a, b in zip(runs["default"], runs["plan"])]
    lines = [
        "# CPU end to end: example training, default vs plan (measured)",
        "",
        f"{datetime.date.today()} · {platform.node()} · {usable_cores()} cores · {args.ranks} gloo ranks · "
        f"{args.rounds} interleaved rounds × {args.steps} steps, each round's first run alternating · plan `{args.plan}`",
        "",
        "| settings | median step ms | min | max | bucket cap MiB | threads |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in (("default", d), ("plan", p_)):
        m = runs[name][0]
        lines.append(f"| {name} | {s[0]:.2f} | {s[1]:.2f} | {s[2]:.2f} | {m['bucket_cap_bytes'] / 2**20:g} | {m['threads']} |")
    same = all((runs["default"][0][k] == runs["plan"][0][k]) for k in ("bucket_cap_bytes", "threads"))
    gmean, low, high = ratio_interval(ratios)
    said = verdict(low, high, same)
    # the headline is the estimate the interval is of: the paired rounds' geometric mean, not the ratio of medians
    lines += ["", f"**speedup (default / plan, geometric mean of per-round ratios): {gmean:.3f}×, {CI_LEVEL:.0%} bootstrap "
                  f"interval {low:.3f}–{high:.3f}×** (per-round ratios {min(ratios):.3f}–{max(ratios):.3f}; ratio of the "
                  f"medians {ratio:.3f}×): **{said}**", ""]
    if same:
        lines += ["The plan keeps the default settings (the model predicts no gain), so the two rows run the same",
                  "configuration and their difference is run-to-run noise on this machine.", ""]
    if args.grid:
        grid = measure_grid(args.plan, args.steps, args.ranks)
        best_cap, best_ms = min(grid.items(), key=lambda kv: kv[1])
        lines += ["## Measured grid (one run each, same steps)", "", "| bucket_cap_mb | median step ms |", "|---:|---:|"]
        lines += [f"| {cap} | {ms:.2f} |" for cap, ms in grid.items()]
        lines += ["", f"Best measured: bucket_cap_mb={best_cap} at {best_ms:.2f} ms; the plan's median is "
                      f"{p_[0] / best_ms:.3f}× that (1.000 = the plan found the measured optimum; single runs are noisy).", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, text)
    print()
    print(f"default {d[0]:.2f} ms | plan {p_[0]:.2f} ms | speedup {gmean:.3f}x (geometric mean of per-round ratios), "
          f"{CI_LEVEL:.0%} interval {low:.3f}-{high:.3f}x over {args.rounds} rounds; ratio of medians {ratio:.3f}x -> {args.out}")
    print(f"verdict: {said}")


if __name__ == "__main__":
    main()
