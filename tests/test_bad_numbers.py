"""Numbers on the command line are checked before any work starts: exit 2, one line, nothing written."""

import pytest

from conftest import ROOT, cli

BAD = [
    ("workload", "show", "llama3-8b", "--seq", "-5"),
    ("workload", "show", "llama3-8b", "--mbs", "0"),
    ("profile", "--seq", "-5", "--out", "OUT/run"),
    ("profile", "--mbs", "-1", "--out", "OUT/run"),
    ("profile", "--mbs", "0", "--out", "OUT/run"),
    ("profile", "--ranks", "0", "--out", "OUT/run"),
    ("profile", "--repeats", "0", "--out", "OUT/run"),
    ("profile", "--backend", "sim", "--noise", "-0.5", "--out", "OUT/run"),
    ("profile", "--timeout", "-1", "--out", "OUT/run"),
    ("profile", "--out", "/proc/lagom-run"),
    ("search", "RUN", "--n-trials", "-5", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--timeout", "-1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--min-gain", "-0.1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--validate", "-1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--out", "/proc/p.yaml"),
]


def snapshot(*folders):
    return {p: p.stat().st_mtime_ns for f in folders for p in f.rglob("*")}


@pytest.mark.parametrize("args", BAD, ids=lambda a: " ".join(a))
def test_bad_numbers_exit_2_with_one_line_and_write_nothing(args, request, tmp_path):
    run = request.getfixturevalue("tiny_run") if "RUN" in args else tmp_path  # profile only where a run is read
    argv = [str(run) if a == "RUN" else a.replace("OUT", str(tmp_path)) for a in args]
    before = snapshot(tmp_path, run, ROOT / "plans")
    r = cli(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lagom-tune: error:") and "Traceback" not in r.stderr, r.stderr
    assert snapshot(tmp_path, run, ROOT / "plans") == before
