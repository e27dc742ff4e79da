"""Resuming a run whose optimizer states live on NVMe continues it exactly: Adam's moments, step counts and
learning rates come back (hf_zero3/callbacks/nvme_resume.py), not only the fp32 weights DeepSpeed 0.19 restores.
The shrunk 70b recipe (its own ds_config, NVMe in a temporary folder) on 2 CPU ranks; needs libaio."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_zero3.checkpoint.contents import optim_states_files
from tests.conftest import ROOT, explain, losses_by_step, run, weights
from tests.integration.test_recipes import shrunk_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sub_group_size", [None, 100_000])
def test_resume_from_an_nvme_checkpoint_matches_the_uninterrupted_run(tmp_path, sub_group_size):
    """None: the recipe's sub-groups (one per rank here, swapped). 100,000: 12 per rank, some below DeepSpeed's
    1 MB swap minimum, which stay in host memory and which DeepSpeed's NVMe load does not restore either. The export
    of such a mixed checkpoint is the 16-bit model the run gathered, bit for bit."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        pytest.skip("NVMe offload needs DeepSpeed's async_io op, which needs libaio (apt install libaio-dev, or "
                    "CFLAGS/LDFLAGS pointing at it: benchmarks/common.sh)")
    config, overrides, _ = shrunk_config("70b", tmp_path / "config")
    recipe_config = json.loads((ROOT / "recipes/70b/ds_config.json").read_text())
    if sub_group_size:
        recipe_config["zero_optimization"]["sub_group_size"] = sub_group_size

    def train(name: str, *extra) -> None:
        (tmp_path / f"nvme-{name}").mkdir()
        recipe_config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / f"nvme-{name}")
        (tmp_path / f"ds-{name}.json").write_text(json.dumps(recipe_config))
        proc = run([ROOT / "recipes/70b/launch.sh", "--deepspeed", tmp_path / f"ds-{name}.json",
                    "--model_name_or_path", "null", "--config_name", config, "--config_overrides", overrides,
                    "--tokenizer_name", "assets/tiny/model", "--train_file", "assets/tiny/corpus/train.txt",
                    "--validation_file", "null", "--block_size", "64", "--max_steps", "5", "--logging_steps", "1",
                    "--save_steps", "3", "--learning_rate", "1.0e-3", "--warmup_steps", "0",
                    "--output_dir", tmp_path / name, *extra], NUM_NODES="1", NUM_GPUS="2", OMP_NUM_THREADS="1")
        assert proc.returncode == 0, explain(proc)

    train("straight")
    shard, = optim_states_files(tmp_path / "straight/checkpoint-3/global_step3", 0)
    groups = torch.load(shard, weights_only=False, map_location="cpu")["optimizer_state_dict"]["fp32_flat_groups"]
    in_memory = sum(g.numel() > 0 for g in groups)
    assert (in_memory > 0) == bool(sub_group_size) and in_memory < len(groups), [g.numel() for g in groups]
    exported = run(["hf-zero3", "export", tmp_path / "straight/checkpoint-3", tmp_path / "export"])
    assert exported.returncode == 0, explain(exported)
    gathered, export = weights(tmp_path / "straight/checkpoint-3"), weights(tmp_path / "export")
    assert all(torch.equal(export[k], gathered[k]) for k in gathered), "export differs from the trained weights"
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight/checkpoint-3", tmp_path / "resumed/checkpoint-3")
    train("resumed", "--resume_from_checkpoint", "auto")
    straight, resumed = losses_by_step(tmp_path / "straight"), losses_by_step(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5] and all(resumed[s] == straight[s] for s in (4, 5)), (straight, resumed)
    # DeepSpeed alone restarts Adam here: step 5's loss was 5.86 against 5.31, its grad norm 10.8 against 2.6
    final, expected = weights(tmp_path / "resumed"), weights(tmp_path / "straight")
    assert all(torch.equal(final[k], expected[k]) for k in expected), "the resumed run ended on other weights"
