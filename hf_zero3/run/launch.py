"""`python -m hf_zero3 launch [--target NxG[xMEM]] RECIPE_DIR [--key value ...]`: one recipe, DeepSpeed's launcher.

Every `recipes/<name>/launch.sh` execs this. The launch settings come from the environment (`--help` lists
them). They are checked together before anything starts, each problem naming its fix, because DeepSpeed's
launcher quietly trims what does not match (NUM_GPUS above a host's slots, NUM_NODES above the hostfile)
or fails late on a remote node. Multi-node runs get a `.deepspeed_env`: DeepSpeed's pdsh/MPI/slurm runners
forward only PYTHON*, MLFLOW*, MV2*, UCX* (and NCCL* on CUDA) to the other nodes, so HF_*, TRANSFORMERS_*
and TORCH_* settings would silently not apply there.

The command is the seed's `deepspeed --num_nodes=2 --num_gpus=4 train.py --deepspeed ds_config.json`, with the
recipe's YAML in front of the overrides; it is printed, then run as this process's child, which passes the
preemption signals on to the ranks (`hf_zero3.run.preemption`; exec'd instead when `preemption_signals` is
none). DRY_RUN=1 prints it with the resolved arguments, the batch math and the memory plan instead (`make
plan-<size>`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hf_zero3 import recipes, units
from hf_zero3.argtypes import parse_size, positive_int
from hf_zero3.config.check import check_ds_config, has_errors, load_config
from hf_zero3.config.spec import EVERY_PARAMETER
from hf_zero3.plan.choose import choose
from hf_zero3.plan.hardware import detect_hardware
from hf_zero3.plan.memory import gathers_are_views, persists_every_parameter, plan
from hf_zero3.plan.profiles import FIXED_TERMS, PROFILES
from hf_zero3.plan.report import print_choice
from hf_zero3.plan.shapes import ModelError, load_config_shape, load_shape
from hf_zero3.plan.types import PlanError, Training
from hf_zero3.run import lora, node_loss, preemption
from hf_zero3.run.distributed import LaunchError, cuda_available, free_port
from hf_zero3.run.facts import RunFacts
from hf_zero3.run.hostfile import HostfileError, read_hostfile, write_hostfile
from hf_zero3.units import gb

DEFAULT_HOSTFILE = "outputs/hostfile"
MULTI_NODE_PORT = 29500
"""MASTER_PORT default for several nodes: every node must agree, and a free-port probe here says nothing
about node 0. One node takes a free port (`free_port`), so parallel runs never collide."""
LAUNCHER_TOOLS = {"pdsh": "pdsh", "openmpi": "ompi_info"}
"""DeepSpeed's multi-node backends we support, and the program DeepSpeed looks for to use each. Not its slurm
backend: it starts one srun task per rank with no RANK/WORLD_SIZE, which the ranks refuse; under SLURM,
scripts/slurm/train.sbatch starts one DeepSpeed launcher per node (NO_SSH=1)."""
FORWARDED_PREFIXES = ("HF_", "TRANSFORMERS_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_")
FORWARDED_NAMES = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "CUDA_DEVICE_MAX_CONNECTIONS", "TOKENIZERS_PARALLELISM")
"""What `.deepspeed_env` carries to every node (HF_ covers HF_HUB_* and HF_ZERO3_*)."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

ENV_HELP = """environment:
  NUM_NODES      nodes (default: the hosts in HOSTFILE/HOSTS, else the recipe's target)
  NUM_GPUS       ranks per node: GPUs, or CPU processes without GPUs (default: the recipe's target)
  HOSTFILE       DeepSpeed hostfile, lines `host slots=N`; needed for NUM_NODES > 1
  HOSTS          host1,host2,...: write HOSTFILE (default outputs/hostfile) with NUM_GPUS slots per host
  INCLUDE        DeepSpeed's --include (host[:slot,...][@host...]); replaces NUM_NODES/NUM_GPUS
  EXCLUDE        DeepSpeed's --exclude, same syntax
  LAUNCHER       multi-node backend: pdsh (default), openmpi (needs mpi4py); SLURM: scripts/slurm/train.sbatch
  SSH_PORT       SSH port of the other nodes (DeepSpeed's --ssh_port; default: ssh's own)
  NODE_TIMEOUT   seconds: a node silent this long is lost (ssh's keepalive), and after a node failed the
                 others' ranks get this long to stop before the launcher stops them (default 60; 0: off)
  NO_SSH=1       start this node's ranks only (DeepSpeed --no_ssh); run once per node with NODE_RANK
  NODE_RANK      this node's index in the hostfile (with NO_SSH=1)
  MASTER_ADDR    address of node 0 (needed with NO_SSH=1)
  MASTER_PORT    default: a free port on one node, 29500 on several
  MODEL          local folder or hub id of pretrained weights (--model_name_or_path); its own config and
                 tokenizer replace a from-scratch recipe's config_name, config_overrides and tokenizer_name
  FROM_CONFIG=1  random weights from MODEL's (or the recipe's) config, for benchmarks (--config_name)
  DRY_RUN=1      print the command, resolved arguments, batch math and memory plan; start nothing
  GPU_MEM        GPU memory for the DRY_RUN plan, e.g. 40GB (default: the recipe's target)
  HOST_RAM       host RAM per node for the DRY_RUN plan, e.g. 1TB (default: not checked)
  HEADROOM       fraction of GPU memory, host RAM and NVMe the DRY_RUN plan leaves free (default: 0.1 when the
                 recipe targets a named machine, else 0)
  DEEPSPEED      the launcher program (default: deepspeed)"""


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


def _flag(env: Mapping[str, str], name: str, problems: list[str]) -> bool:
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


def _recipe_values(recipe: Path) -> dict:
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
    values = _recipe_values(recipe)
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
    no_ssh, dry_run, from_config = (_flag(env, n, problems) for n in ("NO_SSH", "DRY_RUN", "FROM_CONFIG"))
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


# --- files written before the launch ----------------------------------------------------------------

def _forwarded_name(name: str) -> bool:
    return name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES


def forwarded_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """(variables `.deepspeed_env` carries, names it cannot carry: a newline or `"` breaks DeepSpeed's export)."""
    chosen = {k: v for k, v in sorted(env.items()) if _forwarded_name(k)}
    skipped = [k for k, v in chosen.items() if "\n" in v or '"' in v]
    return {k: v for k, v in chosen.items() if k not in skipped}, skipped


def write_deepspeed_env(path: Path, variables: dict[str, str]) -> None:
    """`KEY=VALUE` lines, as DeepSpeed's runner reads them (no comments: it splits every line on `=`).

    This environment's forwarded variables are written over the file's; a line we wrote last time (listed in
    `<path>.hf_zero3`) whose variable is no longer set here goes, every other line stays: putting NCCL_* in
    .deepspeed_env by hand is DeepSpeed's documented way. Mode 0600: HF_TOKEN may be among the values.
    """
    ours_file = path.with_name(path.name + ".hf_zero3")
    ours = set(ours_file.read_text().split()) if ours_file.is_file() else set()
    kept = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and key.strip() not in ours:
                kept[key.strip()] = value
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in {**kept, **variables}.items()))
    ours_file.write_text("".join(f"{k}\n" for k in variables if k not in kept or kept[k] != variables[k]))


# --- DRY_RUN -------------------------------------------------------------------------------------------

def dry_run(launch: Launch, recipe: Path, env: Mapping[str, str], target: Target) -> int:
    """Resolved arguments, batch math, ds_config check and memory plan for this world size; 0 when it all fits."""
    # transformers' TrainingArguments takes seconds to import: a launch that is no dry run never parses the YAML
    from hf_zero3.run.arguments import UsageError, load_arguments

    try:
        values = load_arguments(launch.train_argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    facts = RunFacts.from_values(values)
    micro, accum, seq = facts.micro_batch, facts.grad_accum, facts.seq_len
    global_batch = facts.global_batch(launch.world_size)
    print("arguments (train_args.yaml + overrides, strict-checked):")
    for key, value in sorted(values.items()):
        print(f"  {key}: {value}")
    print(f"batch     micro {micro} x accumulation {accum} x {launch.world_size} ranks ({launch.nodes} node(s) x "
          f"{launch.gpus}) = global batch {global_batch}" + (f" x {seq} tokens = {global_batch * seq:,} tokens "
                                                             "per optimizer step" if seq else ""))
    try:
        config = load_config(values["deepspeed"])
    except (OSError, ValueError) as e:  # missing or unreadable ds_config: the run would fail the same way
        print(f"error: {e}", file=sys.stderr)
        return 2
    findings = check_ds_config(config, world_size=launch.world_size, micro_batch=micro, grad_accum=accum)
    for finding in findings:
        print(f"ds_config {finding}")
    print(f"ds_config {values['deepspeed']}: {len(findings)} finding(s) for world size {launch.world_size}")
    elsewhere = [f for f in findings if f.key.endswith(".nvme_path") and "does not exist on this machine" in f.message]
    if elsewhere:
        print("ds_config (a dry run plans for the training nodes: the NVMe directory must exist there, not here)")
    rc = 1 if has_errors([f for f in findings if f not in elsewhere]) else 0
    return max(rc, _plan(values, facts, config, launch, recipe, env, target))


def _plan(values, facts: RunFacts, config, launch: Launch, recipe: Path, env, target: Target) -> int:
    """The planner's choice for this world size, then the recipe's own config measured against the same hardware."""
    sizes = {}
    for name, text in (("GPU_MEM", env.get("GPU_MEM", "").strip() or target.gpu_mem),
                       ("HOST_RAM", env.get("HOST_RAM", "").strip())):
        try:
            sizes[name] = units.parse_size(text) if text else None
        except ValueError as e:
            print(f"error: {name}={text}: {e}", file=sys.stderr)
            return 2
    try:
        headroom = float(env.get("HEADROOM", "").strip() or (0.1 if target.profile else 0.0))
        if not 0 <= headroom < 1:
            raise ValueError
    except ValueError:
        print(f"error: HEADROOM={env.get('HEADROOM')}: give the fraction of GPU memory, host RAM and NVMe to leave "
              "free, from 0 to below 1, e.g. 0.1", file=sys.stderr)
        return 2
    if not sizes["GPU_MEM"] and not cuda_available():
        print("plan      skipped: no GPU here and no target GPU memory; set GPU_MEM=80GB to plan for such GPUs")
        return 0
    given = env.get("MODEL", "").strip()
    model = given or recipes.resolve_path(values.get("model_name_or_path") or values.get("config_name"))
    own = not given and model == recipes.resolve_path(_recipe_values(recipe).get("model_name_or_path")
                                                      or _recipe_values(recipe).get("config_name"))
    micro, accum, seq = facts.micro_batch, facts.grad_accum, facts.seq_len
    from_scratch = facts.from_scratch or _flag(env, "FROM_CONFIG", [])
    load_bytes = 4 if from_scratch else None
    try:
        overrides = None if given else values.get("config_overrides")
        shape = (load_config_shape(str(model), name=recipe.name, overrides=overrides) if own  # named by its recipe
                 else load_config_shape(str(model), overrides=overrides) if overrides else load_shape(str(model)))
        hardware = _with_profile_and_nvme(
            detect_hardware(nodes=launch.nodes, gpus_per_node=launch.gpus, gpu_mem=sizes["GPU_MEM"],
                            host_ram=sizes["HOST_RAM"]), config, target, headroom)
        lora_adapter = _lora_adapter(shape, values)
        best_choice = choose(shape, hardware, seq, global_batch=facts.global_batch(launch.world_size),
                             micro_batch=micro, precision=facts.precision, attention=facts.attention,
                             load_bytes=load_bytes, liger=facts.liger, adapter=lora_adapter)
    except (ModelError, PlanError) as e:
        print(f"recipe    not planned: {e}")
        return 1
    print(f"plan      {recipe.name if own else model}, {launch.nodes} node(s) x {launch.gpus} GPUs, seq {seq}, "
          f"{facts.describe(launch.world_size)}, {facts.precision}, {facts.attention}"
          + (", Liger" if facts.liger else "") + (", from scratch" if from_scratch else "") + "\n")
    print_choice(shape, hardware, seq, best_choice)
    rc = 0 if best_choice.fits else 1
    ours = plan(shape, hardware, Training(seq, micro, accum, facts.attention, load_bytes, facts.liger, lora_adapter),
                facts.spec(config))
    best = best_choice.plan
    verdict = "fits" if ours.fits else "does NOT fit: " + "; ".join(ours.problems())
    same = best is not None and best.label == ours.label
    print(f"\nrecipe    {recipe.name}: {ours.label}, micro batch {micro}: {gb(ours.gpu_bytes)} per GPU, "
          f"{gb(ours.host_bytes)} host RAM per node: {verdict}"
          + (" (the planner's choice)" if same else f" (the planner's choice: {best.label})" if best else ""))
    for note in ours.notes:
        print(f"          {note}")
    if (best is not None and gathers_are_views(ours.spec, hardware) and persists_every_parameter(best.spec, shape)
            and not persists_every_parameter(ours.spec, shape)):
        print(f"          the planner also sets stage3_param_persistence_threshold: {EVERY_PARAMETER} (every "
              "parameter whole: free on one GPU, and faster there: it skips every per-module fetch)")
    return max(rc, 0 if ours.fits else 1)


def _lora_adapter(shape, values: dict):
    """The adapter when the recipe trains LoRA (its `peft:` block), as the planner counts it (`Training.adapter`)."""
    try:
        return lora.planned(shape, values.get("peft"))
    except ValueError as e:
        raise PlanError(str(e)) from None


def _with_profile_and_nvme(hardware, config: dict, target: Target, headroom: float = 0.0):
    """The target profile's fixed terms, its host RAM and NVMe size (when its GPU count is the one launched and
    HOST_RAM is not given), the config's NVMe directory (its free space here if it exists, else the profile's,
    else unknown) and the headroom to leave free."""
    hardware = dataclasses.replace(hardware, headroom=headroom)
    machine = PROFILES.get(target.profile or "")
    if machine is not None:  # the GPU type's fixed terms hold for any number of its GPUs
        hardware = dataclasses.replace(hardware, fixed=FIXED_TERMS[machine.gpu])
    if machine is not None and machine.gpus != hardware.gpus_per_node:
        machine = None  # e.g. 2 nodes x 4 GPUs: not the profile's node
    if machine is not None and hardware.host_ram is None:
        hardware = dataclasses.replace(hardware, host_ram=machine.host_ram)
    zero = config.get("zero_optimization") or {}
    paths = [(zero.get(k) or {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
             if (zero.get(k) or {}).get("device") == "nvme"]
    if paths and paths[0]:
        free = shutil.disk_usage(paths[0]).free if os.path.isdir(paths[0]) else (machine.nvme if machine else None)
        hardware = dataclasses.replace(hardware, nvme_path=paths[0], nvme_free=free)
    return hardware


# --- entry point ---------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_zero3 launch", epilog=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a recipe with DeepSpeed's launcher (what recipes/<name>/launch.sh does).")
    parser.add_argument("--target", type=Target.parse, default=Target(),
                        help="the recipe's target hardware NODESxGPUS[xGPU_MEM]: defaults for NUM_NODES, "
                             "NUM_GPUS, GPU_MEM (default 1x2)")
    parser.add_argument("recipe", type=Path, help="recipe folder (train_args.yaml, ds_config.json)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="train.py overrides: --key value ...")
    return parser


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if environ is None else environ)
    args = _parser().parse_args(argv)
    try:
        launch = resolve(args.recipe, args.overrides, env, args.target)
    except LaunchError as e:
        print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr)
        return 2
    verb = "would write" if launch.dry_run else "wrote"
    if launch.new_hostfile:
        if not launch.dry_run:
            write_hostfile(Path(launch.hostfile), launch.new_hostfile)
        print(f"hf_zero3.run.launch: {verb} {launch.hostfile}: " + ", ".join(
            f"{h} slots={s}" for h, s in launch.new_hostfile.items()))
    if launch.remote_nodes:
        variables, skipped = forwarded_env(env)
        path = Path(env.get("DS_ENV_FILE") or ".deepspeed_env")
        if not launch.dry_run:
            write_deepspeed_env(path, variables)
        print(f"hf_zero3.run.launch: {verb} {path} for the other nodes: {', '.join(variables) or 'nothing to forward'}"
              + (f" (not forwardable, a newline or \" in the value: {', '.join(skipped)})" if skipped else ""))
    print("hf_zero3.run.launch: " + shlex.join(launch.command), flush=True)
    if launch.dry_run:
        return dry_run(launch, args.recipe, env, args.target)
    signals = preemption.signals_of_argv(launch.train_argv)
    if launch.remote_hosts:  # pdsh: a node lost is noticed, named, and the rest stopped in bounded time
        env = node_loss.ssh_keepalive(env, launch.node_timeout)
        watch = node_loss.NodeWatch(grace_s=launch.node_timeout) if launch.node_timeout else None
        return preemption.run_forwarding(launch.command, env, signals, launch.remote_hosts, watch=watch)
    if not signals:
        os.execvpe(launch.command[0], launch.command, env)
    # DeepSpeed's launcher would not pass them on
    return preemption.run_forwarding(launch.command, env, signals, launch.remote_hosts)


if __name__ == "__main__":
    sys.exit(main())
