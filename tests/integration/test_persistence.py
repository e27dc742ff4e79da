"""ZeRO-3's persistence threshold as the planner models it. One rank, every parameter persistent (the planner's
one-GPU choice): DeepSpeed takes the setting, keeps every parameter whole, and trains exactly as with the default
threshold (fp32 on CPU). Two ranks: a persistent tensor is whole beside its partition, and the persistent elements
are the planner's `persistent_params`."""

from __future__ import annotations

import json

import pytest

from hf_zero3.config.spec import EVERY_PARAMETER
from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, losses, run

pytestmark = pytest.mark.integration


def test_every_parameter_persists_on_one_rank_and_the_losses_do_not_change(tmp_path):
    """Both runs in their own processes: a ZeRO-3 run inside pytest's process would leave DeepSpeed's process groups
    behind for the in-process tests after it."""
    config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    common = ["--max_steps", "5", "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
              "--learning_rate", "1e-3"]
    paths = {}
    for name, threshold in (("auto", "auto"), ("every", EVERY_PARAMETER)):
        config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(config))

    default = run([ROOT / "recipes/tiny/launch.sh", "--deepspeed", paths["auto"], "--output_dir", tmp_path / "auto",
                   *common], NUM_GPUS="1", MASTER_PORT=str(free_port()))
    assert default.returncode == 0, explain(default)
    assert "ZeRO stage 3 | world size 1" in default.stdout
    every = run(["deepspeed", "--num_gpus", "1", "--master_port", free_port(), "tests/integration/persistence_probe.py",
                 tmp_path / "probe", TINY_YAML, "--deepspeed", paths["every"], "--output_dir", tmp_path / "every",
                 *common])
    assert every.returncode == 0, explain(every)

    params = json.loads((tmp_path / "probe" / "rank0.json").read_text())
    assert params and all(p["persist"] and p["whole"] == p["partition"] == p["numel"] for p in params), params
    assert losses(tmp_path / "every") == pytest.approx(losses(tmp_path / "auto"), abs=1e-6)
    assert len(losses(tmp_path / "every")) == 5


def test_on_two_ranks_a_persistent_tensor_is_whole_beside_its_partition(tmp_path):
    from hf_zero3.plan.shapes import load_shape

    threshold = 45_056  # exactly the tiny model's MLP matrices (DeepSpeed: ds_numel <= threshold): every layer
    # matrix persists, not the embedding or lm_head (131,072)
    config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    (tmp_path / "ds.json").write_text(json.dumps(config))
    proc = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "tests/integration/persistence_probe.py",
                tmp_path / "probe", TINY_YAML, "--deepspeed", tmp_path / "ds.json", "--output_dir", tmp_path / "out",
                "--max_steps", "1", "--save_strategy", "no", "--validation_file", "null"])
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        params = json.loads((tmp_path / "probe" / f"rank{rank}.json").read_text())
        persistent = [p for p in params if p["persist"]]
        assert [p["name"] for p in params if p["numel"] <= threshold] == [p["name"] for p in persistent]
        assert all(p["whole"] == p["numel"] and 0 < p["partition"] < p["numel"] for p in persistent), persistent
        assert all(p["whole"] == 0 for p in params if not p["persist"])  # released after use
        assert sum(p["numel"] for p in persistent) == load_shape(str(ROOT / "assets/tiny/model")).persistent_params(
            threshold)
