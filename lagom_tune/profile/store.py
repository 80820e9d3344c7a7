"""The run folder: ``meta.yaml`` (fingerprint, workload, progress), ``measurements.csv``, ``model.yaml``.

Every write is atomic, so an interrupted profile leaves a valid folder that a rerun resumes.
"""

from __future__ import annotations

import fcntl
import io
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd

from lagom_tune import validate as v
from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.base import MAX_NOISE
from lagom_tune.backends.registry import backend_info, backend_names
from lagom_tune.errors import UserError, interrupts_kept
from lagom_tune.knobs import KnobSpace
from lagom_tune.measurements import (
    COUNT_COLUMNS, DEFAULT, DESCRIBING_COLUMNS, KIND_COLUMNS, KNOB_COLUMNS, NUMERIC_COLUMNS, OVERLAPPED_COLUMNS, REQUIRED_COLUMNS,
    MAX_TIME_US, ROW_KINDS, SETTING_COLUMNS, TIMED_COLUMNS, WHOLE_COLUMNS, again_key,
)
from lagom_tune.workload.spec import Workload, gemm_of_key
from lagom_tune.yaml_io import read_yaml, yaml_text

SCHEMA_VERSION = 1


def row_settings(row: Mapping[str, Any]) -> dict:
    """The knob settings a measurement row was taken at (integers as integers).

    Args:
        row: one row of ``measurements.csv``.
    Returns:
        Knob name -> value, for the knob columns the row fills.
    """
    out = {}
    for k in KNOB_COLUMNS:
        if k in row and not pd.isna(row[k]):
            out[k] = row[k] if isinstance(row[k], str) else int(row[k])
    return out


# The fingerprint's numbers, where a backend records them (a hand-edited meta.yaml is checked on
# load), and the least each may be: counts and sizes are positive (fit divides by them).
FINGERPRINT_NUMBERS = {"ranks": (int, 1), "nodes": (int, 1), "gpus_per_node": (int, 1), "sms": (int, 1), "cores": (int, 1),
                       "seed": (int, 0), "max_channels": (int, 1), "default_channels": (int, 1), "hbm_GBps": (float, v.POSITIVE),
                       "noise": (float, 0, MAX_NOISE), "memory_GiB": (float, v.POSITIVE), "rank_memory_GiB": (float, v.POSITIVE),
                       "ib_gbps": (int, 1)}  # (type, least[, most])
FINGERPRINT_NAMES = ("backend", "cluster", "device", "gpu", "mode", "host")  # ... and its names, looked up in tables
META_FIELDS = ("schema_version", "kind", "tool", "simulated", "fingerprint", "workload_digest", "repeats", "points_total",
               "points_done", "complete", "started", "updated", "workload")  # what a profile writes to meta.yaml


@dataclass
class RunFolder:
    path: Path
    # meta.yaml's workload section as text, by the workload's digest: a profile rewrites meta.yaml
    # every second, and a 30,000-group trace took 16 s to dump each time
    _workload_text: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def meta_path(self) -> Path:
        return self.path / "meta.yaml"

    @property
    def csv_path(self) -> Path:
        return self.path / "measurements.csv"

    @property
    def model_path(self) -> Path:
        return self.path / "model.yaml"

    @property
    def fit_plot_path(self) -> Path:
        return self.path / "fit.png"

    @property
    def slowdown_plot_path(self) -> Path:
        return self.path / "slowdown.png"

    @property
    def files(self) -> tuple[Path, ...]:
        """The files the profile and its fit keep here (a command that reads them must not write over them)."""
        return self.meta_path, self.csv_path, self.model_path, self.fit_plot_path, self.slowdown_plot_path

    def exists(self) -> bool:
        return self.meta_path.is_file()

    def check_files(self) -> None:
        """Refuse (UserError), before anything is measured or fitted, a run file that is there but
        not a regular file (a folder named model.yaml was found only after the whole profile ran;
        a measurements.csv linked to /dev/full was read until memory ran out)."""
        for f in self.files:
            if f.exists() and not f.is_file() or f.is_symlink() and not f.exists():
                raise UserError(f"{f} is not a regular file; the run folder's {f.name} must be one (move it away)")

    def lock(self) -> Callable[[], None]:
        """Take the folder for this process's profile until the returned function is called (or
        the process ends): two profiles measuring into one folder would time each other and
        append the same points twice.

        Returns:
            The release function.
        Raises:
            UserError: naming the process that holds it.
        """
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--out {self.path} exists and is not a folder")
        # (dot-files: this folder's lock and a meta.yaml written atomically when the run was killed, .DS_Store, .nfs*)
        if self.path.is_dir() and not self.exists() and any(not p.name.startswith(".") for p in self.path.iterdir()):
            # not a run folder (no meta.yaml) but not empty: `--out ""` or `--out .` profiled into the working folder
            raise UserError(f"--out {self.path} holds other files and no profile; give a new or empty folder (runs/NAME)")
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / ".lock"
        if lock.exists() and not lock.is_file() or lock.is_symlink():
            raise UserError(f"{lock} is not a regular file; the run folder's lock must be one (move it away)")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{self.path} is being profiled by {holder}; wait for it to end, or choose a new --out") from None
        except OSError:  # a file system without locks (some network mounts): profile unguarded, as before
            pass
        else:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {platform.node()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())

        def release() -> None:
            os.close(fd)  # closing the descriptor drops the lock

        return release

    def read_meta(self) -> dict[str, Any]:
        # a misspelt field (``repeat:``) read as absent, as plans and models refuse (an audit, 2026-12-04)
        meta = v.known_keys(v.mapping(read_yaml(self.meta_path, "run metadata"), f"{self.meta_path}"), META_FIELDS, str(self.meta_path))
        v.schema_version(meta, str(self.meta_path), SCHEMA_VERSION)
        where = str(self.meta_path)
        fp = v.field(meta, "fingerprint", where, dict)
        v.bounded_fields(fp, FINGERPRINT_NUMBERS, f"{where}.fingerprint")  # what fit, search and apply compute with
        if fp.get("ranks") and fp.get("nodes") and fp["ranks"] % fp["nodes"]:  # search blamed the plan it had not written
            raise UserError(f"{where}.fingerprint.nodes: {fp['nodes']} nodes cannot hold {fp['ranks']} ranks evenly")
        for key in FINGERPRINT_NAMES:  # every backend records which it is; the rest where they apply
            v.field(fp, key, f"{where}.fingerprint", str, ... if key == "backend" else None)
        # a file without the flag still reads (and plans) as what its backend is
        meta["simulated"] = backend_info(fp["backend"], f"{where}.fingerprint.backend: ").simulated_flag(meta, where)
        v.field(meta, "repeats", where, int, None, minimum=1)
        v.field(meta, "complete", where, bool, False)
        total = v.field(meta, "points_total", where, int, None, minimum=0)
        done = v.field(meta, "points_done", where, int, None, minimum=0)
        if total is not None and done is not None and done > total:
            raise UserError(f"{where}.points_done: {done}, more than points_total {total}")
        # a null field is a missing one (as everywhere a file is read): readers take their default,
        # never None (``ranks: null`` crashed search with a TypeError)
        meta["fingerprint"] = {k: val for k, val in fp.items() if val is not None}
        return meta

    def unfinished(self, health: CsvHealth | None = None) -> str | None:
        """Why the profile is not yet a basis for a plan ("the profile did not finish (47 of 76
        points)", or its CSV lacks points it measured), or None once every point is measured and kept;
        ``health``: this folder's, when just read (else read here)."""
        meta = self.read_meta()
        if meta.get("complete", False):
            return (health or self.health()).lacking  # finished, but rows were lost since (a CSV cut short, replaced)
        return f"the profile did not finish ({meta.get('points_done', 0)} of {meta.get('points_total', '?')} points)"

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Write ``meta.yaml`` atomically; its ``workload`` (last) is dumped once per workload digest."""
        meta = {"schema_version": SCHEMA_VERSION, "kind": "lagom-profile", **meta}
        workload, digest = meta.get("workload"), meta.get("workload_digest")
        if workload is None:
            atomic_write_text(self.meta_path, yaml_text(meta))
            return
        if digest is None or self._workload_text is None or self._workload_text[0] != digest:
            self._workload_text = (digest, yaml_text({"workload": workload}))
        # dumped with an empty workload, so the rest stays a block mapping whatever it holds, then joined
        head = yaml_text({**{k: val for k, val in meta.items() if k != "workload"}, "workload": {}})
        atomic_write_text(self.meta_path, head.removesuffix("workload: {}\n") + self._workload_text[1])

    def knob_space(self, meta: dict[str, Any] | None = None) -> KnobSpace | None:
        """The knobs of the backend this run was profiled on, on the profiled machine.

        Args:
            meta: its ``meta.yaml`` if already read.
        Returns:
            The knob space, or None for a backend this lagom-tune does not have.
        """
        fp = (meta or self.read_meta())["fingerprint"]
        return backend_info(fp["backend"]).knob_space(fp) if fp.get("backend") in backend_names() else None

    def workload(self, meta: dict[str, Any] | None = None) -> Workload:
        """The profiled workload, from ``meta`` (this folder's ``meta.yaml``, read if not given),
        refused if it is not the one profiled (its digest, recorded beside it, differs)."""
        meta = meta or self.read_meta()
        w = Workload.from_dict(meta.get("workload"), f"{self.meta_path}:workload")
        digest = meta.get("workload_digest")
        if digest is not None and digest != w.digest:
            raise UserError(f"{self.meta_path}: its workload is not the one profiled (digest {w.digest}, recorded {digest}): edited?")
        return w

    def fitted_as(self, meta: dict[str, Any] | None = None) -> "ModelExpectation":
        """What this folder's ``model.yaml`` must say of itself to describe its profiles (``meta`` as in
        :meth:`workload`): its backend's model family, its simulated label, its GPU's SMs."""
        meta = meta or self.read_meta()
        fp = meta["fingerprint"]
        info = backend_info(fp["backend"], f"{self.meta_path}: fingerprint.backend: ")
        return ModelExpectation(info.model_family, bool(meta.get("simulated", False)), fp.get("sms") if info.gpu_model else None)

    def _read_rows(self) -> tuple[pd.DataFrame, bool]:
        """Every whole row of ``measurements.csv``, and whether a partial last line was dropped
        (a writer stopped mid-line, or a copy was cut short)."""
        if not self.csv_path.is_file():
            return pd.DataFrame(columns=list(REQUIRED_COLUMNS)), False
        try:
            text = self.csv_path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{self.csv_path} is not a valid measurements CSV: {e}") from None
        partial = bool(text) and not text.endswith("\n")
        if partial:
            text = text[:text.rfind("\n") + 1]
        try:
            with interrupts_kept():
                df = pd.read_csv(io.StringIO(text), low_memory=False)  # one type per column, not per chunk (a DtypeWarning on large runs)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
            raise UserError(f"{self.csv_path} is not a valid measurements CSV: {str(e).splitlines()[0]}") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
        if missing:
            raise UserError(f"{self.csv_path}: missing column(s) {', '.join(missing)}")
        for col in NUMERIC_COLUMNS:
            if col in df.columns and not pd.api.types.is_numeric_dtype(df[col]):
                converted = pd.to_numeric(df[col], errors="coerce")
                if converted.isna().sum() > df[col].isna().sum():
                    bad = df.index[converted.isna() & df[col].notna()][0]
                    row = f"row {int(bad) + 1} after the header"
                    if df.loc[bad, "point"] == "point":  # two profiles' files joined, each with its header
                        raise UserError(f"{self.csv_path}: {row} repeats the header (two files joined?); keep the first")
                    raise UserError(f"{self.csv_path}: column {col!r} holds non-numeric values ({df.loc[bad, col]!r}, {row})")
                df[col] = converted
        for col in COUNT_COLUMNS:
            if col in df.columns:
                values = df[col].dropna()
                bad = values[~np.isfinite(values) | (values < 1) | (values != np.floor(values))]  # 1e400 reads as inf
                if not bad.empty:
                    raise UserError(f"{self.csv_path}: {col} of point {df.loc[bad.index[0], 'point']} is {bad.iloc[0]}, "
                                    f"not a count of at least 1 ({len(bad)} such row(s))")
        stray = df[~df["kind"].isin(ROW_KINDS)]
        if not stray.empty:  # a kind of its own was listed by show, then fit said it found no GEMM
            raise UserError(f"{self.csv_path}: kind of point {stray.iloc[0]['point']} is {stray.iloc[0]['kind']!r}, not one of "
                            f"{', '.join(ROW_KINDS)} ({len(stray)} such row(s))")
        for kind in dict.fromkeys(df["kind"]):  # a column deleted in a spreadsheet: show passed, fit raised KeyError
            missing = [c for c in KIND_COLUMNS[kind] if c not in df.columns]
            if missing:
                raise UserError(f"{self.csv_path}: missing column(s) {', '.join(missing)}, which its {kind} rows need")
        bad = df["repeat"][~((df["repeat"] >= 0) & (df["repeat"] == np.floor(df["repeat"])))]
        if not bad.empty:
            raise UserError(f"{self.csv_path}: repeat of point {df.loc[bad.index[0], 'point']} is {bad.iloc[0]}, not a "
                            f"repeat index (0, 1, ...) ({len(bad)} such row(s))")
        twice = df.duplicated(["point", "repeat"])  # a repeat is written once; resuming never measures it again
        if twice.any():
            first = df[twice].iloc[0]
            raise UserError(f"{self.csv_path}: repeat {first['repeat']} of point {first['point']} appears twice "
                            f"({int(twice.sum())} such row(s))")
        overlapped = df[(df["kind"] == "overlap") | df["point"].astype(str).str.startswith(again_key("overlap|"))]
        if not overlapped.empty:  # an overlapped row times both streams and the window they end in
            for col in OVERLAPPED_COLUMNS:
                missing = overlapped[overlapped[col].isna()] if col in df.columns else overlapped
                if not missing.empty:
                    raise UserError(f"{self.csv_path}: overlapped point {missing.iloc[0]['point']} has no {col} "
                                    f"({len(missing)} such row(s))")
            early = overlapped[overlapped["window_us"] < overlapped[["time_us", "comm_us"]].max(axis=1) * (1 - 1e-9)]
            if not early.empty:
                raise UserError(f"{self.csv_path}: window_us of point {early.iloc[0]['point']} is {early.iloc[0]['window_us']}, "
                                f"before one of its streams ended ({len(early)} such row(s))")
        for col in TIMED_COLUMNS:  # a time is positive and at most a day; only time_us is in every row
            if col in df.columns:
                times = df[col] if col == "time_us" else df[col].dropna()
                bad = times[~(np.isfinite(times) & (times > 0) & (times <= MAX_TIME_US))]
                if not bad.empty:
                    raise UserError(f"{self.csv_path}: {col} of point {df.loc[bad.index[0], 'point']} is {bad.iloc[0]}, "
                                    f"not a positive time of at most a day ({MAX_TIME_US:g} us; {len(bad)} such row(s))")
        return df, partial

    def _check_settings(self, df: pd.DataFrame, meta: dict[str, Any], workload: Workload) -> None:
        """Refuse collective rows of an op neither the workload nor the backend's instruments hold,
        and rows of the workload's collectives without a knob value, or at one the run's backend
        does not have on its machine (``algo: bogus``, ``channels: 999`` were fitted as a setting
        of their own; a blank one failed the fit). Instrument rows (the GPU probe's copy kernel)
        have settings of their own."""
        fp = meta["fingerprint"]
        timed = df[df["kind"].isin(("collective", "overlap", DEFAULT))]
        if timed.empty:
            return
        info = backend_info(fp["backend"])
        ops = {c.op for c in workload.collectives()}
        stray = timed[~timed["op"].isin(ops | info.instruments)] if "op" in df.columns else timed
        if not stray.empty:
            raise UserError(f"{self.csv_path}: collective of point {stray.iloc[0]['point']} is "
                            f"{stray.iloc[0].get('op', 'missing')!r}, not one of the workload's {', '.join(sorted(ops))} "
                            f"({len(stray)} such row(s))")
        ours = timed[timed["op"].isin(ops)]
        space = info.knob_space(fp)
        for knob in (space[name] for name in space.names() if name in KNOB_COLUMNS):
            rows = ours[ours["op"].isin(knob.ops)] if knob.ops else ours
            if knob.name not in df.columns:  # a point's key names the settings its rows were taken at
                if rows["point"].astype(str).str.contains(f"|{knob.name}=", regex=False).any():
                    raise UserError(f"{self.csv_path}: column {knob.name!r} is missing, though its points were taken at a {knob.name}")
                continue
            # a knob a backend sets for a kind of point is in every such row (gloo times its
            # collectives at no thread count: none of them has one)
            taken = rows[knob.name].notna().groupby([rows["kind"], rows["op"]]).transform("any")
            values = rows.loc[taken, knob.name]
            bad = values[~values.isin(knob.domain)]
            if not bad.empty:
                raise UserError(f"{self.csv_path}: {knob.name} of point {df.loc[bad.index[0], 'point']} is {bad.iloc[0]}, not one of "
                                f"the {fp['backend']} backend's {', '.join(map(str, knob.domain))} ({len(bad)} such row(s))")

    def _check_points(self, df: pd.DataFrame, meta: dict[str, Any], workload: Workload) -> None:
        """Refuse rows that contradict their point or their run: a point's columns that differ from
        what its key says (its kind, GEMM shape, collective and settings) or between its repeats, a
        GEMM of a shape the workload does not hold, a backend or simulated label other than the
        run's, a repeat index at or past the profile's repeats. Each was fitted as written (an m
        of 99999 under a key saying 128; repeats 7-13 of a 7-repeat point, 50 times slower)."""
        if df.empty:
            return
        fp = meta["fingerprint"]
        where = f"{self.csv_path}:"
        for col, want in (("backend", fp["backend"]), ("simulated", bool(meta.get("simulated", False)))):
            if col in df.columns:
                bad = df[df[col].astype(str) != str(want)]
                if not bad.empty:
                    got = bad.iloc[0][col]
                    got = got.item() if hasattr(got, "item") else got  # numpy's False printed as np.False_
                    raise UserError(f"{where} {col} of point {bad.iloc[0]['point']} is {got!r}, but the run's is "
                                    f"{want!r} ({len(bad)} such row(s))")
        repeats = meta.get("repeats")
        if isinstance(repeats, int):
            late = df[df["repeat"] >= repeats]
            if not late.empty:
                raise UserError(f"{where} repeat {late.iloc[0]['repeat']} of point {late.iloc[0]['point']}, but the profile "
                                f"takes {repeats} repeats (0..{repeats - 1}) ({len(late)} such row(s))")
        describing = [c for c in DESCRIBING_COLUMNS if c in df.columns]
        differ = df.groupby("point", sort=False)[describing].nunique(dropna=False)
        differ = differ[(differ > 1).any(axis=1)]
        if not differ.empty:
            col = differ.columns[(differ.iloc[0] > 1).to_numpy()][0]
            raise UserError(f"{where} the repeats of point {differ.index[0]} disagree on {col} ({len(differ)} such point(s))")
        shapes = set(workload.gemms())
        instruments = backend_info(fp["backend"]).instruments  # the GPU probe's rows report the bytes it copied in all
        for row in df.drop_duplicates("point").to_dict("records"):  # dicts: a Series per point took seconds on large runs
            wrong = _key_contradiction(row, shapes, instruments)
            if wrong:
                raise UserError(f"{where} point {row['point']}: {wrong}")

    def read(self) -> tuple[pd.DataFrame, CsvHealth]:
        """One read of ``measurements.csv``: the rows of every complete point (all its repeats), and
        what was left out (a partial last line, points with fewer rows than repeats; a resumed
        profile measures those again)."""
        df, partial = self._read_rows()
        meta = self.read_meta() if self.meta_path.is_file() else None
        if meta is not None:
            workload = self.workload(meta)  # parsed and digested once for both checks
            self._check_settings(df, meta, workload)
            self._check_points(df, meta, workload)
        repeats = meta.get("repeats") if meta is not None else None
        repeats = repeats if isinstance(repeats, int) and repeats > 0 else None
        counts = df.groupby("point").size() if repeats and not df.empty else pd.Series(dtype=int)
        short = tuple(sorted(str(p) for p, n in counts.items() if n < repeats))
        complete = df[~df["point"].astype(str).isin(short)].reset_index(drop=True) if short else df
        total = meta.get("points_total") if meta is not None and meta.get("complete") else None
        # points absent altogether (a short point is named as such, not counted again)
        missing = max(0, total - int(df["point"].nunique())) if isinstance(total, int) else 0
        return complete, CsvHealth(partial, short, repeats, missing, total)

    def health(self) -> CsvHealth:
        """What is wrong with ``measurements.csv``, if anything (see :meth:`read`)."""
        return self.read()[1]

    def measurements(self) -> pd.DataFrame:
        """The rows of every complete point (see :meth:`read`)."""
        return self.read()[0]

    def drop_incomplete(self, complete: pd.DataFrame, health: CsvHealth) -> None:
        """Rewrite ``measurements.csv`` with complete points only, before a resume re-measures the rest.

        Args:
            complete, health: what :meth:`read` returned.
        """
        # A point's rows are appended together: an interrupted profile leaves the last short, never
        # all of them. Every point short is meta.yaml's repeats edited up, and the rewrite would delete every row.
        if complete.empty and len(health.short_points) > 1:
            raise UserError(f"{self.csv_path}: none of its {len(health.short_points)} points has the {health.repeats} "
                            "repeats meta.yaml says the profile takes (meta.yaml or measurements.csv was edited); "
                            "nothing was rewritten")
        if not health.ok:
            self._write(complete)

    def append_rows(self, rows: list[dict[str, Any]]) -> None:
        """Add ``rows`` to ``measurements.csv``: appended in one write when the file ends in a whole
        line and its header holds their columns (a profile flushes every second, and rewriting
        tens of thousands of rows each time took longer than that); else the whole file is
        rewritten atomically, its complete points and the new rows. An append cut short leaves a
        partial line or a point short of repeats, which :meth:`read` leaves out and a resume measures
        again.

        Args:
            rows: one dict per repeat, keyed by column.
        """
        new = pd.DataFrame(rows)
        header = self._header()
        if header is not None and set(new.columns) <= set(header):
            buf = io.StringIO()
            _as_written(new.reindex(columns=header)).to_csv(buf, index=False, header=False)
            with open(self.csv_path, "a") as f:
                f.write(buf.getvalue())
                f.flush()
                os.fsync(f.fileno())
            return
        old = self.measurements() if self.csv_path.is_file() else None
        self._write(new if old is None or old.empty else pd.concat([old, new], ignore_index=True))

    def _header(self) -> list[str] | None:
        """The CSV's columns, if it exists, is not empty and ends in a whole line (else None)."""
        try:
            with open(self.csv_path, "rb") as f:
                first = f.readline()
                f.seek(0, os.SEEK_END)
                if not first.endswith(b"\n") or f.tell() == 0:
                    return None
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    return None
        except OSError:
            return None
        return first.decode(errors="replace").rstrip("\r\n").split(",")

    def _write(self, df: pd.DataFrame) -> None:
        buf = io.StringIO()
        _as_written(df).to_csv(buf, index=False)
        atomic_write_text(self.csv_path, buf.getvalue())


def _as_written(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its :data:`WHOLE_COLUMNS` as whole numbers where every value filled is one (an
    empty cell stays empty)."""
    whole = {c: df[c].astype("Int64") for c in WHOLE_COLUMNS
             if c in df.columns and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
             and (df[c].dropna() % 1 == 0).all()}
    return df.assign(**whole)


def _key_contradiction(row: dict[str, Any], shapes: set[str], instruments: frozenset[str]) -> str | None:
    """What in ``row`` contradicts its point key (``Point.key``: kind, GEMM shape, op:bytes:ranks,
    then knob=value settings), or a GEMM shape outside ``shapes``; None when nothing does. The
    collective of an ``instruments`` op is its own (the probe's bytes are what it copied)."""
    parts = str(row["point"]).split("|")
    if parts[0] != row["kind"]:
        return f"its key says {parts[0]}, its kind column {row['kind']}"
    gemm = row.get("gemm")
    if isinstance(gemm, str):
        try:
            g = gemm_of_key(gemm)
        except ValueError:
            return f"gemm {gemm!r} is not a GEMM shape"
        if gemm not in parts:
            return f"its gemm column {gemm} is not the shape its key names"
        if gemm not in shapes:
            return f"GEMM {gemm} is not one of the workload's shapes"
        for col in ("m", "n", "k", "batch", "dtype"):
            if col in row and str(row[col]) != str(getattr(g, col)) and not (col != "dtype" and row[col] == getattr(g, col)):
                return f"{col} is {row[col]}, but its shape {gemm} says {getattr(g, col)}"
    op = row.get("op")
    if isinstance(op, str) and op not in instruments and f"{op}:{_whole(row.get('nbytes'))}:{_whole(row.get('ranks'))}" not in parts:
        return f"op, nbytes and ranks ({op}, {row.get('nbytes')}, {row.get('ranks')}) are not the collective its key names"
    said = dict(part.split("=", 1) for part in parts if "=" in part)
    for col in SETTING_COLUMNS:
        value = row.get(col)
        given = None if value is None or pd.isna(value) else str(_whole(value))
        if given != said.get(col):
            return f"{col} is {given or 'blank'}, but its key says {said.get(col, 'none')}"
    return None


def _whole(value: Any) -> Any:
    """A number read back from the CSV as a float (``64.0``) as the key wrote it (``64``)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True)
class ModelExpectation:
    """What a run folder's ``model.yaml`` must say to be its profiles' model (:meth:`RunFolder.fitted_as`)."""

    family: str  # BackendInfo.model_family of its backend
    simulated: bool
    sms: int | None  # the GPU's SMs (GPU families), which the model's device must be


@dataclass(frozen=True)
class CsvHealth:
    """The state of a run folder's ``measurements.csv`` beyond what parses."""

    partial_line: bool  # the last line was cut short (dropped when read)
    short_points: tuple[str, ...]  # points with fewer rows than repeats (left out when read)
    repeats: int | None
    missing: int = 0  # points a finished profile measured that no row holds (a CSV cut at a line, edited)
    total: int | None = None  # the points it measured

    @property
    def ok(self) -> bool:
        """Whether every row read is whole (else :meth:`RunFolder.drop_incomplete` rewrites the file)."""
        return not self.partial_line and not self.short_points

    @property
    def lacking(self) -> str | None:
        """Why the rows are not the whole finished profile (points short of repeats or absent), or None."""
        if self.short_points and not self.missing:
            return f"{len(self.short_points)} point(s) of measurements.csv have fewer than {self.repeats} repeats"
        if self.missing:
            return f"measurements.csv holds {self.total - self.missing} of the {self.total} points the profile measured"
        return None

    @property
    def whole(self) -> bool:
        """Whether the rows are the profile as measured: a model fitted to fewer is compared with them only then."""
        return self.ok and not self.missing

    def problems(self) -> list[str]:
        """One line per problem, for ``show`` and ``report``."""
        out = []
        if self.partial_line:
            out.append("measurements.csv ends in a partial line (cut short); it is ignored")
        if self.short_points:
            out.append(f"{len(self.short_points)} point(s) have fewer than {self.repeats} repeats and are left out "
                       f"(e.g. {self.short_points[0]}); rerun the same profile command to re-measure them")
        if self.missing:
            out.append(f"{self.lacking}; rerun the same profile command to measure the rest")
        return out


def open_run(path: str | Path) -> RunFolder:
    """An existing run folder, or a one-line error saying what is missing.

    Args:
        path: the folder.
    Returns:
        The RunFolder.
    Raises:
        UserError: for a missing folder or one without ``meta.yaml``.
    """
    run = RunFolder(Path(path))
    if run.path.exists() and not run.path.is_dir():
        raise UserError(f"{run.path} is a file, not a run folder (give the folder `lagom-tune profile --out` made)")
    if not run.path.is_dir():
        raise UserError(f"run folder not found: {run.path}")
    if not run.exists():
        raise UserError(f"{run.path} is not a run folder (no meta.yaml); create one with `lagom-tune profile`")
    run.check_files()
    return run
