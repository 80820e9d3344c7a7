"""The package's metadata builds without deprecation warnings and ships its license."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUILD = """
import sys, warnings
warnings.simplefilter("error")  # setuptools' deprecation of the TOML license table was a warning
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def _setuptools_older_than_the_build_needs() -> bool:
    """pip builds the package with the setuptools ``[build-system]`` asks for; this test imports the
    environment's own, which a venv may hold below that (Python 3.11's ``venv`` gives 65) or not at
    all (3.12's)."""
    needs = re.search(r'requires = \["setuptools>=(\d+)"', (ROOT / "pyproject.toml").read_text())
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) < int(needs.group(1))
    except importlib.metadata.PackageNotFoundError:
        return True


@pytest.mark.skipif(_setuptools_older_than_the_build_needs(), reason="this environment's setuptools is older than the build's, or absent")
def test_metadata_builds_without_warnings_and_names_the_license(tmp_path):
    r = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Deprecat" not in r.stderr and "Warning" not in r.stderr, r.stderr[-2000:]
    meta = (tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-File: LICENSE" in meta
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
