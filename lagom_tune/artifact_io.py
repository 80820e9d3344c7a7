"""Atomic writes of artifact files (a reader never sees a half-written file), and the check, made
before any work starts, that an output may be written. Reading and writing YAML is ``yaml_io``'s:
this module imports no YAML, so the step clock that every process of a trial loads stays light."""

from __future__ import annotations

import datetime
import itertools
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Iterable

from lagom_tune.errors import UserError


MARK_HEAD = 1024  # bytes of an existing file read for the mark of what wrote it


def check_writable(path: str | os.PathLike, what: str = "output", inputs: Iterable[str | os.PathLike] = (),
                   replaces: str | None = None) -> Path:
    """Refuse, before any work starts, an output path that cannot be written, that is one of the
    command's inputs (``search RUN --out RUN/meta.yaml`` replaced the profile's record), or that
    holds something other than what the command writes (another run's ``meta.yaml``, a user's notes).

    Args:
        path: the file to be written later (its folder may not exist yet).
        what: what the file is, for the message.
        inputs: files the command reads.
        replaces: a regular expression an existing file must match to be replaced (the first line
            of what the command writes, e.g. ``^kind: lagom-plan$``; an empty file, as ``mktemp``
            makes, is replaced too); None: any file is replaced.

    Returns:
        The path. Raises ``UserError`` naming the reason.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    if path.exists() and not path.is_file():  # written by a rename over it: a FIFO gone, /dev/null made a file
        raise UserError(f"{what} {path} is not a regular file (a device, a FIFO or a socket); give a file name")
    clash = next((Path(i) for i in inputs if Path(i).exists() and os.path.samefile(path, i)), None) if path.exists() else None
    if clash is not None:
        raise UserError(f"{what} {path} is {clash}, which this command reads; give another file")
    if replaces is not None and path.is_file() and path.stat().st_size and not holds_match(path, replaces):  # empty: mktemp's
        raise UserError(f"{what} {path} exists and is not a {what} lagom-tune wrote; give another file (or remove it)")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK) or folder.resolve().parts[:2] in (("/", "proc"), ("/", "sys")):
        raise UserError(f"cannot write {what} {path}: {folder} is not a writable folder")
    return path


def keep_aside(path: str | os.PathLike) -> Path | None:
    """Rename an existing ``path`` to a name of its own beside it, stamped with when it was last
    written (``trial.json`` -> ``trial.20261207T220301.json``), so that what is written at ``path``
    next replaces nothing (a rerun of ``trial`` that failed in its first round left one run where
    a whole trial's record had been).

    Args:
        path: the file.
    Returns:
        Its new path, or None when there was no file.
    Raises:
        UserError: when it cannot be renamed.
    """
    path = Path(path)
    if not path.is_file():
        return None
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%dT%H%M%S")
    kept = next(c for c in (path.with_name(f"{path.stem}.{stamp}{'-' + str(i) if i else ''}{path.suffix}") for i in itertools.count())
                if not c.exists())
    try:
        os.replace(path, kept)
    except OSError as e:
        raise UserError(f"cannot keep {path} as {kept.name}: {e.strerror or e}") from None
    return kept


def holds_match(path: Path, pattern: str) -> bool:
    """Whether the head of ``path`` (its first :data:`MARK_HEAD` bytes, where every file lagom-tune
    writes says what it is) matches ``pattern`` (multi-line); False for a file that cannot be read
    as text. Not the whole file: notes that quote a plan (README's plan format) hold its mark too,
    which is why the marks are anchored to the file's start (a note quoting a plan under a line of
    prose was overwritten until 2026-12-04)."""
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            head = f.read(MARK_HEAD)
    except (OSError, UnicodeDecodeError):
        return False
    return re.search(pattern, head, re.MULTILINE) is not None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename: a reader
    (or a process killed mid-write) never sees part of it, and once this returns the new file
    survives a power cut (the folder's entry is synced too). A file replaced keeps its
    permissions; a symbolic link keeps pointing where it did, at the new content.

    Args:
        path: the file to write (its folder is made if missing).
        data: the whole content.
    Returns:
        The path.
    Raises:
        UserError: when the folder cannot be made or written.
    """
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path  # a rename onto the link would replace the link itself
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
        _sync_folder(target.parent)
    except OSError as e:  # a full disk, a folder at ``path``: named by the file, not by the temp gone with it
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _mode_for(path: Path) -> int:
    """The permissions a file written at ``path`` gets: those of the file it replaces (a plan made
    0600 by its owner became 0644), else what the umask leaves of 0666 (mkstemp's 0600 would make
    shared plans unreadable to others)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries to disk, so a rename into it is not lost to a power cut (where the
    file system cannot sync a folder, the rename stands as the file system keeps it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
