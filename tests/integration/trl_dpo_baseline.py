"""TRL's DPOTrainer as TRL documents it, for comparison with `hf-zero3 train --stage dpo`: a DPOConfig whose
`deepspeed` is the tiny recipe's ZeRO-3 config (what `accelerate launch --config_file deepspeed_zero3.yaml` gives),
the model and its reference loaded by TRL from a path, the preference file loaded with `datasets`. Launched
`torchrun --nproc_per_node 2 tests/integration/trl_dpo_baseline.py MODEL DATA OUT`; rank 0 writes OUT/log.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
from datasets import load_dataset
from trl import DPOConfig, DPOTrainer

from hf_zero3.job.distributed import exit_process

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    model, data, out = sys.argv[1:4]
    deepspeed.init_distributed(dist_backend="gloo")  # on CPU: DeepSpeed's own group (NCCL's default on GPUs)
    args = DPOConfig(output_dir=out, deepspeed=str(ROOT / "recipes/tiny/ds_config.json"), use_cpu=True,
                     per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3,
                     lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0, max_steps=3,
                     logging_steps=1, save_strategy="no", seed=42, report_to="none", max_length=128, bf16=False)
    trainer = DPOTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=data, split="train"))
    trainer.train()
    if trainer.is_world_process_zero():
        Path(out, "log.json").write_text(json.dumps(trainer.state.log_history))
    exit_process(0)
