"""Packed against padded chat batches on the 7B shape: real tokens per second, the share of token slots spent on
padding, and the loss of both layouts over the same conversations.

Three steps, run by benchmarks/gpu_packing.sh:
  python benchmarks/packing_bench.py prepare --work DIR [--examples N]   the data, the model folder, the YAML
  python -m hf_zero3.train DIR/run.yaml --packing true|false ...         one run per layout (stock product path)
  python benchmarks/packing_bench.py report --work DIR --out FILE.md     the table, from each run's train_log.jsonl

The conversations come from the tiny assets' generators (assets/tiny/build_assets.py) with a long-tailed length
mix: lengths drawn from a log-normal (median 300 tokens, a tail to 4,000), as in public chat SFT sets where most
exchanges are short and a few are long. The tokenizer is the tiny one (its ids fit any vocabulary); the model is
Llama-2-7B's shape from a config, random weights.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import random
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4096
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "max_position_embeddings": BLOCK, "rms_norm_eps": 1e-5,
             "vocab_size": 32000, "tie_word_embeddings": False, "rope_theta": 10000.0}


@functools.cache
def tiny_assets():
    """assets/tiny/build_assets.py, loaded once: the tiny corpus' text and conversation generators."""
    spec = importlib.util.spec_from_file_location("build_assets", ROOT / "assets/tiny/build_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def long_tailed_conversations(n: int, seed: int, tokenizer) -> list[list[dict]]:
    """Conversations whose rendered lengths follow a log-normal (median 300 tokens, sigma 1), capped below BLOCK."""
    assets = tiny_assets()
    r = random.Random(seed)

    def tokens(messages):
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    out = []
    for _ in range(n):
        target = min(int(r.lognormvariate(math.log(300), 1.0)), BLOCK - 200)
        messages = assets.conversation(r)
        while tokens(messages) < target:
            if target - tokens(messages) > 120:
                story = assets.paragraph(r)
                while tokens(messages) + len(tokenizer(story)["input_ids"]) < target - 60 and len(story) < 12_000:
                    story += " " + assets.paragraph(r)
                turn = [{"role": "user", "content": "tell me a story."}, {"role": "assistant", "content": story}]
            else:
                question, answer = assets.qa(r)
                turn = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if tokens(messages + turn) > BLOCK - 100:
                break
            messages += turn
        out.append(messages)
    return out


def prepare(work: Path, examples: int, validation: int) -> None:
    from transformers import AutoTokenizer

    work.mkdir(parents=True, exist_ok=True)
    model = work / "llama2-7b-shape"
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    tokenizer.save_pretrained(model)
    config = dict(LLAMA2_7B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    (model / "config.json").write_text(json.dumps(config, indent=1))
    lengths = {}
    for name, n, seed in (("train", examples, 11), ("validation", validation, 12)):
        rows = long_tailed_conversations(n, seed, tokenizer)
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
        lengths[name] = [len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
                         for m in rows]
    (work / "lengths.json").write_text(json.dumps(lengths))
    train = lengths["train"]
    print(f"prepared {work}: {len(train)} train conversations, {sum(train)} tokens, median "
          f"{statistics.median(train):.0f}, p90 {sorted(train)[int(0.9 * len(train))]}, max {max(train)}")


def padding_share(lengths: list[int], micro: int, seed: int = 0, shuffles: int = 20) -> float:
    """The expected share of token slots that are padding when random batches of `micro` rows are padded to their
    longest row (what the Trainer's shuffled sampler and a padding collator give), over `shuffles` orders."""
    r = random.Random(seed)
    shares = []
    for _ in range(shuffles):
        order = lengths[:]
        r.shuffle(order)
        slots = sum(max(order[i:i + micro]) * len(order[i:i + micro]) for i in range(0, len(order), micro))
        shares.append(1 - sum(order) / slots)
    return statistics.mean(shares)


def packed_share(lengths: list[int]) -> tuple[float, int]:
    """The padding share of best-fit-decreasing packing into BLOCK-token rows (TRL's `pack_dataset`, as the run packs),
    and its rows."""
    import datasets
    from trl import pack_dataset

    rows = len(pack_dataset(datasets.Dataset.from_dict({"input_ids": [[0] * n for n in lengths]}), BLOCK, "bfd"))
    return 1 - sum(lengths) / (rows * BLOCK), rows


def _run(folder: Path) -> dict:
    from hf_zero3.units import current_names  # logs from before the memory fields said their unit (*_gib)

    records = [current_names(json.loads(line)) for line in (folder / "train_log.jsonl").read_text().splitlines()
               if line.strip()]
    steps = [r for r in records if "step_time_s" in r and "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    start, final = (evals[0], evals[-1]) if len(evals) > 1 else ({}, evals[-1] if evals else {})
    return {"steps": len(steps), "time_s": sum(r["step_time_s"] for r in steps[1:]),
            "first_step_s": steps[0]["step_time_s"] if steps else math.nan,
            "losses": [r["loss"] for r in steps], "eval_loss": final.get("eval_loss", math.nan),
            "start_eval_loss": start.get("eval_loss", math.nan),
            "eval_token_accuracy": final.get("eval_mean_token_accuracy", math.nan),
            "peak_gib": max((r.get("gpu_peak_allocated_gib", r.get("peak_allocated_gb", 0)) for r in records),
                            default=0)}


def report(work: Path, out: Path) -> None:
    lengths = json.loads((work / "lengths.json").read_text())["train"]
    runs = {}
    for folder in sorted((work / "runs").iterdir()):
        if (folder / "train_log.jsonl").exists() and (folder / "variant.json").exists():
            runs[folder.name] = {**json.loads((folder / "variant.json").read_text()), **_run(folder)}
    total = sum(lengths)
    lines = [f"Real tokens: {total:,} in {len(lengths)} conversations (median {statistics.median(lengths):.0f}, "
             f"p90 {sorted(lengths)[int(0.9 * len(lengths))]}, max {max(lengths)}); one epoch each.", "",
             "| run | layout | micro x accumulation | optimizer steps | real tokens/s (steps 2..) | padding share | "
             "first-step s | eval loss at start | mean train loss | eval loss at end | eval token acc | GPU peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        micro = run["micro"]
        if run["packing"]:
            share, rows = packed_share(lengths)
        else:
            share, rows = padding_share(lengths, micro), len(lengths)
        steps = run["steps"]
        real = total * (steps - 1) / steps if steps > 1 else total  # tokens of steps 2.. (uniform share)
        rate = real / run["time_s"] if run["time_s"] else math.nan
        run["rate"] = rate
        lines.append(f"| {name} | {'packed' if run['packing'] else 'padded'} ({run['attention']}) | {micro} x "
                     f"{run.get('accumulation', 1)} | {steps} "
                     f"| {rate:,.0f} | {share:.1%} | {run['first_step_s']:.1f} | {run['start_eval_loss']:.4f} | "
                     f"{statistics.mean(run['losses']):.4f} | {run['eval_loss']:.4f} | "
                     f"{run['eval_token_accuracy']:.4f} | {run['peak_gib']:.1f} |")
    by_layout = {}
    for run in runs.values():
        by_layout.setdefault((run["packing"], run["attention"], f"{run['micro']} x {run.get('accumulation', 1)}"),
                             []).append(run["rate"])
    lines += ["", "| layout | micro x accumulation | runs | median real tokens/s | min | max |",
              "|---|---|---|---|---|---|"]
    for (packing, attention, micro), rates in sorted(by_layout.items()):
        lines.append(f"| {'packed' if packing else 'padded'} ({attention}) | {micro} | {len(rates)} | "
                     f"{statistics.median(rates):,.0f} | {min(rates):,.0f} | {max(rates):,.0f} |")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--validation", type=int, default=64)
    r = sub.add_parser("report")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.verb == "prepare":
        prepare(args.work, args.examples, args.validation)
    else:
        report(args.work, args.out)


if __name__ == "__main__":
    main()
