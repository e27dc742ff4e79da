"""`hf-zero3 <verb>`: the one front door; one module per verb, shared argument types, nothing else."""

from hf_zero3.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
