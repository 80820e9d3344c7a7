import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings


from lagom_tune import errors
from lagom_tune.workload.presets import Arch, gpt_ddp

# The fuzz tests draw the same examples on every run (a gate must not fail by the luck of the draw);
# HYPOTHESIS_PROFILE=explore draws new ones, to look for defects the fixed draw does not reach.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# A simulated H100 plan with tuner rules (tree/LL128 and ring/Simple at 64 channels), kept as it was
# written on 2026-12-03: the committed plans change with the simulator (this one now keeps NVLS).
RULES_PLAN = ROOT / "tests" / "data" / "plan-sim-h100-with-rules.yaml"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The tuner plugin is built into $XDG_CACHE_HOME/lagom-tune: tests build into a folder of their own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="lagom-tests-cache-")

# A model small enough that a 2-rank profile and a training run take seconds; TINY_ARGS builds
# the same model in examples/train_gpt.py.
TINY = Arch("tiny-test", hidden=64, ffn=256, heads=2, layers=2, vocab=512, max_seq=32)
TINY_ARGS = ["--hidden", "64", "--ffn", "256", "--heads", "2", "--layers", "2", "--vocab", "512",
             "--max-seq", "32", "--seq", "32", "--mbs", "2"]


@pytest.fixture(autouse=True)
def no_rank_pid_leak(monkeypatch):
    """A shim installed in this process with RANK set marks this process as a rank for its children
    (LAGOM_TUNE_RANK_PID): each test starts and ends without it, so no later subprocess takes
    itself for a rank's helper."""
    monkeypatch.setenv("LAGOM_TUNE_RANK_PID", "")  # records what to restore (delenv of an unset one records nothing)
    monkeypatch.delenv("LAGOM_TUNE_RANK_PID")


@pytest.fixture(autouse=True)
def stops_raise_again(monkeypatch):
    """A CLI run in this process that reported an interrupt says the process is stopping
    (errors.stopping): further Ctrl-Cs are then only noted; each test starts and ends with them
    raising, so the suite itself can still be stopped."""
    monkeypatch.setattr(errors, "_stops", {"stopping": False, "depth": 0, "pending": None})


@pytest.fixture
def tiny_workload(tmp_path):
    path = tmp_path / "tiny.yaml"
    gpt_ddp(TINY, seq=32, mbs=2, ranks=2).save(path)
    return path


def cli(*args: str, check: bool = False, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed `lagom-tune` like a user would."""
    proc = subprocess.run([str(BIN / "lagom-tune"), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"lagom-tune {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One real 2-rank gloo profile of the tiny workload, fitted, shared by the tests that read it."""
    base = tmp_path_factory.mktemp("tiny-run")
    wl = base / "tiny.yaml"
    gpt_ddp(TINY, seq=32, mbs=2, ranks=2).save(wl)
    run = base / "run"
    cli("profile", "--workload", wl, "--backend", "gloo", "--ranks", 2, "--out", run, "--repeats", 3, check=True)
    return run
