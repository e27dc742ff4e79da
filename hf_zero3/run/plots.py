"""Pictures of training logs: loss, throughput and memory per step, one line per run (a train run, bench variants).

Why one function for both: `hf-zero3 train` draws its own run next to train_log.jsonl and `hf-zero3 bench` draws
its variants side by side; the axes, words and warm-up marking are the same. matplotlib is optional: without it
the caller says so in one line and goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MEMORY_KEYS = (("gpu_peak_allocated_gib", "peak GPU memory allocated (GiB)"), ("host_rss_gib", "host memory, RSS (GiB)"))
"""The memory panel plots the first of these the records have."""


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_runs(path: str | Path, runs: dict[str, list[dict[str, Any]]], title: str, warmup: int = 0) -> bool:
    """Write `runs_figure` to `path` (a PNG); False without matplotlib."""
    if not have_matplotlib():
        return False
    import matplotlib.pyplot as plt

    fig = runs_figure(runs, title, warmup)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def runs_figure(runs: dict[str, list[dict[str, Any]]], title: str, warmup: int = 0):
    """Loss, tokens/s per GPU and memory against the optimizer step, a colour per run (and a line per repeat,
    records carrying `repeat`); steps 1..`warmup` are shaded as warm-up. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    every = [r for records in runs.values() for r in records if "loss" in r]
    memory_key, memory_label = next(((k, label) for k, label in MEMORY_KEYS if any(k in r for r in every)),
                                    MEMORY_KEYS[-1])
    panels = [("loss", "training loss"), ("tokens_per_s_per_gpu", "throughput (tokens/s per GPU)"),
              (memory_key, memory_label)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
    for index, (name, records) in enumerate(runs.items()):
        first = min((r.get("repeat", 1) for r in records), default=1)
        for repeat in sorted({r.get("repeat", 1) for r in records}):  # one colour per run, a line per repeat
            steps = [r for r in records if "loss" in r and r.get("repeat", 1) == repeat]
            style = {"color": f"C{index}", "marker": "o", "markersize": 3, "alpha": 0.8,
                     "label": name if repeat == first else None}
            for ax, (key, _) in zip(axes, panels, strict=True):
                points = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), **style)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if warmup > 0:
            ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15,
                       label=f"warm-up: steps 1-{warmup}, not measured" if ax is axes[0] else None)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_train_log(folder: str | Path, title: str) -> str:
    """Draw `<folder>/train_log.png` from `<folder>/train_log.jsonl`; returns the one line to print. Never raises:
    a picture must not fail the run that trained the model."""
    import json

    folder = Path(folder)
    target = folder / "train_log.png"
    try:
        records = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
        if not any("loss" in r for r in records):
            return f"hf_zero3: no {target.name}: no training loss was logged"
        if not plot_runs(target, {"this run": records}, title):
            return f"hf_zero3: no {target.name}: matplotlib is not installed (pip install matplotlib to get it)"
    except Exception as e:  # noqa: BLE001 -- unreadable log, a full disk, a matplotlib bug: say it and go on
        return f"hf_zero3: no {target.name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return f"hf_zero3: plot: {target}"
