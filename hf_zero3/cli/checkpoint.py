"""`hf-zero3 export | reshard | push`: argument parsing and dispatch to hf_zero3.checkpoint.export and hf_zero3.checkpoint.hub."""

from __future__ import annotations

import argparse
import sys

from hf_zero3.argtypes import parse_size, positive_int  # the one size grammar


def add_arguments(verbs) -> None:
    """Add the export, reshard and push verbs to the `hf-zero3` subparsers."""
    export = verbs.add_parser("export", help="ZeRO-3 checkpoint -> plain HF folder (sharded safetensors), or a LoRA "
                                             "run's adapter folder (merged into the base with --merge)")
    export.add_argument("checkpoint", help="a complete checkpoint-N folder")
    export.add_argument("out", help="new (or empty) output folder")
    export.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="weights dtype (default bf16)")
    export.add_argument("--shard-size", type=parse_size, default="5GB",
                        help="max safetensors shard size, e.g. 5GB, 500MB (10^n bytes), 1GiB (2^30 bytes)")
    export.add_argument("--license", help="the model card's license, e.g. apache-2.0 or llama3.1 (the base model's); "
                                          "default: the run's hub_license, else other")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint or output_dir: write the base model with the adapter merged into its "
                             "weights (default: the adapter folder); needs host RAM for the base in --dtype")
    export.add_argument("--base", help="with --merge: the base model folder or hub id (default: the one the adapter "
                                       "was trained on); also names the base in the card")
    export.set_defaults(func=main)

    reshard = verbs.add_parser("reshard", help="add a DeepSpeed universal copy, to resume on another world size")
    reshard.add_argument("checkpoint", help="a complete checkpoint-N folder")
    reshard.add_argument("--workers", type=positive_int, default=2, help="processes for the conversion")
    reshard.set_defaults(func=main)

    push = verbs.add_parser("push", help="upload an exported folder (a model or a LoRA adapter) to the Hub (token: "
                                         "HF_TOKEN or hf auth login)")
    push.add_argument("folder", help="a folder written by `hf-zero3 export` (with or without --merge)")
    push.add_argument("--repo-id", required=True, help="ORG/NAME")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--revision", help="branch to push to (created if needed)")
    push.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.checkpoint.lifecycle import CheckpointError

    try:
        if args.verb == "export":
            from hf_zero3.checkpoint.export import export_checkpoint

            out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.shard_size,
                                    license=args.license, progress=lambda line: print(line, file=sys.stderr, flush=True),
                                    merge=args.merge, base=args.base)
            what = "merged model" if args.merge else "adapter" if (out / "adapter_config.json").is_file() else "model"
            print(f"exported {args.checkpoint} -> {out} ({what}, {args.dtype})")
        elif args.verb == "reshard":
            from hf_zero3.checkpoint.export import reshard_checkpoint

            out = reshard_checkpoint(args.checkpoint, workers=args.workers)
            print(f"wrote {out}: resume on any number of ranks with --resume_from_checkpoint {args.checkpoint} "
                  'and "checkpoint": {"load_universal": true} in the ds_config')
        else:
            from hf_zero3.checkpoint.hub import check_repo_id, push_folder

            check_repo_id(args.repo_id, "--repo-id")
            url = push_folder(args.folder, args.repo_id, private=args.private, revision=args.revision,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
            print(f"pushed {args.folder} to {args.repo_id}: {url}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an input that cannot be read (the checks above name every other problem)
        where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        print(f"error: cannot read {where}: check the path and its permissions", file=sys.stderr)
        return 2
    return 0
