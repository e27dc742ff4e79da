"""Host RAM while a fused-expert model loads under ZeRO-3: does transformers' fusing of per-expert checkpoints hold
more than one MoE block at a time before DeepSpeed partitions it?

Writes a Qwen3-MoE of the given size with random weights in the per-expert layout (save_pretrained, bf16), then
loads it with `from_pretrained` under ZeRO-3 (HfDeepSpeedConfig, as the Trainer sets it up) on `--ranks` CPU ranks,
each sampling its own anonymous RSS every 5 ms (the mapped checkpoint's page cache left out). Transient = peak during the load - RSS after it (the rank's partition stays):
compared with the planner's "loading weights" term (load bytes x the largest module, here the whole MoE block).

  python benchmarks/moe_load_rss.py --out DIR [--layers 8 --hidden 1024 --experts 64 --expert-ffn 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss() -> int:
    """Anonymous resident memory (RssAnon): what the process holds itself. The checkpoint's pages, mapped by
    safetensors, are file-backed page cache the kernel can drop, so they are left out."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def worker(model_dir: str, out: str) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841 -- transformers reads it through a weak reference
    peak, stop = [rss()], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    before = rss()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    seconds = time.time() - started
    stop.set()
    thread.join()
    after = rss()
    record = {"rank": rank, "before": before, "peak": peak[0], "after": after, "load_s": round(seconds, 1),
              "partition_elements": sum(p.ds_tensor.numel() for p in model.parameters())}
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    if rank == 0:
        Path(out).write_text(json.dumps(records, indent=1))
    torch.distributed.barrier()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        worker(*args._worker)
        return 0

    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.shapes import shape_from_config
    from hf_zero3.plan.types import Hardware, Training
    from hf_zero3.job.distributed import free_port

    args.out.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=args.hidden // 16,
                            num_experts=args.experts, num_experts_per_tok=8, moe_intermediate_size=args.expert_ffn,
                            vocab_size=32000, tie_word_embeddings=False)
    model_dir = args.out / "model"
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    result = args.out / "ranks.json"
    cmd = ["torchrun", f"--nproc_per_node={args.ranks}", f"--master_port={free_port()}", __file__, "--out",
           str(args.out), "--_worker", str(model_dir), str(result)]
    code = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if code:
        return code
    ranks = json.loads(result.read_text())
    shape = shape_from_config(config)
    planned = plan(shape, Hardware(nodes=1, gpus_per_node=args.ranks, gpu_mem=10**12, host_ram=None),
                   Training(4096, 1, 1, load_bytes=2), ZeroSpec(precision="bf16"))
    loading = next(t.bytes for t in planned.terms if t.name == "loading weights") // args.ranks
    transient = max(r["peak"] - r["after"] for r in ranks)
    summary = {"params": shape.params, "moe_block_params": shape.expert_block_params(), "ranks": ranks,
               "transient_peak_bytes_max_rank": transient, "planned_loading_bytes_per_rank": loading,
               "ratio": round(transient / loading, 3), "whole_model_bf16_bytes": 2 * shape.params,
               "command": " ".join(sys.argv)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "ranks"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
