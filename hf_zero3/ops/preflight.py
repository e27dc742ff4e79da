"""The doctor's run: its input files read first (a bad one is a usage error, before any check), then each group of
checks in `ops.doctor` and `ops.deepspeed_ops`, in the order of `cli.doctor.CHECK_GROUPS`, skipping the groups asked."""

from __future__ import annotations

from collections.abc import Iterator

from packaging.requirements import InvalidRequirement, Requirement

from hf_zero3.config.check import load_config
from hf_zero3.ops import deepspeed_ops, doctor
from hf_zero3.plan.hardware import default_ranks


def read_inputs(config_path: str | None, hostfile: str | None, matrix: list[str]) -> tuple[dict, list[str]]:
    """The ds_config (`{}` without one), and a problem per bad input, each naming the flag and the fix."""
    config, problems = {}, []
    if config_path:
        try:
            config = load_config(config_path)
        except UnicodeDecodeError:
            problems.append(f"--config {config_path} is not a text file: pass the ds_config JSON you will train with")
        except (FileNotFoundError, ValueError) as e:  # load_config's message names the file and the fix
            problems.append(f"--config: {e}")
        except OSError as e:
            problems.append(f"--config: cannot read {config_path}: {e.strerror}: pass a readable ds_config JSON")
    if hostfile:
        try:
            doctor.read_hostfile(hostfile)
        except doctor.HostfileError as e:
            problems.append(f"--hostfile: {e}")
    for text in matrix:
        try:
            Requirement(text)
        except InvalidRequirement:
            problems.append(f"--matrix {text!r} is not a requirement: give a package and its range, e.g. "
                            "'torch>=2.8,<2.14'")
    return config, problems


def run_checks(args, config: dict) -> Iterator[doctor.Result]:
    """Every check `args` (the doctor's options) asks for, as each finishes."""
    skip = set(args.skip)
    if "versions" not in skip:
        yield doctor.check_python()
        yield from doctor.check_versions(args.matrix)
    if "native" not in skip:
        yield from doctor.check_native_libs()
    if "gpus" not in skip:
        yield doctor.check_gpus()
    if "ops" not in skip:
        yield from _op_checks(args, config)
    if "nvme" not in skip:
        for path in dict.fromkeys([*args.nvme_path, *doctor.nvme_paths(config)]):
            yield doctor.check_nvme(path, args.nvme_test_mb * 2**20)
    ranks, hosts_ok = args.ranks, True
    if args.hostfile:
        host_results = doctor.check_hostfile(args.hostfile, ssh="hosts" not in skip, port=args.ssh_port)
        yield from host_results
        hosts_ok = all(r.status != "FAIL" for r in host_results)
        ranks = sum(host_results[0].data.get("hosts", {}).values()) or ranks
    if "allreduce" not in skip:
        if hosts_ok:
            launcher = "deepspeed" if args.hostfile else args.launcher
            yield doctor.check_allreduce(ranks or default_ranks(), launcher, args.hostfile, ssh_port=args.ssh_port)
        else:
            yield doctor.Result("WARN", "allreduce", "not run: a host check above failed", "fix that first")


def _op_checks(args, config: dict) -> Iterator[doctor.Result]:
    """The DeepSpeed ops the config needs and `--ops` names (required), else the usual ones (optional)."""
    required = deepspeed_ops.needed_ops(config)
    for name in (n.strip() for group in args.ops for n in group.split(",") if n.strip()):
        required.setdefault(name, "named in --ops")
    optional = [] if args.config or args.ops else [n for n in deepspeed_ops.DEFAULT_OPS if n not in required]
    for name, reason in required.items():
        yield deepspeed_ops.check_op(name, reason, required=True, build=args.build_ops)
    for name in optional:
        yield deepspeed_ops.check_op(name, required=False, build=args.build_ops)
