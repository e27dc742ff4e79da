"""DPO with a LoRA adapter on the Llama-3-8B shape: `hf-zero3 train` on recipe 8b-dpo against TRL's own DPO script
(`trl/scripts/dpo.py`) with the recipe's ds_config, on the same pairs, weights and settings.

Three steps, run by benchmarks/gpu_dpo_8b.sh:
  python benchmarks/dpo_bench.py prepare --work DIR [--pairs N]   the pairs (DIR/data/train.jsonl), their lengths
  python benchmarks/dpo_bench.py weights --work DIR               Llama-3-8B-shape random bf16 weights, DIR/model
  python benchmarks/dpo_bench.py report --work DIR --out FILE.md  the table, from each run's stdout and GPU samples

The pairs come from the tiny assets' generators (assets/tiny/build_assets.py): a prompt of a few paragraphs and two
answers of log-normal lengths, each pair at most 2,048 tokens (the recipe's block_size, so neither side truncates).
The tokenizer is the tiny one (its ids fit the 8B vocabulary). Tokens/s counts every pair's prompt + chosen and
prompt + rejected tokens over the Trainer's own `train_runtime` (one epoch, so every run sees every pair once).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import statistics
from pathlib import Path

from packing_bench import tiny_assets  # run as a script: benchmarks/ is on the path

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 2048


def _text(r: random.Random, tokenizer, target: int) -> str:
    assets = tiny_assets()
    text = assets.paragraph(r)
    while len(tokenizer(text)["input_ids"]) < target:
        text += " " + assets.paragraph(r)
    return text


def prepare(work: Path, pairs: int, seed: int = 7) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    r = random.Random(seed)
    rows, lengths = [], []
    while len(rows) < pairs:
        prompt = _text(r, tokenizer, min(int(r.lognormvariate(math.log(250), 0.6)), 900)) + "\nanswer:"
        chosen, rejected = (" " + _text(r, tokenizer, min(int(r.lognormvariate(math.log(300), 0.7)), 1000))
                            for _ in range(2))
        n = [len(tokenizer(prompt + side)["input_ids"]) for side in (chosen, rejected)]
        if max(n) <= MAX_TOKENS - 8:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            lengths.append(sum(n))
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "data/train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (work / "lengths.json").write_text(json.dumps(lengths))
    print(f"prepared {work}: {pairs} pairs, {sum(lengths)} tokens (chosen + rejected sequences), "
          f"median {statistics.median(lengths):.0f} per pair, max {max(lengths)}")


def weights(work: Path) -> None:
    """Random bf16 weights of the Llama-3-8B shape (benchmarks/common.sh's config), made on the GPU and saved."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    config = LlamaConfig.from_pretrained(ROOT / "outputs/llama3-8b")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")


_METRICS = re.compile(r"\{'train_runtime'.*?\}|\{\"train_runtime\".*?\}")


def _run(folder: Path, tokens: int) -> dict:
    text = (folder / "stdout.log").read_text(errors="replace")
    final = [ast.literal_eval(m) for m in _METRICS.findall(text)]
    steps = [ast.literal_eval(line[line.index("{"):]) for line in text.splitlines()
             if re.search(r"'(loss|train/loss)': ", line) and "{" in line and "train_runtime" not in line]
    samples = [float(x) for x in (folder / "gpu_mib.txt").read_text().split()] if (folder / "gpu_mib.txt").exists() \
        else []
    runtime = float(final[-1]["train_runtime"]) if final else math.nan
    return {"runtime_s": runtime, "tokens_per_s": tokens / runtime if final else math.nan,
            "steps": len(steps), "losses": [round(float(s["loss"]), 4) for s in steps if "loss" in s],
            "margins": [round(float(s.get("rewards/margins", math.nan)), 4) for s in steps],
            "nvml_peak_gib": max(samples, default=0) / 1024}


def report(work: Path, out: Path) -> None:
    tokens = sum(json.loads((work / "lengths.json").read_text()))
    lines = ["| run | train_runtime s | tokens/s | ratio to first | steps | GPU peak (nvidia-smi) GiB | losses |",
             "|---|---|---|---|---|---|---|"]
    first = None
    for folder in sorted(p for p in (work / "runs").iterdir() if (p / "stdout.log").exists()):
        result = _run(folder, tokens)
        if first is None and not math.isnan(result["tokens_per_s"]):
            first = result["tokens_per_s"]
        ratio = result["tokens_per_s"] / (first or math.nan)
        lines.append(f"| {folder.name} | {result['runtime_s']:.1f} | {result['tokens_per_s']:,.0f} | {ratio:.3f} | "
                     f"{result['steps']} | {result['nvml_peak_gib']:.1f} | "
                     f"{' '.join(str(x) for x in result['losses'])} |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["prepare", "weights", "report"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.work, args.pairs)
    elif args.action == "weights":
        weights(args.work)
    else:
        report(args.work, args.out or args.work / "report.md")


if __name__ == "__main__":
    main()
