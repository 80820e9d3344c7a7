"""The k-fold fits side by side in worker processes: the same models as one process fits, and a
Ctrl-C or a killed worker ends the fit as cleanly as one process's would."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from conftest import BIN, ROOT
from lagom_tune.errors import UserError
from lagom_tune.model.fit import _fit, fit_device
from lagom_tune.model.fit_workers import run_each
from lagom_tune.model.rows import point_medians

H200_RUN = ROOT / "tests" / "data" / "h200-2026-11-30" / "mpt-7b-tp8-dp1"
DEVICE = fit_device(yaml.safe_load((H200_RUN / "meta.yaml").read_text())["fingerprint"])


def test_a_process_per_call_once_the_first_call_is_slow_enough():
    here = os.getpid()
    assert run_each(os.getpid, [()] * 3, workers=2, worth_s=float("inf")) == [here] * 3
    pids = run_each(os.getpid, [()] * 3, workers=2, worth_s=0)
    assert pids[0] == here and set(pids) - {here}, pids  # the first here; one of the others in a spawned helper
    assert run_each(os.getpid, [()] * 3, workers=1, worth_s=0) == [here] * 3


def test_fits_in_workers_are_the_fits_made_here_and_a_refused_fit_is_a_result():
    pts = point_medians(pd.read_csv(H200_RUN / "measurements.csv"))
    pts = pts[pts["gemm"].isna() | pts["gemm"].isin(sorted(pts["gemm"].dropna().unique())[:2])]  # two shapes: seconds a fit
    refused = (pts[pts["kind"] != "gemm"], DEVICE, False, False)
    # the first call here, the next two to the helpers, the last here again
    calls = [refused, (pts, DEVICE, False, False), refused, (pts, DEVICE, False, True)]
    with np.errstate(all="ignore"):
        apart = run_each(_fit, calls, workers=3, worth_s=0)
        here = [_fit(*calls[1]).to_dict(), _fit(*calls[3]).to_dict()]
    assert all(isinstance(apart[i], UserError) and "no GEMM" in str(apart[i]) for i in (0, 2))
    assert [apart[1].to_dict(), apart[3].to_dict()] == here


def _workers_of(pid: int) -> list[int]:
    """The spawned fitting workers among ``pid``'s children (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError):  # a process that ended meanwhile
            continue
    return found


def _fit_until_workers(tmp_path: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """``lagom-tune fit`` on a copy of a real H200 profile (fits of seconds each: they go to
    workers), once its workers are fitting."""
    run = tmp_path / "run"
    shutil.copytree(H200_RUN, run)
    # on two cores, as CI has: with a core per fold (a GPU host has 16) the folds could end within
    # the seconds this waits for the workers to be at work
    two = set(sorted(os.sched_getaffinity(0))[:2])
    proc = subprocess.Popen([str(BIN / "lagom-tune"), "fit", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, two))
    deadline = time.time() + 120
    while not (workers := _workers_of(proc.pid)):
        assert proc.poll() is None and time.time() < deadline, "the fit started no worker"
        time.sleep(0.1)
    time.sleep(3)  # past their import of torch: at work on a fold
    return proc, run, workers


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_stops_the_workers_with_one_line_and_writes_no_model(tmp_path):
    proc, run, workers = _fit_until_workers(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group, the workers too
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and len(err.strip().splitlines()) == 1 and "interrupted" in err, (proc.returncode, err)
    assert _gone(workers), "a worker outlived the fit"
    assert not (run / "model.yaml").exists()


def test_a_killed_worker_ends_the_fit_with_the_reason_and_writes_no_model(tmp_path):
    proc, run, workers = _fit_until_workers(tmp_path)
    os.kill(workers[0], signal.SIGKILL)  # as the out-of-memory killer would
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "ended without its result" in err and "Traceback" not in err, (proc.returncode, err)
    assert _gone(workers), "a worker outlived the fit"
    assert not (run / "model.yaml").exists()
