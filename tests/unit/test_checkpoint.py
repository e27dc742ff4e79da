"""Checkpoint integrity, marker, keep-last-N and resume planning on checkpoint folders laid out as DeepSpeed
ZeRO-3 + the Trainer write them (real torch.save / safetensors files, tiny tensors)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hf_zero3.checkpoint import contents, folders
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.cli import build_parser
from hf_zero3.cli import main as cli_main
from tests.conftest import SHAPES, error_naming, make_checkpoint


def steps(paths) -> list[int]:
    return [ckpt.checkpoint_step(p) for p in paths]


def test_a_fully_written_checkpoint_has_no_problems_and_the_marker_lists_its_files(tmp_path):
    folder = make_checkpoint(tmp_path, 10, marked=False)
    assert contents.verify_checkpoint(folder) == []
    ckpt.write_marker(folder, {"world_size": 2})
    record = ckpt.read_marker(folder)
    assert record["step"] == 10 and record["world_size"] == 2
    assert "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt" in record["files"]
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != ckpt.MARKER]
    assert record["bytes"] == sum(p.stat().st_size for p in files)
    assert ckpt.is_complete(folder)


@pytest.mark.parametrize("damage, expected", [
    (lambda f: (f / "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
     ("rank 1", "no optim_states shard")),
    (lambda f: (f / "latest").unlink(), ("no `latest` tag file",)),
    (lambda f: (f / "rng_state_1.pth").unlink(), ("rank 1", "rng_state_1.pth", "unreadable")),
    (lambda f: os.truncate(f / "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt", 100),
     ("rank 0", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "unreadable")),
    (lambda f: (f / "trainer_state.json").write_text('{"global_step": 9}'), ("trainer_state.json", "step 9")),
    (lambda f: (f / "model.safetensors").unlink(), ("no model.safetensors",)),
])
def test_each_missing_or_broken_part_is_named(tmp_path, damage, expected):
    folder = make_checkpoint(tmp_path, 10, marked=False)
    damage(folder)
    error_naming("\n".join(contents.verify_checkpoint(folder)), *expected)


def test_weights_that_look_saved_but_hold_nothing_are_caught(tmp_path):
    """The ZeRO-3 failure users hit: a model.safetensors of empty (shape [0]) or missing tensors."""
    empty = make_checkpoint(tmp_path / "a", 10, marked=False, weights={k: torch.empty(0) for k in SHAPES})
    assert any("(no values)" in p for p in contents.verify_weights(empty))
    partial = make_checkpoint(tmp_path / "b", 10, marked=False, weights={"lm_head.weight": torch.ones(8, 4)})
    (problem,) = contents.verify_weights(partial)
    error_naming(problem, "1 trained parameter(s) missing", "model.embed_tokens.weight")
    wrong = make_checkpoint(tmp_path / "c", 10, marked=False, weights={k: torch.ones(4, 8) for k in SHAPES})
    assert "shape (4, 8) in the weights, (8, 4) trained" in contents.verify_weights(wrong)[0]


def test_a_file_changed_after_marking_makes_the_checkpoint_incomplete(tmp_path):
    folder = make_checkpoint(tmp_path, 10)
    assert ckpt.is_complete(folder)
    os.truncate(folder / "rng_state_0.pth", 10)
    assert not ckpt.is_complete(folder)
    folder2 = make_checkpoint(tmp_path, 20)
    (folder2 / "global_step20/zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert not ckpt.is_complete(folder2)


def test_keep_last_n_counts_only_complete_checkpoints_and_never_touches_incomplete_ones(tmp_path):
    for step in range(1, 9):
        make_checkpoint(tmp_path, step, marked=step % 2 == 1)  # 1,3,5,7 complete; 2,4,6,8 not
    deleted = folders.rotate(tmp_path, keep=2)
    assert steps(deleted) == [1, 3]
    assert steps(ckpt.list_checkpoints(tmp_path)) == [2, 4, 5, 6, 7, 8]
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [5, 7]
    assert ckpt.checkpoint_step(ckpt.newest_complete(tmp_path)) == 7  # not 8: it has no marker


def test_rotation_never_deletes_the_newest_complete_nor_the_protected_one(tmp_path):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    assert steps(folders.rotate(tmp_path, keep=0, protect=tmp_path / "checkpoint-1")) == [2]
    assert steps(ckpt.list_checkpoints(tmp_path)) == [1, 3]
    assert folders.rotate(tmp_path, keep=None) == []


def test_auto_resume_takes_the_newest_complete_and_removes_only_our_own_half_written_save(tmp_path):
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20)
    ours = make_checkpoint(tmp_path, 30, marked=False)
    ckpt.mark_saving(ours)
    (ours / "latest").unlink()  # killed before DeepSpeed finished
    unknown = make_checkpoint(tmp_path, 40, marked=False)
    (unknown / "latest").unlink()  # the same state, but nothing says a save of this run started it
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert plan.target == tmp_path / "checkpoint-20"
    assert plan.delete == [ours]
    assert [(f.path, f.kind) for f in plan.skipped] == [(unknown, "foreign")]
    assert "no hf_zero3 completion marker" in plan.skipped[0].why


def test_auto_resume_never_deletes_an_unmarked_folder_that_verifies(tmp_path):
    """A checkpoint written without hf_zero3 (no marker) but whole: never ours to delete, never resumed by auto."""
    make_checkpoint(tmp_path, 10)
    foreign = make_checkpoint(tmp_path, 20, marked=False)
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert (plan.target, plan.delete, [f.path for f in plan.skipped]) == (tmp_path / "checkpoint-10", [], [foreign])


def test_auto_resume_removes_our_own_unfinished_save_even_if_its_files_verify(tmp_path):
    """Killed after the last file but before the marker: the guard's SAVING record (with the output_dir's run id)
    says the folder is ours."""
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    unfinished = make_checkpoint(tmp_path, 20, marked=False)
    ckpt.mark_saving(unfinished)
    assert contents.verify_checkpoint(unfinished) == []
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert (plan.target, plan.delete) == (tmp_path / "checkpoint-10", [unfinished])
    ckpt.write_marker(unfinished, {"world_size": 2})
    assert not (unfinished / ckpt.SAVING).exists() and ckpt.is_complete(unfinished)


def test_a_save_flag_of_another_run_or_an_older_version_is_not_ours_to_delete(tmp_path):
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    copied = make_checkpoint(tmp_path, 20, marked=False)
    ckpt.mark_saving(copied, run_id="another-run")
    old = make_checkpoint(tmp_path, 30, marked=False)
    (old / ckpt.SAVING).write_text("a save into this folder started; hf_zero3_complete.json marks its end\n")
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert plan.delete == [] and [f.path for f in plan.skipped] == [copied, old]
    assert all("not this output_dir's run" in f.why for f in plan.skipped)


def test_a_complete_checkpoint_that_lost_a_file_is_kept_and_auto_falls_back(tmp_path):
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    damaged = make_checkpoint(tmp_path, 20)
    (damaged / "global_step20/zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert (plan.target, plan.delete) == (tmp_path / "checkpoint-10", [])
    assert plan.skipped[0].kind == "damaged"
    error_naming(plan.skipped[0].why, "global_step20/zero_pp_rank_0_mp_rank_00_model_states.pt", "missing")
    assert (damaged / "model.safetensors").is_file()
    assert folders.rotate(tmp_path, keep=1) == [] and damaged.is_dir()  # keep-last-N neither counts nor deletes it


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_shard_with_its_marker_intact_is_never_resumed_from(tmp_path, damage):
    make_checkpoint(tmp_path, 10)
    bad = make_checkpoint(tmp_path, 20)
    shard = bad / "global_step20/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    if damage == "flip":  # same size, 64 bytes overwritten in the middle: only the checksum can tell
        with shard.open("r+b") as f:
            f.seek(size // 2)
            f.write(bytes(64))
        assert shard.stat().st_size == size and ckpt.is_complete(bad)
        expected = "optim_states.pt is corrupted"
    else:
        os.truncate(shard, size - 1)
        expected = f"has {size - 1} bytes, the marker says {size}"
    assert any(expected in p for rank in (0, 1) for p in ckpt.verify_complete(bad, rank, 2))
    assert ckpt.verify_complete(bad, 0, 2) == []  # rank 1 wrote the shard: rank 0 checks only its own share
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert plan.target == tmp_path / "checkpoint-10" and plan.delete == []
    assert expected in folders.describe_found(plan.skipped)
    with pytest.raises(ckpt.CheckpointError, match="--resume_from_checkpoint .*checkpoint-10"):
        folders.plan_resume(tmp_path, str(bad), world_size=2)


def test_the_marker_records_a_checksum_of_every_file(tmp_path):
    folder = make_checkpoint(tmp_path, 10)
    files = ckpt.read_marker(folder)["files"]
    shard = "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert files[shard] == {"size": (folder / shard).stat().st_size, "xxh3_64": ckpt.file_hash(folder / shard)}
    assert ckpt.hash_files(folder, 1, 2) == {shard.replace("optim", "model"): ckpt.file_hash(
        folder / shard.replace("optim", "model")), shard: ckpt.file_hash(folder / shard),
        "rng_state_1.pth": ckpt.file_hash(folder / "rng_state_1.pth")}
    assert all(ckpt.verify_complete(folder, rank, 2) == [] for rank in (0, 1))


def test_rotation_renames_before_deleting_and_the_next_start_finishes_a_killed_one(tmp_path):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    # a rotation killed mid-delete: renamed, half its files gone
    left = tmp_path / f"{ckpt.DELETING}checkpoint-1"
    (tmp_path / "checkpoint-1").rename(left)
    (left / "model.safetensors").unlink()
    assert steps(ckpt.list_checkpoints(tmp_path)) == [2, 3] and steps(ckpt.complete_checkpoints(tmp_path)) == [2, 3]
    assert ckpt.finish_deletions(tmp_path) == [left] and not left.exists()
    assert steps(folders.rotate(tmp_path, keep=1)) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_explicit_resume_refuses_an_incomplete_checkpoint_and_one_older_than_a_complete_one(tmp_path):
    make_checkpoint(tmp_path, 10)
    broken = make_checkpoint(tmp_path, 20, marked=False)
    (broken / "rng_state_1.pth").unlink()
    with pytest.raises(ckpt.CheckpointError, match="checkpoint-20 cannot be resumed: rank 1: RNG state"):
        folders.plan_resume(tmp_path, str(broken), world_size=2)
    make_checkpoint(tmp_path, 30)
    with pytest.raises(ckpt.CheckpointError, match="this run would overwrite it"):
        folders.plan_resume(tmp_path, str(tmp_path / "checkpoint-10"), world_size=2)


def test_save_collisions_name_what_a_run_would_write_into(tmp_path):
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 2)
    foreign = make_checkpoint(tmp_path, 9, marked=False)
    ours = make_checkpoint(tmp_path, 4, marked=False)
    ckpt.mark_saving(ours)
    assert folders.save_collisions(tmp_path, 2, 8, save_every=2) == []  # 9 is past the end; 4 is our own
    assert [f.path for f in folders.save_collisions(tmp_path, 2, 9, save_every=2)] == [foreign]  # the final save
    assert [f.path for f in folders.save_collisions(tmp_path, 2, 10, save_every=3)] == [foreign]
    assert folders.save_collisions(tmp_path, 2, 10, save_every=2) == []


def test_resume_on_another_world_size_names_reshard(tmp_path):
    folder = make_checkpoint(tmp_path, 10)
    with pytest.raises(ckpt.CheckpointError, match="hf-zero3 reshard"):
        folders.plan_resume(tmp_path, "auto", world_size=1)
    (folder / "latest_universal").write_text("global_step10_universal")  # names a copy that is not there
    with pytest.raises(ckpt.CheckpointError, match="hf-zero3 reshard"):
        folders.plan_resume(tmp_path, "auto", world_size=1)
    (folder / ".global_step10_universal.partial").mkdir()  # DeepSpeed's own pointer, before our rename
    (folder / "latest_universal").write_text(".global_step10_universal.partial")
    with pytest.raises(ckpt.CheckpointError, match="hf-zero3 reshard"):
        folders.plan_resume(tmp_path, "auto", world_size=1)
    (folder / ".global_step10_universal.partial").rename(folder / "global_step10_universal")
    from hf_zero3.checkpoint.export import reshard_checkpoint

    assert reshard_checkpoint(folder) == folder / "global_step10_universal"  # a kill after the rename: mended
    assert (folder / "latest_universal").read_text() == "global_step10_universal"
    assert folders.plan_resume(tmp_path, "auto", world_size=1) == folders.ResumePlan(folder, [], [])


def test_removing_a_symlinked_checkpoint_removes_only_the_link(tmp_path):
    elsewhere = make_checkpoint(tmp_path / "elsewhere", 10, marked=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint-10").symlink_to(elsewhere)
    ckpt.remove_checkpoint(tmp_path / "run" / "checkpoint-10")
    assert not (tmp_path / "run" / "checkpoint-10").exists() and (elsewhere / "latest").is_file()


def _guard_args(tmp_path, **kw):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
    return args, TrainerState(), TrainerControl()


def test_guard_refuses_the_trainers_own_rotation(tmp_path):
    from hf_zero3.callbacks import CheckpointGuardCallback

    args, state, control = _guard_args(tmp_path, save_total_limit=3)
    with pytest.raises(ckpt.CheckpointError, match="set it to None and pass CheckpointGuardCallback"):
        CheckpointGuardCallback(save_total_limit=3).on_train_begin(args, state, control)


def test_guard_stops_before_a_save_the_disk_cannot_hold(tmp_path):
    """Free space is checked against the newest complete checkpoint's size before the Trainer writes a byte."""
    from hf_zero3.callbacks import CheckpointGuardCallback

    folder = make_checkpoint(tmp_path, 10)
    record = ckpt.read_marker(folder)
    (folder / ckpt.MARKER).write_text(json.dumps({**record, "bytes": 10**18}))  # "an exabyte checkpoint"
    args, state, control = _guard_args(tmp_path)
    state.global_step, control.should_save = 20, True
    with pytest.raises(ckpt.CheckpointError, match=r"disk full: checkpoint-20 needs about .* Nothing was written"):
        CheckpointGuardCallback().on_step_end(args, state, control)
    assert not (tmp_path / "checkpoint-20").exists()


def test_guard_explains_a_save_that_fails_on_a_full_disk(tmp_path, capsys):
    """torch.save says "iostream error" when the disk fills mid-save: the guard adds what it means."""
    import sys

    from hf_zero3.callbacks import CheckpointGuardCallback

    folder = make_checkpoint(tmp_path, 10)
    record = ckpt.read_marker(folder)
    (folder / ckpt.MARKER).write_text(json.dumps({**record, "bytes": 10**18}))
    guard, hook = CheckpointGuardCallback(space_margin=0.0), sys.excepthook
    args, state, control = _guard_args(tmp_path)
    guard.on_train_begin(args, state, control)
    try:
        state.global_step, control.should_save = 20, True
        guard.on_step_end(args, state, control)
        sys.excepthook(RuntimeError, RuntimeError("basic_ios::clear: iostream error"), None)
    finally:
        guard.on_train_end(args, state, control)
    assert sys.excepthook is hook
    err = capsys.readouterr().err
    assert "RuntimeError: basic_ios::clear: iostream error" in err
    error_naming(err, f"saving {tmp_path / 'checkpoint-20'}", "failed", "disk is full")
    assert f"removes it and resumes from {folder}" in err
    assert (tmp_path / "checkpoint-20" / ckpt.SAVING).is_file()


def test_guard_marks_a_plain_trainer_checkpoint_and_rotates(tmp_path):
    """Without DeepSpeed the same guard applies: optimizer.pt, rng_state.pth, trainer state, weights."""
    from hf_zero3.callbacks import CheckpointGuardCallback

    guard = CheckpointGuardCallback(save_total_limit=1)
    args, state, control = _guard_args(tmp_path)
    guard.on_train_begin(args, state, control)
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        torch.save({"state": {}}, folder / "optimizer.pt")
        torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
        save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
        state.global_step = step
        guard.on_save(args, state, control)
    assert steps(ckpt.list_checkpoints(tmp_path)) == [2] and ckpt.is_complete(tmp_path / "checkpoint-2")
    assert ckpt.read_marker(tmp_path / "checkpoint-2")["training_args"]["hub_token"] == "<HUB_TOKEN>"
    (tmp_path / "checkpoint-3").mkdir()
    torch.save({"cpu": torch.get_rng_state()}, tmp_path / "checkpoint-3" / "rng_state.pth")
    state.global_step = 3
    with pytest.raises(ckpt.CheckpointError, match="checkpoint-3 is incomplete: optimizer.pt is unreadable"):
        guard.on_save(args, state, control)
    assert not ckpt.is_complete(tmp_path / "checkpoint-3")


def test_cli_registers_export_reshard_push_and_fails_clearly_on_an_incomplete_checkpoint(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["export", "ck", "out", "--dtype", "fp32", "--shard-size", "1MB"])
    assert (args.checkpoint, args.out, args.dtype, args.shard_size) == ("ck", "out", "fp32", 10**6)  # bytes, parsed
    args = parser.parse_args(["push", "out", "--repo-id", "org/name", "--private", "--revision", "v1"])
    assert (args.repo_id, args.private, args.revision) == ("org/name", True, "v1")
    assert parser.parse_args(["reshard", "ck"]).checkpoint == "ck"
    broken = make_checkpoint(tmp_path, 10, marked=False)
    (broken / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert cli_main(["export", str(broken), str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint: rank 1: no optim_states shard" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "export"
    empty.mkdir()
    save_file({"w": torch.empty(0)}, str(empty / "model.safetensors"))
    assert cli_main(["push", str(empty), "--repo-id", "org/name"]) == 2
    assert "not pushing" in capsys.readouterr().err


def test_a_checkpoint_that_failed_its_checksums_never_takes_a_place_in_keep_last_n(tmp_path):
    """A corrupted checkpoint-20 looks whole by size. Once a resume found it corrupted it is recorded as damaged,
    so the resumed run's rotation keeps its own new checkpoint, not the corrupted one with the higher step."""
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    bad = make_checkpoint(tmp_path, 20)
    shard = bad / "global_step20/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(bytes(64))
    plan = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert plan.target == tmp_path / "checkpoint-10" and [f.path for f in plan.failed] == [bad]
    ckpt.mark_failed(bad, plan.failed[0].why)
    assert not ckpt.is_complete(bad) and folders.classify(bad, ckpt.read_run_id(tmp_path)).kind == "damaged"
    assert "optim_states.pt is corrupted" in folders.classify(bad, None).why
    make_checkpoint(tmp_path, 15)  # the resumed run's next save
    assert steps(folders.rotate(tmp_path, keep=1)) == [10]
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [15] and bad.is_dir()  # kept for the user, not counted
    again = folders.plan_resume(tmp_path, "auto", world_size=2)
    assert again.target == tmp_path / "checkpoint-15" and again.failed == []
    assert [f.path for f in again.skipped] == [bad]
    assert folders.save_collisions(tmp_path, 15, 20, 5)[0].why.startswith("failed verification on ")


def test_an_explicit_resume_does_not_record_a_failure(tmp_path):
    make_checkpoint(tmp_path, 10)
    assert folders.plan_resume(tmp_path, str(tmp_path / "checkpoint-10"), world_size=2).failed == []


def test_an_explicit_resume_through_a_link_or_a_renamed_copy_knows_its_step(tmp_path):
    """`--resume_from_checkpoint out/best` (a link to checkpoint-20): step 20, so checkpoint-10 is older, not newer."""
    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    (tmp_path / "best").symlink_to(newest)
    assert ckpt.resume_step(tmp_path / "best") == 20
    assert folders.plan_resume(tmp_path, str(tmp_path / "best"), world_size=2).target == tmp_path / "best"
    elsewhere = tmp_path.parent / f"{tmp_path.name}-final"  # a copy renamed by hand: its trainer state says 10
    import shutil
    shutil.copytree(tmp_path / "checkpoint-10", elsewhere)
    assert ckpt.resume_step(elsewhere) == 10
    with pytest.raises(ckpt.CheckpointError, match="checkpoint-20 in .*complete and newer than the resume point"):
        folders.plan_resume(tmp_path, str(elsewhere), world_size=2)


# --- node-local disks: a checkpoint is what its copies on the nodes together are ---------------------------------

def node_copy(root, step: int, run_id: str, kind: str):
    """A 2-rank checkpoint folder in one node's output_dir: complete (marked with `run_id`) or our unfinished save."""
    folder = make_checkpoint(root, step, marked=False)
    if kind == "complete":
        ckpt.write_marker(folder, {"world_size": 2, "run_id": run_id})
    else:
        ckpt.mark_saving(folder, run_id)
    return folder


def seen(*nodes):
    return [folders.view(folders.survey(node)) for node in nodes]


def test_a_checkpoint_counts_only_when_complete_on_every_node_and_a_half_finished_one_is_ours_to_delete(tmp_path):
    a, b = tmp_path / "node0", tmp_path / "node1"
    run_id = ckpt.claim_output_dir(a)
    assert ckpt.claim_output_dir(b, run_id) == run_id  # node 1's copy gets node 0's id
    for node in (a, b):
        node_copy(node, 2, run_id, "complete")
    node_copy(a, 4, run_id, "complete")  # node 0 marked step 4, then node 1 died before it did
    node_copy(b, 4, run_id, "unfinished")
    node_copy(a, 6, run_id, "unfinished")  # node 1 never got to step 6 at all
    found = folders.combine(a, seen(a, b))
    assert [(f.path.name, f.kind) for f in found] == [
        ("checkpoint-2", "complete"), ("checkpoint-4", "unfinished"), ("checkpoint-6", "unfinished")]
    assert "complete on some nodes only" in found[1].why
    plan = folders.plan_resume(a, "auto", world_size=2, found=found)
    assert plan.target == a / "checkpoint-2" and plan.delete == [a / "checkpoint-4", a / "checkpoint-6"]
    assert folders.combine(a, seen(a, a)) == folders.combine(a, seen(a))  # one shared folder: what one rank sees


def test_a_copy_that_is_not_this_runs_is_never_taken_for_an_unfinished_save(tmp_path):
    a, b = tmp_path / "node0", tmp_path / "node1"
    run_id = ckpt.claim_output_dir(a)
    ckpt.claim_output_dir(b, run_id)
    node_copy(a, 4, "another run", "complete")  # copied there by hand, say
    node_copy(a, 6, run_id, "complete")
    damaged = node_copy(b, 6, run_id, "complete")
    (damaged / "rng_state_1.pth").unlink()
    found = folders.combine(a, seen(a, b))
    assert [(f.path.name, f.kind) for f in found] == [("checkpoint-4", "foreign"), ("checkpoint-6", "damaged")]
    assert found[1].why.startswith("on some node")
    error_naming(found[1].why, "rng_state_1.pth", "missing")
    plan = folders.plan_resume(a, "auto", world_size=2, found=found)
    assert plan.target is None and plan.delete == [] and len(plan.skipped) == 2


def test_keep_last_n_on_a_node_counts_only_the_checkpoints_complete_on_every_node(tmp_path):
    run_id = ckpt.claim_output_dir(tmp_path)
    for step in (2, 4, 6):
        node_copy(tmp_path, step, run_id, "complete")
    assert steps(folders.rotate(tmp_path, keep=1, everywhere={2, 6})) == [2]  # 4 is complete here only: not counted
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [4, 6]


def test_on_a_node_local_copy_the_nodes_first_rank_owns_the_files_that_are_not_a_ranks_own():
    assert ckpt.file_owner("trainer_state.json", 4, writer=2) == 2
    assert ckpt.file_owner("rng_state_3.pth", 4, writer=2) == 3
    assert ckpt.file_owner("global_step2/zero_pp_rank_3_mp_rank_00_optim_states.pt", 4, writer=2) == 3
    assert ckpt.file_owner("trainer_state.json", 4) == 0
