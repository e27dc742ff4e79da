"""Tokens/s, step time, TFLOP/s per GPU and MFU at every logging step."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from hf_zero3.callbacks._logs import merge_into_logs
from hf_zero3.plan.hardware import gpu_name
from hf_zero3.plan.shapes import ModelError, flops_per_token, shape_from_config
from hf_zero3.job.facts import global_batch_of

PEAK_TFLOPS = {
    # Dense (no sparsity) tensor-core TFLOP/s per GPU in bf16 (fp16 on V100, which has no bf16), matched as a
    # substring of torch.cuda.get_device_name(), longest key first. Sources: the vendors' datasheets.
    "B200": 2250.0,       # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS with sparsity, 2.25 dense
    "GB200": 2500.0,      # NVIDIA GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity over 72 GPUs
    "H200": 989.0,        # NVIDIA H200 datasheet (SXM): BF16 1,979 TFLOPS with sparsity
    "H200 NVL": 835.0,    # NVIDIA H200 datasheet (NVL): BF16 1,671 TFLOPS with sparsity
    "GH200": 989.0,       # NVIDIA GH200 datasheet: the H100 SXM's 1,979 with sparsity
    "H100": 989.0,        # NVIDIA H100 datasheet, SXM ("H100 80GB HBM3"): BF16 1,979 TFLOPS with sparsity
    "H100 PCIe": 756.0,   # NVIDIA H100 datasheet, PCIe: BF16 1,513 TFLOPS with sparsity
    "H100 NVL": 835.0,    # NVIDIA H100 datasheet, NVL: BF16 1,671 TFLOPS with sparsity
    "H800": 989.0,        # NVIDIA H800 (SXM): the H100 SXM's compute
    "A100": 312.0,        # NVIDIA A100 datasheet, 40GB and 80GB, SXM and PCIe: BF16 312 TFLOPS (624 sparse)
    "A800": 312.0,        # NVIDIA A800: the A100's compute
    "L40S": 362.0,        # NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 sparse)
    "L40": 181.0,         # NVIDIA L40 datasheet: BF16 181.05 TFLOPS (362 sparse)
    "L4": 121.0,          # NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity
    "A10G": 70.0,         # no NVIDIA datasheet (AWS-only part, EC2 G5): the dense BF16 figure usually cited; check
                          # it with `hf-zero3 bench` and pass --peak-tflops if yours differs
    "A10": 125.0,         # NVIDIA A10 datasheet: BF16 125 TFLOPS (250 sparse)
    "RTX 4090": 165.0,    # NVIDIA Ada Lovelace whitepaper, GeForce RTX 4090: BF16 with FP32 accumulate 165.2
    "V100": 125.0,        # NVIDIA V100 datasheet, SXM2: FP16 tensor 125 TFLOPS (no bf16 on Volta)
    "V100-PCIE": 112.0,   # NVIDIA V100 datasheet, PCIe: FP16 tensor 112 TFLOPS
    "V100S": 130.0,       # NVIDIA V100S datasheet, PCIe: FP16 tensor 130 TFLOPS
    "T4": 65.0,           # NVIDIA T4 datasheet: FP16 tensor 65 TFLOPS (no bf16 on Turing)
}
"""Peak TFLOP/s used for MFU; `--peak_tflops` (train) or `--peak-tflops` (bench) for a GPU not listed."""

SET_PEAK = ("pass --peak-tflops N (hf-zero3 train and bench), N being one GPU's dense bf16 TFLOP/s from its "
            "datasheet (without sparsity)")
"""How to get MFU on a GPU the table does not know."""


def peak_tflops_of(name: str) -> float | None:
    """The table's peak for a GPU named `name` (as torch.cuda.get_device_name() gives it), or None."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "L40S" before "L40" before "L4"
        if key.lower() in name.lower():
            return PEAK_TFLOPS[key]
    return None


class ThroughputCallback(TrainerCallback):
    """Throughput between logging steps, into the Trainer's logs (so every `report_to` gets it).

    Tokens are the real tokens fed: the Trainer's own count when `include_num_input_tokens_seen` is on,
    else micro batch x accumulation x world size x `tokens_per_sample` per step: exact for raw-text blocks (no
    padding), the data's mean for packed or padded examples. Model FLOPs per token are 6N + 12·L·H·S (PaLM,
    appendix B), with N counted from the model config, so they are right under ZeRO-3 where each rank holds only
    a shard of the parameters; S is `seq_len`, the length each token attends within.

    Args:
        seq_len: the attended sequence length (the block size for raw text; the token-weighted mean example
            length for packed or padded examples, so padding and other examples count no FLOPs).
        tokens_per_sample: real tokens per sample (default: seq_len).
        flops_per_token: model FLOPs per trained token; default: from the model's config.
        peak_tflops: GPU peak for MFU; default: looked up by GPU name (None on CPU: no MFU; an unknown GPU
            says how to set it).
    """

    def __init__(self, seq_len: int, flops_per_token: float | None = None, peak_tflops: float | None = None,
                 tokens_per_sample: float | None = None):
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"peak_tflops must be a positive number of TFLOP/s, got {peak_tflops}: {SET_PEAK}")
        self.seq_len = seq_len
        self.tokens_per_sample = tokens_per_sample or seq_len
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self._last_time = self._last_step = self._last_tokens = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.seq_len < 1:
            raise ValueError(f"ThroughputCallback needs seq_len >= 1 (got {self.seq_len}): pass the block size")
        if self.flops_per_token is None and model is not None:
            try:
                self.flops_per_token = flops_per_token(shape_from_config(model.config), self.seq_len)
            except ModelError as e:  # not a Llama-family config: tokens/s still, no TFLOP/s or MFU
                print(f"hf_zero3: no TFLOP/s or MFU for this model ({e}); pass flops_per_token= to get them",
                      flush=True)
        if self.peak_tflops is None and (gpu := gpu_name()):
            self.peak_tflops = peak_tflops_of(gpu)
            if self.peak_tflops is None and getattr(state, "is_world_process_zero", True):
                print(f"hf_zero3: no MFU: the peak TFLOP/s of {gpu} is not known here: {SET_PEAK}", flush=True)
        self._mark(args, state)

    def on_step_end(self, args, state, control, **kwargs):
        self._step_end = time.perf_counter()

    def _exclude_since_step_end(self):
        """Evaluation and checkpoint saves run after a step's log: keep their time out of the next window."""
        if getattr(self, "_step_end", None) is not None:
            now = time.perf_counter()
            self._excluded += now - self._step_end
            self._step_end = now  # evaluate then save: each excluded once

    def on_evaluate(self, args, state, control, **kwargs):
        self._exclude_since_step_end()

    def on_save(self, args, state, control, **kwargs):
        self._exclude_since_step_end()

    def _tokens(self, args, state) -> int:
        if args.include_num_input_tokens_seen not in ("no", False, None):
            return state.num_input_tokens_seen
        return round(state.global_step * global_batch_of(args) * self.tokens_per_sample)

    def _mark(self, args, state) -> None:
        self._last_time, self._last_step, self._last_tokens = time.perf_counter(), state.global_step, \
            self._tokens(args, state)
        self._excluded = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._last_time is None or state.global_step <= self._last_step:
            return
        seconds = time.perf_counter() - self._last_time - self._excluded
        steps = state.global_step - self._last_step
        tokens = self._tokens(args, state) - self._last_tokens
        tokens_per_s = tokens / seconds
        values = {"step_time_s": round(seconds / steps, 4), "tokens_per_s": round(tokens_per_s, 2),
                  "tokens_per_s_per_gpu": round(tokens_per_s / args.world_size, 2),
                  "samples_per_s": round(tokens_per_s / self.tokens_per_sample, 3), "tokens_seen": self._tokens(args, state)}
        if self.flops_per_token:
            tflops = tokens_per_s / args.world_size * self.flops_per_token / 1e12
            values["tflops_per_gpu"] = round(tflops, 3)
            if self.peak_tflops:
                values["mfu"] = round(tflops / self.peak_tflops, 4)
        merge_into_logs(state, logs, values)
        self._mark(args, state)
