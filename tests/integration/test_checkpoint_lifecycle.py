"""The checkpoint lifecycle under real 2-rank ZeRO-3 on CPU: kill -9, full disk, keep-last-N, resume, export,
reshard, Hub push. Runs are shared between assertions (module fixtures) to keep the file near 5 minutes."""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.distributed import free_port
from tests.conftest import (
    CHECKPOINT_RUN,
    ROOT,
    TINY_YAML,
    Launch,
    explain,
    logged_steps,
    losses_by_step,
    run,
    weights,
)
from tests.hub_server import LocalHub

pytestmark = pytest.mark.integration

STEPS = 8
COMMON = CHECKPOINT_RUN
TOKEN = "hf_" + secrets.token_hex(16)
"""A fake Hub token: must reach the Hub's Authorization header and nothing else."""


@pytest.fixture(scope="module")
def hub():
    server = LocalHub(token=TOKEN)  # weights through the LFS path, as on the Hub (tests/hub_server.py)
    yield server
    server.close()


def hub_env(hub: LocalHub) -> dict[str, str]:
    return hub.env(TOKEN)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, hub):
    """The uninterrupted run: 8 steps, a save every 2, keep 2, pushing each complete checkpoint to LocalHub."""
    out = tmp_path_factory.mktemp("reference") / "run"
    started = time.time()
    proc = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", out, *COMMON, "--save_total_limit", "2",
                "--push_to_hub", "true", "--hub_model_id", "org/tiny-run", "--hub_private_repo", "true"],
               MASTER_PORT=str(free_port()), **hub_env(hub))
    assert proc.returncode == 0, explain(proc)
    print(f"reference run: {time.time() - started:.0f} s")
    return proc, out


def test_keep_last_n_leaves_the_newest_two_complete_checkpoints(reference):
    _, out = reference
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6", "checkpoint-8"]
    for folder in ckpt.list_checkpoints(out):
        assert ckpt.is_complete(folder) and contents.verify_checkpoint(folder) == [], folder
    record = ckpt.read_marker(out / "checkpoint-8")
    assert record["world_size"] == 2 and record["weights_16bit"] is True
    assert record["recipe"] == {"name": "tiny", "version": "v1"}
    assert record["files"]["global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"]["size"] > 1_000_000


def test_callback_pushes_exported_weights_with_a_card_at_each_save(reference, hub):
    proc, out = reference
    pushes = [c for c in hub.commits if c["repo"] == "org/tiny-run"]
    pushed = [c["summary"] for c in pushes]  # one push at a time in the background: a busy save is skipped
    assert pushed[0] == "checkpoint-2 (step 2)" and pushed[-1] == "checkpoint-8 (step 8)", pushed
    assert set(pushed) <= {f"checkpoint-{s} (step {s})" for s in (2, 4, 6, 8)}, pushed
    created = hub.repos["org/tiny-run"]
    assert created.get("private") is True or created.get("visibility") == "private", created
    assert set(pushes[-1]["files"]) == {"model.safetensors", "config.json", "generation_config.json",
                                        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md"}
    assert pushes[-1]["lfs"] == ["model.safetensors"]  # the weights took the LFS upload, as on the Hub
    card = pushes[-1]["files"]["README.md"].decode()
    final_loss = losses_by_step(out)[STEPS]
    for text in ("- Recipe: `tiny` v1", "- Hardware: 2 × CPU", "samples/s", "- distributed_type: DeepSpeed ZeRO-3",
                 f"- Final training loss: {final_loss:.4f} (step 8)", "- train_batch_size: 8", "license: other",
                 "- transformers "):
        assert text in card, text
    assert str(out) not in card and "Infinity" not in card
    from safetensors.torch import load

    pushed = load(pushes[-1]["files"]["model.safetensors"])
    trained = weights(out / "checkpoint-8")
    assert all(torch.equal(pushed[k], trained[k].to(torch.bfloat16)) for k in trained)
    assert "hf_zero3: pushed checkpoint-8 to org/tiny-run" in proc.stdout
    # exported in the background from hard-link snapshots (keep-last-N may delete a checkpoint meanwhile)
    assert "cannot hard-link" not in proc.stdout and "hf_zero3: WARNING" not in proc.stdout, proc.stdout[-4000:]
    assert list(out.glob(".hub-export-*")) == []


def test_the_token_reaches_the_hub_and_nothing_else(reference, hub):
    proc, out = reference
    assert f"Bearer {TOKEN}" in hub.auth
    assert TOKEN not in proc.stdout + proc.stderr
    for commit in hub.commits:
        assert all(TOKEN.encode() not in data for data in commit["files"].values())
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """kill -9 one rank at a random step; resume and kill -9 again in the middle of a save; resume to the end."""
    root = tmp_path_factory.mktemp("killed")
    out = root / "run"
    step = random.Random().randint(3, 5)
    first = Launch(out, *COMMON, log=root / "1.log")
    first.wait_for(lambda: max(logged_steps(out), default=0) >= step)
    first.kill_rank(1)
    first_status = first.wait(timeout=120)
    after_first = ckpt.newest_complete(out)

    second = Launch(out, *COMMON, "--resume_from_checkpoint", "auto", log=root / "2.log")
    mid_save = ckpt.checkpoint_step(after_first) + 2
    second.wait_for(lambda: (out / f"checkpoint-{mid_save}" / f"global_step{mid_save}").is_dir(), poll=0.001)
    second.kill_rank(0)
    second_status = second.wait(timeout=120)
    half_written = out / f"checkpoint-{mid_save}"
    half_written_state = (half_written.is_dir(), ckpt.is_complete(half_written),
                          (half_written / ckpt.SAVING).exists())
    after_second = ckpt.newest_complete(out)

    third = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", out, *COMMON, "--resume_from_checkpoint",
                 "auto"], MASTER_PORT=str(free_port()))
    return {"out": out, "step": step, "first": (first_status, after_first, first.text()), "mid_save": mid_save,
            "second": (second_status, half_written_state, after_second), "third": third}


def test_kill_at_a_random_step_leaves_the_complete_checkpoints_before_it(killed_and_resumed):
    status, after_first, log = killed_and_resumed["first"]
    assert status != 0, log
    assert after_first is not None and ckpt.checkpoint_step(after_first) <= killed_and_resumed["step"] + 1, log


def test_kill_in_the_middle_of_a_save_leaves_it_unmarked_and_the_previous_one_newest(killed_and_resumed):
    status, (exists, complete, saving), after_second = killed_and_resumed["second"]
    assert status != 0
    assert exists and not complete and saving
    assert ckpt.checkpoint_step(after_second) == killed_and_resumed["mid_save"] - 2


def test_resume_cleans_up_the_half_written_save_and_continues_bit_identically(killed_and_resumed, reference):
    out, third = killed_and_resumed["out"], killed_and_resumed["third"]
    _, after_second = killed_and_resumed["second"][1:]
    assert third.returncode == 0, explain(third)
    mid_save = killed_and_resumed["mid_save"]
    assert f"removing {out / f'checkpoint-{mid_save}'}: its save never finished" in third.stdout
    resumed_from = ckpt.checkpoint_step(after_second)
    steps = logged_steps(out)  # three runs appended to one log: the third starts where the order restarts
    restart = max(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart:] == list(range(resumed_from + 1, STEPS + 1)), steps
    ours, uninterrupted = losses_by_step(out), losses_by_step(reference[1])
    assert [ours[s] for s in range(1, STEPS + 1)] == [uninterrupted[s] for s in range(1, STEPS + 1)]
    final, expected = weights(out), weights(reference[1])
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert all(ckpt.is_complete(p) for p in ckpt.list_checkpoints(out))


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")


@pytest.fixture(scope="module")
def small_disks(tmp_path_factory):
    root = tmp_path_factory.mktemp("disks")
    mounts = []

    def mount(name: str, size: str) -> Path:
        _mount_tmpfs(root / name, size)
        mounts.append(root / name)
        return root / name

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_too_small_for_the_next_checkpoint_is_a_clear_error_before_writing(small_disks, tmp_path):
    disk = small_disks("precheck", "26m")  # one ~16 MB checkpoint fits, a second does not
    proc = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", disk / "run", *COMMON], timeout=300,
               MASTER_PORT=str(free_port()))
    assert proc.returncode != 0
    assert "disk full: checkpoint-4 needs about 0.01" in proc.stdout + proc.stderr, explain(proc)
    assert [p.name for p in ckpt.list_checkpoints(disk / "run")] == ["checkpoint-2"]
    assert ckpt.is_complete(disk / "run/checkpoint-2") and contents.verify_checkpoint(disk / "run/checkpoint-2") == []


def test_disk_full_in_the_middle_of_a_save_keeps_older_checkpoints_and_resumes(small_disks, tmp_path, reference):
    """checkpoint-4 lives on a 6 MB disk (a symlink): the save fails half-way; the run ends, nothing hangs."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-4").symlink_to(small_disks("full", "6m"))
    first = Launch(out, *COMMON, "--overwrite_output_dir", "true", log=tmp_path / "1.log")
    assert first.wait(timeout=300) != 0
    assert f"saving {out / 'checkpoint-4'} failed: the disk is full" in first.text(), first.text()
    assert ckpt.is_complete(out / "checkpoint-2") and not ckpt.is_complete(out / "checkpoint-4")
    resumed = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", out, *COMMON, "--resume_from_checkpoint",
                   "auto"], MASTER_PORT=str(free_port()))
    assert resumed.returncode == 0, explain(resumed)
    assert f"removing {out / 'checkpoint-4'}" in resumed.stdout
    assert not (out / "checkpoint-4").is_symlink() and ckpt.is_complete(out / "checkpoint-4")
    assert losses_by_step(out) == losses_by_step(reference[1])


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    _, out = reference
    root = tmp_path_factory.mktemp("export")
    fp32 = run(["hf-zero3", "export", out / "checkpoint-8", root / "fp32", "--dtype", "fp32"])
    bf16 = run(["hf-zero3", "export", out / "checkpoint-8", root / "bf16", "--shard-size", "1MB"])
    assert fp32.returncode == 0 and bf16.returncode == 0, explain(fp32) + explain(bf16)
    return out, root


def _logits(folder: Path, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = torch.arange(64).reshape(2, 32) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_export_reloads_with_from_pretrained_and_matches_the_trained_logits(exported):
    out, root = exported
    assert torch.equal(_logits(root / "fp32"), _logits(out))  # fp32 master weights == the final model, exactly
    assert sorted(p.name for p in (root / "fp32").iterdir()) == [
        "README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    shards = sorted((root / "bf16").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (root / "bf16/model.safetensors.index.json").is_file()
    assert json.loads((root / "bf16/config.json").read_text())["dtype"] == "bfloat16"
    bf16_logits = _logits(root / "bf16", dtype=torch.bfloat16)
    assert torch.allclose(bf16_logits, _logits(out), atol=0.1), (bf16_logits - _logits(out)).abs().max()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(root / "bf16")("hello").input_ids


def test_push_cli_uploads_an_exported_folder_to_a_private_branch(exported, hub):
    _, root = exported
    proc = run(["hf-zero3", "push", root / "bf16", "--repo-id", "org/cli", "--private", "--revision", "v1"],
               **hub_env(hub))
    assert proc.returncode == 0, explain(proc)
    assert TOKEN not in proc.stdout + proc.stderr
    assert ("org/cli", "v1") in hub.branches
    commit = [c for c in hub.commits if c["repo"] == "org/cli"][-1]
    assert commit["revision"] == "v1"
    assert set(commit["files"]) == {p.name for p in (root / "bf16").iterdir()}
    assert commit["lfs"] == sorted(p.name for p in (root / "bf16").glob("*.safetensors")) and len(commit["lfs"]) >= 3
    assert "- Recipe: `tiny` v1" in commit["files"]["README.md"].decode()


def test_reshard_two_ranks_then_resume_on_one(reference, tmp_path):
    """Universal checkpoint from the 2-rank checkpoint-6, then steps 7-8 on one rank with the same global batch."""
    import shutil

    _, out = reference
    resumed = tmp_path / "run"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-6", resumed / "checkpoint-6")
    proc = run(["hf-zero3", "reshard", resumed / "checkpoint-6"])
    assert proc.returncode == 0, explain(proc)
    assert (resumed / "checkpoint-6/latest_universal").read_text() == "global_step6_universal"
    ds_config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    ds_config["checkpoint"] = {"load_universal": True}
    (tmp_path / "ds_universal.json").write_text(json.dumps(ds_config))
    one = run(["python", "-m", "hf_zero3.train", TINY_YAML, *COMMON, "--per_device_train_batch_size", "16",
               "--deepspeed", tmp_path / "ds_universal.json", "--output_dir", resumed,
               "--resume_from_checkpoint", "auto"])
    assert one.returncode == 0, explain(one)
    assert "ZeRO stage 3 | world size 1 | micro batch 16" in one.stdout
    ours, uninterrupted = losses_by_step(resumed), losses_by_step(out)
    assert sorted(ours) == [7, 8]
    assert all(abs(ours[s] - uninterrupted[s]) < 1e-5 for s in ours), (ours, uninterrupted)
