"""Field-path-aware checks for turning loaded YAML/JSON into typed artifacts.

Every artifact loader (workload, plan, run folder) goes through these, so a bad file is reported
as ``plan.collectives[2].set.chunk_bytes: expected an integer, got 'x'`` and never as a traceback.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from lagom_tune.errors import UserError

_EXPONENT_TEXT = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")  # 1e9, 1.0e9: numbers to Python, text to YAML 1.1 (which needs 1.0e+9)
# Terminal control characters (C0 but tab and newline, DEL, C1): a name holding ESC [2J cleared the
# screen when `show` printed it. A name may not hold a tab or newline either (it printed as two lines).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_OR_SPACING = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_INT = (1 << 63) - 1  # no count, size or seed lagom-tune reads is larger (NCCL's and torch's are int64)


POSITIVE = 1e-9  # the least a number other code divides by may be, where a file gives it (0 divided by zero)

def mapping(value: Any, path: str) -> dict:
    """``value`` if it is a mapping.

    Args:
        value: loaded data.
        path: its field path, for the error.
    Returns:
        The dict.
    Raises:
        UserError: for anything else.
    """
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value


def document(value: Any, path: str, what: str) -> dict:
    """``value`` if it is a mapping, as the top level of every file lagom-tune reads is.

    Args:
        value: the loaded file.
        path: the file, for the error.
        what: what the file should be ("plan file"), for the error.
    Returns:
        The dict.
    Raises:
        UserError: saying the file is not one (a text file, a YAML list).
    """
    if value is None:  # an empty file, or one of comments only
        raise UserError(f"{path}: not a {what}: it is empty")
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a {what}: its top level is a {type(value).__name__}, not a YAML mapping")
    return value


def named(value: Any, path: str) -> dict[str, Any]:
    """``value`` if it is a mapping keyed by names: YAML reads a key ``2:`` as a number, which no
    role or communicator is called.

    Args:
        value: loaded data.
        path: its field path, for the error.
    Returns:
        The dict.
    Raises:
        UserError: for anything but a mapping, or a key that is not a string.
    """
    d = mapping(value, path)
    for key in d:
        if not isinstance(key, str):
            raise UserError(f"{path}: key {key!r} is read as {type(key).__name__}, not a name; quote it ('{key}')")
    return d


def known_keys(d: dict, allowed: tuple[str, ...], path: str) -> dict:
    """``d`` if every key is one of ``allowed``: a misspelt section (``communicator:``) would
    otherwise be read as absent, and what it holds silently never applied.

    Args:
        d: the mapping.
        allowed: the keys its schema defines.
        path: its field path, for the error.
    Returns:
        The dict.
    Raises:
        UserError: naming the first unknown key, and the closest allowed one.
    """
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"{path}.{key}: unknown field ({hint}known: {', '.join(allowed)})")
    return d


def seq(value: Any, path: str) -> list:
    """``value`` if it is a list.

    Args:
        value: loaded data.
        path: its field path, for the error.
    Returns:
        The list.
    Raises:
        UserError: for anything else.
    """
    if not isinstance(value, list):
        raise UserError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def field(d: dict, key: str, path: str, kind: type | tuple, default: Any = ..., *, minimum: float | None = None,
          maximum: float | None = None, finite: bool = True) -> Any:
    """Return ``d[key]`` checked against ``kind`` (bool is never accepted as a number).

    Args:
        d: the mapping that holds the field.
        key: the field's name.
        path: the mapping's field path, for the error.
        kind: the accepted type or types (an int is accepted, as a float, where float is).
        default: the value of a missing or null field; ``...`` makes the field required.
        minimum: the smallest accepted value, for numbers.
        maximum: the largest accepted value, for numbers.
        finite: refuse NaN and infinities (False where NaN is a recorded "undefined", e.g. a
            rank correlation of constant values).
    Returns:
        The value (or the default).
    Raises:
        UserError: naming ``path.key``, for a missing required field or a bad value.
    """
    if key not in d or d[key] is None:
        if default is ...:
            raise UserError(f"{path}.{key}: required field is missing")
        return default
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT and (int in kinds or float in kinds):
        # a 400-digit count was taken as a world size; one past a float's range was an OverflowError
        raise UserError(f"{path}.{key}: must be <= {min(MAX_INT, maximum) if maximum is not None else MAX_INT}, got {_digits(value)}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        hint = (" (YAML 1.1 reads this as text: write the exponent with a dot and a sign, 1.0e+9, or the digits)"
                if (float in kinds or int in kinds) and isinstance(value, str) and _EXPONENT_TEXT.fullmatch(value.strip()) else "")
        raise UserError(f"{path}.{key}: expected {names}, got {value!r}{hint}")
    if isinstance(value, str) and _CONTROL.search(value):
        raise UserError(f"{path}.{key}: holds a control character ({_CONTROL.search(value).group()!r}), which a terminal would act on")
    if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan passes every comparison
        if finite:
            raise UserError(f"{path}.{key}: expected a finite number, got {value!r}")
        return value
    if minimum is not None and value < minimum:
        raise UserError(f"{path}.{key}: must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise UserError(f"{path}.{key}: must be <= {maximum}, got {value!r}")
    return value


def name(d: dict, key: str, path: str, default: Any = ...) -> Any:
    """``d[key]`` as a name: a string with something besides spaces in it (an empty communicator
    name made a plan role ``''``; an empty op name cannot be told from another).

    Args:
        d: the mapping that holds the field.
        key: the field's name.
        path: the mapping's field path, for the error.
        default: as :func:`field`'s.
    Returns:
        The name (or the default).
    Raises:
        UserError: for a missing required field, a non-string or a blank one.
    """
    value = field(d, key, path, str, default)
    if value is not None and not value.strip():  # None: an absent field's default
        raise UserError(f"{path}.{key}: expected a name, got {value!r}")
    if value is not None:
        one_line({key: value}, key, path)
    return value


def one_line(d: dict, key: str, path: str) -> str:
    """``d[key]`` as a label a record may leave empty (a plan's workload name, its optimizer): text
    of one line without tabs or control characters, "" when absent.

    Args:
        d: the mapping that holds the field.
        key: the field's name.
        path: the mapping's field path, for the error.
    Returns:
        The text.
    Raises:
        UserError: for a non-string, or one holding a line break, tab or control character.
    """
    value = field(d, key, path, str, "")
    if _CONTROL_OR_SPACING.search(value):
        raise UserError(f"{path}.{key}: expected one line without tabs, got {value!r}")
    return value


def _digits(value: int) -> str:
    """A huge integer for a message: its digits up to 40, else its sign and digit count."""
    if value.bit_length() < 133:
        return str(value)
    return f"a {'negative ' if value < 0 else ''}number of about {round(abs(value).bit_length() * math.log10(2))} digits"


def bounded_fields(d: dict, spec: dict[str, tuple], path: str) -> None:
    """Check each of ``spec``'s keys that ``d`` holds (absent or null: skipped) against its
    ``(type[, least[, most]])``, as :func:`field` does.

    Args:
        d: the mapping.
        spec: key -> (type, least, most), least and most optional.
        path: its field path, for errors.
    Raises:
        UserError: naming the first bad field.
    """
    for key, (kind, *bounds) in spec.items():
        field(d, key, path, kind, None, minimum=bounds[0] if bounds else None, maximum=bounds[1] if len(bounds) > 1 else None)


def number_map(value: Any, path: str, *, minimum: float | None = None, maximum: float | None = None) -> dict[str, float]:
    """``value`` if it maps names to finite numbers (each at least ``minimum``, at most ``maximum``).

    Args:
        value: loaded data.
        path: its field path, for the error.
        minimum: the smallest accepted number.
        maximum: the largest accepted number.
    Returns:
        The mapping, its numbers as floats.
    Raises:
        UserError: naming the first bad key or number.
    """
    d = mapping(value, path)
    for k in d:
        if not isinstance(k, str):
            raise UserError(f"{path}: key {k!r} is not a name")
    return {k: field(d, k, path, float, minimum=minimum, maximum=maximum) for k in d}


def schema_version(d: dict, path: str, reads: int, default: Any = ...) -> int:
    """An artifact's ``schema_version``, refused unless it is the one this lagom-tune reads.

    Args:
        d: the artifact's top-level mapping.
        path: its path, for errors.
        reads: the version this lagom-tune reads (the artifact module's ``SCHEMA_VERSION``).
        default: the version of a file without the field; ``...`` makes it required.

    Returns:
        The version.
    """
    version = field(d, "schema_version", path, int, default)
    if version != reads:
        raise UserError(f"{path}.schema_version: unknown version {version} (this lagom-tune reads {reads})")
    return version


def one_of(value: Any, choices, path: str) -> Any:
    """``value`` if it is one of ``choices``.

    Args:
        value: loaded data.
        choices: the accepted values.
        path: its field path, for the error.
    Returns:
        The value.
    Raises:
        UserError: naming the choices, for anything else.
    """
    if value not in choices:
        raise UserError(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value
