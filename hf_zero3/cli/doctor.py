"""`hf-zero3 doctor`: run the preflight checks in hf_zero3.ops.doctor, one line each, exit 1 on any FAIL."""

from __future__ import annotations

import argparse
import json
import sys

from hf_zero3.argtypes import port, positive_int

CHECK_GROUPS = ("versions", "native", "gpus", "ops", "nvme", "hosts", "allreduce")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--hostfile", metavar="FILE", help="DeepSpeed hostfile (`host slots=N`): check SSH, code and "
        "versions on every host, and all-reduce over all their slots")
    add("--ssh-port", type=port, metavar="N", help="SSH port of the hosts, as DeepSpeed's --ssh_port "
        "(default: ssh's); further ssh options come from PDSH_SSH_ARGS_APPEND, as for DeepSpeed's "
        "pdsh runner")
    add("--config", metavar="FILE", help="the ds_config you will train with: decides the DeepSpeed ops "
        "required and the NVMe paths checked")
    add("--ops", action="append", default=[], metavar="NAME[,NAME]",
        help="also require these DeepSpeed ops (names as in `ds_report`)")
    add("--build-ops", action="store_true", help="really build/load each op (JIT, ~1-2 min each)")
    add("--ranks", type=positive_int, help="all-reduce ranks on this node "
        "(default: one per visible GPU, 2 on CPU; with --hostfile: its slots)")
    add("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed",
        help="launcher for the all-reduce, as for training (with --hostfile: deepspeed)")
    add("--nvme-path", action="append", default=[], metavar="DIR",
        help="check this NVMe offload directory (also taken from --config)")
    add("--nvme-test-mb", type=positive_int, default=256, metavar="MB",
        help="size of the NVMe throughput test file")
    add("--matrix", action="append", default=[], metavar="REQ",
        help="override one package's supported range from setup.cfg, e.g. 'torch>=2.8,<2.14'")
    add("--skip", action="append", default=[], choices=CHECK_GROUPS, help="skip a group of checks")
    add("--json", action="store_true", help="print one JSON document instead of lines")


def main(args: argparse.Namespace) -> int:
    from packaging.requirements import InvalidRequirement, Requirement

    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.config.check import load_config
    from hf_zero3.ops import doctor
    from hf_zero3.plan.hardware import default_ranks

    results: list[doctor.Result] = []

    def emit(*new: doctor.Result) -> None:
        results.extend(new)
        if not args.json:
            for r in new:
                print(r.line(), flush=True)

    skip = set(args.skip)
    config, problems = {}, []  # the input files, read before any check runs: a bad one is a usage error
    if args.config:
        try:
            config = load_config(args.config)
        except UnicodeDecodeError:
            problems.append(f"--config {args.config} is not a text file: pass the ds_config JSON you will train with")
        except (FileNotFoundError, ValueError) as e:  # load_config's message names the file and the fix
            problems.append(f"--config: {e}")
        except OSError as e:
            problems.append(f"--config: cannot read {args.config}: {e.strerror}: pass a readable ds_config JSON")
    if args.hostfile:
        try:
            doctor.read_hostfile(args.hostfile)
        except doctor.HostfileError as e:
            problems.append(f"--hostfile: {e}")
    for text in args.matrix:
        try:
            Requirement(text)
        except InvalidRequirement:
            problems.append(f"--matrix {text!r} is not a requirement: give a package and its range, e.g. "
                            "'torch>=2.8,<2.14'")
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    if "versions" not in skip:
        emit(doctor.check_python(), *doctor.check_versions(args.matrix))
    if "native" not in skip:
        emit(*doctor.check_native_libs())
    if "gpus" not in skip:
        emit(doctor.check_gpus())
    if "ops" not in skip:
        required = doctor.needed_ops(config)
        for name in (n.strip() for group in args.ops for n in group.split(",") if n.strip()):
            required.setdefault(name, "named in --ops")
        optional = [] if args.config or args.ops else [n for n in doctor.DEFAULT_OPS if n not in required]
        for name, reason in required.items():
            emit(doctor.check_op(name, reason, required=True, build=args.build_ops))
        for name in optional:
            emit(doctor.check_op(name, required=False, build=args.build_ops))
    if "nvme" not in skip:
        for path in dict.fromkeys([*args.nvme_path, *doctor.nvme_paths(config)]):
            emit(doctor.check_nvme(path, args.nvme_test_mb * 2**20))
    ranks, hosts_ok = args.ranks, True
    if args.hostfile:
        host_results = doctor.check_hostfile(args.hostfile, ssh="hosts" not in skip, port=args.ssh_port)
        emit(*host_results)
        hosts_ok = all(r.status != "FAIL" for r in host_results)
        ranks = sum(host_results[0].data.get("hosts", {}).values()) or ranks
    if "allreduce" not in skip:
        if hosts_ok:
            launcher = "deepspeed" if args.hostfile else args.launcher
            emit(doctor.check_allreduce(ranks or default_ranks(), launcher, args.hostfile,
                                        ssh_port=args.ssh_port))
        else:
            emit(doctor.Result("WARN", "allreduce", "not run: a host check above failed", "fix that first"))

    counts = {s: sum(r.status == s for r in results) for s in ("OK", "WARN", "FAIL")}
    if args.json:
        report = {"ok": counts["FAIL"] == 0, "counts": counts, "results": [r.as_dict() for r in results]}
        print(json.dumps(report, indent=2))
    else:
        print(f"doctor: {counts['OK']} ok, {counts['WARN']} warning(s), {counts['FAIL']} failure(s)")
    return 1 if counts["FAIL"] else 0
