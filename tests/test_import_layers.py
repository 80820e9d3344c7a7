"""The package's layers only point down: every import of a lagom_tune module (at module level or
inside a function) goes to its own layer or one below, so no two layers import each other.

Layers, bottom to top. A module belongs to the layer of the longest prefix that names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "lagom_tune"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Shared types and file helpers: errors, field checks, YAML I/O, knobs and settings, the timeline,
    # the measurement row's columns.
    ("base", ("lagom_tune", "lagom_tune.errors", "lagom_tune.validate", "lagom_tune.artifact_io", "lagom_tune.yaml_io",
              "lagom_tune.knobs", "lagom_tune.timeline", "lagom_tune.measurements",
              "lagom_tune.comparison")),
    ("workload", ("lagom_tune.workload",)),
    ("backends", ("lagom_tune.backends",)),
    ("profile", ("lagom_tune.profile",)),
    ("model", ("lagom_tune.model",)),
    ("search", ("lagom_tune.search",)),
    # The plan file format only (DESIGN.md §2): what search decided, as runtime reads it.
    ("plan", ("lagom_tune.plan",)),
    ("runtime", ("lagom_tune.runtime",)),
    # Workflows that compose the layers (run folder -> plan), and the CLI and renderers on top.
    ("interface", ("lagom_tune.planning", "lagom_tune.plan_check", "lagom_tune.cli", "lagom_tune.render", "lagom_tune.report", "lagom_tune.__main__")),
)

# Upward imports that stay for now, each with the reason and what ends it: (file, imported module).
PENDING: dict[tuple[str, str], str] = {}  # (file, module) -> why an upward import is allowed for now; none


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the layer whose longest prefix names ``module`` (None: no layer does)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def imported_modules(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every lagom_tune module ``path`` imports, anywhere in the file.

    ``from package import name`` counts as importing ``package.name`` when that is a module.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                out.append((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base))
    return sorted({(line, m) for line, m in out if m == "lagom_tune" or m.startswith("lagom_tune.")})


def edges() -> list[tuple[str, int, str, int, int]]:
    """``(file, line, imported module, from layer, to layer)`` for every import between layers."""
    out = []
    for module, path in MODULES.items():
        src = layer_of(module)
        for line, target in imported_modules(module, path):
            dst = layer_of(target)
            if src is not None and dst is not None and src != dst:
                out.append((str(path.relative_to(ROOT)), line, target, src, dst))
    return out


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"add these modules to a layer of LAYERS: {missing}"


def test_imports_only_point_down():
    upward = [f"{f}:{line}: imports {target} ({LAYERS[src][0]} -> {LAYERS[dst][0]}, upward)"
              for f, line, target, src, dst in edges() if dst > src and (f, target) not in PENDING]
    assert not upward, "upward imports between layers:\n" + "\n".join(upward)


def test_no_cycle_between_layers():
    graph: dict[int, set[int]] = {}
    where: dict[tuple[int, int], str] = {}
    for f, line, target, src, dst in edges():
        if (f, target) not in PENDING:
            graph.setdefault(src, set()).add(dst)
            where.setdefault((src, dst), f"{f}:{line}")

    def cycle_from(node: int, path: list[int]) -> list[int] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None

    for start in sorted(graph):
        cycle = cycle_from(start, [start])
        assert cycle is None, "cycle between layers: " + " -> ".join(
            f"{LAYERS[a][0]} ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:])) + f" -> {LAYERS[cycle[-1]][0]}"


def test_pending_exceptions_name_real_files():
    """An exception names a file that exists (a moved file would silently drop its check)."""
    assert all((ROOT / f).is_file() for f, _ in PENDING), PENDING
