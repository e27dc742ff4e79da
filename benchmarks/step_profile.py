"""Where one optimizer step's time goes: `hf_zero3.train` with a callback that runs torch.profiler over one optimizer
step (all its micro-batches, the optimizer step included) and writes a short table: the step's wall time, GPU time by
category (matmul, attention, collectives, optimizer, loss, norms/activations/elementwise, copies), the GPU's idle time
within the step, the host's blocking syncs, and the top kernels.

Launched like training (rank 0 writes the table):
  deepspeed --num_gpus 1 benchmarks/step_profile.py --profile-out OUT/profile.txt [--profile-step 3] \
      [--profile-trace OUT/trace.json.gz] CONFIG.yaml [train overrides]

On CPU (no CUDA) the table is over the CPU operators' own time instead (a check of the plumbing).
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the first category whose words one appears in a kernel's (or operator's) lower-cased name takes it
    ("collectives (all-gather, reduce-scatter, all-reduce)", ("nccl", "all_gather", "allgather", "reduce_scatter",
                                                               "reducescatter", "all_reduce", "allreduce", "c10d")),
    ("loss (cross-entropy, Liger's fused linear CE)", ("cross_entropy", "crossentropy", "nll_loss", "log_softmax")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("optimizer step (Adam)", ("adam", "multi_tensor", "foreach", "lerp", "_amp_foreach")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "wgmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::linear", "sm90_", "sm80_")),
    ("copies (memcpy, memset)", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
    ("norms, activations, rotary, elementwise", ("triton", "norm", "rms", "silu", "swiglu", "gelu", "rope", "rotary",
                                                "elementwise", "vectorized", "reduce_kernel", "unrolled", "fused",
                                                "aten::mul", "aten::add", "aten::div", "aten::sum", "aten::mean",
                                                "aten::pow", "aten::rsqrt", "aten::neg", "aten::cat")),
)
OTHER = "other"
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
              "cudaMemcpy", "cudaStreamWaitEvent")
"""CUDA runtime calls where the host waits for the GPU (cudaMemcpy without Async copies to or from pageable memory
synchronously)."""


def category(name: str) -> str:
    low = name.lower()
    for label, words in CATEGORIES:
        if any(word in low for word in words):
            return label
    return OTHER


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(events, wall_us: float, title: str, top: int = 15) -> str:
    """The table of one profiled step from torch.profiler's events (`prof.events()`), `wall_us` its wall time."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    on_gpu = bool(kernels)
    if on_gpu:
        timed = [(e.name, e.time_range.end - e.time_range.start) for e in kernels]
        busy = busy_time([(e.time_range.start, e.time_range.end) for e in kernels])
        unit = "GPU kernel time"
    else:  # CPU: each operator's own time, so nested operators are not counted twice
        timed = [(e.name, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU]
        busy = sum(t for _, t in timed)
        unit = "CPU operator self time"
    by_category: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, t in timed:
        by_category[category(name)] = by_category.get(category(name), 0.0) + t
        by_name.setdefault(name, []).append(t)
    total = sum(by_category.values()) or 1.0
    syncs = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(HOST_SYNCS)]
    sync_us = sum(e.cpu_time_total for e in syncs)

    def ms(us: float) -> str:
        return f"{us / 1000:10.1f}"

    lines = [title, "", f"step wall time {wall_us / 1e6:.3f} s; {unit} {total / 1e6:.3f} s over {len(timed)} events",
             ""]
    if on_gpu:
        idle = max(0.0, wall_us - busy)
        lines += [f"GPU busy (union over streams) {busy / 1e6:.3f} s = {busy / wall_us:.1%} of the step; "
                  f"idle {idle / 1e6:.3f} s = {idle / wall_us:.1%}",
                  f"host blocked in syncs ({', '.join(sorted({e.name for e in syncs})) or 'none'}): "
                  f"{sync_us / 1e6:.3f} s in {len(syncs)} calls", ""]
    lines += [f"{'category':<52} {'ms':>10} {'share':>7}", "-" * 71]
    for label, t in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"{label:<52} {ms(t)} {t / total:7.1%}")
    if on_gpu:
        lines.append(f"{'GPU idle within the step':<52} {ms(max(0.0, wall_us - busy))} {'':>7}")
    lines += ["", f"top {top} by time", f"{'ms':>10} {'calls':>7} {'share':>7}  category / name", "-" * 71]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{ms(sum(times))} {len(times):7d} {sum(times) / total:7.1%}  {category(name)} / {name[:90]}")
    return "\n".join(lines) + "\n"


def make_callback(out: Path, step: int, trace: Path | None):
    import torch
    from transformers import TrainerCallback

    class StepProfile(TrainerCallback):
        """torch.profiler over optimizer step `step` (1-based), its table to `out` on rank 0."""

        def __init__(self):
            self.prof, self.began = None, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 != step:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is None:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = (time.perf_counter() - self.began) * 1e6
            self.prof.__exit__(None, None, None)
            if state.is_world_process_zero:
                title = (f"one optimizer step (step {step}) of {args.output_dir}: micro batch "
                         f"{args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps}, "
                         f"{args.world_size} rank(s), {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(summarize(self.prof.events(), wall, title))
                print(f"step_profile: wrote {out}", flush=True)
                if trace is not None:
                    raw = trace.with_suffix("") if trace.suffix == ".gz" else trace
                    self.prof.export_chrome_trace(str(raw))
                    if trace.suffix == ".gz":
                        with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                        raw.unlink()
            self.prof = None

    return StepProfile()


def _take(argv: list[str], flag: str, default: str | None = None) -> str | None:
    if flag in argv:
        at = argv.index(flag)
        value = argv[at + 1]
        del argv[at:at + 2]
        return value
    return default


if __name__ == "__main__":
    from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown
    from hf_zero3.train import main

    argv = sys.argv[1:]
    out = _take(argv, "--profile-out")
    if out is None:
        sys.exit("usage: step_profile.py --profile-out FILE [--profile-step N] [--profile-trace FILE] CONFIG [...]")
    at_step = int(_take(argv, "--profile-step", "3"))
    trace = _take(argv, "--profile-trace")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    exit_process(main(argv, extra_callbacks=[make_callback(Path(out), at_step, Path(trace) if trace else None)]))
