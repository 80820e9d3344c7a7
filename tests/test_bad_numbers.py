"""Numbers on the command line are checked before any work starts: exit 2, one line, nothing written."""

from pathlib import Path

import pandas as pd
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
    ("profile", "--backend", "sim", "--noise", "nan", "--out", "OUT/run"),
    ("profile", "--timeout", "-1", "--out", "OUT/run"),
    ("profile", "--timeout", "inf", "--out", "OUT/run"),  # spawned ranks, then an OverflowError in one
    ("profile", "--repeats", "99999999999999999999999", "--out", "OUT/run"),  # ran on, recorded in meta.yaml
    ("profile", "--backend", "sim", "--out", "OUT"),  # a folder with other files: `--out ""` profiled into the working folder
    ("workload", "import", "OUT/t.json", "--out", "OUT/t.json"),  # replaced the trace it reads
    ("workload", "import", "OUT/t.json", "--ranks", "100000000000", "--out", "OUT/w.yaml"),  # blamed the trace
    ("workload", "import", "OUT/inf.json", "--out", "OUT/w.yaml"),  # each number finite, their sum not: every time inf
    ("workload", "import", "OUT/long.json", "--out", "OUT/w.yaml"),  # a 6e11 ms step: written, then refused by its loader
    ("workload", "import", "OUT/t.json", "--name", "   ", "--out", "OUT/w.yaml"),  # ditto
    ("workload", "import", "OUT/t.json", "--name", "", "--out", "OUT/w.yaml"),  # silently named after the file
    ("workload", "show", "llama3-8b", "--mbs", "1" + "0" * 300),  # internal error: OverflowError
    ("workload", "show", "OUT/huge.yaml"),  # a 400-digit m: "int too large to convert to float"
    ("search", "OUT/t.json", "--out", "OUT/plan.yaml"),  # "run folder not found" for a file that is there
    ("profile", "--backend", "sim", "--seed", "-5", "--out", "OUT/run"),  # measured all, then unreadable
    ("profile", "--out", "/proc/lagom-run"),
    ("search", "RUN", "--n-trials", "-5", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--timeout", "-1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--min-gain", "-0.1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--min-gain", "nan", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--optimizer", "optuna", "--timeout", "inf", "--out", "OUT/plan.yaml"),  # taken as no budget
    ("search", "RUN", "--optimizer", "optuna", "--seed", "8589934592", "--out", "OUT/plan.yaml"),  # blamed "the Optuna storage None"
    ("search", "RUN", "--validate", "-1", "--out", "OUT/plan.yaml"),
    ("search", "RUN", "--validate", "100000000000000000000", "--out", "OUT/plan.yaml"),  # ran until killed
    ("search", "RUN", "--out", "/proc/p.yaml"),
]


TRACE = ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 100, "args": {"Input Dims": [[64, 64], [64, 64]], '
         '"Input type": ["float", "float"]}}, {"ph": "X", "name": "gloo:all_reduce", "ts": 10, "dur": 50, '
         '"args": {"Input Dims": [[1024]], "Input type": ["float"]}}]}')


def snapshot(*folders):
    return {p: p.stat().st_mtime_ns for f in folders for p in f.rglob("*")}


@pytest.mark.parametrize("args", BAD, ids=lambda a: " ".join(a))
def test_bad_numbers_exit_2_with_one_line_and_write_nothing(args, request, tmp_path):
    run = request.getfixturevalue("tiny_run") if "RUN" in args else tmp_path  # profile only where a run is read
    (tmp_path / "t.json").write_text(TRACE)  # an input the command must not replace, in the folder OUT names
    (tmp_path / "inf.json").write_text(TRACE.replace('"ts": 0, "dur": 100', '"ts": 1.7e308, "dur": 1.7e308'))
    (tmp_path / "long.json").write_text(TRACE.replace('"ts": 10, "dur": 50', '"ts": 1e15, "dur": 50'))
    (tmp_path / "huge.yaml").write_text("name: w\ngroups: [{name: g, compute: [{name: mm, m: 1" + "0" * 400 + ", n: 8, k: 8}]}]\n")
    argv = [str(run) if a == "RUN" else a.replace("OUT", str(tmp_path)) for a in args]
    before = snapshot(tmp_path, run, ROOT / "plans")
    r = cli(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lagom-tune: error:") and "Traceback" not in r.stderr, r.stderr
    assert snapshot(tmp_path, run, ROOT / "plans") == before


@pytest.mark.parametrize("args, said", [
    (("profile", "--backend", "sim", "--noise", "nan"), "'--noise': expected a finite number, got 'nan'"),  # said "at most 0.5"
    (("profile", "--timeout", "1e400"), "'--timeout': expected a finite number"),
    (("profile", "--backend", "sim", "--noise", "0.6"), "'--noise': expected a number at least 0 and at most 0.5, got 0.6"),
    (("search", "RUN", "--min-gain", "1"), "'--min-gain': expected a number at least 0 and below 1, got 1"),
    (("search", "RUN", "--timeout", "x"), "'--timeout': expected a number, got 'x'"),
])
def test_a_bad_float_option_is_named_with_what_it_takes(args, said, tmp_path):
    r = cli(*[str(tmp_path / "missing") if a == "RUN" else a for a in args], "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("time_us", ["inf", "nan", "-5", "0"])
def test_a_time_in_measurements_csv_that_is_no_time_is_refused(tiny_run, tmp_path, time_us):
    """A hand-edited or corrupted time reached the fit: inf was written into model.yaml (which
    search then refused), and NaN, negative and zero times were fitted without a word."""
    import shutil

    import pandas as pd

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    df = pd.read_csv(run / "measurements.csv")
    df.loc[3, "time_us"] = float(time_us)
    df.to_csv(run / "measurements.csv", index=False)
    before = snapshot(run)
    r = cli("fit", run)
    assert r.returncode == 2 and "not a positive time" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(run) == before


@pytest.mark.parametrize("edit, said", [
    (lambda df: df.assign(m=df["m"].where(df["kind"] != "gemm", -64)), "m of point gemm|"),
    (lambda df: df.assign(nbytes=df["nbytes"].where(df["kind"] != "collective", 0.5)), "not a count of at least 1"),
    (lambda df: df.assign(nbytes=df["nbytes"].where(df["kind"] != "collective", float("inf"))), "is inf, not a count"),  # 1e400: OverflowError
    (lambda df: pd.concat([df, df.iloc[[0]]]), "appears twice"),
    (lambda df: df.assign(chunk_bytes=df["chunk_bytes"].where(df["kind"] != "collective", 12345)), "not one of the gloo backend's"),
    (lambda df: df.assign(window_us=df["window_us"].where(df["kind"] != "overlap", df["time_us"] / 2)), "before one of its streams ended"),
    # each passed the checks above, then was fitted or failed the fit with an internal error
    (lambda df: df.assign(op=df["op"].where(df["kind"] != "collective", "All_to_all")), "not one of the workload's all_reduce"),
    (lambda df: df.assign(chunk_bytes=df["chunk_bytes"].where(df.index % 7 != 3)), "chunk_bytes of point"),
    (lambda df: df.drop(columns=["chunk_bytes"]), "column 'chunk_bytes' is missing"),
    (lambda df: df.assign(comm_us=df["comm_us"].where(df["kind"] != "overlap")), "has no comm_us"),
    (lambda df: df.drop(columns=["window_us"]), "has no window_us"),
    (lambda df: df.assign(repeat=df["repeat"].where(df.index != 4, -1)), "is -1, not a repeat index"),
    (lambda df: df.assign(kind=df["kind"].where(df.index != 4, "bogus")), "is 'bogus', not one of gemm, collective, overlap"),
    # rows that contradict their point's key or their run, each fitted as written (gemm MAPE 22% -> 4498%)
    (lambda df: df.assign(m=df["m"].where(df["point"] != df["point"].iloc[0], 99999)), "m is 99999.0, but its shape"),
    (lambda df: df.assign(dtype=df["dtype"].where(df["kind"] != "gemm", "bogus")), "dtype is bogus, but its shape"),  # KeyError in fit
    (lambda df: df.assign(backend="sim", simulated=True), "backend of point"),
    (lambda df: pd.concat([df, df[df["point"] == df["point"].iloc[0]].assign(repeat=lambda x: x["repeat"] + 7)]),
     "but the profile takes"),
    (lambda df: df.assign(nbytes=df["nbytes"].where(df["kind"] != "collective", 1)), "are not the collective its key names"),
    (lambda df: df.assign(m=df["m"].where(df.index != 3, 5)), "disagree on m"),
    # a column deleted in a spreadsheet: show passed it, fit raised KeyError 'n_compute' (an audit, 2026-12-03)
    (lambda df: df.drop(columns=["n_compute"]), "missing column(s) n_compute, which its overlap rows need"),
    (lambda df: df.drop(columns=["gemm", "m"]), "missing column(s) gemm, m, which its"),
])
def test_a_shape_or_repeat_in_measurements_csv_that_cannot_be_is_refused(tiny_run, tmp_path, edit, said):
    """A negative GEMM dimension, a fraction of a byte and a repeat written twice were fitted
    (a MAPE of 78,305,862% was written to model.yaml); so were a collective at a knob value the
    backend does not have (fitted as a setting of its own) and an overlapped window that ended
    before one of its streams."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    edit(pd.read_csv(run / "measurements.csv")).to_csv(run / "measurements.csv", index=False)
    before = snapshot(run)
    r = cli("fit", run)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(run) == before


def test_an_output_that_is_a_fifo_or_a_device_is_refused(tiny_run, tmp_path):
    """`report --out /dev/null` (as root) replaced the device with a file, and `search --out FIFO`
    a named pipe: the rename of the written file went over whatever was there."""
    import os

    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    for args in (("search", tiny_run, "--out", fifo), ("report", tiny_run, "--out", fifo), ("report", tiny_run, "--out", "/dev/null")):
        r = cli(*args)
        assert r.returncode == 2 and "is not a regular file" in r.stderr, r.stderr
    assert fifo.is_fifo() and Path("/dev/null").is_char_device()
