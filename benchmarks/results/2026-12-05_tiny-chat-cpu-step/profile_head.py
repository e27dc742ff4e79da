"""`python profile_head.py` (from a checkout with this change, PYTHONPATH at it): CPU time per training step of six of
the tiny chat run's batches (8 packed rows of 256 tokens, as SFTTrainer batches them), one thread, under
torch.profiler: the model's own loss over the full logits (what 78a2bc5 trained with), TRL's compute_loss scoring
every position (TRL on CPU), and scoring only the trained positions (`run.sft.score_trained_positions_only`)."""

import warnings

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.build import build_examples
from hf_zero3.run.sft import PackedRows, score_trained_positions_only

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained("assets/tiny/model")
prepared = build_examples(DataArguments(train_file="assets/tiny/chat/train.jsonl", block_size=256), tokenizer, 42, 512)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("assets/tiny/model"))
args = SFTConfig(output_dir="/tmp/profile_head", max_length=256, packing=True, packing_strategy="bfd", bf16=False,
                 per_device_train_batch_size=8, report_to=[], pad_to_multiple_of=None, use_cpu=True)
trainer = SFTTrainer(model=model, args=args, train_dataset=prepared.train, processing_class=tokenizer)
trainer.data_collator = PackedRows(trainer.data_collator.pad_token_id)
batches = [b for _, b in zip(range(6), trainer.get_train_dataloader())]
print("trained share of the positions:", float((batches[0]["labels"] != -100).float().mean()))


def own_loss(batch):
    model(**batch, use_cache=False).loss.backward()


def trl_loss(batch):
    trainer.compute_loss(model, dict(batch)).backward()


def run(name, step):
    for batch in batches[:2]:
        step(batch)
        model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
            model.zero_grad(set_to_none=True)
    events = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / len(batches)
    head = sum(events[k].cpu_time_total for k in ("ChunkedLogProbFunction", "ChunkedLogProbFunctionBackward")
               if k in events) / 1e3 / len(batches)
    print(f"{name:45s} CPU per step {total:4.0f} ms; TRL's LM head (forward + backward) {head:3.0f} ms")


run("model's own loss (full logits, as at 78a2bc5)", own_loss)
run("TRL compute_loss, every position scored", trl_loss)
score_trained_positions_only()
run("TRL compute_loss, trained positions only", trl_loss)
