"""`hf-zero3 data CONFIG.yaml [--key value ...] [--show N] [--json]`: what train would train on, and the mask."""

from __future__ import annotations

import json
import sys

SHOW = 3
"""Examples shown when --show is not given."""


def _own_options(argv: list[str]) -> tuple[list[str], int, bool]:
    """--show N and --json taken out of train's YAML and overrides."""
    rest, show, as_json, i = [], SHOW, False, 0
    while i < len(argv):
        if argv[i] == "--json":
            as_json, i = True, i + 1
        elif argv[i] == "--show" and i + 1 < len(argv) and argv[i + 1].isdigit():
            show, i = int(argv[i + 1]), i + 2
        elif argv[i] == "--show":
            raise SystemExit("error: --show takes a number of examples, e.g. --show 5")
        else:
            rest, i = [*rest, argv[i]], i + 1
    return rest, show, as_json


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.split(":", 1)[0].strip("`") + "\n\nBuilds the datasets exactly as train would (no process "
              "group, no weights), prints the counts and the first N examples with the trained tokens between « and "
              "»; --json: one object per example (input_ids, labels, trained_text), the counts on stderr.")
        return 0
    # datasets, transformers and TRL take seconds to import: for this verb only, not every `hf-zero3` call
    from hf_zero3.data.errors import DataError  # with datasets, as above
    from hf_zero3.job.arguments import UsageError  # with transformers, as above
    from hf_zero3.run.preview import marked, preview  # with TRL, as above

    argv, show, as_json = _own_options(argv)
    try:
        counts, examples, notes, tokenizer = preview(argv, show)
    except (UsageError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(counts), file=sys.stderr)
        for example in examples:
            print(json.dumps(example))
        return 0
    for note in notes:
        print(f"data: {note}")
    print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for i, example in enumerate(examples):
        answer = f", {example['answer']}" if "answer" in example else ""  # a preference stage's pair: each answer
        print(f"\n--- example {i + 1} ({len(example['input_ids'])} tokens{answer}, trained between « and ») ---")
        print(marked(tokenizer, example["input_ids"], example["labels"]))
    return 0
