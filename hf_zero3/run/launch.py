"""`python -m hf_zero3 launch [--target NxG[xMEM]] RECIPE_DIR [--key value ...]`: one recipe, DeepSpeed's launcher.

Every `recipes/<name>/launch.sh` execs this. The launch settings come from the environment (`--help` lists
them). They are checked together before anything starts (`run.launch_command`), each problem naming its
fix, because DeepSpeed's launcher quietly trims what does not match (NUM_GPUS above a host's slots, NUM_NODES
above the hostfile) or fails late on a remote node. Multi-node runs get a `.deepspeed_env`: DeepSpeed's
pdsh/MPI/slurm runners forward only PYTHON*, MLFLOW*, MV2*, UCX* (and NCCL* on CUDA) to the other nodes, so
HF_*, TRANSFORMERS_* and TORCH_* settings would silently not apply there.

The command is the seed's `deepspeed --num_nodes=2 --num_gpus=4 train.py --deepspeed ds_config.json`, with the
recipe's YAML in front of the overrides; it is printed, then run as this process's child, which passes the
preemption signals on to the ranks (`hf_zero3.job.preemption`; exec'd instead when `preemption_signals` is
none). DRY_RUN=1 prints it with the resolved arguments, the batch math and the memory plan instead (`make
plan-<size>`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from hf_zero3 import recipes, units
from hf_zero3.config import batch
from hf_zero3.config.check import check_ds_config, has_errors, load_config
from hf_zero3.config.spec import EVERY_PARAMETER
from hf_zero3.plan.choose import choose
from hf_zero3.plan.hardware import detect_hardware
from hf_zero3.plan.length import per_rank, plan_length, report_lines, with_run_args
from hf_zero3.plan.memory import gathers_are_views, persists_every_parameter, plan
from hf_zero3.plan.profiles import FIXED_TERMS, PROFILES
from hf_zero3.plan.report import print_choice
from hf_zero3.plan.shapes import ModelError, load_config_shape, load_shape
from hf_zero3.plan.types import PlanError, Training
from hf_zero3.job import preemption
from hf_zero3.model import lora
from hf_zero3.run import node_loss
from hf_zero3.job.distributed import LaunchError, cuda_available
from hf_zero3.job.facts import RunFacts
from hf_zero3.run.hostfile import write_hostfile
from hf_zero3.run.launch_command import Launch, Target, flag, recipe_values, resolve
from hf_zero3.units import gb

FORWARDED_PREFIXES = ("HF_", "TRANSFORMERS_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_")
FORWARDED_NAMES = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "CUDA_DEVICE_MAX_CONNECTIONS", "TOKENIZERS_PARALLELISM")
"""What `.deepspeed_env` carries to every node (HF_ covers HF_HUB_* and HF_ZERO3_*)."""

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
    from hf_zero3.job.arguments import UsageError, load_arguments

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
    limits = _hardware_limits(env, target)
    if limits is None:
        return 2
    sizes, headroom = limits
    if not sizes["GPU_MEM"] and not cuda_available():
        print("plan      skipped: no GPU here and no target GPU memory; set GPU_MEM=80GB to plan for such GPUs")
        return 0
    given = env.get("MODEL", "").strip()
    model = given or recipes.resolve_path(values.get("model_name_or_path") or values.get("config_name"))
    own = not given and model == recipes.resolve_path(recipe_values(recipe).get("model_name_or_path")
                                                      or recipe_values(recipe).get("config_name"))
    micro, accum, seq = facts.micro_batch, facts.grad_accum, facts.seq_len
    from_scratch = facts.from_scratch or flag(env, "FROM_CONFIG", [])
    load_bytes = 4 if from_scratch else None
    try:
        overrides = None if given else values.get("config_overrides")
        shape = (load_config_shape(str(model), name=recipe.name, overrides=overrides) if own  # named by its recipe
                 else load_config_shape(str(model), overrides=overrides) if overrides else load_shape(str(model)))
        hardware = _with_profile_and_nvme(
            detect_hardware(nodes=launch.nodes, gpus_per_node=launch.gpus, gpu_mem=sizes["GPU_MEM"],
                            host_ram=sizes["HOST_RAM"]), config, target, headroom)
        lora_adapter = _lora_adapter(shape, values)
        preference = facts.preference(lora=lora_adapter is not None)  # a preference stage: its pairs and reference
        whole = Training(seq, micro, accum, facts.attention, load_bytes, facts.liger, lora_adapter, preference)
        training = per_rank(whole, facts.sequence_parallel, facts.tiled_compute)  # one rank's share of a sequence
        best_choice = with_run_args(choose(
            shape, hardware, training.seq_len, global_batch=batch.global_batch(micro, accum, launch.world_size),
            micro_batch=micro, precision=facts.precision, attention=facts.attention, load_bytes=load_bytes,
            liger=training.liger, adapter=lora_adapter, preference=preference),
            facts.sequence_parallel, facts.tiled_compute, facts.liger)
        length = _length(shape, hardware, facts, whole, best_choice)
    except (ModelError, PlanError) as e:
        print(f"recipe    not planned: {e}")
        return 1
    print(f"plan      {recipe.name if own else model}, {launch.nodes} node(s) x {launch.gpus} GPUs, seq {seq}"
          + _run_line(facts, launch, training.seq_len, from_scratch) + "\n")
    if length is not None and length.best is not None:  # sequence parallelism or tiling makes it fit
        best_choice = length.best.choice
    print_choice(shape, hardware, training.seq_len, best_choice)
    for line in report_lines(length, shape, facts.precision, facts.attention) if length is not None else []:
        print(line)
    rc = 0 if best_choice.fits else 1
    return max(rc, _measure_recipe(shape, hardware, training, facts.spec(config), best_choice.plan, recipe))


def _run_line(facts: RunFacts, launch: Launch, rank_seq: int, from_scratch: bool) -> str:
    """The dry run's plan line after the sequence length: each rank's share, the run's facts, its stage."""
    return ((f" ({rank_seq} per rank: sequence parallel {facts.sequence_parallel})"
             if facts.sequence_parallel > 1 else "")
            + f", {facts.describe(launch.world_size)}, {facts.precision}, {facts.attention}"
            + (", tiled compute" if facts.tiled_compute else "") + (", Liger" if facts.liger else "")
            + (", from scratch" if from_scratch else "")
            + (f", stage {facts.stage}" + (" (reference log-probs precomputed)" if facts.precompute_ref else "")
               if facts.stage != "sft" else ""))


def _length(shape, hardware, facts: RunFacts, whole: Training, choice):
    """The length plan when the run, as set, does not fit and sets neither sequence parallelism nor tiling (a long
    block_size: `plan --seq-len`'s answer); None otherwise."""
    if choice.fits or facts.sequence_parallel > 1 or facts.tiled_compute:
        return None
    return plan_length(shape, hardware, whole.seq_len, precision=facts.precision, attention=facts.attention,
                       liger=facts.liger, adapter=whole.adapter, load_bytes=whole.load_bytes,
                       preference=whole.preference)


def _measure_recipe(shape, hardware, training: Training, spec, best, recipe: Path) -> int:
    """The recipe's own config planned on the same hardware, beside the planner's choice; 0 when it fits."""
    ours = plan(shape, hardware, training, spec)
    verdict = "fits" if ours.fits else "does NOT fit: " + "; ".join(ours.problems())
    same = best is not None and best.label == ours.label
    print(f"\nrecipe    {recipe.name}: {ours.label}, micro batch {training.micro_batch}: {gb(ours.gpu_bytes)} per GPU, "
          f"{gb(ours.host_bytes)} host RAM per node: {verdict}"
          + (" (the planner's choice)" if same else f" (the planner's choice: {best.label})" if best else ""))
    for note in ours.notes:
        print(f"          {note}")
    if (best is not None and gathers_are_views(ours.spec, hardware) and persists_every_parameter(best.spec, shape)
            and not persists_every_parameter(ours.spec, shape)):
        print(f"          the planner also sets stage3_param_persistence_threshold: {EVERY_PARAMETER} (every "
              "parameter whole: free on one GPU, and faster there: it skips every per-module fetch)")
    return 0 if ours.fits else 1


def _hardware_limits(env, target: Target) -> tuple[dict, float] | None:
    """GPU_MEM and HOST_RAM (None: not given) and HEADROOM, or None after printing the error of a bad one."""
    sizes = {}
    for name, text in (("GPU_MEM", env.get("GPU_MEM", "").strip() or target.gpu_mem),
                       ("HOST_RAM", env.get("HOST_RAM", "").strip())):
        try:
            sizes[name] = units.parse_size(text) if text else None
        except ValueError as e:
            print(f"error: {name}={text}: {e}", file=sys.stderr)
            return None
    try:
        headroom = float(env.get("HEADROOM", "").strip() or (0.1 if target.profile else 0.0))
        if not 0 <= headroom < 1:
            raise ValueError
    except ValueError:
        print(f"error: HEADROOM={env.get('HEADROOM')}: give the fraction of GPU memory, host RAM and NVMe to leave "
              "free, from 0 to below 1, e.g. 0.1", file=sys.stderr)
        return None
    return sizes, headroom


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
