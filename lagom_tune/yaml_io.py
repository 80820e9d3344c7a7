"""YAML artifacts: written atomically (``artifact_io``) with keys in their given order, and read
with every failure a one-line ``UserError``, a key given twice refused and aliases bounded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.errors import UserError


def write_yaml(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` to ``path`` as YAML, atomically (keys in their given order).

    Args:
        path: the file to write.
        data: plain data (dicts, lists, scalars).
    Returns:
        The path.
    """
    return atomic_write_text(path, yaml_text(data))


def yaml_text(data: Any) -> str:
    """``data`` as the YAML :func:`write_yaml` writes (keys in their given order): the dumps of two
    mappings, one after the other, are the dump of the two merged.

    Args:
        data: plain data (dicts, lists, scalars).
    Returns:
        The text.
    """
    return yaml.dump(data, Dumper=_DUMPER, sort_keys=False, default_flow_style=None)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, mark: Any):
        super().__init__(f"key {key!r} given twice")
        self.key, self.problem_mark = key, mark


# libyaml's parser and emitter where PyYAML was built with it: the pure-Python ones took 15 s to
# write a workload imported from a trace of 60,000 ops. Same documents either way.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _TooLarge(yaml.YAMLError):
    def __init__(self, nodes: int):
        super().__init__(f"{nodes} nodes")
        self.nodes = nodes


MAX_YAML_NODES = 5 * 10 ** 6  # nodes a document may hold with its aliases expanded (a workload of 60,000 ops has ~1.2 x 10^6)


def _expanded_nodes(root: Any) -> int:
    """Nodes of a composed YAML document with every alias expanded, as ``json.dumps`` or a deep
    copy of what it loads to would meet them (shared, a few aliases nested ten deep are 10^10);
    counted once per distinct node. A node that holds itself counts as too many."""
    size: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, closing = stack.pop()
        if id(node) in size:
            continue
        kids = [] if isinstance(node, yaml.ScalarNode) else (
            [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else list(node.value))
        if closing:
            open_.discard(id(node))
            size[id(node)] = min(1 + sum(size[id(k)] for k in kids), MAX_YAML_NODES + 1)
            continue
        if id(node) in open_:  # reached again before it closed: it holds itself
            return MAX_YAML_NODES + 1
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    return size[id(root)]


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """``yaml.safe_load``, refusing a key given twice in one mapping: YAML requires unique keys and
    PyYAML silently keeps the last (``{threads: 1, threads: 4}`` read as 4). Keys a merge (``<<``)
    brings in may still be overridden, as YAML allows."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


class _AliasBoundedLoader(_UniqueKeyLoader):
    """:class:`_UniqueKeyLoader` for a document with anchors: one whose aliases expand past
    :data:`MAX_YAML_NODES` is refused (a "billion laughs" in a workload's free-form ``meta`` ran
    ``show --json`` out of memory). Counting costs half a load again, so only documents that
    can hold an alias pay it."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            nodes = _expanded_nodes(node)
            if nodes > MAX_YAML_NODES:
                raise _TooLarge(nodes)
        return node


def read_yaml(path: str | os.PathLike, what: str = "file") -> Any:
    """Load a YAML file, turning every failure into a one-line ``UserError``.

    Args:
        path: the file to read.
        what: what the file is, for the error (``"plan file"``).
    Returns:
        The loaded data.
    Raises:
        UserError: for a missing, unreadable or malformed file.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a {what}")
    if not path.exists():
        raise UserError(f"{what} not found: {path}")
    if not path.is_file():  # /dev/null, a pipe, a socket
        raise UserError(f"{what} {path} is not a regular file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
    try:
        return yaml.load(text, Loader=_AliasBoundedLoader if "&" in text else _UniqueKeyLoader)  # no anchor, no alias
    except _TooLarge:
        raise UserError(f"{what} {path}: its aliases expand to more than {MAX_YAML_NODES:,} nodes (or hold themselves); "
                        "write the data out rather than by reference") from None
    except _DuplicateKey as e:
        raise UserError(f"{what} {path}: key {e.key!r} is given twice in one mapping (line {e.problem_mark.line + 1})") from None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = (f" (line {mark.line + 1})" if mark else "") + (f": {problem}" if problem else "")
        raise UserError(f"{what} {path} is not valid YAML{where}") from None
    except RecursionError:  # thousands of nested brackets
        raise UserError(f"{what} {path} is nested too deeply to be read") from None
    except ValueError as e:  # an integer of over 4,300 digits, a date like 2026-13-01
        raise UserError(f"{what} {path}: a value cannot be read ({str(e).split(';')[0].strip()})") from None
