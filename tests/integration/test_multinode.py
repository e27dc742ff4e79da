"""Several nodes without a cluster: two "nodes" on this machine, each its own loopback address (127.X.Y.2 and .3)
with its own real sshd, reached by DeepSpeed's own pdsh runner with keys this module makes; the same run
without SSH (`NO_SSH`, as the SLURM script starts it), and the SLURM script's per-node launches.

srun and scontrol do not exist here: the SLURM test puts a small stand-in for each on PATH that records what it
was asked and runs it on this machine; so does the test of what `make sync` sends. Everything else is real:
sshd, ssh, pdsh, rsync, our launcher, DeepSpeed's runner, the trainer. The nodes' ssh client settings go where a
cluster keeps them (an ssh_config: DeepSpeed's own reachability check reads no other), as a drop-in in
/etc/ssh/ssh_config.d for these two addresses only, removed at the end: so the real-node tests need root.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.distributed import free_port
from hf_zero3.run.node_loss import PEER_LOST_EXIT
from hf_zero3.job.preemption import PREEMPTED_EXIT
from tests.conftest import ROOT, VENV, error_naming, explain, losses, losses_by_step, run, subprocess_env

pytestmark = pytest.mark.integration

STEPS = 6
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_steps", "100", "--validation_file", "null"]


def stand_in(folder: Path, name: str, body: str) -> None:
    """An executable `name` in `folder` that appends its arguments (one per line, then ---) to folder/name.log."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" --- >> "{folder}/{name}.log"\n{body}\n')
    path.chmod(0o755)


def checkout_copy(tmp_path: Path, worktree: bool = False) -> Path:
    """This checkout as a git repository of its own under tmp_path (with `worktree`: a `git worktree` of one, whose
    .git is a file), holding this checkout's files as they are. `make sync` there copies it onto itself on these
    nodes (the same machine): nothing of this checkout's own git data is touched."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(repo)], check=True)
    target = repo
    if worktree:
        target = tmp_path / "worktree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(target)], check=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, map(os.fsdecode, listed.split(b"\0"))):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def make_in(folder: Path, target: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`make` as tests.conftest.make does it, in `folder`."""
    return subprocess.run(["make", "--no-print-directory", "-o", f"{VENV}/bin/.installed", f"VENV={VENV}", target,
                           *args], cwd=folder, env=subprocess_env(**env), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: 2 ranks on one node (fp32, same seed, one thread per rank); it also builds the dataset cache
    the nodes share."""
    out = tmp_path_factory.mktemp("one") / "run"
    one = run([ROOT / "recipes/tiny/launch.sh", "--output_dir", out, *COMMON], NUM_GPUS="2", OMP_NUM_THREADS="1")
    assert one.returncode == 0, explain(one)
    return out


def assert_same_losses_as(reference: Path, out: Path) -> None:
    expected, got = losses(reference), losses(out)
    assert len(expected) == len(got) == STEPS and expected[-1] < expected[0]
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5, list(zip(expected, got, strict=True))


def test_two_nodes_without_ssh_train_like_one_node_with_two_ranks(one_node, tmp_path):
    """`deepspeed --no_ssh --num_nodes 2 --node_rank 0|1 --master_addr 127.0.0.1`, one rank each, through
    recipes/tiny/launch.sh: the same losses as 2 ranks on one node."""

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

    assert_same_losses_as(one_node, tmp_path / "two")


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


def test_make_sync_sends_what_git_tracks_and_deletes_nothing_else(tmp_path):
    """What `make sync` asks rsync for, per host, the same path: the files git tracks or would track (no
    outputs/.venv/caches, no .deepspeed_env), deleting nothing there, then .git; then the doctor's SSH fingerprint
    of each host. rsync and ssh are stand-ins here (a sync onto itself would show nothing); the real ones are
    below, on real nodes."""
    bin_dir, hosts = tmp_path / "bin", tmp_path / "hosts"
    hosts.write_text("# the cluster\nnode1 slots=4\n\nnode2 slots=4  # second\n")
    stand_in(bin_dir, "rsync", f'if printf "%s\\n" "$@" | grep -qx -- --files-from=-; then tr "\\0" "\\n" > '
                               f'"{bin_dir}/files.$(printf "%s\\n" "$@" | tail -1 | cut -d: -f1)"; fi; exit 0')
    stand_in(bin_dir, "ssh", 'while [[ "$1" == -o ]]; do shift 2; done; shift; exec bash -c "$*"')
    stand_in(bin_dir, "pdsh", "exit 0")  # the doctor checks the launcher's backend is installed
    checkout = checkout_copy(tmp_path)
    proc = make_in(checkout, "sync", f"HOSTFILE={hosts}", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, explain(proc)
    calls = [c.strip("\n").split("\n") for c in (bin_dir / "rsync.log").read_text().split("---") if c.strip()]
    assert [c[-1] for c in calls] == [f"{host}:{checkout}/{where}" for host in ("node1", "node2")
                                      for where in ("", ".git/")]
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


# --- two nodes with real sshd ----------------------------------------------------------------------------------

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
NODE_TOOLS = {"sshd": SSHD, "ssh": "ssh", "ssh-keygen": "ssh-keygen", "pdsh": "pdsh", "rsync": "rsync", "ip": "ip"}
SSH_CONFIG_DIR = Path("/etc/ssh/ssh_config.d")
needs_nodes = pytest.mark.skipif(
    os.geteuid() != 0 or not SSH_CONFIG_DIR.is_dir() or not all(shutil.which(t) for t in NODE_TOOLS.values()),
    reason="real nodes need root and openssh-server, openssh-client, pdsh, rsync, iproute2 (.ci/run installs them)")
NODE_NIC = "eth0"
"""Each node's network interface, in its own namespace: the name gloo binds to (GLOO_SOCKET_IFNAME), as on a
cluster whose host names resolve to a loopback address (Debian's 127.0.1.1; here 127.0.0.1)."""


@dataclass
class Nodes:
    hosts: list[str]  # one address per node, each in its own network namespace
    hostfile: Path  # DeepSpeed's `host slots=1` lines
    logs: list[Path]  # each node's sshd log
    links: list[str]  # each node's cable: the bridge side of its veth pair
    local: Path  # a path each node sees as a folder of its own disk (`disks[i]`); others see the real folder
    disks: list[Path]
    ds_env: Path  # a .deepspeed_env (DS_ENV_FILE) that names the nodes' interface to gloo

    def accepted_logins(self, node: int) -> int:
        return self.logs[node].read_text().count("Accepted publickey for")

    def cut(self, node: int) -> None:
        """Pull node's cable: its link goes down; nothing is reset, packets to and from it are dropped."""
        subprocess.run(["ip", "link", "set", self.links[node], "down"], check=True)

    def mend(self, node: int) -> None:
        subprocess.run(["ip", "link", "set", self.links[node], "up"], check=True)


def _ip(*args: str, netns: str | None = None) -> None:
    subprocess.run(["ip", *(["-n", netns] if netns else []), *args], check=True, capture_output=True, text=True)


def _free_subnet() -> str:
    """10.X.Y (X, Y random) with no address or route on this machine: test sessions running at once do not meet."""
    taken = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    for _ in range(100):
        prefix = f"10.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
        if f"{prefix}." not in taken:
            return prefix
    raise RuntimeError("no free 10.X.Y.0/24 subnet")


def _wait_for_port(address: str, port: int, process: subprocess.Popen, log: Path, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, f"sshd on {address} exited {process.returncode}:\n{log.read_text()}"
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex((address, port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"sshd on {address}:{port} did not listen within {timeout} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two nodes, 10.X.Y.2 and 10.X.Y.3, each in its own network namespace, its veth cable plugged into a bridge
    that this machine reaches at 10.X.Y.1; each with its own sshd (own host key, public-key login only, this
    module's client key authorized) and a disk of its own at `local` (a bind mount in the sshd's mount namespace:
    what a node's processes write there, the other node does not see). Known to ssh through a drop-in ssh_config
    for exactly these two addresses."""
    root = tmp_path_factory.mktemp("nodes")
    prefix = _free_subnet()
    tag = prefix.split(".", 1)[1].replace(".", "x")
    hosts, bridge = [f"{prefix}.2", f"{prefix}.3"], f"hfz{tag}"
    netns = [f"hfz-{tag}-{i}" for i in range(len(hosts))]
    links = [f"hfz{tag}n{i}" for i in range(len(hosts))]
    port = 22  # each node has a network namespace, and so the ports, of its own
    keygen = lambda path: subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],  # noqa: E731
                                         check=True, capture_output=True)
    keygen(root / "id_ed25519")
    (root / "authorized_keys").write_text((root / "id_ed25519.pub").read_text())
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    local, disks = root / "local", [root / f"node{i}" / "disk" for i in range(len(hosts))]
    local.mkdir()
    daemons, logs, known = [], [], []
    drop_in = SSH_CONFIG_DIR / f"hf-zero3-test-{tag}.conf"
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"no bridge device here ({e.stderr.strip()}): real nodes need network namespaces")
        _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts):
            node = root / f"node{i}"
            disks[i].mkdir(parents=True)
            _ip("netns", "add", netns[i])
            _ip("link", "add", links[i], "type", "veth", "peer", "name", NODE_NIC, "netns", netns[i])
            _ip("link", "set", links[i], "master", bridge, "up")
            _ip("addr", "add", f"{host}/24", "dev", NODE_NIC, netns=netns[i])
            _ip("link", "set", NODE_NIC, "up", netns=netns[i])
            _ip("link", "set", "lo", "up", netns=netns[i])
            keygen(node / "host_key")
            (node / "sshd_config").write_text(
                f"ListenAddress {host}:{port}\nHostKey {node / 'host_key'}\nPidFile {node / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {root / 'authorized_keys'}\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                "UsePAM no\nStrictModes no\nLogLevel VERBOSE\nMaxStartups 64\nMaxSessions 64\n")
            logs.append(node / "sshd.log")
            # `ip netns exec` gives the command a mount namespace of its own: the bind mount is this node's alone
            daemons.append(subprocess.Popen(
                ["ip", "netns", "exec", netns[i], "sh", "-c",
                 f'mount --bind "{disks[i]}" "{local}" && exec "{SSHD}" -D -e -f "{node / "sshd_config"}"'],
                stdout=subprocess.DEVNULL, stderr=logs[-1].open("w")))
            key = (node / "host_key.pub").read_text().split(" ")
            known.append(f"{host} {key[0]} {key[1]}")
        (root / "known_hosts").write_text("\n".join(known) + "\n")
        drop_in.write_text(f"Host {' '.join(hosts)}\n  Port {port}\n  IdentityFile {root / 'id_ed25519'}\n"
                           f"  IdentitiesOnly yes\n  UserKnownHostsFile {root / 'known_hosts'}\n"
                           "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
                           "  ConnectTimeout 10\n  LogLevel ERROR\n")
        for host, daemon, log in zip(hosts, daemons, logs, strict=True):
            _wait_for_port(host, port, daemon, log)
        hostfile = root / "hostfile"
        hostfile.write_text("".join(f"{host} slots=1\n" for host in hosts))
        ds_env = root / "ds_env"
        ds_env.write_text(f"GLOO_SOCKET_IFNAME={NODE_NIC}\n")
        yield Nodes(hosts, hostfile, logs, links, local, disks, ds_env)
    finally:
        drop_in.unlink(missing_ok=True)
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=10)
        for name in netns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its eth0 and the veth pair go too
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@needs_nodes
def test_doctor_reaches_both_nodes_over_ssh_and_all_reduces_across_them(nodes):
    """`hf-zero3 doctor --hostfile`: SSH, the same code and versions on each node, then an all-reduce over gloo
    whose two ranks DeepSpeed's pdsh runner starts one per node."""
    proc = run(["hf-zero3", "doctor", "--hostfile", nodes.hostfile, "--skip", "native", "--skip", "gpus",
                "--skip", "ops", "--skip", "nvme"], timeout=300, MASTER_ADDR=nodes.hosts[0],
               DS_ENV_FILE=str(nodes.ds_env))
    assert proc.returncode == 0, explain(proc)
    for host in nodes.hosts:
        for check in ("ssh", "code", "versions"):
            assert f"OK    {check}:{host}" in proc.stdout, explain(proc)
    allreduce = [line for line in proc.stdout.splitlines() if " allreduce " in f" {line} "]
    assert allreduce and allreduce[0].startswith("OK") and "2 ranks" in allreduce[0], explain(proc)
    assert all(nodes.accepted_logins(i) >= 2 for i in (0, 1))  # the checks and pdsh logged in to each node


@needs_nodes
def test_make_sync_goes_over_ssh_to_every_node_then_the_doctor_finds_the_same_code(nodes, tmp_path):
    """From a `git worktree`, whose .git is a file: the repository's git folder goes too (a clone's .git folder is
    the stand-in test's case above)."""
    checkout = checkout_copy(tmp_path, worktree=True)
    before = [nodes.accepted_logins(i) for i in (0, 1)]
    proc = make_in(checkout, "sync", f"HOSTFILE={nodes.hostfile}")
    assert proc.returncode == 0, explain(proc)
    for host in nodes.hosts:
        assert f"sync {checkout}/ -> {host}:{checkout}/" in proc.stdout
        assert f"OK    code:{host}" in proc.stdout and f"OK    versions:{host}" in proc.stdout, explain(proc)
    # three rsyncs (the checkout, its .git file, the repository's git folder) and the doctor's two calls, each its
    # own SSH login on each node
    assert [nodes.accepted_logins(i) - before[i] for i in (0, 1)] == [5, 5]


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask in /proc): a rank that does is listening."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@needs_nodes
def test_two_nodes_over_pdsh_and_ssh_train_like_one_node_through_a_preemption(one_node, nodes, tmp_path):
    """NUM_NODES=2 through recipes/tiny/launch.sh: DeepSpeed's pdsh runner logs in to each node and starts one rank
    there (a process under that node's sshd, with the variables `.deepspeed_env` carried and no others). SIGTERM
    to the launcher's whole process group, as a scheduler sends it, as soon as both ranks exist (before they have
    a handler: the launcher's pdsh call holds it until they do; DeepSpeed's runner and pdsh, in the group, never
    act on it) reaches them over pdsh: they stop after the same step with a complete checkpoint and exit 75,
    passed back by pdsh; the same command resumes, and the losses are those of 2 ranks on one node."""
    out = tmp_path / "two"
    env = subprocess_env(NUM_NODES="2", NUM_GPUS="1", HOSTFILE=str(nodes.hostfile), MASTER_ADDR=nodes.hosts[0],
                         OMP_NUM_THREADS="1", DS_ENV_FILE=str(tmp_path / "ds_env"), HF_ZERO3_NODE_CHECK="carried",
                         GLOO_SOCKET_IFNAME=NODE_NIC,
                         MY_OWN="not carried")
    command = [str(ROOT / "recipes/tiny/launch.sh"), "--output_dir", str(out), *COMMON, "--resume_from_checkpoint",
               "auto"]
    launcher = subprocess.Popen(command, cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ranks: dict[int, dict] = {}
    while launcher.poll() is None and len(ranks) < 2:
        for process in psutil.process_iter(["pid", "cmdline"]):
            cmdline = process.info["cmdline"] or []
            if str(out) in cmdline and any(a.startswith("--local_rank=") for a in cmdline):
                try:
                    node = int(process.environ()["CROSS_RANK"])  # DeepSpeed's node rank, set per node
                    ranks[node] = {"env": process.environ(), "parents": {p.pid: p.name() for p in process.parents()},
                                   "listens": _catches(process.pid, signal.SIGTERM)}
                except (psutil.Error, KeyError, OSError):
                    pass
        time.sleep(0.05)
    early = not all(r["listens"] for r in ranks.values())  # a signal now, sent once, would be lost or kill a rank
    os.killpg(launcher.pid, signal.SIGTERM)
    text = launcher.communicate(timeout=600)[0]
    assert launcher.returncode == PREEMPTED_EXIT, text[-4000:]
    assert f"--hostfile={nodes.hostfile} --num_nodes=2 --num_gpus=1 --master_addr={nodes.hosts[0]}" in text
    assert "hf_zero3: ZeRO stage 3 | world size 2 |" in text
    assert sorted(ranks) == [0, 1] and early, text[-4000:]
    for rank in ranks.values():  # started over SSH: under sshd, not under this launcher
        assert "sshd" in rank["parents"].values() and launcher.pid not in rank["parents"], rank["parents"]
        assert rank["env"].get("HF_ZERO3_NODE_CHECK") == "carried" and "MY_OWN" not in rank["env"]
    complete = ckpt.complete_checkpoints(out)
    assert len(complete) == 1 and "SIGTERM received: stopping after step" in text, text[-4000:]
    assert all(nodes.accepted_logins(i) >= 2 for i in (0, 1))  # the launch and the signal
    resumed = subprocess.run(command, cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())}, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, explain(resumed)
    assert_same_losses_as(one_node, out)


# --- a node lost ------------------------------------------------------------------------------------------------

NODE_TIMEOUT = 5
"""The launcher's NODE_TIMEOUT in these tests: ssh gives a silent node up after ~5 s, the other nodes get 5 s more."""


def _node_ranks(out: Path) -> dict[int, int]:
    """{node index: pid} of the ranks training into `out` (DeepSpeed's CROSS_RANK is a rank's node)."""
    ranks = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if str(out) in cmdline and any(a.startswith("--local_rank=") for a in cmdline):
            try:
                ranks[int(process.environ()["CROSS_RANK"])] = process.pid
            except (psutil.Error, KeyError, OSError):
                pass
    return ranks


def _end_leftovers(out: Path) -> None:
    """Kill what is left of a run into `out` on a node that was cut off (its launcher, its rank): processes this
    test started, found by their command line."""
    for process in psutil.process_iter(["pid", "cmdline"]):
        if str(out) in " ".join(process.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                process.kill()


@dataclass
class Lost:
    text: str  # the launcher's output
    code: int  # its exit status
    peers_gone_s: float  # from the failure until node 0's rank was gone
    launcher_s: float  # from the failure until the launcher exited


def _lose_node_1(command: list[str], env: dict, log: Path, ready, fail, timeout: float = 300) -> Lost:
    """Run `command` until `ready()` holds, then `fail()` node 1; time node 0's rank and the launcher out."""
    with log.open("w") as sink:
        launcher = subprocess.Popen(command, cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())}, stdout=sink,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert launcher.poll() is None, f"the run ended before node 1 failed:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready after {timeout} s:\n{log.read_text()[-4000:]}"
            time.sleep(0.02)
        ranks = _node_ranks(command[2])
        assert sorted(ranks) == [0, 1], ranks
        fail(ranks[1])
        failed = time.monotonic()
        while psutil.pid_exists(ranks[0]) and psutil.Process(ranks[0]).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - failed < 240, f"node 0's rank still runs:\n{log.read_text()[-4000:]}"
            time.sleep(0.1)
        peers_gone = time.monotonic() - failed
        code = launcher.wait(timeout=240)
        return Lost(log.read_text(), code, peers_gone, time.monotonic() - failed)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@needs_nodes
def test_a_node_lost_mid_step_mid_save_and_cut_off_then_the_same_command_resumes_on_node_local_disks(
        one_node, nodes, tmp_path):
    """Checkpoints on each node's own disk (`save_on_each_node`), one command run four times:

    1. node 1's rank killed (kill -9) mid-step, after checkpoint-2: node 0's rank stops within seconds, naming the
       peer it lost; the launcher names node 1 and the signal;
    2. again, killed mid-save of checkpoint-4: no copy of checkpoint-4 is marked complete;
    3. node 1's network cut mid-step, after checkpoint-4: ssh gives node 1 up after NODE_TIMEOUT, the launcher
       names it and stops node 0 (whose collective would otherwise wait ddp_timeout, 30 min);
    4. it finishes: each run resumed from the newest checkpoint complete on both nodes (2, 2, 4), and the losses
       are those of 2 ranks on one node running straight through."""
    out = nodes.local / "run"
    disks = [disk / "run" for disk in nodes.disks]  # what node i sees at `out`
    env = subprocess_env(NUM_NODES="2", NUM_GPUS="1", HOSTFILE=str(nodes.hostfile), MASTER_ADDR=nodes.hosts[0],
                         OMP_NUM_THREADS="1", DS_ENV_FILE=str(tmp_path / "ds_env"), GLOO_SOCKET_IFNAME=NODE_NIC,
                         NODE_TIMEOUT=str(NODE_TIMEOUT))
    command = [str(ROOT / "recipes/tiny/launch.sh"), "--output_dir", str(out), *COMMON, "--save_steps", "2",
               "--save_total_limit", "2", "--save_on_each_node", "true", "--resume_from_checkpoint", "auto"]
    marked = lambda step: all((d / f"checkpoint-{step}" / ckpt.MARKER).is_file() for d in disks)  # noqa: E731
    kill = lambda pid: os.kill(pid, signal.SIGKILL)  # noqa: E731
    named = f"hf_zero3.run.launch: node {nodes.hosts[1]} failed: exit "
    timings = {}

    try:
        shared_only = subprocess.run([c for c in command if c not in ("--save_on_each_node", "true")], cwd=ROOT,
                                     env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True,
                                     timeout=600)
        assert shared_only.returncode == 2, explain(shared_only)
        error_naming(shared_only.stderr, "on each node's own disk", "--save_on_each_node true")
        assert all(not list(d.iterdir()) for d in disks)  # refused before anything was written

        killed = _lose_node_1(command, env, tmp_path / "1.log", lambda: marked(2), kill)
        assert killed.code != 0, killed.text[-4000:]
        assert f"{named}247, a rank there was killed by SIGKILL" in killed.text, killed.text[-4000:]
        assert f"{nodes.hosts[0]} exit {PEER_LOST_EXIT}: its ranks lost a peer" in killed.text
        assert f"lost contact with the rank at {nodes.hosts[1]}" in killed.text  # node 0's rank, in one line
        assert killed.peers_gone_s < 30 and killed.launcher_s < 40, (killed.peers_gone_s, killed.launcher_s)
        timings["kill mid-step"] = killed

        saving = _lose_node_1(command, env, tmp_path / "2.log",
                              lambda: (disks[1] / "checkpoint-4" / ckpt.SAVING).is_file(), kill)
        assert f"{named}247" in saving.text and saving.peers_gone_s < 30, saving.text[-4000:]
        assert not any((d / "checkpoint-4" / ckpt.MARKER).exists() for d in disks)  # killed before any copy counted
        assert all(ckpt.is_complete(d / "checkpoint-2") for d in disks)
        timings["kill mid-save"] = saving

        try:
            cut = _lose_node_1(command, env, tmp_path / "3.log", lambda: marked(4), lambda pid: nodes.cut(1))
        finally:
            nodes.mend(1)
            _end_leftovers(out)  # node 1's rank, cut off, would wait ddp_timeout
        assert f"removing {out}/checkpoint-4: its save never finished" in cut.text  # each node's unfinished copy
        assert f"{named}255, ssh lost it" in cut.text, cut.text[-4000:]
        assert "stopping the job on every node" in cut.text
        assert cut.peers_gone_s < 2 * NODE_TIMEOUT + 45 and cut.launcher_s < 2 * NODE_TIMEOUT + 60, (
            cut.peers_gone_s, cut.launcher_s)
        timings["network cut mid-step"] = cut

        finished = subprocess.run(command, cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())},
                                  capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, explain(finished)
        expected, got = losses_by_step(one_node), losses_by_step(disks[0])
        assert sorted(got) == list(range(1, STEPS + 1)), got
        assert max(abs(expected[s] - got[s]) for s in got) < 1e-5, (expected, got)
        for disk in disks:  # each node's copy: the newest 2 complete, keep-last-N done on each, the run finished
            assert [p.name for p in ckpt.complete_checkpoints(disk)] == ["checkpoint-4", "checkpoint-6"], disk
            assert ckpt.read_finished(disk) is not None and (disk / "checkpoint-6" / "latest").is_file()
        # DeepSpeed gathers the 16-bit weights on rank 0 alone: they are on node 0's disk
        assert all((folder / "model.safetensors").is_file() for folder in (disks[0], disks[0] / "checkpoint-6"))
        for name, lost in timings.items():
            print(f"{name}: node 0's rank gone {lost.peers_gone_s:.1f} s after, the launcher {lost.launcher_s:.1f} s")
    finally:
        _end_leftovers(out)  # whatever failed, no rank of this test lives on under a node's sshd


def test_a_rank_whose_peers_never_come_stops_after_ddp_timeout(tmp_path):
    """The process group honours ddp_timeout (DeepSpeed's default is 30 min): rank 0 of 2, alone, stops after it
    with one line naming what it waited for, exit 69."""
    started = time.monotonic()
    alone = run(["hf-zero3", "train", "recipes/tiny/train_args.yaml", "--output_dir", tmp_path / "run",
                 "--ddp_timeout", "5", "--validation_file", "null"], timeout=300, RANK="0", LOCAL_RANK="0",
                WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    assert alone.returncode == PEER_LOST_EXIT, explain(alone)
    assert "the ranks that never joined: 1 of 2 reached MASTER_ADDR:MASTER_PORT within ddp_timeout" in alone.stderr
    assert "Traceback" not in alone.stderr and time.monotonic() - started < 120
