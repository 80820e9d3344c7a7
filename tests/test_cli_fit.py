"""`lagom-tune fit RUN`: a better model reaches an old profile without measuring anything."""

import shutil

import yaml

from conftest import cli


def test_fit_refits_a_run_folder_and_measures_nothing(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "model.yaml").unlink()
    before = (run / "measurements.csv").read_bytes()
    r = cli("fit", run, check=True)
    assert (run / "measurements.csv").read_bytes() == before  # nothing measured, nothing rewritten
    model = yaml.safe_load((run / "model.yaml").read_text())
    assert model["kind"] == "lagom-model" and model["accuracy"]["mape"] and "MAPE" in r.stdout
    assert "wrote" in r.stdout and str(run / "model.yaml") in r.stdout


def test_fit_refuses_what_is_not_a_run_folder(tmp_path):
    for target in (tmp_path / "nowhere", tmp_path):
        r = cli("fit", target)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
