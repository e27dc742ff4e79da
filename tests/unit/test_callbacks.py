"""Callback arithmetic that needs no training run (FLOPs, MFU peaks, install order), and one short in-process run
that hands `hf_zero3.train` an extra callback."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero3.callbacks import JsonlLogCallback, MemoryCallback, ThroughputCallback, install_callbacks
from hf_zero3.callbacks.throughput import PEAK_TFLOPS

ARGS = types.SimpleNamespace(include_num_input_tokens_seen="no", per_device_train_batch_size=1,
                             gradient_accumulation_steps=1, world_size=1)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def test_llama3_8b_flops_per_token_by_hand():
    # N without the input embedding: 32 layers x (q,o 2*4096*4096 + k,v 2*4096*1024 + mlp 3*4096*14336 + 2 norms)
    # + final norm + lm_head 128256*4096 = 7,504,924,672; 6N + 12*L*H*S at S=4096.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    n = 32 * layer + 4096 + 128256 * 4096
    assert n == 7_504_924_672
    expected = 6 * n + 12 * 32 * 4096 * 4096
    callback = ThroughputCallback(seq_len=4096)
    args = ARGS
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    assert sum(p.numel() for p in model.parameters()) == n + 128256 * 4096  # the embedding table on top
    callback.on_train_begin(args, types.SimpleNamespace(global_step=0, num_input_tokens_seen=0), None, model=model)
    assert callback.flops_per_token == expected == 51_471_998_976


def test_flops_come_from_the_config_not_the_local_shard():
    """Under ZeRO-3 every rank's parameters are empty placeholders; the count must not read them."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    for p in model.parameters():
        p.data = torch.empty(0, device="meta")  # what a ZeRO-3 partitioned parameter looks like locally
    callback = ThroughputCallback(seq_len=4096)
    callback.on_train_begin(ARGS, types.SimpleNamespace(global_step=0, num_input_tokens_seen=0), None, model=model)
    assert callback.flops_per_token == 51_471_998_976


def test_peak_table_has_the_reference_gpus():
    assert PEAK_TFLOPS["H100"] == PEAK_TFLOPS["H200"] == 989.0 and PEAK_TFLOPS["A100"] == 312.0


def test_throughput_rejects_a_missing_sequence_length():
    with pytest.raises(ValueError, match="pass the block size"):
        ThroughputCallback(seq_len=0).on_train_begin(types.SimpleNamespace(), None, None)


def test_install_puts_ours_after_printers_and_before_integrations():
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, ProgressCallback

    class Integration(TensorBoardCallback):
        def __init__(self):  # no tensorboard needed: only the position is tested
            pass

    handler = CallbackHandler([DefaultFlowCallback, Integration(), ProgressCallback], None, None, None, None)
    trainer = types.SimpleNamespace(callback_handler=handler)
    ours = [MemoryCallback(), JsonlLogCallback()]
    install_callbacks(trainer, ours)
    kinds = [type(cb).__name__ for cb in handler.callbacks]
    assert kinds == ["DefaultFlowCallback", "ProgressCallback", "MemoryCallback", "JsonlLogCallback", "Integration"]


def test_train_runs_extra_callbacks(single_rank_env, tmp_path):
    """`hf_zero3.run.train.main(argv, extra_callbacks=...)`: how a probe (benchmarks/memory_probe.py) joins a real run."""
    from transformers import TrainerCallback

    from hf_zero3.run.train import main
    from tests.conftest import TINY_YAML

    class Recorder(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    recorder = Recorder()
    argv = [str(TINY_YAML), "--deepspeed", "null", "--max_steps", "2", "--save_strategy", "no",
            "--output_dir", str(tmp_path / "run")]
    assert main(argv, extra_callbacks=[recorder]) == 0
    assert recorder.steps == [1, 2]


def test_memory_fields_name_their_unit(tmp_path):
    """The memory callback's figures are GiB (2^30, torch's and the OS's unit) and named `*_gib`; `*_gb` means
    10^9 (the planner's). They were named `*_gb`, 7% apart from the planner's GB; older logs map to today's names."""
    import psutil

    from hf_zero3 import units
    from hf_zero3.callbacks.memory import host_memory

    record = host_memory()
    assert set(record) == {"host_rss_gib", "host_peak_rss_gib", "host_available_gib"}
    assert record["host_available_gib"] * units.GIB == pytest.approx(psutil.virtual_memory().available, rel=0.05)
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=1, log_history=[{"step": 1, "loss": 1.0}])
    logs = {"loss": 1.0}
    MemoryCallback(print_line=False).on_log(types.SimpleNamespace(output_dir=str(tmp_path)), state, None, logs=logs)
    assert {k for k in logs if k != "loss"} == set(record) and not any(k.endswith("_gb") for k in logs)
    assert units.gb(80 * 10**9) == "80.0 GB" and units.parse_size("80GB") == 80 * units.GB
    assert units.current_names({"host_rss_gb": 1.5, "tokens_per_s": 2}) == {"host_rss_gib": 1.5, "tokens_per_s": 2}
