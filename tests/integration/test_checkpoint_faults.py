"""Fault injection and a retry loop on real 2-rank ZeRO-3 CPU runs of the tiny recipe.

Whatever happens to a checkpoint folder (a lost shard, a truncated or bit-flipped one under an intact marker,
foreign folders, a read-only disk, kill -9 at any moment), `--resume_from_checkpoint auto` deletes nothing but
our own unfinished saves, never resumes from a damaged checkpoint, names what it skipped with the fix, and the
loss continues exactly as in the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.preemption import PREEMPTED_EXIT
from tests.conftest import (
    CHECKPOINT_RUN,
    ROOT,
    Launch,
    error_naming,
    explain,
    logged_steps,
    losses_by_step,
    run,
    weights,
)

pytestmark = pytest.mark.integration

LAUNCH = ROOT / "recipes/tiny/launch.sh"
KEEP_ALL = ["--save_total_limit", "10"]


def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    from hf_zero3.job.distributed import free_port

    return run([LAUNCH, "--output_dir", out, *CHECKPOINT_RUN, *extra], MASTER_PORT=str(free_port()))


def tree(path: Path) -> dict[str, str]:
    """Every file under path with a digest of its bytes: to show that nothing changed."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: 8 steps without a fault, every checkpoint kept (2, 4, 6, 8)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = train(out, *KEEP_ALL)
    assert proc.returncode == 0, explain(proc)
    assert [ckpt.checkpoint_step(p) for p in ckpt.complete_checkpoints(out)] == [2, 4, 6, 8]
    return out


def copy_checkpoints(source: Path, out: Path) -> None:
    """A run killed right after its last save: the checkpoints and run id, none of the final outputs."""
    out.mkdir(parents=True)
    shutil.copy2(source / ckpt.RUN_ID, out / ckpt.RUN_ID)
    for folder in ckpt.list_checkpoints(source):
        shutil.copytree(folder, out / folder.name)


def test_damaged_checkpoints_are_kept_named_and_skipped_and_the_run_continues_exactly(uninterrupted, tmp_path):
    out = tmp_path / "run"
    copy_checkpoints(uninterrupted, out)
    # 8: 4096 bytes of rank 1's optimizer shard overwritten, same size, marker intact (only a checksum sees it)
    shard = out / "checkpoint-8/global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.seek(size // 2)
        f.write(bytes(4096))
    assert shard.stat().st_size == size and ckpt.is_complete(out / "checkpoint-8")
    # 6: rank 0's optimizer shard truncated; 4: rank 0's model states gone (the marker lists both)
    shard6 = out / "checkpoint-6/global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard6.write_bytes(shard6.read_bytes()[:1000])
    (out / "checkpoint-4/global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    # foreign folders newer than every checkpoint: another tool's, and a copy without our marker
    (out / "checkpoint-12").mkdir()
    (out / "checkpoint-12/notes.txt").write_text("not hf_zero3's\n")
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-20")
    (out / "checkpoint-20" / ckpt.MARKER).unlink()
    before = tree(out)

    refused = train(out, *KEEP_ALL, "--resume_from_checkpoint", "auto")
    assert refused.returncode == 2, explain(refused)
    err = refused.stderr
    assert "Traceback" not in refused.stdout + err, explain(refused)
    assert "this run would save into" in err and "Nothing was deleted" in err and "Move them out" in err, err
    for name, why in (("checkpoint-8", "zero_pp_rank_1_mp_rank_00_optim_states.pt is corrupted"),
                      ("checkpoint-6", "zero_pp_rank_0_mp_rank_00_optim_states.pt has 1000 bytes"),
                      ("checkpoint-4", "zero_pp_rank_0_mp_rank_00_model_states.pt is missing")):
        assert f"not resuming from {out / name}: " in refused.stdout and why in refused.stdout, refused.stdout
    assert "resuming from " + str(out / "checkpoint-2") in refused.stdout
    assert tree(out) == before  # nothing deleted, nothing written

    aside = tmp_path / "aside"  # the fix the error names: move the damaged ones out of output_dir
    aside.mkdir()
    for name in ("checkpoint-4", "checkpoint-6", "checkpoint-8"):
        (out / name).rename(aside / name)
    resumed = train(out, *KEEP_ALL, "--resume_from_checkpoint", "auto")
    assert resumed.returncode == 0, explain(resumed)
    assert losses_by_step(out) == {s: loss for s, loss in losses_by_step(uninterrupted).items() if s > 2}
    final, expected = weights(out), weights(uninterrupted)
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert tree(aside) == {k: v for k, v in before.items() if k.split("/")[0] in ("checkpoint-4", "checkpoint-6",
                                                                                   "checkpoint-8")}
    assert tree(out / "checkpoint-12") == {"notes.txt": before["checkpoint-12/notes.txt"]}
    assert {f"checkpoint-20/{k}": v for k, v in tree(out / "checkpoint-20").items()} == {
        k: v for k, v in before.items() if k.startswith("checkpoint-20/")}
    assert [ckpt.checkpoint_step(p) for p in ckpt.complete_checkpoints(out)] == [2, 4, 6, 8]


def test_a_full_fine_tunes_checkpoint_resumed_with_a_peft_block_is_one_line_before_start(uninterrupted, tmp_path,
                                                                                         capsys):
    """A real 2-rank ZeRO-3 checkpoint of a full fine-tune, resumed with a peft: block: one line naming both and the
    fix, before anything starts (no KeyError from peft's load); nothing written."""
    from hf_zero3.run.train import main

    out = tmp_path / "run"
    copy_checkpoints(uninterrupted, out)
    before = tree(out)
    assert main([str(ROOT / "recipes/tiny/train_args.yaml"), "--deepspeed", "null", "--output_dir", str(out),
                 *CHECKPOINT_RUN, "--resume_from_checkpoint", "auto", "--peft", "{r: 4, target_modules: all-linear}"]) == 2
    err = capsys.readouterr().err
    error_naming(err, "resume_from_checkpoint", "a full fine-tune's checkpoint", "--peft null")
    assert "Traceback" not in err and tree(out) == before


def _read_only_folder(root: Path) -> Path:
    path = root / "ro"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(path)], capture_output=True,
                             check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.decode().strip()}); needs root")
    return path


def test_a_read_only_checkpoint_folder_at_save_time_is_a_clear_error_and_resume_continues(uninterrupted, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    read_only = _read_only_folder(tmp_path)
    try:
        (out / "checkpoint-4").symlink_to(read_only)  # an empty folder: a save may write there, but cannot
        first = Launch(out, *CHECKPOINT_RUN, *KEEP_ALL, "--overwrite_output_dir", "true", log=tmp_path / "1.log")
        assert first.wait(timeout=300) == 1, first.text()
        assert f"cannot write {out / 'checkpoint-4'}: [Errno 30] Read-only file system" in first.text(), first.text()
        assert "Traceback" not in first.text(), first.text()
        assert [ckpt.checkpoint_step(p) for p in ckpt.complete_checkpoints(out)] == [2]
        assert ckpt.verify_complete(out / "checkpoint-2") == []
        (out / "checkpoint-4").unlink()  # the user's fix: a writable place for the checkpoint
        resumed = train(out, *KEEP_ALL, "--resume_from_checkpoint", "auto")
        assert resumed.returncode == 0, explain(resumed)
        assert losses_by_step(out) == losses_by_step(uninterrupted)
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=False)


def test_nan_weights_that_verify_stop_the_run_without_saving_them(uninterrupted, tmp_path):
    """A checkpoint whose fp32 master weights went NaN before the save (so its checksums match): the loss is NaN
    from the first resumed step; the guard stops after 3 steps in a row and no checkpoint of NaN weights is made."""
    out = tmp_path / "run"
    copy_checkpoints(uninterrupted, out)
    for name in ("checkpoint-6", "checkpoint-8"):
        shutil.rmtree(out / name)
    for rank in (0, 1):
        shard = out / f"checkpoint-4/global_step4/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        states = torch.load(shard, map_location="cpu", weights_only=False)
        for flat in states["optimizer_state_dict"]["fp32_flat_groups"]:
            flat.detach().fill_(float("nan"))
        torch.save(states, shard)
    ckpt.write_marker(out / "checkpoint-4", ckpt.read_marker(out / "checkpoint-4"))
    proc = train(out, *KEEP_ALL, "--resume_from_checkpoint", "auto")
    assert proc.returncode == 1, explain(proc)
    assert "NaN/inf for 3 steps in a row (steps 5-7); training stopped" in proc.stderr, explain(proc)
    assert f"The newest complete checkpoint is {out / 'checkpoint-4'}" in proc.stderr
    assert "step 6 is non-finite (NaN/inf loss or gradients): not saving checkpoint-6" in proc.stderr
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)] == [2, 4]
    logged = [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "nonfinite_steps" in r]
    # the stock log hides the NaN (logging_nan_inf_filter logs 0.0); our count says what happened; step 7 stopped
    assert [(r["step"], r["loss"], r["nonfinite_steps"]) for r in logged] == [(5, 0.0, 1), (6, 0.0, 2)], logged


def test_the_same_command_after_kills_at_any_moment_converges_to_one_finished_run(uninterrupted, tmp_path):
    """A retry loop (a SLURM requeue): one command, kill -9 before the first save, mid-save, when keep-last-N
    rotates, and after the last save; then it finishes, and once more it says so."""
    out = tmp_path / "run"
    command = [*CHECKPOINT_RUN, "--save_total_limit", "2", "--resume_from_checkpoint", "auto"]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)

    def marked(step: int):
        return lambda: (out / f"checkpoint-{step}" / ckpt.MARKER).is_file()

    def saving():
        return any(not (p.parent / ckpt.MARKER).exists() for p in out.glob("checkpoint-*/global_step*"))

    moments = [
        ("early, as the run starts", lambda: (out / ckpt.RUN_ID).is_file(), rng.uniform(0, 1)),
        ("mid-save", saving, 0),
        ("when keep-last-N rotates", marked(6), 0),
        ("after the last save", marked(8), 0),
    ]
    history = []
    for i, (moment, condition, delay) in enumerate(moments):
        complete_before = set(ckpt.complete_checkpoints(out))
        attempt = Launch(out, *command, log=tmp_path / f"{i}.log")
        attempt.wait_for(condition, poll=0.001)
        time.sleep(delay)
        attempt.kill_rank(rng.randrange(2))
        assert attempt.wait(timeout=120) != 0, attempt.text()
        history.append((moment, [p.name for p in ckpt.list_checkpoints(out)]))
        # nothing complete is lost but what keep-last-N rotates (it keeps the newest 2)
        lost = complete_before - set(ckpt.complete_checkpoints(out))
        newest_two = sorted(ckpt.complete_checkpoints(out), key=ckpt.checkpoint_step)[-2:]
        assert all(ckpt.checkpoint_step(p) < min(map(ckpt.checkpoint_step, newest_two)) for p in lost), (seed, history)
    finishing = train(out, *command)
    assert finishing.returncode == 0, explain(finishing) + f"\nseed {seed}, {history}"
    again = train(out, *command)
    assert again.returncode == 0 and "already finished at step 8" in again.stdout, explain(again)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6", "checkpoint-8"], (seed, history)
    assert all(ckpt.verify_complete(p) == [] for p in ckpt.list_checkpoints(out))
    assert not list(out.glob(f"{ckpt.DELETING}*"))
    assert losses_by_step(out) == losses_by_step(uninterrupted), (seed, history)
    final, expected = weights(out), weights(uninterrupted)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    mask = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def test_a_preemption_signal_saves_the_step_in_flight_and_the_same_command_continues(uninterrupted, tmp_path):
    """One table of whoever sends the signal, and when: SIGUSR1 to the launcher (`hf-zero3 launch`; DeepSpeed's own
    launcher would die of it and leave the ranks running), SIGTERM to rank 1 alone, SIGTERM to the whole process
    group as a scheduler sends it (DeepSpeed's per-node launcher gets it too: it would kill the ranks and exit 1),
    and that again before the ranks have installed their handler. Each time both ranks stop after the same step,
    that step's checkpoint is complete, nothing is marked finished and the exit code is 75. The same command then
    finishes the run with the losses and weights of the uninterrupted one, and a group SIGTERM as it shuts down
    changes nothing but its exit code (75). No periodic saves: every checkpoint here is a preemption's."""
    out = tmp_path / "run"
    command = [*CHECKPOINT_RUN, "--save_steps", "100", *KEEP_ALL, "--resume_from_checkpoint", "auto"]

    def after_a_step(attempt: Launch, start: int) -> bool:
        return max(logged_steps(out), default=0) > start

    def rank_started(attempt: Launch, start: int) -> bool:
        return _no_handler_yet(attempt.rank_pid(1))

    cases = [("launcher", signal.SIGUSR1, after_a_step), ("rank 1", signal.SIGTERM, after_a_step),
             ("group", signal.SIGTERM, after_a_step), ("group", signal.SIGTERM, rank_started)]
    stops = []
    for i, (who, sig, moment) in enumerate(cases):
        attempt = Launch(out, *command, log=tmp_path / f"{i}.log")
        start = max(stops, default=0)
        attempt.wait_for(lambda a=attempt, s=start, m=moment: m(a, s), poll=0.01)
        if who == "group":
            os.killpg(attempt.proc.pid, sig)
        else:
            os.kill(attempt.proc.pid if who == "launcher" else attempt.rank_pid(1), sig)
        assert attempt.wait(timeout=180) == PREEMPTED_EXIT, (who, attempt.text())
        complete = [ckpt.checkpoint_step(p) for p in ckpt.complete_checkpoints(out)]
        assert len(complete) == i + 1 and complete[-1] > start, (who, complete, attempt.text())
        stops.append(complete[-1])
        assert f"{sig.name} received: stopping after step {stops[-1]}" in attempt.text(), attempt.text()
        assert f"checkpoint-{stops[-1]} is complete" in attempt.text() and "Traceback" not in attempt.text()
        assert ckpt.read_finished(out) is None and not (out / "model.safetensors").exists()
    finishing = Launch(out, *command, log=tmp_path / "finishing.log")
    # The last stop may already be step 8 (a loaded machine trains on while a signal travels): then step 8 is in the
    # log before this command has started anything, and only its ranks' handlers say that it is running.
    finishing.wait_for(lambda: _handling(finishing.rank_pid(1)) and max(logged_steps(out), default=0) == 8, poll=0.01)
    os.killpg(finishing.proc.pid, signal.SIGTERM)
    assert finishing.wait(timeout=180) == PREEMPTED_EXIT, finishing.text()
    assert "SIGTERM received as the run finished" in finishing.text() and "Traceback" not in finishing.text()
    assert ckpt.read_finished(out) is not None, finishing.text()
    assert losses_by_step(out) == losses_by_step(uninterrupted), stops
    final, expected = weights(out), weights(uninterrupted)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def _handling(pid: int) -> bool:
    """A rank that has its preemption handler in place (False once it has ended)."""
    try:
        return _catches(pid, signal.SIGTERM)
    except FileNotFoundError:
        return False


def _no_handler_yet(pid: int) -> bool:
    """A rank that has started and not yet installed its preemption handler (a signal now would have been lost)."""
    assert not _catches(pid, signal.SIGTERM), "the rank installed its handler before the test could signal it"
    return True
