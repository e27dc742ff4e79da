"""The launch settings in the environment, checked together, and the deepspeed command they make.

DeepSpeed's launcher quietly trims what does not match (NUM_GPUS above a host's slots, NUM_NODES above the
hostfile) or fails late on a remote node, so every setting is checked against the others before anything starts,
each problem naming its fix (`hf_zero3.run.launch` prints and runs the command).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hf_zero3 import recipes
from hf_zero3.argtypes import parse_size, positive_int
from hf_zero3.plan.profiles import PROFILES
from hf_zero3.run import node_loss
from hf_zero3.job.distributed import LaunchError, free_port
from hf_zero3.run.hostfile import HostfileError, read_hostfile

DEFAULT_HOSTFILE = "outputs/hostfile"
MULTI_NODE_PORT = 29500
"""MASTER_PORT default for several nodes: every node must agree, and a free-port probe here says nothing
about node 0. One node takes a free port (`free_port`), so parallel runs never collide."""
LAUNCHER_TOOLS = {"pdsh": "pdsh", "openmpi": "ompi_info"}
"""DeepSpeed's multi-node backends we support, and the program DeepSpeed looks for to use each. Not its slurm
backend: it starts one srun task per rank with no RANK/WORLD_SIZE, which the ranks refuse; under SLURM,
scripts/slurm/train.sbatch starts one DeepSpeed launcher per node (NO_SSH=1)."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Target:
    """A recipe's target hardware: the defaults for NUM_NODES, NUM_GPUS and GPU_MEM."""

    nodes: int = 1
    gpus: int = 2
    gpu_mem: str | None = None
    profile: str | None = None
    """A named machine (`hf_zero3/plan/profiles.py`): its host RAM and NVMe size are planned for too."""

    @classmethod
    def parse(cls, text: str) -> Target:
        """`NODESxGPUS[xMEM]`, MEM in the size grammar of `plan --gpu-mem` (40GB, 140GiB), or a profile name."""
        if text in PROFILES:
            machine = PROFILES[text]
            return cls(1, machine.gpus, f"{machine.gpu_mem}B", text)
        parts = text.split("x", 2)
        try:
            if len(parts) < 2:
                raise argparse.ArgumentTypeError(text)
            target = cls(positive_int(parts[0]), positive_int(parts[1]), parts[2] if len(parts) == 3 else None)
            if len(parts) == 3:
                parse_size(parts[2])
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"bad target {text!r}: NODESxGPUS[xGPU_MEM], e.g. 1x8x40GB, or a "
                                             f"profile ({', '.join(PROFILES)})") from None
        return target


@dataclass
class Launch:
    """What `resolve` decided: the command, and the files to write before it runs."""

    command: list[str]
    train_argv: list[str]
    """What train.py receives: the recipe YAML, --deepspeed, the model and the user's overrides."""
    nodes: int
    gpus: int
    world_size: int
    dry_run: bool = False
    hostfile: str | None = None
    new_hostfile: dict[str, int] | None = None
    """Hosts and slots to write into `hostfile` first (from HOSTS)."""
    remote_nodes: bool = False
    """DeepSpeed starts the other nodes from here (pdsh/MPI/slurm), so they need `.deepspeed_env`."""
    remote_hosts: tuple[str, ...] = ()
    """The hosts where DeepSpeed's pdsh runner starts the ranks (for passing signals on, naming a node lost)."""
    node_timeout: int = node_loss.DEFAULT_NODE_TIMEOUT
    """NODE_TIMEOUT: seconds a node may be silent (ssh's keepalive), and the others' time to stop after one failed."""


def flag(env: Mapping[str, str], name: str, problems: list[str]) -> bool:
    text = env.get(name, "").strip().lower()
    if text not in _TRUE + _FALSE:
        problems.append(f"{name}={env[name]} is not a switch: set {name}=1 or unset it")
    return text in _TRUE


def _number(env: Mapping[str, str], name: str, default: int, problems: list[str], low: int = 1,
            high: int | None = None) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        limits = f"{low}..{high}" if high is not None else f">= {low}"
        problems.append(f"{name}={text} is not a whole number {limits}: fix or unset it")
        return default
    return int(text)


def _shown(path: Path) -> str:
    """A path as the command shows it: relative to the working directory when inside it."""
    path = path.resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def recipe_values(recipe: Path) -> dict:
    """The recipe's YAML as the registry reads it ({} without one: `resolve` says it is missing)."""
    return recipes.Recipe(recipe).values if (recipe / "train_args.yaml").is_file() else {}


def _hosts(env: Mapping[str, str], gpus: int, problems: list[str]) -> tuple[str | None, dict | None, bool]:
    """(hostfile path, its hosts and slots, whether we write it) from HOSTS or HOSTFILE."""
    hostfile = env.get("HOSTFILE", "").strip() or None
    if env.get("HOSTS", "").strip():
        if "[" in env["HOSTS"] or "]" in env["HOSTS"]:
            problems.append(f"HOSTS={env['HOSTS']} is a SLURM node list, which HOSTS does not expand: pass the "
                            "names, e.g. HOSTS=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | paste -sd,)")
            return hostfile or DEFAULT_HOSTFILE, None, False
        names = [h.strip() for h in env["HOSTS"].split(",") if h.strip()]
        if len(set(names)) < len(names):
            problems.append(f"HOSTS={env['HOSTS']} names a host twice: list each host once")
        return hostfile or DEFAULT_HOSTFILE, dict.fromkeys(names, gpus), True
    if hostfile is None:
        return None, None, False
    if not Path(hostfile).exists():
        problems.append(f"HOSTFILE={hostfile} does not exist: write it (lines `host slots=N`), "
                        "or set HOSTS=host1,host2 to have it written")
        return hostfile, None, False
    try:
        return hostfile, read_hostfile(hostfile), False
    except HostfileError as e:
        problems.append(f"HOSTFILE: {e}")
        return hostfile, None, False


def _resources(env: Mapping[str, str], nodes: int, gpus: int, hostfile: str | None, pool: dict | None,
               launcher: str, problems: list[str]) -> tuple[int, int]:
    """(hosts used, world size), after checking hosts, slots, INCLUDE/EXCLUDE and the backend against each other."""
    include, exclude = env.get("INCLUDE", "").strip(), env.get("EXCLUDE", "").strip()
    hosts_used, world = nodes, nodes * gpus
    if include and exclude:
        problems.append("INCLUDE and EXCLUDE are both set: DeepSpeed takes one of them; keep one")
    elif include or exclude:
        explicit = sorted(n for n in ("NUM_NODES", "NUM_GPUS") if env.get(n, "").strip())
        if explicit:
            problems.append("INCLUDE/EXCLUDE pick hosts and slots themselves and DeepSpeed refuses them with "
                            f"--num_nodes/--num_gpus: unset {' and '.join(explicit)}")
        from deepspeed.launcher.runner import (
            parse_inclusion_exclusion,  # DeepSpeed's own reading of the filter
        )

        available = pool or {"localhost": gpus}
        try:
            active = parse_inclusion_exclusion(available, include, exclude)
            hosts_used, world = len(active), sum(len(slots) for slots in active.values())
        except (ValueError, KeyError) as e:
            problems.append(f"{'INCLUDE' if include else 'EXCLUDE'}: {e}: fix it against {available}")
    elif pool:
        if nodes > len(pool):
            problems.append(f"NUM_NODES={nodes} but {hostfile} lists {len(pool)} host(s): set NUM_NODES="
                            f"{len(pool)} or add hosts to the hostfile")
        short = {h: s for h, s in list(pool.items())[:nodes] if s < gpus}
        if short:
            problems.append(f"NUM_GPUS={gpus} but {hostfile} gives " + ", ".join(
                f"{h} {s} slot(s)" for h, s in short.items()) + f": set NUM_GPUS={min(short.values())} or fix the slots")
    if nodes > 1 and hostfile is None:
        problems.append(f"NUM_NODES={nodes} needs the hosts: set HOSTFILE=path (lines `host slots=N`) or "
                        "HOSTS=host1,host2 (a hostfile with NUM_GPUS slots per host is written)")
    if launcher == "slurm":
        problems.append("LAUNCHER=slurm starts one srun task per rank without RANK/WORLD_SIZE, which the ranks "
                        "refuse: under SLURM submit scripts/slurm/train.sbatch (one DeepSpeed launcher per node, "
                        "NO_SSH=1), or use LAUNCHER=pdsh")
    elif launcher and launcher not in LAUNCHER_TOOLS:
        problems.append(f"LAUNCHER={launcher} is not supported: use {', '.join(LAUNCHER_TOOLS)}, "
                        "or NO_SSH=1 on every node")
    if launcher == "openmpi":  # DeepSpeed's OpenMPI runner starts every slot of the hostfile, nothing less
        if include or exclude or pool is None:
            problems.append("LAUNCHER=openmpi runs every slot of a hostfile and takes no INCLUDE/EXCLUDE: set "
                            "HOSTFILE (or HOSTS) to exactly the hosts and slots to use")
        elif nodes != len(pool) or set(pool.values()) != {gpus}:
            problems.append(f"LAUNCHER=openmpi runs every slot of {hostfile} ({pool}), not NUM_NODES={nodes} x "
                            f"NUM_GPUS={gpus}: make the hostfile match (HOSTS=... writes one) or unset them")
        else:
            hosts_used, world = len(pool), sum(pool.values())
    return hosts_used, world


def _node_rank(env: Mapping[str, str], no_ssh: bool, launcher: str, hosts_used: int, problems: list[str]) -> int:
    """This node's rank for a NO_SSH launch (0 otherwise), checked with what such a launch needs."""
    node_rank = _number(env, "NODE_RANK", 0, problems, low=0)
    given = bool(env.get("NODE_RANK", "").strip())
    if not no_ssh:
        if given:
            problems.append("NODE_RANK is only used with NO_SSH=1: set NO_SSH=1 (one launch per node) or unset it")
        return node_rank
    if not given:
        problems.append(f"NO_SSH=1 needs NODE_RANK: this node's index (0..{hosts_used - 1}) in the hostfile")
    elif node_rank >= hosts_used:
        problems.append(f"NODE_RANK={node_rank} but there are {hosts_used} node(s): use 0..{hosts_used - 1}")
    if not env.get("MASTER_ADDR", "").strip():
        problems.append("NO_SSH=1 needs MASTER_ADDR: the address of the node with NODE_RANK=0, the same on every node")
    if launcher:
        problems.append(f"LAUNCHER={launcher} is unused with NO_SSH=1 (each node starts its own ranks): unset it")
    return node_rank


# A recipe that trains from scratch names its shape and tokenizer with these; MODEL= replaces all three, else the
# recipe's overrides would reshape MODEL's config (its weights loaded into a model of the recipe's size) and its
# tokenizer would replace MODEL's.
FROM_SCRATCH_KEYS = ("config_name", "config_overrides", "tokenizer_name")


def _model_args(env: Mapping[str, str], recipe: Path, from_config: bool, problems: list[str]) -> list[str]:
    """MODEL: pretrained weights; FROM_CONFIG=1: random weights from that model's (or the recipe's) config."""
    source = env.get("MODEL", "").strip()
    values = recipe_values(recipe)
    if not from_config:
        cleared = [arg for key in FROM_SCRATCH_KEYS if values.get(key) for arg in (f"--{key}", "null")]
        return ["--model_name_or_path", source, *cleared] if source else []
    if source:
        cleared = [arg for key in FROM_SCRATCH_KEYS[1:] if values.get(key) for arg in (f"--{key}", "null")]
        return ["--model_name_or_path", "null", "--config_name", source, *cleared]
    source = values.get("model_name_or_path") or values.get("config_name") or ""
    if not source:
        problems.append("FROM_CONFIG=1 needs a model config: set MODEL=folder-or-hub-id")
    return ["--model_name_or_path", "null", "--config_name", source]


def resolve(recipe: Path, overrides: list[str], env: Mapping[str, str], target: Target = Target()) -> Launch:
    """Check the launch settings in `env` together and build the deepspeed command (raises LaunchError)."""
    problems: list[str] = []
    for name in ("train_args.yaml", "ds_config.json"):
        if not (recipe / name).is_file():
            found = ", ".join(recipes.names())
            problems.append(f"{recipe} has no {name}: pass a recipe folder (recipes/<name>: {found})")
    gpus = _number(env, "NUM_GPUS", target.gpus, problems)
    hostfile, pool, write = _hosts(env, gpus, problems)
    nodes = _number(env, "NUM_NODES", len(pool) if pool else target.nodes, problems)
    launcher = env.get("LAUNCHER", "").strip().lower()
    no_ssh, dry_run, from_config = (flag(env, n, problems) for n in ("NO_SSH", "DRY_RUN", "FROM_CONFIG"))
    hosts_used, world = _resources(env, nodes, gpus, hostfile, pool, launcher, problems)
    node_rank = _node_rank(env, no_ssh, launcher, hosts_used, problems)
    port = _number(env, "MASTER_PORT", 0, problems, high=65535)
    ssh_port = _number(env, "SSH_PORT", 0, problems, high=65535)
    node_timeout = _number(env, "NODE_TIMEOUT", node_loss.DEFAULT_NODE_TIMEOUT, problems, low=0)
    if ssh_port and no_ssh:
        problems.append("SSH_PORT is unused with NO_SSH=1 (no node is reached over SSH): unset it")
    remote = hosts_used > 1 and not no_ssh
    tool = LAUNCHER_TOOLS.get(launcher or "pdsh")
    if remote and pool and tool and not dry_run and not shutil.which(tool, path=env.get("PATH")):
        problems.append(f"LAUNCHER={launcher or 'pdsh'} needs `{tool}` on this node: install it, or start every node "
                        "yourself with NO_SSH=1 NODE_RANK=i MASTER_ADDR=node0 (scripts/slurm/train.sbatch)")
    if launcher == "openmpi" and not dry_run and importlib.util.find_spec("mpi4py") is None:
        problems.append("LAUNCHER=openmpi: DeepSpeed reads each rank's place from MPI through mpi4py, which is not "
                        "installed here: pip install mpi4py on every node (or use LAUNCHER=pdsh)")
    model_args = _model_args(env, recipe, from_config, problems)
    if problems:
        raise LaunchError("\n".join(problems))

    include, exclude = env.get("INCLUDE", "").strip(), env.get("EXCLUDE", "").strip()
    master_addr = env.get("MASTER_ADDR", "").strip()
    port = port or (MULTI_NODE_PORT if hosts_used > 1 or no_ssh else free_port())
    command = [env.get("DEEPSPEED", "").strip() or "deepspeed"]
    command += [f"--hostfile={hostfile}"] if pool else []
    command += [f"--include={include}"] if include else [f"--exclude={exclude}"] if exclude else []
    if not (include or exclude or launcher == "openmpi"):
        command += [f"--num_nodes={nodes}", f"--num_gpus={gpus}"]
    command += [f"--launcher={launcher}"] if launcher else []
    command += [f"--ssh_port={ssh_port}"] if ssh_port else []
    command += ["--no_ssh", f"--node_rank={node_rank}"] if no_ssh else []
    command += [f"--master_addr={master_addr}"] if master_addr else []
    train_argv = [_shown(recipe / "train_args.yaml"), "--deepspeed", _shown(recipe / "ds_config.json"),
                  *model_args, *overrides]
    command += [f"--master_port={port}", _shown(recipes.ROOT / "train.py"), *train_argv]
    used: tuple[str, ...] = ()
    if remote and pool and launcher in ("", "pdsh"):  # the hosts DeepSpeed's pdsh runner starts ranks on
        if include or exclude:
            from deepspeed.launcher.runner import parse_inclusion_exclusion

            used = tuple(parse_inclusion_exclusion(pool, include, exclude))
        else:
            used = tuple(pool)[:hosts_used]
    return Launch(command, train_argv, hosts_used, gpus, world, dry_run, hostfile if pool else None,
                  pool if write else None, remote, used, node_timeout)
