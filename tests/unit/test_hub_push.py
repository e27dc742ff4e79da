"""HubPushCallback takes a hard-link snapshot at on_save and exports + uploads it in a thread, so neither the
export nor keep-last-N gets in the way of the other. Real checkpoints in DeepSpeed's ZeRO-3 layout
(`make_checkpoint`), the real export (DeepSpeed's zero_to_fp32); only the network upload is replaced by a
recorder of what would be uploaded, and an export wrapper holds the export until the test lets it go."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import hf_zero3.checkpoint.export
import hf_zero3.checkpoint.hub
from hf_zero3.callbacks.hub_push import STAGING_OWNER, STAGING_PREFIX, HubPushCallback, snapshot_checkpoint
from hf_zero3.checkpoint import contents, folders
from hf_zero3.checkpoint import lifecycle as ckpt
from tests.conftest import error_naming, make_checkpoint, master_weights


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _staging(out) -> list:
    return sorted(out.glob(f"{STAGING_PREFIX}*"))


@pytest.fixture
def run(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    out = tmp_path / "run"
    out.mkdir()
    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[])
    return out, args, TrainerState(), TrainerControl()


@pytest.fixture
def uploads(monkeypatch):
    """What each push would upload: folder name, the thread it ran on, the weights, the files."""
    from safetensors.torch import load_file

    pushed = []

    def record(folder, repo_id, private=False, revision=None, commit_message=None):
        pushed.append({"name": folder.name, "thread": threading.current_thread(), "message": commit_message,
                       "weights": load_file(folder / "model.safetensors"),
                       "files": sorted(p.name for p in folder.iterdir())})
        return f"local://{repo_id}/{folder.name}"

    monkeypatch.setattr(hf_zero3.checkpoint.hub, "push_folder", record)
    return pushed


@pytest.fixture
def held_export(monkeypatch):
    """The real export, entered on whatever thread runs it, held until `release` is set."""
    real = hf_zero3.checkpoint.export.export_checkpoint
    calls = {"threads": [], "sources": [], "entered": threading.Event(), "release": threading.Event(),
             "finished": threading.Event()}

    def export(checkpoint, out, *args, **kwargs):
        calls["threads"].append(threading.current_thread())
        calls["sources"].append(checkpoint)
        calls["entered"].set()
        assert calls["release"].wait(60), "the test never released the export"
        try:
            return real(checkpoint, out, *args, **kwargs)
        finally:
            calls["finished"].set()

    monkeypatch.setattr(hf_zero3.checkpoint.export, "export_checkpoint", export)
    return calls


def _save(callback, run_, step):
    out, args, state, control = run_
    make_checkpoint(out, step)
    state.global_step = step
    callback.on_save(args, state, control)


def test_a_snapshot_keeps_identical_bytes_after_the_checkpoint_is_deleted(tmp_path):
    folder = make_checkpoint(tmp_path / "run", 10)
    before = _files(folder)
    snap = snapshot_checkpoint(folder, tmp_path / "run" / ".hub-export-x" / "checkpoint-10")
    model = "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert (snap / model).stat().st_ino == (folder / model).stat().st_ino  # a link, not a copy: no new space
    assert (folder / model).stat().st_nlink == 2
    ckpt.remove_checkpoint(folder)  # what keep-last-N does
    assert not folder.exists()
    assert _files(snap) == before and ckpt.is_complete(snap) and contents.verify_checkpoint(snap) == []
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == []  # never counted as a checkpoint


def test_on_save_returns_while_the_export_runs_in_a_thread_and_rotation_cannot_touch_it(run, uploads,
                                                                                         held_export):
    out, args, state, control = run
    push = HubPushCallback("org/name", dtype="fp32")
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    # on_save has returned; the export was entered from another thread and has not finished
    assert held_export["entered"].wait(30) and not held_export["finished"].is_set()
    assert held_export["threads"][0] is not threading.current_thread()
    assert held_export["threads"][0].name == "hf_zero3-hub-push"
    source = held_export["sources"][0]
    assert source.parent.parent.parent in _staging(out) and source != out / "checkpoint-2"
    make_checkpoint(out, 4)
    assert [p.name for p in folders.rotate(out, keep=1)] == ["checkpoint-2"]  # rotated away mid-export
    held_export["release"].set()
    push.on_train_end(args, state, control)
    push.wait()
    assert [u["name"] for u in uploads] == ["checkpoint-2"]
    assert uploads[0]["message"] == "checkpoint-2 (step 2)"
    assert uploads[0]["thread"] is held_export["threads"][0]
    assert uploads[0]["files"] == ["README.md", "config.json", "model.safetensors"]
    expected = master_weights(2)
    assert all(torch.equal(uploads[0]["weights"][k], expected[k]) for k in expected)
    assert _staging(out) == []


def test_saves_during_a_push_are_snapshotted_and_the_last_one_is_pushed_at_the_end(run, uploads, held_export,
                                                                                   capsys):
    out, args, state, control = run
    push = HubPushCallback("org/name", dtype="fp32")
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    assert held_export["entered"].wait(30)
    _save(push, run, 4)
    assert len(_staging(out)) == 2  # the running push, checkpoint-4's snapshot
    _save(push, run, 6)
    assert len(_staging(out)) == 2  # checkpoint-4's snapshot dropped for checkpoint-6's
    assert capsys.readouterr().out.count("the previous push is still running") == 2
    for step in (2, 4, 6):  # all rotated away before the end of training
        ckpt.remove_checkpoint(out / f"checkpoint-{step}")
    held_export["release"].set()
    push.on_train_end(args, state, control)
    push.wait()
    assert [u["name"] for u in uploads] == ["checkpoint-2", "checkpoint-6"]
    expected = master_weights(6)
    assert all(torch.equal(uploads[1]["weights"][k], expected[k]) for k in expected)
    assert _staging(out) == []


def test_without_hard_links_the_export_runs_before_on_save_returns_and_says_why(run, uploads, held_export,
                                                                                 monkeypatch, capsys):
    out, args, state, control = run

    def no_links(src, dst, *a, **kw):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), str(dst))

    monkeypatch.setattr(os, "link", no_links)  # output_dir on another filesystem than the checkpoint
    held_export["release"].set()
    push = HubPushCallback("org/name", dtype="fp32")
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    assert held_export["finished"].is_set()  # exported before on_save returned ...
    assert held_export["threads"] == [threading.current_thread()]
    assert held_export["sources"] == [out / "checkpoint-2"]  # ... from the checkpoint itself
    lines = [line for line in capsys.readouterr().out.splitlines() if "hard-link" in line]
    assert len(lines) == 1 and "cannot hard-link checkpoint-2" in lines[0] and "Invalid cross-device link" in \
        lines[0], lines
    push.on_train_end(args, state, control)
    push.wait()
    assert [u["name"] for u in uploads] == ["checkpoint-2"]
    assert uploads[0]["thread"] is not threading.current_thread()  # the upload still runs in the thread
    assert _staging(out) == []


def test_an_export_that_fails_in_the_thread_is_reported_and_training_goes_on(run, uploads, capsys):
    out, args, state, control = run
    push = HubPushCallback("org/name", dtype="fp16")  # export_checkpoint refuses this dtype
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    push.on_train_end(args, state, control)
    push.wait()
    error_naming(capsys.readouterr().out, "WARNING", "checkpoint-2", "failed", "dtype 'fp16'")
    assert uploads == [] and _staging(out) == [] and ckpt.is_complete(out / "checkpoint-2")


def test_a_save_into_a_snapshotted_folder_lets_go_of_the_snapshot_first(run, uploads, held_export):
    """The Trainer never saves one step twice, but if it did, its writes must not reach a snapshot's files."""
    out, args, state, control = run
    push = HubPushCallback("org/name", dtype="fp32")
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    _save(push, run, 4)  # skipped: snapshotted
    control.should_save = True
    push.on_step_end(args, state, control)  # step 4 is about to be saved again
    assert push._skipped is None and len(_staging(out)) == 1
    state.global_step = 2
    threading.Timer(0.2, held_export["release"].set).start()
    push.on_step_end(args, state, control)  # step 2 (being exported) is about to be saved again: wait for it
    assert not push._worker.is_alive() and held_export["finished"].is_set()
    assert [u["name"] for u in uploads] == ["checkpoint-2"] and _staging(out) == []


def test_stale_staging_folders_from_a_killed_run_are_removed_at_train_begin(run, capsys):
    out, args, state, control = run
    folder = make_checkpoint(out, 2)
    snapshot_checkpoint(folder, out / f"{STAGING_PREFIX}killed" / "source" / "run" / "checkpoint-2")
    (out / f"{STAGING_PREFIX}killed" / STAGING_OWNER).write_text("")
    users = out / f"{STAGING_PREFIX}notes"  # a folder of that name without our owner file is someone's data
    users.mkdir()
    (users / "keep.txt").write_text("mine")
    HubPushCallback("org/name").on_train_begin(args, state, control)
    assert _staging(out) == [users] and ckpt.is_complete(folder)  # the links went, the checkpoint stays whole
    assert (users / "keep.txt").read_text() == "mine" and "left in place" in capsys.readouterr().out


def test_the_end_of_training_does_not_wait_for_pushes_on_the_training_path(run, uploads, held_export):
    """After training every rank enters save_model's ZeRO-3 gather: rank 0 must get there without waiting for
    the export; `wait()` (train.py, once the collectives are done) is where it waits."""
    out, args, state, control = run
    push = HubPushCallback("org/name", dtype="fp32")
    push.on_train_begin(args, state, control)
    _save(push, run, 2)
    _save(push, run, 4)  # skipped while 2 is exported: pushed after it
    assert held_export["entered"].wait(10)
    push.on_train_end(args, state, control)  # returns with the export of 2 still held
    assert not held_export["finished"].is_set() and push._worker.is_alive()
    held_export["release"].set()
    push.wait()
    assert [u["name"] for u in uploads] == ["checkpoint-2", "checkpoint-4"] and _staging(out) == []
