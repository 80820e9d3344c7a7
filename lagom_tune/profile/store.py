"""The run folder: ``meta.yaml`` (fingerprint, workload, progress), ``measurements.csv``, ``model.yaml``.

Every write is atomic, so an interrupted profile leaves a valid folder that a rerun resumes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from lagom_tune import validate as v
from lagom_tune.artifact_io import atomic_write_text, read_yaml, write_yaml
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import Workload

SCHEMA_VERSION = 1
REQUIRED_COLUMNS = ("point", "kind", "repeat", "time_us")
NUMERIC_COLUMNS = ("repeat", "time_us", "comm_us", "window_us", "nbytes", "ranks", "m", "n", "k", "batch", "flops",
                   "threads", "n_compute", "compute_alone_us", "comm_alone_us")


@dataclass
class RunFolder:
    path: Path

    @property
    def meta_path(self) -> Path:
        return self.path / "meta.yaml"

    @property
    def csv_path(self) -> Path:
        return self.path / "measurements.csv"

    @property
    def model_path(self) -> Path:
        return self.path / "model.yaml"

    def exists(self) -> bool:
        return self.meta_path.is_file()

    def read_meta(self) -> dict[str, Any]:
        meta = v.mapping(read_yaml(self.meta_path, "run metadata"), f"{self.meta_path}")
        version = v.field(meta, "schema_version", str(self.meta_path), int)
        if version != SCHEMA_VERSION:
            raise UserError(f"{self.meta_path}: unknown schema_version {version} (this lagom-tune reads {SCHEMA_VERSION})")
        v.field(meta, "fingerprint", str(self.meta_path), dict)
        return meta

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_yaml(self.meta_path, {"schema_version": SCHEMA_VERSION, "kind": "lagom-profile", **meta})

    def workload(self) -> Workload:
        return Workload.from_dict(self.read_meta().get("workload"), f"{self.meta_path}:workload")

    def measurements(self) -> pd.DataFrame:
        if not self.csv_path.is_file():
            return pd.DataFrame(columns=list(REQUIRED_COLUMNS))
        try:
            df = pd.read_csv(self.csv_path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"{self.csv_path} is not a valid measurements CSV: {str(e).splitlines()[0]}") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
        if missing:
            raise UserError(f"{self.csv_path}: missing column(s) {', '.join(missing)}")
        for col in NUMERIC_COLUMNS:
            if col in df.columns and not pd.api.types.is_numeric_dtype(df[col]):
                converted = pd.to_numeric(df[col], errors="coerce")
                if converted.isna().sum() > df[col].isna().sum():
                    raise UserError(f"{self.csv_path}: column {col!r} holds non-numeric values")
                df[col] = converted
        return df

    def done_points(self) -> set[str]:
        return set(self.measurements()["point"].astype(str))

    def append_rows(self, rows: list[dict[str, Any]]) -> None:
        new = pd.DataFrame(rows)
        old = self.measurements() if self.csv_path.is_file() else None
        df = new if old is None or old.empty else pd.concat([old, new], ignore_index=True)
        buf = io.StringIO()
        df.to_csv(buf, index=False)
        atomic_write_text(self.csv_path, buf.getvalue())


def open_run(path: str | Path) -> RunFolder:
    """An existing run folder, or a one-line error saying what is missing."""
    run = RunFolder(Path(path))
    if not run.path.is_dir():
        raise UserError(f"run folder not found: {run.path}")
    if not run.exists():
        raise UserError(f"{run.path} is not a run folder (no meta.yaml); create one with `lagom-tune profile`")
    return run
