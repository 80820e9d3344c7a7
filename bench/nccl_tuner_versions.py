"""Which tuner-plugin API each released NCCL looks for, read from the released libraries.

NCCL dlopens ``NCCL_TUNER_PLUGIN`` and looks up ``ncclTunerPlugin_vN`` symbols, newest first; the
names it tries are strings in ``libnccl.so``. This downloads NCCL's wheels from PyPI
(``nvidia-nccl-cu12`` and ``nvidia-nccl-cu13``, the NCCL that pip-installed CUDA builds of torch
load; of each, the newest patch of each minor release from 2.19 on unless ``--releases`` names
others), reads those names from the library in each wheel, and says which of the versions
lagom-tune's plugin exports each release will use.
Needs PyPI and about 300 MB of disk at a time (one wheel); not part of ``make bench``.

    python bench/nccl_tuner_versions.py
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.backends.tuner_build import ensure_plugin

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")  # NCCL for CUDA 12 and 13: their patch releases differ
FIRST = (2, 19)  # the first NCCL with tuner plugins
_NAME = re.compile(rb"ncclTunerPlugin_v(\d+)")


def tuner_versions_named(data: bytes) -> set[int]:
    """The ``ncclTunerPlugin_vN`` versions a library's bytes name: for NCCL those it looks up in a
    plugin, for a plugin those it defines.

    Args:
        data: the shared library's contents.
    Returns:
        The version numbers.
    """
    return {int(v) for v in _NAME.findall(data)}


def pip(*args: str) -> str:
    """Run this Python's pip with ``args``; its standard output (a failure raises)."""
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=True).stdout


def listed(package: str) -> list[str]:
    """Every version of ``package`` on the index, as ``pip index versions`` lists them."""
    line = pip("index", "versions", package).split("Available versions:")[1].splitlines()[0]
    return [x.strip() for x in line.split(",")]


def newest_patches(versions: list[str]) -> list[str]:
    """The newest patch of each minor release from 2.19 on, oldest first."""
    newest: dict[tuple[int, int], tuple[int, int, int]] = {}
    for v in versions:
        if re.fullmatch(r"\d+\.\d+\.\d+", v):  # not 2.26.2.post1, a repackaged 2.26.2
            parts = tuple(int(x) for x in v.split("."))
            if parts[:2] >= FIRST:
                newest[parts[:2]] = max(newest.get(parts[:2], parts), parts)
    return [".".join(map(str, v)) for _, v in sorted(newest.items())]


def asked_by_release(package: str, version: str, tmp: Path) -> set[int]:
    """Download one release's wheel and read the tuner versions its libnccl looks up."""
    pip("download", "-q", "--no-deps", "-d", str(tmp), f"{package}=={version}")
    wheel = next(tmp.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    try:
        with zipfile.ZipFile(wheel) as z:
            lib = next(n for n in z.namelist() if re.search(r"/libnccl\.so(\.\d+)*$", n))
            return tuner_versions_named(z.read(lib))
    finally:
        wheel.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", nargs="*", help="versions, read from each package that has them "
                   "(default: the newest patch of each minor from 2.19)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nccl_tuner_versions.md")
    args = p.parse_args()
    build = ensure_plugin()
    if not build.ok:
        sys.exit(f"the plugin did not build: {build.reason}")
    exported = tuner_versions_named(build.path.read_bytes())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        on_index = {package: listed(package) for package in PACKAGES}
        # a version named by --releases is read from each package that has it (2.32.6 is cu13's only)
        wheels = [(package, version) for package in PACKAGES
                  for version in ([r for r in args.releases if r in on_index[package]] if args.releases else newest_patches(on_index[package]))]
        unknown = sorted(set(args.releases or ()) - {version for _, version in wheels})
        if unknown:
            print(f"--releases: {', '.join(unknown)} is no release of {' or '.join(PACKAGES)}", file=sys.stderr)
            sys.exit(2)
        for package, version in wheels:
            asked = asked_by_release(package, version, Path(tmp))
            used = max(asked & exported, default=None)
            rows.append(f"| {version} | `{package}` | {', '.join(f'v{v}' for v in sorted(asked, reverse=True)) or 'none'} | "
                        f"{f'v{used}' if used else 'none: NCCL keeps its own choices'} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Tuner-plugin API versions each NCCL release looks for (MEASURED from the released libraries)",
        "",
        f"{datetime.date.today()} · {platform.node()} ({platform.machine()}) · `python bench/nccl_tuner_versions.py`",
        "",
        "Each row: the wheel of that release from PyPI, its `libnccl.so`'s `ncclTunerPlugin_vN` names "
        "(NCCL tries them newest first and uses the first the plugin defines), and the version of lagom-tune's "
        f"plugin it therefore uses (the plugin defines v{min(exported)}-v{max(exported)}).",
        "",
        "| NCCL | wheel | looks for | lagom-tune's plugin used as |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
