"""The doctor's pure parts: matrix, hostfile, op selection, bandwidth math, NVMe probe, code hash."""

from __future__ import annotations

import configparser
import json
import subprocess

import pytest
from packaging.requirements import Requirement

from hf_zero3.ops import deepspeed_ops, doctor
from hf_zero3.ops.allreduce import bus_bandwidth
from tests.conftest import ROOT, error_naming


def test_matrix_is_setup_cfg_install_requires():
    """One source of truth: the installed metadata the doctor reads agrees with setup.cfg (stale egg-info
    after an edit of setup.cfg fails here)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines()]
    expected = {Requirement(line).name: Requirement(line).specifier for line in lines if line}
    assert {r.name: r.specifier for r in doctor.supported_matrix()} == expected, (
        "hf_zero3's installed metadata is stale: run `make setup` (pip install -e .) after editing setup.cfg")


def test_matrix_override_replaces_one_package_by_canonical_name():
    matrix = {r.name.lower(): str(r.specifier) for r in doctor.supported_matrix(["PyYAML<6", "torch>=9"])}
    assert matrix["pyyaml"] == "<6" and matrix["torch"] == ">=9"
    assert len(matrix) == len(doctor.supported_matrix())


def test_version_outside_matrix_fails_with_the_pip_command():
    results = {r.name: r for r in doctor.check_versions(["torch<2.0", "not-a-real-package>=1"])}
    assert results["version:torch"].status == "FAIL"
    assert results["version:torch"].fix.startswith('pip install "torch<2.0"')
    assert results["version:not-a-real-package"].status == "FAIL"
    assert "not installed" in results["version:not-a-real-package"].detail
    assert results["version:deepspeed"].status == "OK"


def test_installed_venv_is_inside_the_matrix():
    assert [r.line() for r in doctor.check_versions() if r.status != "OK"] == []
    assert doctor.check_python().status == "OK"


def test_peft_before_0_19_beside_torchao_0_18_is_a_warning_naming_the_fix(tmp_path, monkeypatch):
    """The check reads installed package metadata only (nothing is imported): the dist-info of the pair the GPU box
    had (peft 0.18.1, torchao 0.18.0), first on the path, is what importlib.metadata reports as installed."""
    for name, version in (("peft", "0.18.1"), ("torchao", "0.18.0")):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    results = {r.name: r for r in doctor.check_versions()}
    pair = results["version:peft+torchao"]
    assert pair.status == "WARN" and "peft 0.18.1" in pair.detail and "torchao 0.18.0" in pair.detail
    assert "pip uninstall torchao" in pair.fix and "peft>=0.19" in pair.fix
    assert results["version:peft"].status == "OK"  # inside the supported range: only the pair fails


@pytest.mark.parametrize(("bytes_", "seconds", "world", "algbw", "busbw"), [
    (10**9, 1.0, 2, 1.0, 1.0),      # 2(n-1)/n = 1 for two ranks
    (10**9, 0.5, 8, 2.0, 3.5),      # nccl-tests: busbw = algbw * 2*7/8
    (4 * 10**9, 2.0, 64, 2.0, 3.9375),
])
def test_bus_bandwidth_matches_nccl_tests(bytes_, seconds, world, algbw, busbw):
    assert bus_bandwidth(bytes_, seconds, world) == pytest.approx((algbw, busbw))


def test_bad_hostfile_is_a_failure_with_the_format(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node1 gpus=8\n")
    [result] = doctor.check_hostfile(path)
    assert result.status == "FAIL" and "hostname slots=N" in result.fix


def _config(name: str) -> dict:
    return json.loads((ROOT / "ds_configs" / name).read_text())


def test_ops_needed_by_the_shipped_configs():
    assert deepspeed_ops.needed_ops(_config("zero3.json")) == {}  # HF creates a torch optimizer
    assert set(deepspeed_ops.needed_ops(_config("zero3_offload_optimizer.json"))) == {"cpu_adam"}
    assert set(deepspeed_ops.needed_ops(_config("zero3_offload_all.json"))) == {"cpu_adam"}
    nvme = deepspeed_ops.needed_ops(_config("zero3_nvme.json"))
    assert set(nvme) == {"cpu_adam", "async_io"}
    assert nvme["async_io"] == "offload_optimizer and offload_param to nvme"
    assert doctor.nvme_paths(_config("zero3_nvme.json")) == ["/local_nvme"]


@pytest.mark.parametrize(("config", "ops"), [
    ({"optimizer": {"type": "AdamW"}}, {"fused_adam"}),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, set()),
    ({"optimizer": {"type": "Lion"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     {"cpu_lion"}),
    ({"optimizer": {"type": "Lamb"}}, {"fused_lamb"}),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"}}}, {"async_io"}),
    ({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, set()),
])
def test_ops_follow_the_engines_optimizer_choice(config, ops):
    assert set(deepspeed_ops.needed_ops(config)) == ops


def test_nvme_probe_writes_reads_and_cleans_up(tmp_path):
    result = doctor.check_nvme(tmp_path, test_bytes=4 * 2**20, chunk=2**20)
    assert result.status in ("OK", "WARN"), result.line()  # WARN: this disk is slower than an NVMe drive
    assert result.data["write_mbps"] > 0 and result.data["read_mbps"] > 0 and result.data["free_bytes"] > 0
    assert "4 MiB fsync'd write" in result.detail
    assert list(tmp_path.iterdir()) == []


def test_nvme_probe_fails_on_unwritable_and_missing_paths(tmp_path):
    proc = doctor.check_nvme("/proc", test_bytes=2**20)  # root can write almost anywhere, not into /proc
    assert proc.status == "FAIL" and "cannot write" in proc.detail and "--nvme-path" in proc.fix
    missing = doctor.check_nvme(tmp_path / "nope", test_bytes=2**20)
    assert missing.status == "FAIL" and f"mkdir -p {tmp_path / 'nope'}" in missing.fix


def test_code_hash_covers_tracked_content_only(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    before = doctor.code_hash(tmp_path)
    (tmp_path / "untracked.txt").write_text("scratch")
    assert doctor.code_hash(tmp_path) == before
    (tmp_path / "a.py").write_text("x = 2\n")
    assert doctor.code_hash(tmp_path) != before


def test_cudnn_version_decoding():
    assert doctor._parse_cudnn(8600) == "8.6.0"
    assert doctor._parse_cudnn(90100) == "9.1.0"


def test_result_line_names_the_fix():
    assert doctor.Result("FAIL", "nvme:/x", "not writable", "chown it").line() == (
        "FAIL  nvme:/x                not writable (fix: chown it)")
    assert doctor.Result("OK", "python", "3.11").line() == "OK    python                 3.11"


def test_allreduce_launch_command_is_the_training_launcher():
    cmd = doctor.allreduce_command(2, "deepspeed", 29555)
    assert cmd[0].endswith("deepspeed")
    assert cmd[1:6] == ["--num_gpus", "2", "--master_port", "29555", "--module"]
    assert cmd[6] == "hf_zero3.ops.allreduce"
    assert "--hostfile" in doctor.allreduce_command(8, "deepspeed", 1, hostfile="hf")
    torchrun = doctor.allreduce_command(4, "torchrun", 1)
    assert torchrun[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "4"]


def test_arch_list_deepspeed_cannot_parse_is_named_with_a_fix(monkeypatch):
    """Seen on an H200 image: TORCH_CUDA_ARCH_LIST=9.0a makes every CUDA op's JIT build raise int('0a')."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;8.0")
    assert deepspeed_ops._arch_list_problem().endswith('export TORCH_CUDA_ARCH_LIST="8.0;9.0" before training')
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0+PTX")
    assert deepspeed_ops._arch_list_problem() is None


def test_ssh_call_is_deepspeeds_pdsh_call(monkeypatch):
    """DeepSpeed's pdsh runner appends PDSH_SSH_ARGS_APPEND and `-p <--ssh_port>`: the doctor tests that."""
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    assert doctor.ssh_command("node1", "true") == [*doctor.SSH, "node1", "true"]
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-i '/keys/my key' -o IdentitiesOnly=yes")
    assert doctor.ssh_command("node1", "true", port=2222) == [
        *doctor.SSH, "-i", "/keys/my key", "-o", "IdentitiesOnly=yes", "-p", "2222", "node1", "true"]
    assert doctor.allreduce_command(4, "deepspeed", 1, hostfile="hf", ssh_port=2222)[1:5] == [
        "--hostfile", "hf", "--ssh_port", "2222"]


def _fake_ssh(monkeypatch, *, rc: int = 0, stderr: str = "", remote: dict | None = None) -> None:
    def fake(host, command, timeout=60, port=None):
        out = json.dumps(remote) if remote and command != "true" else ""
        return subprocess.CompletedProcess([], rc, out, stderr)

    monkeypatch.setattr(doctor, "_ssh", fake)


LOCAL = {"code_root": "/src", "code_hash": "a" * 64, "versions": {"python": "3.11.7", "torch": "2.13.0"}}


def test_ssh_failure_names_the_fix_for_its_cause(monkeypatch):
    _fake_ssh(monkeypatch, rc=255, stderr="No ED25519 host key is known for [node1]:2222 and you have "
              "requested strict checking.\nHost key verification failed.\n")
    [result] = doctor.check_host("node1", LOCAL, port=2222)
    assert result.detail == "no passwordless SSH: Host key verification failed."
    assert "`ssh-keyscan -p 2222 node1 >> ~/.ssh/known_hosts`" in result.fix
    _fake_ssh(monkeypatch, rc=255, stderr="root@node1: Permission denied (publickey).\n")
    [result] = doctor.check_host("node1", LOCAL)
    assert "`ssh-copy-id node1`" in result.fix and "ssh-keyscan" not in result.fix


def test_different_code_and_versions_fail_with_sync_and_pins(monkeypatch):
    _fake_ssh(monkeypatch, remote={"code_root": "/src", "code_hash": "b" * 64,
                                   "versions": {"python": "3.11.7", "torch": "2.12.0"}})
    results = {r.name: r for r in doctor.check_host("node1", LOCAL, port=2222)}
    assert results["ssh:node1"].status == "OK"
    assert results["code:node1"].detail == f"tracked files differ ({'b' * 12} there, {'a' * 12} here)"
    error_naming(results["code:node1"].fix, "`make sync HOSTFILE=<hostfile> SSH_PORT=2222`", "in /src")
    assert results["versions:node1"].detail == "differ: torch 2.12.0 there, 2.13.0 here"
    assert results["versions:node1"].fix == 'on node1: pip install "torch==2.13.0"'
    _fake_ssh(monkeypatch, remote=LOCAL)
    assert [r.status for r in doctor.check_host("node1", LOCAL)] == ["OK", "OK", "OK"]


def test_ssh_port_option_is_a_port():
    import argparse

    from hf_zero3.cli import doctor as doctor_cli

    parser = argparse.ArgumentParser()
    doctor_cli.add_arguments(parser)
    assert parser.parse_args(["--ssh-port", "2222"]).ssh_port == 2222
    assert parser.parse_args([]).ssh_port is None
    for bad in ("0", "65536", "22x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--ssh-port", bad])
