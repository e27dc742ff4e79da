"""Several nodes without a cluster: two "nodes" on this machine, DeepSpeed's pdsh runner reading our
`.deepspeed_env`, the SLURM script's per-node launches, and `make sync`.

pdsh, ssh to other hosts, rsync, srun and scontrol do not exist here; where a test needs one, a small stand-in
on PATH records what it was asked and (ssh, srun) runs it on this machine. Everything else is the real code:
our launcher, DeepSpeed's runner, the trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hf_zero3.run.distributed import free_port
from tests.conftest import ROOT, VENV, explain, losses, make, run, subprocess_env

pytestmark = pytest.mark.integration

COMMON = ["--max_steps", "4", "--logging_steps", "1", "--save_steps", "100", "--validation_file", "null"]


def stand_in(folder: Path, name: str, body: str) -> None:
    """An executable `name` in `folder` that appends its arguments (one per line, then ---) to folder/name.log."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" --- >> "{folder}/{name}.log"\n{body}\n')
    path.chmod(0o755)


def test_two_nodes_without_ssh_train_like_one_node_with_two_ranks(tmp_path):
    """`deepspeed --no_ssh --num_nodes 2 --node_rank 0|1 --master_addr 127.0.0.1`, one rank each, through
    recipes/tiny/launch.sh: the same losses as 2 ranks on one node (fp32, same seed, one thread per rank)."""
    one = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", tmp_path / "one", *COMMON],
              NUM_GPUS="2", OMP_NUM_THREADS="1")  # first: it also builds the dataset cache the nodes share
    assert one.returncode == 0, explain(one)

    env = subprocess_env(NUM_NODES="2", NUM_GPUS="1", HOSTS="node0,node1", HOSTFILE=str(tmp_path / "hostfile"),
                         NO_SSH="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([str(ROOT / "recipes/tiny/launch.sh"), "--output_dir", str(tmp_path / "two"), *COMMON],
                              cwd=ROOT, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for rank, (node, text) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}:\n{text[-4000:]}"
        assert (f"deepspeed --hostfile={tmp_path / 'hostfile'} --num_nodes=2 --num_gpus=1 --no_ssh "
                f"--node_rank={rank} --master_addr=127.0.0.1 --master_port=") in text
    assert "hf_zero3: ZeRO stage 3 | world size 2 |" in outputs[0]
    assert (tmp_path / "hostfile").read_text() == "node0 slots=1\nnode1 slots=1\n"
    ranks = {json.loads(line)["rank"] for line in (tmp_path / "two" / "memory.jsonl").read_text().splitlines()}
    assert ranks == {0, 1}  # global rank 1 ran on "node" 1

    reference, two_nodes = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(reference) == len(two_nodes) == 4 and reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(reference, two_nodes)) < 1e-5, list(zip(reference, two_nodes))


def test_deepspeeds_pdsh_runner_exports_our_deepspeed_env_to_every_node(tmp_path):
    """DeepSpeed's own runner reads the `.deepspeed_env` we write (DS_ENV_FILE points it here) and puts every
    HF_*/TRANSFORMERS_*/NCCL_* variable into the command pdsh runs on each node; by itself it forwards none of
    them on this machine."""
    bin_dir, env_file = tmp_path / "bin", tmp_path / "ds_env"
    stand_in(bin_dir, "pdsh", "exit 0")  # would run the command on node0 and node1
    stand_in(bin_dir, "ssh", "exit 0")  # DeepSpeed's reachability check of the first host
    proc = run([ROOT / "recipes/tiny/launch.sh", "--max_steps", "1"], NUM_GPUS="1", HOSTS="node0,node1",
               HOSTFILE=str(tmp_path / "hostfile"), MASTER_ADDR="10.0.0.1", DS_ENV_FILE=str(env_file),
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HF_TOKEN="hf_abc", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", NCCL_SOCKET_IFNAME="^lo,docker0", MY_OWN="not forwarded")
    assert proc.returncode == 0, explain(proc)
    assert f"wrote {env_file} for the other nodes:" in proc.stdout
    args = (bin_dir / "pdsh.log").read_text().split("\n---\n")[0].split("\n")
    assert args[:5] == ["-S", "-f", "1024", "-w", "node0,node1"]
    exports = args[5]  # "export K=V; ..." run on every node before DeepSpeed's per-node launcher
    for export in ("export HF_TOKEN=hf_abc;", "export HF_HUB_OFFLINE=1;", "export TRANSFORMERS_VERBOSITY=error;",
                   'export NCCL_SOCKET_IFNAME="^lo,docker0";'):
        assert export in exports, exports
    assert "MY_OWN" not in exports
    assert args[6] == f"cd {ROOT};" and "--master_addr=10.0.0.1" in args
    assert args[-6:] == ["train.py", "recipes/tiny/train_args.yaml", "--deepspeed", "recipes/tiny/ds_config.json",
                         "--max_steps", "1"]


def test_slurm_script_starts_one_no_ssh_launch_per_node(tmp_path):
    """scripts/slurm/train.sbatch under stand-ins for scontrol (the job's hosts) and srun (runs its command once
    per node with SLURM_NODEID): node ranks, node 0 as master, a per-job port and hostfile; DRY_RUN, so
    nothing trains."""
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    stand_in(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
                              'for n in 0 1; do SLURM_NODEID=$n "$@" || exit 1; done')
    proc = run(["bash", ROOT / "scripts/slurm/train.sbatch", "70b", "--output_dir", "outputs/70b-run1"],
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), VENV=str(VENV),
               SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242", NUM_GPUS="4",
               DRY_RUN="1")
    assert proc.returncode == 0, explain(proc)
    assert "job 4242: 2 node(s) (gpu-a,gpu-b) x 4 GPUs, node 0 gpu-a:24242" in proc.stdout
    for rank in (0, 1):
        assert (f"hf_zero3.run.launch: deepspeed --hostfile=outputs/hostfile.4242 --num_nodes=2 --num_gpus=4 --no_ssh "
                f"--node_rank={rank} --master_addr=gpu-a --master_port=24242 train.py recipes/70b/train_args.yaml "
                "--deepspeed recipes/70b/ds_config.json --output_dir outputs/70b-run1") in proc.stdout
    assert proc.stdout.count("would write outputs/hostfile.4242: gpu-a slots=4, gpu-b slots=4") == 2
    srun = (bin_dir / "srun.log").read_text().split("\n")
    assert srun[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]  # one launcher per node; one failure ends all


def test_make_sync_copies_the_checkout_to_every_host_then_the_doctor_compares_the_code(tmp_path):
    """rsync per host to the same path: the files git tracks or would track (no outputs/.venv/caches, no
    .deepspeed_env), deleting nothing there, then .git; then the doctor's SSH fingerprint of each host (ssh here
    runs the command on this machine, which holds the same checkout)."""
    bin_dir, hosts = tmp_path / "bin", tmp_path / "hosts"
    hosts.write_text("# the cluster\nnode1 slots=4\n\nnode2 slots=4  # second\n")
    stand_in(bin_dir, "rsync", f'if printf "%s\\n" "$@" | grep -qx -- --files-from=-; then tr "\\0" "\\n" > '
                               f'"{bin_dir}/files.$(printf "%s\\n" "$@" | tail -1 | cut -d: -f1)"; fi; exit 0')
    stand_in(bin_dir, "ssh", 'while [[ "$1" == -o ]]; do shift 2; done; shift; exec bash -c "$*"')
    stand_in(bin_dir, "pdsh", "exit 0")  # the doctor checks the launcher's backend is installed
    proc = make("sync", f"HOSTFILE={hosts}", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, explain(proc)
    calls = [c.strip("\n").split("\n") for c in (bin_dir / "rsync.log").read_text().split("---") if c.strip()]
    assert [c[-1] for c in calls] == [f"{host}:{ROOT}/{where}" for host in ("node1", "node2") for where in ("", ".git/")]
    for files, git in zip(calls[::2], calls[1::2]):
        assert "--files-from=-" in files and "--delete" not in files  # a host's own files in the checkout stay
        assert git[:2] == ["-az", "--delete"] and git[-2] == ".git/"  # the doctor hashes `git ls-files` on each host
    for host in ("node1", "node2"):
        sent = set((bin_dir / f"files.{host}").read_text().split())
        assert {"Makefile", "hf_zero3/run/train.py", "recipes/tiny/train_args.yaml"} <= sent
        assert not any(p.startswith((".venv/", "outputs/", ".git/")) or "__pycache__" in p for p in sent)
        assert ".deepspeed_env" not in sent
    for host in ("node1", "node2"):
        assert f"OK    code:{host}" in proc.stdout and f"OK    versions:{host}" in proc.stdout, proc.stdout
