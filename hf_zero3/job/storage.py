"""Where a run's checkpoints go on several nodes: one output_dir every node shares, or one on each node's own disk.

Found out by looking (each node writes a probe into output_dir, every rank says whose probes it sees), then
checked against the settings that decide who writes what, before anything starts. What the stack does with
node-local disks (transformers 5, DeepSpeed 0.19):

- Every rank writes its own ZeRO shards and RNG state into the folder it sees, shared or not.
- `save_on_each_node` (TrainingArguments): each node's local rank 0 writes the trainer state, the 16-bit weights,
  config and tokenizer, instead of global rank 0 alone (`TrainingArguments.should_save`). Every rank reads
  trainer_state.json to resume, so on node-local disks without it the other nodes could not resume: refused.
- DeepSpeed's `checkpoint.use_node_local_storage`: each node's local rank 0 creates the folder, and NVMe-offloaded
  optimizer states are copied by local rank. DeepSpeed's `latest` tag is still written by global rank 0 only, and
  every rank reads it to resume: the checkpoint guard writes it into the other nodes' copies.

On a shared output_dir, `save_on_each_node` has every node write the same files at once, and
`use_node_local_storage` names NVMe copies by local rank, which collide across nodes: both are refused there.
A checkpoint on node-local disks counts only when it is complete on every node
(`hf_zero3.checkpoint.folders.combine`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from hf_zero3.job.arguments import UsageError
from hf_zero3.job.distributed import fail_together, gather_from_ranks
from hf_zero3.job.facts import ds_config_of

SHARED, NODE_LOCAL = "shared", "node-local"
_PROBE = ".hf_zero3_probe_"


def several_nodes(args) -> bool:
    """Whether the run's ranks span more than one node: their nodes' first ranks (rank - local rank) differ. All
    ranks call it. Not from LOCAL_WORLD_SIZE: on CPU, Accelerate sets it to 1 under DeepSpeed's launcher."""
    if args.world_size <= 1:
        return False
    firsts = {r["first"] for r in gather_from_ranks({"first": args.process_index - args.local_process_index})}
    return len(firsts) > 1


def node_writer(args) -> int:
    """The rank that writes the files of the checkpoint folder this rank sees, other than the ranks' own shards:
    each node's first rank with `save_on_each_node` (its copy on its disk), else rank 0."""
    return args.process_index - args.local_process_index if args.save_on_each_node else 0


def detect(output_dir: str | Path, rank: int, local_rank: int) -> str:
    """SHARED or NODE_LOCAL, as every rank sees output_dir (all ranks call it); a UsageError for a folder that some
    nodes share and others do not, or that a node cannot write."""
    root, first = Path(output_dir), rank - local_rank
    nonce = gather_from_ranks({"nonce": uuid.uuid4().hex})[0]["nonce"]
    mine = root / f"{_PROBE}{nonce}_{first}"
    problem = None
    if local_rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            mine.write_text("")
        except OSError as e:
            problem = (f"output_dir {root} cannot be written on the node of rank {rank} ({e.strerror}): make it "
                       "writable there, or choose another output_dir")
    fail_together(problem, UsageError)
    sees = sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob(f"{_PROBE}{nonce}_*"))
    records = gather_from_ranks({"first": first, "sees": sees})
    if local_rank == 0:
        mine.unlink(missing_ok=True)
    gather_from_ranks({})  # no rank looks at output_dir again before every probe is gone
    nodes = sorted({r["first"] for r in records})
    if all(r["sees"] == nodes for r in records):
        return SHARED
    if all(r["sees"] == [r["first"]] for r in records):
        return NODE_LOCAL
    groups = sorted({tuple(r["sees"]) for r in records})
    raise UsageError(f"output_dir {root} is one folder for some nodes and another for others (the nodes, by their "
                     f"first rank, that see the same folder: {', '.join(str(list(g)) for g in groups)}): put it on "
                     "a disk every node shares, or on each node's own disk")


def check(args) -> str:
    """SHARED or NODE_LOCAL for this run's output_dir (SHARED on one node), after checking that the settings work
    there: a UsageError naming the fix on every rank otherwise."""
    if not several_nodes(args):
        return SHARED
    kind = detect(args.output_dir, args.process_index, args.local_process_index)
    local_storage = bool(((ds_config_of(args) or {}).get("checkpoint") or {}).get("use_node_local_storage"))
    problems = []
    if kind == NODE_LOCAL and not args.save_on_each_node:
        problems.append(f"output_dir {args.output_dir} is on each node's own disk (a node does not see what another "
                        "writes there), but save_on_each_node is false: the trainer state, weights and tokenizer of "
                        "every checkpoint would be on node 0 only, and the other nodes could not resume. Pass "
                        "--save_on_each_node true, or put output_dir on a disk every node shares")
    if kind == SHARED and args.save_on_each_node:
        problems.append(f"save_on_each_node is true, but every node sees the same output_dir {args.output_dir}: each "
                        "node would write the same files at once. Set save_on_each_node false (it is for a folder "
                        "on each node's own disk)")
    if kind == SHARED and local_storage:
        problems.append(f'the ds_config sets "checkpoint": {{"use_node_local_storage": true}}, but every node sees '
                        f"the same output_dir {args.output_dir}: DeepSpeed would name files by local rank, which "
                        "the nodes share. Set it false (it is for a folder on each node's own disk)")
    if problems:
        raise UsageError("\n".join(problems))
    return kind
