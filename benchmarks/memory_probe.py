"""Where a training run's peak GPU memory goes, and how much host RAM its node used: the measurements
behind the planner's calibration (benchmarks/README.md, "Planner: predicted vs measured").

It runs `hf_zero3.train` with two additions: the CUDA caching allocator records its history (python
stacks) from before the model is built, and local rank 0 samples /proc/meminfo. At the end of
training each rank replays its allocator trace to the moment of its peak and writes, to
PROBE_OUT/probe_rank<R>.json, what was live then, grouped by the source line that allocated it (autograd's
C++ backward has no python frame: "backward (autograd engine)"). Host RAM "used" is MemTotal - MemAvailable,
so page cache does not count; the figure reported is its peak minus its value when the probe started.

Launch it like training (a GPU box; DeepSpeed's launcher sets LOCAL_RANK):
  deepspeed --num_gpus 2 benchmarks/memory_probe.py --probe_out OUT recipes/8b/train_args.yaml --max_steps 4 ...
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections import Counter
from pathlib import Path

GiB = 1024**3
MAX_ENTRIES = 5_000_000
"""Allocator events kept; the history is a ring buffer, so a longer run would lose its start (checked)."""


def meminfo_used() -> int:
    """Host RAM in use (bytes): MemTotal - MemAvailable, i.e. not counting reclaimable page cache."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class HostSampler(threading.Thread):
    """Peak host RAM in use on this node, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.baseline = interval, meminfo_used()
        self.peak, self.peak_at, self.t0, self.stopped = self.baseline, 0.0, time.time(), threading.Event()

    def run(self):
        self.at_peak, snapshot_at = {}, self.baseline
        while not self.stopped.wait(self.interval):
            used = meminfo_used()
            if used > self.peak:
                self.peak, self.peak_at = used, time.time() - self.t0
                if used > snapshot_at + GiB // 2:  # who holds it: enough to explain a peak, cheap enough to repeat
                    self.at_peak, snapshot_at = who_holds_host_ram(), used

    def result(self) -> dict:
        self.stopped.set()
        return {"baseline_used_gib": self.baseline / GiB, "peak_used_gib": self.peak / GiB,
                "peak_minus_baseline_gib": (self.peak - self.baseline) / GiB, "peak_at_s": round(self.peak_at, 1),
                "near_peak": getattr(self, "at_peak", {})}


def who_holds_host_ram(top: int = 8) -> dict:
    """The largest processes by resident memory and the node's shared memory (tmpfs, /dev/shm: not reclaimable,
    in no process's RSS alone), read from /proc when the node's use reaches a new high."""
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    procs = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            info = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            rss = int(info.get("VmRSS", "0 kB").split()[0]) * 1024
        except (OSError, ValueError):
            continue  # the process ended while we read it
        if rss:
            procs.append((rss, int(status.parent.name), info.get("Name", "?").strip()))
    procs.sort(reverse=True)
    return {"shmem_gib": round(fields.get("Shmem", 0) / GiB, 2),
            "processes": [{"pid": pid, "name": name, "rss_gib": round(rss / GiB, 2)} for rss, pid, name in procs[:top]]}


def _short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/", "hf_zero3/"):
        if marker in filename:
            return (("hf_zero3/" if marker == "hf_zero3/" else "") + filename.split(marker, 1)[1])
    return filename


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch itself: the library line that asked for the memory."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            return f"{_short(name)}:{frame.get('line')} {frame.get('name')}"
    return "backward (autograd engine)" if not frames else f"torch: {_short(frames[0].get('filename', '?'))}"


def replay(trace: list[dict], baseline: int) -> tuple[int, int, list[dict]]:
    """Peak allocated bytes, the index of the event that reached it, and the allocations live at that moment."""
    current, peak, peak_index = baseline, baseline, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        if current > peak:
            peak, peak_index = current, i
    live: dict[int, dict] = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, peak_index, list(live.values())


def breakdown(snapshot: dict, device: int, baseline: int) -> dict:
    trace = snapshot["device_traces"][device]
    peak, index, live = replay(trace, baseline)
    by_site: Counter = Counter()
    counts: Counter = Counter()
    for event in live:
        key = site(event.get("frames", []))
        by_site[key] += event["size"]
        counts[key] += 1
    at_peak = trace[index] if index >= 0 else {}
    return {
        "events": len(trace), "trace_complete": len(trace) < MAX_ENTRIES, "baseline_gib": baseline / GiB,
        "replayed_peak_gib": peak / GiB,
        "peak_event_stack": [f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in at_peak.get("frames", [])
                             if "/torch/" not in f.get("filename", "")][:8],
        "live_at_peak": [{"site": k, "gib": round(v / GiB, 3), "tensors": counts[k]} for k, v in by_site.most_common()],
    }


def _probe_callback(out: Path, sampler: HostSampler | None, baseline: int):
    import torch
    from transformers import TrainerCallback

    class MemoryProbeCallback(TrainerCallback):
        """Per-step peaks while training; the allocator replay and host figures when training ends."""

        def __init__(self):
            self.step_peaks: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.step_peaks.append(round(torch.cuda.max_memory_allocated() / GiB, 3))

        def on_train_end(self, args, state, control, **kwargs):
            device = torch.cuda.current_device()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            rank = int(os.environ.get("RANK", "0"))
            result = {
                "rank": rank, "argv": sys.argv[1:], "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
                "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
                "max_after_step_gib": self.step_peaks,
                "pinned_host_peak_gib": torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0) / GiB,
                "process_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
                **breakdown(snapshot, device, baseline),
            }
            if sampler is not None:
                result["host_node"] = sampler.result()
            out.mkdir(parents=True, exist_ok=True)
            (out / f"probe_rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
            if rank == 0:
                top = ", ".join(f"{x['gib']:.1f} {x['site']}" for x in result["live_at_peak"][:6])
                print(f"memory_probe: peak {result['max_memory_allocated_gib']:.2f} GiB (replay "
                      f"{result['replayed_peak_gib']:.2f}); live at peak: {top}; host: {result.get('host_node')}",
                      flush=True)

    return MemoryProbeCallback()


def main(argv: list[str]) -> int:
    import torch

    if "--probe_out" not in argv:
        print("usage: memory_probe.py --probe_out DIR [train args ...]", file=sys.stderr)
        return 2
    i = argv.index("--probe_out")
    out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if not torch.cuda.is_available():
        print("memory_probe.py needs CUDA GPUs", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # record on this rank's GPU, not GPU 0
    sampler = HostSampler() if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    if sampler:
        sampler.start()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python", context="alloc")

    from hf_zero3.run import train

    return train.main(argv, extra_callbacks=[_probe_callback(out, sampler, baseline)])


if __name__ == "__main__":
    from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown

    exit_process(main(sys.argv[1:]))
