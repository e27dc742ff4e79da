"""Progress that works in a terminal and in a log file: lines during training go around the tqdm bar, a bench
off a terminal prints a line per N steps with the ETA, an export says where it is shard by shard."""

from __future__ import annotations

import io
import subprocess
import sys
import types

from tqdm import tqdm

from hf_zero3.callbacks import MemoryCallback
from hf_zero3.ops.bench import follow_run, progress_line


def test_the_memory_line_does_not_cut_the_trainers_progress_bar(monkeypatch, tmp_path):
    screen = io.StringIO()  # a terminal shared by the bar (stderr) and the line (stdout)
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    bar = tqdm(total=10, file=sys.stderr, desc="train")
    bar.update(3)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=3, log_history=[])
    MemoryCallback().on_log(args, state, None, logs={"loss": 1.0})
    bar.close()
    shown = [line.split("\r")[-1] for line in screen.getvalue().split("\n")]  # what the terminal shows per row
    memory = [line for line in shown if "hf_zero3 memory:" in line]
    assert len(memory) == 1 and memory[0].startswith("hf_zero3 memory: step 3"), shown  # a row of its own
    assert any(line.startswith("train:") and "3/10" in line for line in shown), shown  # the bar, whole


def test_bench_off_a_terminal_prints_a_line_per_tenth_with_the_eta(tmp_path, capfd):
    log = tmp_path / "train_log.jsonl"
    writer = ("import json, sys, time\n"
              "for step in range(1, 21):\n"
              "    with open(sys.argv[1], 'a') as f: f.write(json.dumps({'step': step, 'loss': 1.0}) + '\\n')\n"
              "    time.sleep(0.12)\n"
              "time.sleep(2.5)\n")  # the run goes on after its last step (saving, exiting): no more lines
    proc = subprocess.Popen([sys.executable, "-c", writer, str(log)])
    assert follow_run(proc, log, 20, "[1/1] ours run 1") == 0
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[1/1] ours run 1: step")]
    assert 2 <= len(lines) <= 10 and len(set(lines)) == len(lines), lines  # stderr is not a terminal under pytest: lines, no bar
    assert all(" s, ETA " in line for line in lines) and lines[-1].startswith("[1/1] ours run 1: step 20/20"), lines


def test_progress_line_estimates_the_rest_from_the_steps_so_far():
    assert progress_line("ours", 5, 20, 10.0) == "ours: step 5/20, 10 s, ETA 30 s"


def _writer(steps: int, then_sleep: float) -> str:
    return ("import json, sys, time\n"
            f"for step in range(1, {steps + 1}):\n"
            "    with open(sys.argv[1], 'a') as f: f.write(json.dumps({'step': step, 'loss': 1.0}) + '\\n')\n"
            f"time.sleep({then_sleep})\n")


def test_a_run_past_the_limit_fails_unless_all_its_steps_are_logged(tmp_path, capfd):
    """--run-timeout stops both; the one that hangs on its way out after its last step has measured everything."""
    finished, hung = tmp_path / "finished.jsonl", tmp_path / "hung.jsonl"
    exiting = subprocess.Popen([sys.executable, "-c", _writer(4, 60), str(finished)])
    assert follow_run(exiting, finished, 4, "exiting", limit=4) == 0
    assert exiting.poll() is not None  # stopped all the same
    short = subprocess.Popen([sys.executable, "-c", _writer(3, 60), str(hung)])
    assert follow_run(short, hung, 4, "short", limit=4) == 124
    assert short.poll() is not None
    err = capfd.readouterr().err
    assert "exiting: all 4 steps logged; stopped while exiting" in err and "short: stopped after 4 s" in err


def test_stop_at_ends_a_run_after_that_many_steps_and_counts_it(tmp_path, capfd):
    """`compare --stop-after`: the first N steps of a longer schedule are a result, not a failure."""
    log = tmp_path / "long.jsonl"
    writer = ("import json, sys, time\n"
              "for step in range(1, 1001):\n"
              "    with open(sys.argv[1], 'a') as f: f.write(json.dumps({'step': step, 'loss': 1.0}) + '\\n')\n"
              "    time.sleep(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(log)])
    assert follow_run(proc, log, 1000, "long", limit=60, stop_at=5) == 0
    assert proc.poll() is not None  # stopped, long before its 1000 steps
    logged = sum(1 for line in log.read_text().splitlines() if '"loss"' in line)
    import re

    said = re.search(r"long: stopped after (\d+) of 1000 steps, as asked", capfd.readouterr().err)
    assert said and 5 <= int(said.group(1)) <= logged < 100  # a line may land between the count and the kill
