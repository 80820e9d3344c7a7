"""The measurement row's schema (lagom_tune/measurements.py) against rows that real runs wrote: a
short sim profile, the gloo profile of the tiny workload, and the H200 profiles in tests/data."""

import shutil
from pathlib import Path

import pandas as pd
import pytest

from lagom_tune import measurements as m
from lagom_tune.errors import UserError
from lagom_tune.profile.store import RunFolder, row_settings
from lagom_tune.workload.spec import Gemm

from conftest import cli

H200 = sorted((Path(__file__).parent / "data" / "h200-2026-11-30").glob("*/measurements.csv"))
GROUPS = (m.IDENTITY_COLUMNS, m.GEMM_COLUMNS, m.COLLECTIVE_COLUMNS, m.KNOB_COLUMNS, m.LAYOUT_COLUMNS, m.RESULT_COLUMNS,
          m.BANDWIDTH_COLUMNS, m.CHOSEN_COLUMNS)


@pytest.fixture(scope="module")
def sim_csv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("schema") / "run"
    cli("profile", "--backend", "sim", "--workload", "olmoe-1b-7b-ep8", "--out", out, "--repeats", 1, check=True)
    return out / "measurements.csv"


def check_against_schema(csv: Path) -> pd.DataFrame:
    """Every column of ``csv`` is in the schema, the required ones are there, and the numeric ones read as numbers."""
    df = pd.read_csv(csv)
    assert [c for c in df.columns if c not in m.COLUMNS] == [], csv
    assert set(m.REQUIRED_COLUMNS) <= set(df.columns) and set(m.IDENTITY_COLUMNS) <= set(df.columns)
    assert [c for c in df.columns if c in m.NUMERIC_COLUMNS and not pd.api.types.is_numeric_dtype(df[c])] == [], csv
    return df


def test_the_groups_name_each_column_once():
    every = [c for group in GROUPS for c in group]
    assert len(every) == len(set(every)) and tuple(every) == m.COLUMNS
    assert set(m.REQUIRED_COLUMNS) <= set(m.COLUMNS) and set(m.TEXT_COLUMNS) <= set(m.COLUMNS)
    assert set(m.TIMED_COLUMNS) == set(m.OVERLAPPED_COLUMNS) | set(m.ALONE_COLUMNS) and set(m.TIMED_COLUMNS) <= set(m.RESULT_COLUMNS)
    assert not set(m.NUMERIC_COLUMNS) & set(m.TEXT_COLUMNS)


def test_the_builders_fill_their_groups_in_order():
    g = Gemm("g", 64, 128, 256, "bf16", batch=2)
    assert tuple(m.identity_columns("p", "gemm", "sim", True)) == m.IDENTITY_COLUMNS
    assert m.gemm_columns(g) == dict(zip(m.GEMM_COLUMNS, (g.shape_key, 64, 128, 256, 2, "bf16", g.flops)))
    assert tuple(m.collective_columns("all_reduce", 1024, 8)) == m.COLLECTIVE_COLUMNS
    assert m.timed_columns(5.0) == {"time_us": 5.0} and list(m.timed_columns(5.0, 3, "graph")) == ["time_us", "inner", "timing"]
    over = m.overlap_columns(10.0, 12.0, 4, 8.0, 9.0)
    assert set(over) <= set(m.RESULT_COLUMNS) and set(m.TIMED_COLUMNS) <= set(over) and over["window_us"] == 12.0


def test_a_sim_profile_writes_the_schema(sim_csv):
    df = check_against_schema(sim_csv)
    # The simulator's column order (first appearance: GEMM, collective, nothing-set since 2026-12-05, overlapped rows).
    assert list(df.columns) == [*m.IDENTITY_COLUMNS, *m.GEMM_COLUMNS, "time_us", "repeat", *m.COLLECTIVE_COLUMNS,
                                "algo", "proto", "channels", "threads", "buffsize", "nodes", *m.BANDWIDTH_COLUMNS,
                                *m.CHOSEN_COLUMNS, "comm_us", "window_us", *m.ALONE_COLUMNS, "n_compute", "baseline"]
    over = df[df["kind"] == "overlap"]
    assert over[list(m.TIMED_COLUMNS)].notna().all().all() and (over["baseline"] == m.PAIRED).all()
    assert df["simulated"].all() and (df["backend"] == "sim").all()
    assert_whole_numbers_written_whole(sim_csv)


def test_a_gloo_profile_writes_the_schema(tiny_run):
    df = check_against_schema(tiny_run / "measurements.csv")
    assert list(df.columns) == [*m.IDENTITY_COLUMNS, *m.GEMM_COLUMNS, "threads", "time_us", "inner", "repeat",
                                *m.COLLECTIVE_COLUMNS, "chunk_bytes", *m.BANDWIDTH_COLUMNS, "comm_us", "window_us",
                                "n_compute", *m.ALONE_COLUMNS, "baseline"]
    assert not df["simulated"].any() and (df["backend"] == "gloo").all()
    assert_whole_numbers_written_whole(tiny_run / "measurements.csv")
    # its alone times are measured right before each pair too: without the mark the GPU fit's
    # rebaselining took gloo's pairs for legacy rows, and slowdown.png plotted other slowdowns
    assert (df[df["kind"] == "overlap"]["baseline"] == m.PAIRED).all()


@pytest.mark.parametrize("csv", H200, ids=lambda p: p.parent.name)
def test_the_h200_profiles_hold_only_schema_columns(csv):
    df = check_against_schema(csv)
    # every column but the gloo knob, and NCCL's own choices (profiles before 2026-12-05 timed none)
    assert set(m.COLUMNS) - set(df.columns) == {"chunk_bytes", *m.CHOSEN_COLUMNS}
    settings = row_settings(df[df["kind"] == "overlap"].iloc[0])
    assert set(settings) == {"algo", "proto", "channels", "threads", "buffsize"}  # the knob columns an NCCL row fills


def test_the_run_folder_reads_numeric_columns_as_numbers(sim_csv):
    df = RunFolder(sim_csv.parent).measurements()
    assert all(pd.api.types.is_numeric_dtype(df[c]) for c in m.NUMERIC_COLUMNS if c in df.columns)


def test_a_meta_yaml_without_its_simulated_flag_reads_as_its_backend_says(sim_csv, tmp_path):
    """Without the flag, show dropped every SIMULATED label and search wrote a plan marked
    measured, which then failed to load."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(sim_csv.parent, run)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    del meta["simulated"]
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    assert RunFolder(run).read_meta()["simulated"] is True


def test_a_folder_holding_only_dot_files_is_profiled_into(tmp_path):
    """A profile killed while it wrote meta.yaml leaves the lock and a temp file: the rerun was
    refused as "a folder with other files"."""
    from lagom_tune.errors import UserError

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").touch()
    (out / ".meta.yaml.abc.tmp").touch()
    RunFolder(out).lock()()  # taken and released
    (out / "notes.txt").touch()
    with pytest.raises(UserError, match="holds other files and no profile"):
        RunFolder(out).lock()


def test_a_lock_that_is_no_regular_file_is_refused_as_such(tmp_path):
    """A folder named .lock ended a profile with exit 1 and "rerun the same command to resume",
    which could never help (an auditor's run)."""
    from lagom_tune.errors import UserError

    out = tmp_path / "run"
    (out / ".lock").mkdir(parents=True)
    with pytest.raises(UserError, match="lock must be one"):
        RunFolder(out).lock()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["fingerprint"].update(sms=0), "fingerprint.sms: must be >= 1"),  # fit divided by it
    (lambda m: m["fingerprint"].update(backend="foo"), "unknown backend 'foo'"),  # fit: ValueError
    (lambda m: m.update(simulated=False), "simulated: False, but the sim backend simulates"),  # labels dropped, plan applied
    (lambda m: m.update(repeats=0), "repeats: must be >= 1"),
    (lambda m: m.update(complete="false"), "complete: expected bool"),  # search planned from it
    (lambda m: m.update(points_done=m["points_total"] + 1), "more than points_total"),
    (lambda m: m["workload"]["groups"][0].update(repeat=99), "not the one profiled"),
])
def test_a_hand_edited_meta_yaml_is_refused(sim_csv, tmp_path, edit, message):
    """Each was accepted by show, fit and search (or crashed them)."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(sim_csv.parent, run)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    edit(meta)
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    for verb in ("show", "fit"):
        r = cli(verb, run)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (verb, r.stderr)
        assert message in r.stderr, r.stderr


def test_rows_are_appended_and_a_file_that_cannot_take_an_append_is_rewritten(tmp_path):
    """A profile flushes once a second; each flush rewrote the whole CSV (1.3 s at 19k rows on
    this VM, longer than the flush interval). New rows are now appended, unless a new column or a
    cut-short last line needs the whole file rewritten, and either way the file reads the same."""
    run = RunFolder(tmp_path)

    def rows(point, kind, **extra):
        shape = {"gemm": {"gemm": point, "n": 64, "k": 64, "batch": 1, "dtype": "fp32"}, "collective": {"ranks": 2}}[kind]
        return [{"point": point, "kind": kind, "repeat": r, "time_us": 10.0 + r, **shape, **extra} for r in range(2)]

    run.append_rows(rows("g1", "gemm", m=64))
    before = run.csv_path.stat().st_ino
    run.append_rows(rows("g2", "gemm", m=128))
    assert run.csv_path.stat().st_ino == before  # appended in place
    run.append_rows(rows("c1", "collective", op="all_reduce", nbytes=1024))  # new columns: rewritten
    assert run.csv_path.stat().st_ino != before
    with open(run.csv_path, "a") as f:
        f.write("c2,collective,0,11")  # a writer killed mid-line
    run.append_rows(rows("g3", "gemm", m=256))
    df = run.measurements()
    assert list(df["point"]) == ["g1", "g1", "g2", "g2", "c1", "c1", "g3", "g3"] and run.health().ok
    assert list(df["m"].iloc[[0, 2, 6]]) == [64, 128, 256] and df["nbytes"].iloc[4] == 1024
    run.append_rows(rows("g4", "gemm", m=512) + rows("c3", "collective", op="all_reduce", nbytes=2048))  # one flush, both kinds
    assert_whole_numbers_written_whole(run.csv_path)


def assert_whole_numbers_written_whole(csv: Path) -> None:
    """Counts and settings read "4096", never "4096.0", in every row, whichever rows shared a flush."""
    text = pd.read_csv(csv, dtype=str)
    cells = text[[c for c in m.WHOLE_COLUMNS if c in text.columns]].stack()
    assert not cells.empty and not cells.str.contains(".", regex=False).any(), cells[cells.str.contains(".", regex=False)].head()


def test_meta_yaml_is_the_same_text_with_its_workload_dumped_once(tmp_path):
    """meta.yaml is rewritten every flush; its workload section (16 s to dump for a 30,000-group
    trace) is dumped once per workload and joined to the rest, the same text as one dump."""
    from lagom_tune.yaml_io import yaml_text
    from lagom_tune.workload.presets import build_preset

    run, w = RunFolder(tmp_path), build_preset("olmoe-1b-7b-ep8")
    for done in (1, 2):
        meta = {"points_done": done, "workload_digest": w.digest, "workload": w.to_dict()}
        run.write_meta(meta)
        assert run.meta_path.read_text() == yaml_text({"schema_version": 1, "kind": "lagom-profile", **meta})
    other = build_preset("cpu-demo")
    run.write_meta({"workload_digest": other.digest, "workload": other.to_dict()})
    import yaml

    assert yaml.safe_load(run.meta_path.read_text())["workload"]["name"] == "cpu-demo"  # a new workload is dumped anew


def test_two_csvs_joined_or_a_word_among_numbers_is_named_where_it_is(sim_csv, tmp_path):
    """Two profiles' files joined (a header repeated mid-file) read as "column 'm' holds non-numeric
    values", with nothing to say where or why."""
    run = tmp_path / "run"
    shutil.copytree(sim_csv.parent, run)
    lines = (run / "measurements.csv").read_text().splitlines(keepends=True)
    (run / "measurements.csv").write_text("".join(lines[:11] + lines[:1] + lines[11:]))
    with pytest.raises(UserError, match=r"row 11 after the header repeats the header \(two files joined\?\); keep the first"):
        RunFolder(run).measurements()
    header = lines[0].rstrip("\n").split(",")
    cells = lines[5].rstrip("\n").split(",")
    cells[header.index("time_us")] = "fast"
    lines[5] = ",".join(cells) + "\n"
    (run / "measurements.csv").write_text("".join(lines))
    with pytest.raises(UserError, match=r"column 'time_us' holds non-numeric values \('fast', row 5 after the header\)"):
        RunFolder(run).measurements()
