"""How long the first call of TRL's fused LM head (its Triton chunked log-prob kernels, forward and backward) takes
in a process whose Triton cache is cold, against one that finds the kernels cached: the compile a training run's
first step pays on a fresh machine. A small Llama with Llama-3's 128,256-entry vocabulary, bf16, 2 x 512 tokens.
Usage (GPU): TRITON_CACHE_DIR=DIR python benchmarks/triton_first_call.py LABEL   (run twice: cold, then warm)"""

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=8, vocab_size=128256)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = LlamaForCausalLM(config).to(device).to(torch.bfloat16)
add_fused_lm_head(model)
ids = torch.randint(0, config.vocab_size, (2, 512), device=device)
for call in range(3):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{sys.argv[1]}: call {call}: {time.perf_counter() - start:.3f} s", flush=True)
