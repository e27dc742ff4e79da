"""`hf-zero3 doctor` for real: a 2-rank gloo all-reduce through the DeepSpeed launcher, and each failure path
exiting non-zero with its named fix. Failure paths run in-process (same code, no interpreter start-up)
except the unreachable host, which goes through the console script and a real ssh."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from hf_zero3.cli import main as cli_main
from hf_zero3.ops import deepspeed_ops, doctor
from tests.conftest import explain, run

pytestmark = pytest.mark.integration


def skip(*groups: str) -> list[str]:
    return [arg for group in groups for arg in ("--skip", group)]


QUICK = skip("native", "gpus", "allreduce")  # the failure paths need none of these


def doctor_in_process(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["doctor", *args])
    return code, capsys.readouterr().out


def test_doctor_passes_on_cpu_with_two_gloo_ranks_and_measures_bus_bandwidth(tmp_path):
    """Asserted on the JSON report: the text columns, the disk's speed (OK or WARN) and the load vary by machine."""
    proc = run(["hf-zero3", "doctor", "--nvme-path", tmp_path, "--nvme-test-mb", "8", "--json"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    results = {r["name"]: r for r in report["results"]}
    assert report["ok"] and report["counts"]["FAIL"] == 0, explain(proc)
    allreduce = results["allreduce"]
    assert allreduce["status"] == "OK" and "sum exact" in allreduce["detail"], allreduce
    assert (allreduce["data"]["backend"], allreduce["data"]["world_size"]) == ("gloo", 2)
    assert allreduce["data"]["results"][-1]["bytes"] == 64 * 2**20
    assert all(r["busbw_gbps"] > 0 for r in allreduce["data"]["results"]), allreduce
    nvme = results[f"nvme:{tmp_path}"]
    assert "8 MiB fsync'd write" in nvme["detail"] and min(nvme["data"]["write_mbps"], nvme["data"]["read_mbps"]) > 0
    slow = min(nvme["data"]["write_mbps"], nvme["data"]["read_mbps"]) < doctor.SLOW_MBPS
    assert nvme["status"] == ("WARN" if slow else "OK"), nvme  # the threshold decides, whichever side this disk is
    assert results["version:deepspeed"]["status"] == "OK"
    assert list(tmp_path.iterdir()) == []


def test_unreachable_host_fails_fast_and_names_passwordless_ssh(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1.invalid slots=2\n")
    start = time.monotonic()
    proc = run(["hf-zero3", "doctor", "--hostfile", hostfile, *skip("versions", "ops", "native", "gpus")],
               timeout=120)
    assert proc.returncode == 1, explain(proc)
    assert time.monotonic() - start < 60, "an unreachable host must not wait for long timeouts"
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FAIL  ssh:worker-1.invalid"))
    assert "ssh-copy-id worker-1.invalid" in line and "BatchMode=yes" in line
    assert re.search(r"^WARN  allreduce +not run", proc.stdout, re.MULTILINE)  # no launch towards a dead host


def test_remote_fingerprint_command_matches_this_host():
    """What the doctor runs over SSH on each host, run here: it must reproduce the local hash and versions."""
    proc = subprocess.run([sys.executable, "-m", "hf_zero3.ops.doctor", "--fingerprint"], capture_output=True,
                          text=True, timeout=120, cwd="/", check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doctor.fingerprint()


def test_version_outside_matrix_fails_with_json_fix(capsys):
    code, out = doctor_in_process(capsys, "--matrix", "transformers<5", *skip("ops"), *QUICK, "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["counts"]["FAIL"] == 1
    [failed] = [r for r in report["results"] if r["status"] == "FAIL"]
    assert failed["name"] == "version:transformers" and failed["fix"] == 'pip install "transformers<5"'


def test_unwritable_nvme_path_fails_with_fix(capsys):
    code, out = doctor_in_process(capsys, "--nvme-path", "/proc", "--nvme-test-mb", "1",
                                  *skip("versions", "ops"), *QUICK)
    assert code == 1
    assert re.search(r"^FAIL  nvme:/proc +cannot write a file here: .*\(fix: .*--nvme-path\)$", out,
                     re.MULTILINE), out


def test_unknown_op_and_failing_build_fail_with_fix(capsys):
    code, out = doctor_in_process(capsys, "--ops", "no_such_op", *skip("versions"), *QUICK)
    assert code == 1 and "FAIL  op:no_such_op" in out and "(fix: use one of: " in out and "cpu_adam" in out
    # An op that passes is_compatible() but cannot build on this accelerator: --build-ops really loads it.
    code, out = doctor_in_process(capsys, "--ops", "deepspeed_not_implemented", "--build-ops",
                                  *skip("versions"), *QUICK)
    assert code == 1 and "FAIL  op:deepspeed_not_implemented build failed" in out and "ds_report" in out, out


def test_nvme_config_requires_async_io(tmp_path, capsys):
    """ZeRO-Infinity to NVMe needs DeepSpeed's async_io op; without libaio that fails, naming the package."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}))
    code, out = doctor_in_process(capsys, "--config", str(config), "--nvme-test-mb", "1", *skip("versions"),
                                  *QUICK)
    # the config's path is probed (OK or WARN: the disk's speed decides)
    assert re.search(rf"^(OK|WARN) +nvme:{re.escape(str(tmp_path))} ", out, re.MULTILINE), out
    ops, _ = deepspeed_ops._all_ops()
    if ops["async_io"].is_compatible():
        assert code == 0 and "OK    op:async_io" in out, out
        pytest.skip("libaio is installed here: the missing-op failure path cannot be shown on this machine")
    assert code == 1, out
    assert re.search(r"^FAIL  op:async_io +not compatible .*\(needed: offload_param to nvme\) "
                     r"\(fix: install libaio: `apt install libaio-dev`", out, re.MULTILINE), out


def test_input_files_are_checked_before_any_check_runs(tmp_path, capsys):
    """A hostfile DeepSpeed would refuse and unreadable inputs: exit 2, each named with its fix, nothing run."""
    spaced, binary = tmp_path / "hostfile", tmp_path / "ds_config.json"
    spaced.write_text("# node list\nlocalhost slots = 2\n")
    binary.write_bytes(b"\xff\xfe{}")
    for args, expected in (
        (["--hostfile", str(spaced)], [(f"error: --hostfile: {spaced}:2: 'localhost slots = 2' is not `hostname "
                                        "slots=N`: write `localhost slots=2` (DeepSpeed takes no spaces around =)")]),
        (["--hostfile", str(tmp_path)], [f"error: --hostfile: cannot read hostfile {tmp_path}: Is a directory"]),
        (["--config", str(binary), "--hostfile", str(tmp_path / "none")],
         [f"error: --config: ds_config {binary} is not text", f"cannot read hostfile {tmp_path / 'none'}: No such file"]),
        (["--config", str(tmp_path)], [f"error: --config: ds_config {tmp_path} is a folder"]),
    ):
        code = cli_main(["doctor", *args])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (args, out, err)
        assert all(text in err for text in expected), err


def test_hostfile_with_max_slots_passes_as_it_does_for_deepspeed(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2 max_slots=4\n")
    code, out = doctor_in_process(capsys, "--hostfile", str(hostfile), "--json", *skip("versions", "ops", "hosts"),
                                  *QUICK)
    [result] = json.loads(out)["results"]
    assert code == 0 and (result["status"], result["data"]) == ("OK", {"hosts": {"localhost": 2}})
