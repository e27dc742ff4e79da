"""`hf-zero3 doctor`: run the preflight checks in hf_zero3.ops.doctor, one line each, exit 1 on any FAIL."""

from __future__ import annotations

import argparse
import json
import sys

from hf_zero3.argtypes import port, positive_int

CHECK_GROUPS = ("versions", "native", "gpus", "ops", "nvme", "hosts", "allreduce")
"""The groups of checks `--skip` names (`ops.preflight` runs them in this order)."""


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
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.ops.preflight import read_inputs, run_checks

    config, problems = read_inputs(args.config, args.hostfile, args.matrix)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    results = []
    for result in run_checks(args, config):
        results.append(result)
        if not args.json:
            print(result.line(), flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("OK", "WARN", "FAIL")}
    if args.json:
        report = {"ok": counts["FAIL"] == 0, "counts": counts, "results": [r.as_dict() for r in results]}
        print(json.dumps(report, indent=2))
    else:
        print(f"doctor: {counts['OK']} ok, {counts['WARN']} warning(s), {counts['FAIL']} failure(s)")
    return 1 if counts["FAIL"] else 0
