"""A plain Hugging Face Trainer script: our ds_configs work with `--deepspeed` as they are.

    deepspeed --num_gpus 2 examples/plain_trainer.py --deepspeed ds_configs/zero3.json --bf16 true \
        --model assets/tiny/model --train_file assets/tiny/corpus/train.txt --output_dir outputs/plain

On a CPU-only machine use ds_configs/zero3_auto.json (no bf16/fp16 needed) and `--use_cpu true`; the
lines marked CPU are what the stock stack needs there (hf-zero3 train does them for you), the last one
(our only import here) because DeepSpeed's CPU all-reduce would leave its buffers in /dev/shm.
"""

from dataclasses import dataclass

import torch
from datasets import load_dataset
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer,
                          TrainingArguments, default_data_collator)


@dataclass
class ScriptArguments:
    model: str = "assets/tiny/model"
    train_file: str = "assets/tiny/corpus/train.txt"
    block_size: int = 128
    from_scratch: bool = True


def main():
    if not torch.cuda.is_available():  # CPU: DeepSpeed must see the gloo world before TrainingArguments
        import deepspeed

        from hf_zero3.job.distributed import release_shm_buffer_names
        deepspeed.init_distributed(dist_backend="gloo")
        release_shm_buffer_names()  # DeepSpeed's CPU all-reduce would leave its buffers in /dev/shm
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    if script.from_scratch:  # created after TrainingArguments: ZeRO-3 partitions the weights as they are made
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(script.model))
    else:
        model = AutoModelForCausalLM.from_pretrained(script.model)

    def tokenize_and_pack(batch):
        ids = [t for text in batch["text"] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
        n = len(ids) // script.block_size * script.block_size
        blocks = [ids[i:i + script.block_size] for i in range(0, n, script.block_size)]
        return {"input_ids": blocks, "labels": blocks}

    raw = load_dataset("text", data_files=script.train_file, split="train")
    with args.main_process_first(desc="tokenize"):
        data = raw.map(tokenize_and_pack, batched=True, remove_columns=raw.column_names)
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                      data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
    # Stop gloo's threads before the interpreter exits: alive at exit they can abort the process after a good run
    # (seen once here as exit 250). main()'s frame, and with it the ZeRO-3 model holding the group, is gone now.
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
