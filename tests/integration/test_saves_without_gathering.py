"""Saves without 16-bit gathering (`stage3_gather_16bit_weights_on_model_save: false`), under real 2-rank ZeRO-3
on CPU. The planner turns gathering off where the 16-bit copy of the whole model that each save puts in rank 0's
host RAM does not fit (recipes 10b-h200x1, 20b-h200x2): training must be the same, and the final state and every
checkpoint must still become a Hugging Face folder with `hf-zero3 export`."""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, explain, losses_by_step, run, weights

pytestmark = pytest.mark.integration

RUN = ["--max_steps", "5", "--save_steps", "2", "--logging_steps", "1", "--validation_file", "null",
       "--warmup_steps", "2"]
"""5 steps, a save every 2: the final state (step 5) is past the newest checkpoint (step 4)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gather")
    config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (root / "no_gather.json").write_text(json.dumps(config))
    procs = {}
    for name, extra in (("gathered", []), ("shards", ["--deepspeed", root / "no_gather.json"])):
        procs[name] = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", root / name, *RUN, *extra],
                          MASTER_PORT=str(free_port()))
        assert procs[name].returncode == 0, explain(procs[name])
    return root, procs


def test_training_is_the_same_and_the_run_says_how_to_get_the_model(runs):
    root, procs = runs
    assert losses_by_step(root / "shards") == losses_by_step(root / "gathered")
    assert not (root / "shards/model.safetensors").exists()
    assert f"hf-zero3 export {root / 'shards'} {root / 'shards'}-hf" in procs["shards"].stdout
    assert "ZeRO shards" not in procs["gathered"].stdout


def test_the_final_shards_export_to_the_gathered_final_model(runs):
    root, _ = runs
    proc = run(["hf-zero3", "export", root / "shards", root / "shards-hf", "--dtype", "fp32"])
    assert proc.returncode == 0, explain(proc)
    exported, gathered = weights(root / "shards-hf"), weights(root / "gathered")
    assert exported.keys() == gathered.keys()
    assert all(torch.equal(exported[k], gathered[k]) for k in gathered)  # tiny trains in fp32 on CPU


def test_a_stale_latest_in_a_finished_folder_is_not_exported_as_its_final_model(runs, tmp_path):
    """A gathering run in a folder an earlier shards run used: its finished record names no shards, so the old
    `latest` there is not taken for its final model."""
    import shutil

    root, _ = runs
    reused = tmp_path / "reused"
    shutil.copytree(root / "gathered", reused)
    shutil.copy(root / "shards/latest", reused / "latest")
    proc = run(["hf-zero3", "export", reused, tmp_path / "out"])
    assert proc.returncode != 0 and "is not a complete checkpoint" in proc.stderr and not (tmp_path / "out").exists()


def test_a_checkpoint_without_gathered_weights_exports(runs):
    root, _ = runs
    assert (root / "shards/checkpoint-4/hf_zero3_complete.json").is_file()
    assert not (root / "shards/checkpoint-4/model.safetensors").exists()
    proc = run(["hf-zero3", "export", root / "shards/checkpoint-4", root / "ckpt4-hf"])
    assert proc.returncode == 0, explain(proc)
    assert (root / "ckpt4-hf/model.safetensors").is_file()
