"""measured.json, the planner's measured figures: shipped with the package, every row's source a committed report, and
the memory model's defaults the H200 probe's figures (one copy of each fact)."""

from __future__ import annotations

from hf_zero3.plan import calibration, memory
from hf_zero3.plan.profiles import FIXED_TERMS, PROFILES
from tests.conftest import ROOT


def test_every_row_names_a_committed_report_under_benchmarks_results():
    data = calibration.load()
    assert isinstance(data["version"], int) and data["speeds"]
    for row in data["speeds"]:
        assert row["source"].startswith("benchmarks/results/") and (ROOT / row["source"]).is_file(), row
    for gpu, row in data["fixed_terms"].items():
        assert row["source"].startswith("estimate") or (ROOT / row["source"]).is_file(), (gpu, row["source"])


def test_every_profile_has_fixed_terms_and_unprobed_types_say_estimate():
    assert {p.gpu for p in PROFILES.values()} <= set(FIXED_TERMS)
    assert all(t.source.startswith("estimate") for gpu, t in FIXED_TERMS.items() if gpu != "H200")


def test_the_memory_models_defaults_are_the_h200_probe():
    """An unnamed machine (`plan --gpus 2 --gpu-mem 140GiB`) is planned with memory.py's defaults: they must be the
    measured H200 row, not a second copy that drifts from it."""
    h200 = FIXED_TERMS["H200"]
    assert memory.FixedTerms(source=h200.source) == h200


def test_the_data_file_ships_with_the_package():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert calibration.FILE in cfg["options.package_data"]["hf_zero3.plan"].split()
