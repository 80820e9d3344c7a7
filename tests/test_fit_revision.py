"""A change to what the fit predicts is a new fit revision (``FIT_REVISION``), never a silent one.

``model.yaml`` records the revision that fitted it, and ``show``, ``report`` and ``search`` name a
model another revision made (``contention.fit_revision_note``). That only works if every change to
the fit's predictions bumps the revision: here each revision's held-out figures on measured runs
(two H200 probe profiles and one simulated two-node profile for ``lagom-gpu``, one gloo profile for
``cpu-pairwise``) are recorded, and a refit that moves one under the same revision fails. The
simulated run holds what the H200 runs do not: ring, tree and NVLS all-reduces in three protocols,
across two nodes.
"""

import shutil
from pathlib import Path

import pytest
import yaml

from lagom_tune.model.contention import FIT_REVISION

from conftest import ROOT, cli

DATA = Path(__file__).parent / "data"
RUNS = {
    "mpt-7b-tp8-dp1": DATA / "h200-2026-11-30" / "mpt-7b-tp8-dp1",
    "llama3-8b-fsdp8": DATA / "h200-2026-11-30" / "llama3-8b-fsdp8",
    "cpu-demo": DATA / "gloo-2026-12-06-cpu-demo",
    "llama3-8b-tp8-dp2-simulated": DATA / "sim-2026-12-07-h100-llama3-8b-tp8-dp2",
}
# Each revision's held-out MAPEs (and, for the GPU fit, ranking medians) on RUNS. A change to the fit
# that moves one is a new revision: add its figures under the new FIT_REVISION, never edit an old one.
FIGURES = {
    1: {"mpt-7b-tp8-dp1": dict(collective=0.0455, gemm=0.0363, overlap_window=0.0149, overlap_compute=0.0215, overlap_comm=0.0241,
                               median_spearman=0.9875, median_best_gap=0.0074),
        "llama3-8b-fsdp8": dict(collective=0.0412, gemm=0.1102, overlap_window=0.0204, overlap_compute=0.0304, overlap_comm=0.025,
                                median_spearman=0.9375, median_best_gap=0.0272),
        "cpu-demo": dict(collective=0.2679, gemm=0.3934, overlap_window=0.1846, overlap_compute=0.1998, overlap_comm=0.2075),
        "llama3-8b-tp8-dp2-simulated": dict(collective=0.0199, gemm=0.013, overlap_window=0.027, overlap_compute=0.0346,
                                            overlap_comm=0.0228, collective_default=0.021, median_spearman=0.9292,
                                            median_best_gap=0.0288)},
}
# 2026-12-07: the CPU family takes a measured shape's time alone from its point and its pairs' alone
# times; the GPU family's figures are revision 1's
FIGURES[2] = {**FIGURES[1], "cpu-demo": dict(collective=0.2679, gemm=0.3851, overlap_window=0.1032, overlap_compute=0.0781,
                                             overlap_comm=0.1853)}
# Figures are recorded to 4 places; this allows another BLAS its last digits (torch 2.6, 2.9 and 2.13
# fit the same). Capping one grid of the GPU fit (CORUN_GRID at 30%) moved overlap_compute by 0.0009
# and the Spearman by 0.004.
SAME = 0.0005
REFIT = ("lagom-tune fit bench/results/gpu_check-{w}-run, then python bench/gpu_check.py "
         "--run bench/results/gpu_check-{w}-run --workload {w} --report-only")


@pytest.fixture(scope="module", params=list(RUNS))
def refitted(request, tmp_path_factory) -> tuple[str, dict]:
    """A run's name and the accuracy record this lagom-tune's fit of it writes."""
    run = tmp_path_factory.mktemp("refit") / request.param
    shutil.copytree(RUNS[request.param], run)
    cli("fit", run, check=True, timeout=600)
    return request.param, yaml.safe_load((run / "model.yaml").read_text())["accuracy"]


def gpu_check_run(name: str) -> Path:
    """Where bench/gpu_check.py left the H200 run of ``name``, fitted: the README's H200 figures."""
    return ROOT / "bench" / "results" / f"gpu_check-{name}-run"


def figures(accuracy: dict) -> dict:
    """A model's held-out MAPEs and its ranking's medians (a GPU model's), in one mapping."""
    ranking = accuracy.get("ranking") or {}
    return {**accuracy["mape"], **{k: ranking[k] for k in ("median_spearman", "median_best_gap") if k in ranking}}


def moved(got: dict, expected: dict) -> dict:
    """The figures of ``expected`` that ``got`` lacks or that differ by more than :data:`SAME`."""
    return {k: (expected[k], got.get(k)) for k in expected if got.get(k) is None or abs(got[k] - expected[k]) > SAME}


def test_a_change_to_what_the_fit_predicts_is_a_new_fit_revision(refitted):
    name, accuracy = refitted
    assert accuracy["fit_revision"] == FIT_REVISION
    assert FIT_REVISION in FIGURES, f"add revision {FIT_REVISION}'s figures to FIGURES: {name}: {figures(accuracy)}"
    off = moved(figures(accuracy), FIGURES[FIT_REVISION][name])
    hint = f", and {REFIT.format(w=name)}" if gpu_check_run(name).is_dir() else ""
    assert not off, (f"the fit's held-out figures on {name} moved (revision {FIT_REVISION}'s, now): {off}; bump FIT_REVISION "
                     f"in model/contention.py and add its figures to FIGURES{hint}")


@pytest.mark.parametrize("refitted", ["mpt-7b-tp8-dp1", "llama3-8b-fsdp8"], indirect=True)
def test_the_committed_h200_models_are_the_current_fit(refitted):
    """bench/results/gpu_check-*-run/model.yaml come from the same measurements as the H200 runs:
    they must be this revision's fit of them."""
    name, accuracy = refitted
    committed = gpu_check_run(name)
    assert (committed / "measurements.csv").read_bytes() == (RUNS[name] / "measurements.csv").read_bytes()
    recorded = yaml.safe_load((committed / "model.yaml").read_text())["accuracy"]
    assert recorded.get("fit_revision") == FIT_REVISION and not moved(figures(recorded), figures(accuracy)), \
        f"{committed}/model.yaml is not revision {FIT_REVISION}'s fit: {REFIT.format(w=name)}"
