"""Preflight checks before a ZeRO-3 run: each check is a small function returning `Result`s that name a fix.

What a multi-node ZeRO-3 job needs and usually finds out an hour in: versions inside the supported matrix
(setup.cfg's `install_requires`, the one source of truth), the DeepSpeed ops the ds_config will JIT-build,
GPUs with free memory, a working all-reduce over every rank, passwordless SSH and the same code and
packages on every host, and a writable, fast NVMe path (the DeepSpeed ops: `ops.deepspeed_ops`).
`python -m hf_zero3.ops.doctor --fingerprint` prints this host's code hash and versions; the doctor runs it on
every host over SSH.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hf_zero3 import recipes
from hf_zero3.model import lora
from hf_zero3.job.distributed import free_port
from hf_zero3.run.hostfile import HOSTFILE_FIX, HostfileError, read_hostfile

# setup.cfg cannot express native libraries; these floors are the seed's (torch>=2.6 wheels ship newer).
NATIVE_MINIMUMS = {"cuda": "11.8", "cudnn": "8.6", "nccl": "2.18"}
SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
SSH_FIX = ("set up passwordless SSH from this node: `ssh-keygen -t ed25519` once, then "
           "`ssh-copy-id {port}{host}`; check that `ssh -o BatchMode=yes {port}{host} true` works without a "
           "prompt and the name resolves")
HOST_KEY_FIX = ("this node does not know {host}'s host key and BatchMode cannot ask: add it once, "
                "`ssh-keyscan {port}{host} >> ~/.ssh/known_hosts` (compare its fingerprint with the "
                "host's `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), or `ssh {port}{host} true` "
                "and answer yes")
SLOW_MBPS = 500  # below this an "NVMe" path is probably a network or spinning disk


@dataclass
class Result:
    status: str  # OK | WARN | FAIL
    name: str
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<22} {self.detail}" + (f" (fix: {self.fix})" if self.fix else "")

    def as_dict(self) -> dict:
        return asdict(self)


# ---- versions ---------------------------------------------------------------------------------------

def supported_matrix(overrides: list[str] | tuple[str, ...] = ()) -> list[Requirement]:
    """setup.cfg's install_requires (as installed metadata); `overrides` replace ranges by package name."""
    reqs = {}
    for text in importlib.metadata.requires("hf_zero3") or []:  # PackageNotFoundError: not pip-installed
        req = Requirement(text)
        if req.marker is None:  # extras (dev tools) are not part of the runtime matrix
            reqs[_canonical(req.name)] = req
    for text in overrides:
        req = Requirement(text)
        reqs[_canonical(req.name)] = req
    return list(reqs.values())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_python() -> Result:
    try:
        spec = SpecifierSet(importlib.metadata.metadata("hf_zero3").get("Requires-Python") or "")
    except importlib.metadata.PackageNotFoundError:
        spec = SpecifierSet()  # check_versions reports the missing install
    version = ".".join(map(str, sys.version_info[:3]))
    if spec.contains(version):
        return Result("OK", "python", f"{version} ({sys.executable})")
    return Result("FAIL", "python", f"{version} is outside {spec}",
                  f"create the venv with a Python {spec} (`python3.11 -m venv .venv`)")


def check_versions(overrides: list[str] | tuple[str, ...] = ()) -> list[Result]:
    """One result per package of the matrix: installed, and inside its range."""
    try:
        matrix = supported_matrix(overrides)
    except importlib.metadata.PackageNotFoundError:
        return [Result("FAIL", "version:hf_zero3", "hf_zero3 is not pip-installed, so the supported matrix "
                       "is unknown", "pip install -e . in the checkout (`make setup`)")]
    results = []
    for req in matrix:
        name = f"version:{req.name}"
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            results.append(Result("FAIL", name, f"not installed (supported: {req.specifier})",
                                  f'pip install "{req}"'))
            continue
        if req.specifier.contains(installed, prereleases=True):
            results.append(Result("OK", name, f"{installed} in {req.specifier}"))
        else:
            hint = " (pick the wheel for your CUDA: https://pytorch.org/get-started/locally/)" \
                if _canonical(req.name) == "torch" else ""
            results.append(Result("FAIL", name, f"{installed} is outside the supported {req.specifier}",
                                  f'pip install "{req}"{hint}'))
    if (conflict := lora.torchao_conflict()) is not None:  # LoRA runs fail; every other run is unaffected
        results.append(Result("WARN", "version:peft+torchao", conflict[0], conflict[1]))
    return results


def _parse_cudnn(v: int) -> str:
    """torch reports cuDNN 8.6.0 as 8600 and 9.1.0 as 90100."""
    major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def check_native_libs() -> list[Result]:
    """CUDA, cuDNN and NCCL as torch was built with them, against the floors in NATIVE_MINIMUMS."""
    import torch

    if torch.version.cuda is None:
        return [Result("WARN", "cuda", f"torch {torch.__version__} is a CPU-only build: no CUDA/cuDNN/NCCL, "
                       "ranks use gloo", "for GPU training install a CUDA build of torch "
                       "(https://pytorch.org/get-started/locally/)")]
    cudnn = torch.backends.cudnn.is_available() and _parse_cudnn(torch.backends.cudnn.version())
    nccl = torch.distributed.is_nccl_available() and ".".join(map(str, torch.cuda.nccl.version()))
    found = {"cuda": torch.version.cuda, "cudnn": cudnn or None, "nccl": nccl or None}
    results = []
    for lib, version in found.items():
        floor = NATIVE_MINIMUMS[lib]
        if version is None:
            results.append(Result("FAIL", lib, f"torch {torch.__version__} has no {lib}",
                                  "install the standard CUDA build of torch, which bundles cuDNN and NCCL"))
        elif Version(version) < Version(floor):
            results.append(Result("FAIL", lib, f"{version} is older than {floor}",
                                  f"install a torch wheel built with {lib} >= {floor}"))
        else:
            results.append(Result("OK", lib, f"{version} (>= {floor})"))
    return results


def check_gpus(min_free_fraction: float = 0.9) -> Result:
    """GPUs this process sees and their free memory; memory held by another process is a warning."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            return Result("WARN", "gpus", "none visible: training runs on CPU ranks (gloo)",
                          "on a GPU machine install a CUDA build of torch, leave CUDA_VISIBLE_DEVICES unset")
        return Result("FAIL", "gpus", f"torch {torch.__version__} is a CUDA build but sees no GPU",
                      "check `nvidia-smi` (driver loaded, new enough for CUDA "
                      f"{torch.version.cuda}) and CUDA_VISIBLE_DEVICES")
    gpus, busy = [], []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "free_gib": free / 2**30,
                     "total_gib": total / 2**30})
        if free < min_free_fraction * total:
            busy.append(i)
    detail = f"{len(gpus)} x {gpus[0]['name']}: " + ", ".join(
        f"{g['index']}: {g['free_gib']:.1f}/{g['total_gib']:.1f} GiB free" for g in gpus)
    if busy:
        return Result("WARN", "gpus", detail, f"GPU {busy} already hold memory: find the process with "
                      "`nvidia-smi` and stop it, or set CUDA_VISIBLE_DEVICES", {"gpus": gpus})
    return Result("OK", "gpus", detail, data={"gpus": gpus})


# ---- NVMe -------------------------------------------------------------------------------------------

def nvme_paths(config: dict) -> list[str]:
    zero = config.get("zero_optimization") or {}
    paths = [(zero.get(k) or {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
             if (zero.get(k) or {}).get("device") == "nvme"]
    return sorted({p for p in paths if p})


def check_nvme(path: str | os.PathLike, test_bytes: int = 256 * 2**20, chunk: int = 16 * 2**20) -> Result:
    """A real write + fsync and a read past the page cache in `path`; reports free space and MB/s."""
    p = Path(path)
    label = f"nvme:{p}"
    fix = ("ZeRO-Infinity writes its swap files here: use a directory on a local NVMe mount that the "
           "training user can write (`chown`/`chmod` it), or pass another --nvme-path")
    if not p.is_dir():
        return Result("FAIL", label, "does not exist or is not a directory",
                      f"mount the NVMe drive and `mkdir -p {p}`, or pass another --nvme-path")
    probe = p / f".hf_zero3_doctor_{os.getpid()}"
    block = os.urandom(min(chunk, test_bytes))
    try:
        start = time.perf_counter()
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            written = 0
            while written < test_bytes:
                written += os.write(fd, block[: test_bytes - written])
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - start
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop the cached pages: measure the device
            start = time.perf_counter()
            read = 0
            while data := os.read(fd, chunk):
                read += len(data)
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    except OSError as e:
        return Result("FAIL", label, f"cannot write a file here: {e.strerror}", fix)
    finally:
        probe.unlink(missing_ok=True)
    if read != test_bytes:
        return Result("FAIL", label, f"read back {read} of {test_bytes} bytes", "check the disk (`dmesg`)")
    free = shutil.disk_usage(p).free
    mbps = {"write_mbps": test_bytes / 1e6 / write_s, "read_mbps": test_bytes / 1e6 / max(read_s, 1e-9)}
    detail = (f"writable, {free / 2**30:.1f} GiB free, {test_bytes / 2**20:.0f} MiB fsync'd write "
              f"{mbps['write_mbps']:.0f} MB/s, read {mbps['read_mbps']:.0f} MB/s")
    data = {"free_bytes": free, **mbps}
    if min(mbps.values()) < SLOW_MBPS:
        return Result("WARN", label, detail, f"under {SLOW_MBPS} MB/s is not a local NVMe drive: check "
                      f"`findmnt -T {p}`; tune with `ds_nvme_tune`", data)
    return Result("OK", label, detail, data=data)


# ---- hosts ------------------------------------------------------------------------------------------

def code_root() -> Path:
    """The checkout hf_zero3 runs from (`recipes.CHECKOUT`), or the package folder for an installed wheel."""
    return recipes.CHECKOUT or recipes.PACKAGE


def code_hash(root: Path) -> str:
    """sha256 over the git-tracked files (path and content as on disk), or every .py file outside git."""
    listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60,
                             check=False)
    if listing.returncode == 0:
        names = sorted(n for n in listing.stdout.decode().split("\0") if n)
    else:
        names = sorted(str(f.relative_to(root)) for f in root.rglob("*.py"))
    digest = hashlib.sha256()
    for name in names:
        path = root / name
        if path.is_file():  # a tracked file deleted in the work tree is simply absent
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def fingerprint() -> dict:
    """What must match across hosts: the code and the package versions (python, matrix, CUDA, NCCL)."""
    versions = {"python": ".".join(map(str, sys.version_info[:3]))}
    for req in supported_matrix():
        try:
            versions[req.name] = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            versions[req.name] = None
    import torch

    versions["cuda"] = torch.version.cuda
    versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    root = code_root()
    return {"code_root": str(root), "code_hash": code_hash(root), "versions": versions}


def ssh_command(host: str, command: str, port: int | None = None) -> list[str]:
    """The ssh call DeepSpeed's pdsh runner makes: PDSH_SSH_ARGS_APPEND, then `-p` for its --ssh_port."""
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    return [*SSH, *extra, *(["-p", str(port)] if port else []), host, command]


def _ssh(host: str, command: str, timeout: int = 60, port: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(ssh_command(host, command, port), capture_output=True, text=True, timeout=timeout,
                          check=False)


def check_host(host: str, local: dict, port: int | None = None) -> list[Result]:
    """Passwordless SSH to `host`, then the same code hash and package versions as this node."""
    try:
        proc = _ssh(host, "true", timeout=30, port=port)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], 255, "", "ssh timed out")
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        fix = HOST_KEY_FIX if "Host key verification failed" in proc.stderr else SSH_FIX
        return [Result("FAIL", f"ssh:{host}", f"no passwordless SSH: {reason}",
                       fix.format(host=host, port=f"-p {port} " if port else ""))]
    results = [Result("OK", f"ssh:{host}", "passwordless SSH works")]
    root = local["code_root"]
    rsync = f"rsync -a -e 'ssh -p {port}'" if port else "rsync -a"
    command = (f"cd {shlex.quote(root)} && {shlex.quote(sys.executable)} "
               "-m hf_zero3.ops.doctor --fingerprint")
    try:
        proc = _ssh(host, command, timeout=300, port=port)
        remote = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        remote = None
    if remote is None:
        return results + [Result("FAIL", f"code:{host}", f"`{command}` failed there",
                                 f"put the same checkout and venv at the same paths on {host} (shared NFS, "
                                 f"or `{rsync} {root}/ {host}:{root}/` and the venv)")]
    here, there = local["code_hash"][:12], remote["code_hash"][:12]
    if here == there:
        results.append(Result("OK", f"code:{host}", f"same tracked files (sha256 {here})"))
    else:
        results.append(Result("FAIL", f"code:{host}", f"tracked files differ ({there} there, {here} here)",
                              f"sync it: `make sync HOSTFILE=<hostfile>{f' SSH_PORT={port}' if port else ''}` in "
                              f"{root} (copies what git tracks and deletes nothing else there), or share it on NFS"))
    diff = {k: (v, remote["versions"].get(k)) for k, v in local["versions"].items()
            if remote["versions"].get(k) != v}
    if diff:
        pins = " ".join(f'"{k}=={mine}"' for k, (mine, _) in diff.items()
                        if mine and k not in ("python", "cuda", "nccl"))
        results.append(Result("FAIL", f"versions:{host}", "differ: " + ", ".join(
            f"{k} {theirs} there, {mine} here" for k, (mine, theirs) in diff.items()),
            f"on {host}: pip install {pins}" if pins else "rebuild the venv on every host from one image"))
    else:
        results.append(Result("OK", f"versions:{host}", "same python, packages, CUDA and NCCL"))
    return results


def check_hostfile(path: str | os.PathLike, ssh: bool = True, port: int | None = None) -> list[Result]:
    """Parse the hostfile, then (with `ssh`) check every host in parallel (on SSH port `port`)."""
    try:
        hosts = read_hostfile(path)
    except HostfileError as e:
        return [Result("FAIL", "hostfile", str(e), HOSTFILE_FIX)]
    results = [Result("OK", "hostfile", f"{len(hosts)} host(s), {sum(hosts.values())} slots",
                      data={"hosts": hosts})]
    if idle := [h for h, slots in hosts.items() if slots == 0]:
        results.append(Result("WARN", "hostfile", f"{', '.join(idle)}: slots=0, so DeepSpeed starts no rank "
                              "there", "give each host the ranks it should run (slots=N) or remove its line"))
    if not ssh:
        return results
    if shutil.which("ssh") is None:
        return results + [Result("FAIL", "ssh", "no ssh client", "apt install openssh-client")]
    if len(hosts) > 1 and shutil.which("pdsh") is None:
        results.append(Result("FAIL", "pdsh", "not installed: DeepSpeed's launcher starts the nodes with it",
                              "apt install pdsh (or launch with `--launcher openmpi`)"))
    local = fingerprint()
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        for host_results in pool.map(lambda h: check_host(h, local, port), hosts):
            results.extend(host_results)
    return results


# ---- all-reduce -------------------------------------------------------------------------------------

def allreduce_command(ranks: int, launcher: str, port: int, hostfile: str | None = None,
                      sizes_mb: str = "1,16,64", ssh_port: int | None = None) -> list[str]:
    """The same launcher as training, running hf_zero3.ops.allreduce on every rank."""
    module = ["hf_zero3.ops.allreduce", "--sizes-mb", sizes_mb]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(port), "-m", *module]
    deepspeed = Path(sys.executable).parent / "deepspeed"
    hosts = ["--hostfile", str(hostfile)] if hostfile else ["--num_gpus", str(ranks)]
    hosts += ["--ssh_port", str(ssh_port)] if hostfile and ssh_port else []
    # as training (hf_zero3.run.launch) passes it; else DeepSpeed asks node 0 for `hostname -I` over SSH
    hosts += ["--master_addr", os.environ["MASTER_ADDR"]] if hostfile and os.environ.get("MASTER_ADDR") else []
    return [str(deepspeed) if deepspeed.exists() else "deepspeed", *hosts, "--master_port", str(port),
            "--module", *module]


def check_allreduce(ranks: int, launcher: str = "deepspeed", hostfile: str | None = None,
                    timeout: int = 300, min_nccl_busbw: float = 5.0, ssh_port: int | None = None) -> Result:
    """Launch the all-reduce test like training; rank 0's numbers, or the launcher's last words and a fix.

    `ranks` is the world size it must reach (with a hostfile: the sum of its slots)."""
    import torch

    from hf_zero3.ops.allreduce import RESULT_TAG  # the probe imports torch.distributed: only when it runs

    gpu = torch.cuda.is_available()
    sizes = "1,16,256" if gpu else "1,16,64"
    cmd = allreduce_command(ranks, launcher, free_port(), hostfile, sizes, ssh_port)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    if gpu:
        fix = ("rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME names the interface the nodes share, "
               "the firewall allows the master port and NCCL's ports between nodes, each rank sees one GPU")
    else:
        fix = "check gloo can bind (GLOO_SOCKET_IFNAME=lo on one machine) and this runs: " + " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return Result("FAIL", "allreduce", f"no result after {timeout} s (a rank hangs)", fix)
    # pdsh puts "host: " in front of every line a node prints
    tagged = [line[line.index(RESULT_TAG):] for line in proc.stdout.splitlines()
              if line.startswith(RESULT_TAG + " ") or f": {RESULT_TAG} " in line]
    if proc.returncode != 0 or not tagged:
        tail = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-2:]
        return Result("FAIL", "allreduce", f"exit {proc.returncode}: " + " | ".join(tail)[-400:], fix)
    summary = json.loads(tagged[-1][len(RESULT_TAG) + 1:])
    big = summary["results"][-1]
    detail = (f"{summary['backend']}, {summary['world_size']} ranks ({launcher}), sum exact; busbw "
              f"{big['busbw_gbps']:.2f} GB/s at {big['bytes'] / 2**20:.0f} MiB "
              f"(algbw {big['algbw_gbps']:.2f}); "
              + ", ".join(f"{r['bytes'] / 2**20:.0f} MiB {r['busbw_gbps']:.2f}"
                          for r in summary["results"][:-1]))
    if summary["world_size"] != ranks:
        return Result("FAIL", "allreduce", f"{summary['world_size']} ranks started, expected {ranks}: "
                      f"{detail}", "check --ranks / the hostfile slots against each node's GPUs", summary)
    if summary["world_size"] == 1:
        return Result("OK", "allreduce", f"{summary['backend']}, 1 rank: works, but nothing crosses a link "
                      "(busbw is 0 by definition)", data=summary)
    if summary["backend"] == "nccl" and big["busbw_gbps"] < min_nccl_busbw:
        return Result("WARN", "allreduce", detail, "slow for NCCL: with NCCL_DEBUG=INFO check it uses "
                      "NVLink/IB, not sockets (NCCL_IB_DISABLE, NCCL_SOCKET_IFNAME, `nvidia-smi topo -m`)",
                      summary)
    return Result("OK", "allreduce", detail, data=summary)




def main(argv: list[str] | None = None) -> int:
    """`python -m hf_zero3.ops.doctor --fingerprint`: what the doctor runs on each host over SSH."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_zero3.ops.doctor")
    parser.add_argument("--fingerprint", action="store_true", help="print this host's code hash and versions")
    args = parser.parse_args(argv)
    if not args.fingerprint:
        parser.error("run `hf-zero3 doctor` for the checks; this entry point only has --fingerprint")
    print(json.dumps(fingerprint()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
