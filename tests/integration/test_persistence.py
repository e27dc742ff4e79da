"""ZeRO-3's persistence threshold as the planner models it. One rank, every parameter persistent (the planner's
one-GPU choice): DeepSpeed takes the setting, keeps every parameter whole, and trains exactly as with the default
threshold (fp32 on CPU). Two ranks: a persistent tensor is whole beside its partition, and the persistent elements
are the planner's `persistent_params`."""

from __future__ import annotations

import json

import pytest

from hf_zero3.config.spec import EVERY_PARAMETER
from hf_zero3.run.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, losses, run

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("single_rank_env")
def test_every_parameter_persists_on_one_rank_and_the_losses_do_not_change(tmp_path):
    from transformers import TrainerCallback

    from hf_zero3.run.train import main

    class Persistence(TrainerCallback):
        """Which parameters DeepSpeed keeps whole (`ds_persist`), seen from inside the run."""

        def __init__(self):
            self.persist = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if not self.persist:
                self.persist = [bool(getattr(p, "ds_persist", False)) for p in model.parameters()]

    config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    common = ["--max_steps", "5", "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
              "--learning_rate", "1e-3"]
    paths = {}
    for name, threshold in (("auto", "auto"), ("every", EVERY_PARAMETER)):
        config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(config))

    # the default threshold through the recipe's launcher on one rank; the planner's through the Trainer in-process,
    # where a callback can look at the parameters (a process group cannot be set up twice in one process)
    default = run([ROOT / "recipes/tiny/launch.sh", "--deepspeed", paths["auto"], "--output_dir", tmp_path / "auto",
                   *common], NUM_GPUS="1", MASTER_PORT=str(free_port()))
    assert default.returncode == 0, explain(default)
    assert "ZeRO stage 3 | world size 1" in default.stdout
    probe = Persistence()
    argv = [str(TINY_YAML), "--deepspeed", str(paths["every"]), "--output_dir", str(tmp_path / "every"), *common]
    assert main(argv, extra_callbacks=[probe]) == 0

    assert probe.persist and all(probe.persist), probe.persist
    every, auto = losses(tmp_path / "every"), losses(tmp_path / "auto")
    assert len(every) == 5 and every == pytest.approx(auto, abs=1e-6)


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
