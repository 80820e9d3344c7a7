"""Interruption: Ctrl-C, a killed rank or a hung rank leave a valid run folder that a rerun completes."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
import yaml

from lagom_tune import errors
from lagom_tune.errors import STOP_SIGNALS, Interrupted, raise_on_stop_signals, stops_deferred

from conftest import BIN, ROOT, cli
from test_cli_errors import assert_one_line_error

pytestmark = pytest.mark.slow

# The interruptions land in the demo workload's profile (76 points, about 7 s of measuring on 2
# cores): progress reaches meta.yaml once a second, so the tiny workload's (25 points, 2 s) could
# finish before the signal does.
WORKLOAD = "cpu-demo"


def start_profile(workload, run, *extra):
    # A session of its own, so a test can send Ctrl-C to the whole group as a terminal does; Ctrl-C
    # handled as in a terminal even when the tests run as a background job (which ignores SIGINT,
    # and its children with it).
    return subprocess.Popen([str(BIN / "lagom-tune"), "profile", "--workload", str(workload), "--ranks", "2",
                             "--out", str(run), "--repeats", "3", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_points(run, n, proc, limit=120):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        meta = run / "meta.yaml"
        if meta.exists() and (yaml.safe_load(meta.read_text()) or {}).get("points_done", 0) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("profile made no progress")


def rank_pids(parent_pid):
    out = subprocess.run(["pgrep", "-P", str(parent_pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def assert_complete_without_duplicates(run):
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    df = pd.read_csv(run / "measurements.csv")
    assert meta["complete"] and df.point.nunique() == meta["points_total"]
    assert (df.groupby("point").size() == 3).all()
    assert not list(run.glob(".*.tmp"))


def test_ctrl_c_then_resume(tmp_path):
    run = tmp_path / "run"
    proc = start_profile(WORKLOAD, run)
    wait_for_points(run, 8, proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the parent and both spawned ranks get it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "rerun the same command to resume" in err
    assert err.strip().splitlines() == ["lagom-tune: interrupted; rerun the same command to resume"], err  # one line, no rank traceback
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    assert not meta["complete"]
    done_before = meta["points_done"]
    assert pd.read_csv(run / "measurements.csv").point.nunique() == done_before
    r = cli("profile", "--workload", WORKLOAD, "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    assert "profiled" in r.stdout
    # a resume looked like a fresh profile (an audit, 2026-12-07)
    total = yaml.safe_load((run / "meta.yaml").read_text())["points_total"]
    assert f"resuming {run}: {done_before} of {total} points measured before, {total - done_before} to go" in r.stdout, r.stdout
    assert_complete_without_duplicates(run)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_parent_stops_the_ranks_too(tmp_path, sig):
    """SIGTERM (a scheduler's stop) or SIGHUP (a closed terminal) to lagom-tune alone killed it and
    left both spawned ranks running; now it stops them as Ctrl-C does, exits 128 + the signal and
    the profile resumes."""
    run = tmp_path / "run"
    proc = start_profile(WORKLOAD, run)
    wait_for_points(run, 4, proc)
    ranks = rank_pids(proc.pid)
    assert ranks
    proc.send_signal(sig)  # the parent only, not its process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert err.strip().splitlines() == [f"lagom-tune: interrupted by {sig.name}; rerun the same command to resume"], err
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in ranks):
        assert time.time() < deadline, "a rank outlived the profile"
        time.sleep(0.2)
    cli("profile", "--workload", WORKLOAD, "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    assert_complete_without_duplicates(run)


def test_a_killed_rank_ends_the_run_and_a_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    proc = start_profile(WORKLOAD, run)
    wait_for_points(run, 5, proc)
    victim = rank_pids(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1
    # ranks start in order (pids ascending); the survivor's broken connection used to be named instead
    assert "rank 1 died (exit code -9)" in err and "rerun the same command to resume" in err, err
    cli("profile", "--workload", WORKLOAD, "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    assert_complete_without_duplicates(run)


def test_a_hung_rank_ends_the_run_within_the_timeout_naming_it(tmp_path):
    run = tmp_path / "run"
    proc = start_profile(WORKLOAD, run, "--timeout", "5")
    wait_for_points(run, 5, proc)
    pids = rank_pids(proc.pid)
    os.kill(pids[-1], signal.SIGSTOP)  # rank 1 stops answering without dying
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 30
    assert "rank 1 is stopped (SIGSTOP or a debugger)" in err, err  # the tie in progress named rank 0, the lowest


def test_a_measuring_child_is_shielded_from_ctrl_c_its_parent_stops_it():
    """A rank that took Ctrl-C itself printed a traceback after "interrupted" now and then (a second
    Ctrl-C of a burst inside multiprocessing's exit finalizers). Started shielded, it holds SIGINT
    blocked from its first instruction, and the parent's own mask is as it was."""
    import multiprocessing
    from pathlib import Path

    from lagom_tune.backends.parent_watch import start_shielded

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(2,))
    start_shielded(proc)
    try:
        blocked = int(next(ln for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ln.startswith("SigBlk:")).split()[1], 16)
        assert blocked & (1 << (signal.SIGINT - 1)), hex(blocked)
        os.kill(proc.pid, signal.SIGINT)
        proc.join(timeout=30)
        assert proc.exitcode == 0  # slept its two seconds out: the SIGINT never reached it
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        proc.kill()


def test_a_cut_short_csv_is_reported_and_its_points_measured_again(tiny_workload, tmp_path):
    """A partial last line and a point with fewer rows than repeats: `show` says so, the readers
    leave them out, and a resume re-measures them whole (once read as complete: 'points 100 / 100')."""
    run = tmp_path / "run"
    cli("profile", "--workload", tiny_workload, "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    csv = run / "measurements.csv"
    lines = csv.read_text().splitlines(keepends=True)
    victim = lines[1].split(",")[0]  # the first point: keep one of its three rows
    kept = [ln for ln in lines[1:] if ln.split(",")[0] != victim]
    first_row = next(ln for ln in lines[1:] if ln.split(",")[0] == victim)
    csv.write_text(lines[0] + first_row + "".join(kept) + kept[-1][: len(kept[-1]) // 2])  # ends mid-line
    shown = cli("show", run, check=True).stdout
    assert "partial line" in shown and "fewer than 3 repeats" in shown
    import json

    assert len(json.loads(cli("show", run, "--json", check=True).stdout)["problems"]) == 2  # each named once
    cli("profile", "--workload", tiny_workload, "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    assert_complete_without_duplicates(run)
    assert "warning" not in cli("show", run, check=True).stdout


def test_a_measuring_child_ends_when_its_parent_is_killed(tmp_path):
    """A profile killed outright (SIGKILL, the OOM killer) left its gloo ranks running for minutes,
    holding the cores its rerun then measured on. Its children now end with it."""
    import sys
    from pathlib import Path

    child = ("import os, sys, time; from lagom_tune.backends.parent_watch import exit_with_parent; exit_with_parent(int(sys.argv[1]), 0.1); "
             "print(os.getpid(), flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", f"import os, subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(parent.stdout.readline())

    def alive() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    assert alive()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(), "the child outlived its killed parent"
    # a parent dead before the child's watch starts (it imports torch first): the pid it was given is gone
    late = subprocess.run([sys.executable, "-c", child, "999999999"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert late.returncode == 1, late


def test_a_resume_never_deletes_every_row_when_meta_yaml_says_more_repeats(tiny_run, tmp_path):
    """meta.yaml's repeats edited from 3 to 4: every point read as short, and the resume rewrote
    measurements.csv with its complete points (none): 152 measured rows deleted."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    meta = run / "meta.yaml"
    meta.write_text(meta.read_text().replace("\nrepeats: 3\n", "\nrepeats: 4\n"))
    before = (run / "measurements.csv").read_bytes()
    r = cli("profile", "--workload", tiny_run.parent / "tiny.yaml", "--backend", "gloo", "--ranks", 2, "--out", run,
            "--repeats", 4)
    assert r.returncode == 2 and "has the 4 repeats meta.yaml says" in r.stderr, r.stderr
    assert (run / "measurements.csv").read_bytes() == before


def test_a_resume_refuses_rows_of_points_this_profile_does_not_measure(tiny_run, tmp_path):
    """Another run's measurements.csv (collectives keyed at 3 ranks) beside this run's meta.yaml:
    the resume measured every planned point too, and the fit mixed both sets (collective MAPE
    3.6% -> 5.7%)."""
    import shutil

    import pandas as pd

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    df = pd.read_csv(run / "measurements.csv", low_memory=False)
    other = df[df["kind"] == "collective"].copy()
    other["point"] = other["point"].str.replace(r"^(collective\|\w+:\d+):2\|", r"\1:3|", regex=True)
    other["ranks"] = 3
    assert other["point"].str.contains(":3|", regex=False).all()
    pd.concat([df, other]).to_csv(run / "measurements.csv", index=False)
    with open(run / "measurements.csv", "a") as f:  # and a cut line: refused before the rewrite that drops it
        f.write((run / "measurements.csv").read_text().splitlines()[1][:40])
    before = (run / "measurements.csv").read_bytes()
    r = cli("profile", "--workload", tiny_run.parent / "tiny.yaml", "--ranks", 2, "--repeats", 3, "--out", run)
    assert r.returncode == 2 and "point(s) this profile does not measure" in r.stderr, r.stderr
    assert (run / "measurements.csv").read_bytes() == before


def test_a_folder_of_another_workload_names_what_it_holds(tmp_path):
    """`profile --out` into another workload's folder said "another workload or backend" without
    saying which (an audit, 2026-12-04); it names both."""
    for name in ("first", "second"):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: {name}\ngroups:\n- name: layer\n  compute:\n  - {{name: g, m: 1024, n: 1024, k: 1024, dtype: bf16}}\n"
            "  comm:\n  - {name: ar, op: all_reduce, nbytes: 1000000, ranks: 8}\n" + ("  repeat: 2\n" if name == "second" else ""))
    cli("profile", "--backend", "sim", "--workload", tmp_path / "first.yaml", "--out", tmp_path / "run", check=True)
    assert_one_line_error(cli("profile", "--backend", "sim", "--workload", tmp_path / "second.yaml", "--out", tmp_path / "run"),
                          "holds a profile of workload 'first' on the sim backend, not of 'second' on sim")
    # the same name of another shape said "holds a profile of 'x' ... not of 'x'": it names what differs
    (tmp_path / "first.yaml").write_text((tmp_path / "second.yaml").read_text().replace("second", "first"))
    assert_one_line_error(cli("profile", "--backend", "sim", "--workload", tmp_path / "first.yaml", "--out", tmp_path / "run"),
                          "holds a profile of 'first' on sim of another shape (other GEMMs or collectives: the workload changed since)")


def test_a_stop_signal_waits_for_the_block_that_writes_rows(monkeypatch):
    """What stops_deferred holds back is raised once the block ends, not in the middle of it, also
    when another thread (torch's, a queue's) is the one the signal is delivered to."""
    monkeypatch.setattr(errors, "_received", [])  # the stop noted here is no later test's
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)}
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after: raise_on_stop_signals wraps it
    other = threading.Thread(target=time.sleep, args=(0.5,))  # SIGTERM unblocked there too
    try:
        raise_on_stop_signals()
        other.start()
        ran = []
        with pytest.raises(Interrupted):
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                ran.append("the rest of the block")
        assert ran == ["the rest of the block"]
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        other.join()


STOP_IN_A_FINALIZER = """
import signal, time
from lagom_tune.errors import raise_on_stop_signals

class Collected:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)
        sum(range(1000))  # the handler runs here, inside __del__, where its KeyboardInterrupt cannot go on

raise_on_stop_signals()
try:
    Collected()
    time.sleep(30)  # the work a profile goes on with
    print("lost")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_stop_raised_inside_a_finalizer_is_raised_again_after_it():
    """The burst of Ctrl-Cs below once printed "Exception ignored in: <Finalize object, dead> ...
    KeyboardInterrupt": the first Ctrl-C landed while a multiprocessing queue was closed as it was
    collected, where Python prints an exception and drops it."""
    r = subprocess.run([sys.executable, "-c", STOP_IN_A_FINALIZER], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "interrupted" and not r.stderr, (r.stdout, r.stderr)


def test_a_burst_of_ctrl_cs_keeps_every_point_meta_yaml_counts(tmp_path):
    """A burst of Ctrl-Cs cut the last write short: 43 points shown measured, 14 kept, or meta.yaml
    behind the CSV, and now and then a traceback from an atexit callback."""
    run = tmp_path / "run"
    proc = start_profile(WORKLOAD, run)
    wait_for_points(run, 8, proc)
    for _ in range(6):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err  # a last one may land as it exits
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    df = pd.read_csv(run / "measurements.csv")
    assert meta["points_done"] == df.point.nunique() >= 8 and (df.groupby("point").size() == 3).all()
