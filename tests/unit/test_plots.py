"""Plots where people look: bench (title with model and hardware, warm-up marked, integer steps, worded axes, a
loss panel), `plan --plot` (stacked terms per option against the GPU and host limits), train's train_log.png
(never failing the run, one line without matplotlib)."""

from __future__ import annotations

import json
import sys

import pytest

from hf_zero3.run.plots import plot_train_log, runs_figure
from tests.conftest import error_naming


def _records(base, repeat=1):
    return [{"repeat": repeat, "step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s_per_gpu": base + s,
             "gpu_peak_allocated_gib": 40.0} for s in range(1, 14)]


def test_bench_figure_has_title_warmup_integer_steps_worded_axes_and_a_loss_panel():
    import matplotlib.pyplot as plt

    fig = runs_figure({"ours": _records(100) + _records(110, 2), "stock": _records(70)},
                      "8b on 2xH200: hf_zero3 vs stock\n2 x NVIDIA H200 (140 GiB)", warmup=3)
    loss, _, memory = fig.axes
    assert "8b" in fig._suptitle.get_text() and "NVIDIA H200" in fig._suptitle.get_text()
    assert [a.get_ylabel() for a in fig.axes] == ["training loss", "throughput (tokens/s per GPU)",
                                                  "peak GPU memory allocated (GiB)"]
    assert memory.get_xlabel() == "optimizer step"
    fig.canvas.draw()
    ticks = [t for t in memory.get_xticks() if memory.get_xlim()[0] <= t <= memory.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    spans = [p for p in loss.patches if p.get_label().startswith("warm-up")]
    assert len(spans) == 1 and spans[0].get_x() == 0.5 and spans[0].get_width() == 3  # steps 1-3 shaded
    assert [line.get_label() for line in loss.lines if not line.get_label().startswith("_")] == ["ours", "stock"]
    assert len(loss.lines) == 3  # a line per run: ours twice (repeats), stock once
    plt.close(fig)


def test_train_log_png_is_written_and_a_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(50)))
    assert plot_train_log(tmp_path, "tiny: 2 x CPU") == f"hf_zero3: plot: {tmp_path / 'train_log.png'}"
    assert (tmp_path / "train_log.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "train_log.png").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed: import raises
    error_naming(plot_train_log(tmp_path, "t"), "no train_log.png", "matplotlib", "pip install matplotlib")
    assert not (tmp_path / "train_log.png").exists()


def test_train_log_png_never_raises(tmp_path):
    assert plot_train_log(tmp_path / "missing", "t").startswith("hf_zero3: no train_log.png: FileNotFoundError")
    (tmp_path / "train_log.jsonl").write_text('{"step": 1, "eval_loss": 2.0}\n')
    assert plot_train_log(tmp_path, "t") == "hf_zero3: no train_log.png: no training loss was logged"


def test_plan_plot_stacks_each_options_terms_up_to_its_total(tmp_path, capsys):
    from hf_zero3.cli import main
    from hf_zero3.plan.plot import gpu_terms, host_terms

    path = tmp_path / "plan.png"
    assert main(["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "141GB", "--host-ram", "512G",
                 "--plot", str(path)]) == 0
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from hf_zero3.plan.choose import choose
    from hf_zero3.plan.hardware import detect_hardware
    from hf_zero3.plan.report import rows
    from hf_zero3.plan.shapes import load_shape

    hardware = detect_hardware(nodes=1, gpus_per_node=2, gpu_mem=141 * 10**9, host_ram=512 * 2**30)
    plans = rows(choose(load_shape("8b"), hardware, 4096))
    assert len(plans) >= 6
    for plan in plans:  # the bars are the totals the table prints
        assert sum(t.bytes for t in gpu_terms(plan)) == plan.gpu_bytes, plan.label
        assert sum(t.bytes for t in host_terms(plan)) == plan.host_bytes, plan.label


def test_plan_plot_without_matplotlib_says_so_and_still_answers(tmp_path, capsys, monkeypatch):
    from hf_zero3.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "141GB", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr()
    assert "note: no plot written to" in out.err and "matplotlib is not installed" in out.err
    assert "choice" in out.out and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("bad", ["{folder}", "{folder}/no/such/dir/p.png"])
def test_plan_plot_refuses_a_folder_or_a_missing_parent(tmp_path, capsys, bad):
    from hf_zero3.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "8b", "--plot", bad.format(folder=tmp_path)])
    assert "--plot" in capsys.readouterr().err
