"""The package's metadata builds without deprecation warnings and ships its license."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD = """
import sys, warnings
warnings.simplefilter("error")  # setuptools' deprecation of the TOML license table was a warning
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_metadata_builds_without_warnings_and_names_the_license(tmp_path):
    r = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Deprecat" not in r.stderr and "Warning" not in r.stderr, r.stderr[-2000:]
    meta = (tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-File: LICENSE" in meta
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
