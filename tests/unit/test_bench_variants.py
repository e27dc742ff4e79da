"""`hf-zero3 bench` variants and report, without running anything: the hand-tuned baselines are what their
docstring says, every variant trains the recipe's global batch, and repeats are reported with their spread."""

from __future__ import annotations

import json

import pytest

from hf_zero3.ops.bench import STOCK_ZERO3, TUNED_MICRO_BATCH, aggregate, build_variants, render_report
from tests.conftest import ROOT

RECIPE = ROOT / "recipes" / "8b"


def _value(overrides: list[str], key: str) -> str:
    return overrides[len(overrides) - 1 - overrides[::-1].index(key) + 1]  # the last one given wins


def test_tuned_baselines_run_the_stock_templates_with_the_trainers_optimizer_and_no_checkpointing():
    variants = {v.name: v for v in build_variants(RECIPE, ["stock_tuned", "zero2_tuned", "fsdp2_tuned"], False, True,
                                                   global_batch=12, gpus=2)}
    assert list(variants) == ["ours", "stock_tuned", "zero2_tuned", "fsdp2_tuned"]
    stock, zero2, fsdp2 = variants["stock_tuned"], variants["zero2_tuned"], variants["fsdp2_tuned"]
    assert stock.ds_config == {k: v for k, v in STOCK_ZERO3.items() if k not in ("optimizer", "scheduler")}
    assert zero2.ds_config["zero_optimization"]["stage"] == 2
    assert "optimizer" not in zero2.ds_config and "scheduler" not in zero2.ds_config
    assert "offload_optimizer" not in zero2.ds_config["zero_optimization"]
    assert fsdp2.launcher == "torchrun" and fsdp2.ds_config is None
    assert json.loads(_value(fsdp2.overrides, "--fsdp_config"))["activation_checkpointing"] is False
    for variant in (stock, zero2, fsdp2):
        micro = int(_value(variant.overrides, "--per_device_train_batch_size"))
        accum = int(_value(variant.overrides, "--gradient_accumulation_steps"))
        assert micro == TUNED_MICRO_BATCH[variant.name] and micro * accum * 2 == 12
        assert _value(variant.overrides, "--gradient_checkpointing") == "false"
        assert _value(variant.overrides, "--use_liger_kernel") == "false"
        assert _value(variant.overrides, "--optim") == "adamw_torch_fused"


def test_a_global_batch_the_tuned_micro_batch_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="global batch 9 is not a multiple of 4"):
        build_variants(RECIPE, ["stock_tuned"], False, True, global_batch=9, gpus=2)


def test_other_recipe_folders_run_with_their_own_yaml_and_config(tmp_path):
    (tmp_path / "train_args.yaml").write_text("block_size: 64\n")
    (tmp_path / "ds_config.json").write_text('{"zero_optimization": {"stage": 2}}')
    variants = build_variants(RECIPE, [], False, True, others={"z2": tmp_path})
    assert [v.name for v in variants] == ["ours", "z2"]
    assert variants[1].recipe_dir == tmp_path and variants[1].ds_config == {"zero_optimization": {"stage": 2}}


def _run(tokens: float, peak: float) -> dict:
    return {"tokens_per_s_per_gpu": tokens, "tflops_per_gpu": tokens / 20, "mfu": tokens / 20000, "step_time_s": 1.0,
            "ds_fwd_ms": None, "ds_bwd_ms": None, "ds_step_ms": None, "gpu_peak_allocated_gb": peak,
            "gpu_peak_reserved_gb": peak + 1, "host_rss_gb": 2.0, "final_loss": 11.0, "steps_measured": 4}


def test_repeats_report_medians_spread_and_each_run():
    ours = aggregate([_run(10000, 110), _run(9000, 112), _run(10400, 111)])
    stock = aggregate([_run(8000, 120), {"error": "exit 1: OOM"}, _run(7000, 121)])
    assert ours["tokens_per_s_per_gpu"] == 10000 and ours["gpu_peak_allocated_gb"] == 112
    assert stock["tokens_per_s_per_gpu"] == 7500  # median of the two that ran
    meta = {"title": "t", "date": "d", "hardware": "h", "versions": {}, "model": "m", "seq_len": 4096,
            "global_batch": 12, "steps": 4, "warmup": 2, "repeats": 3, "commands": ["hf-zero3 bench 8b"], "configs": {}}
    text = render_report(meta, {"ours": ours, "stock_tuned": stock})
    assert "| ours | 10000 | 500.0 | 50.0% | 112.00 |" in text and text.count("| 3: 9000-10400 |") == 1
    assert "| 2: 7000-8000 (1 failed) |" in text
    assert "ours / stock_tuned: 1.33x tokens/s" in text
    assert "| ours | 2 | 9000 |" in text and "| stock_tuned | 2 | failed: exit 1: OOM |" in text
    assert "3 run(s) per config" in text
    assert aggregate([{"error": "exit 1: x"}])["error"] == "exit 1: x"
    without_ours = render_report(meta, {"stock_tuned": stock})  # `--only stock_tuned`: a table, no ratio
    assert "| stock_tuned | 7500 |" in without_ours and "ours /" not in without_ours


def test_a_scratch_run_folder_is_emptied_only_when_the_bench_made_it(tmp_path):
    from hf_zero3.ops.bench import scratch_run_dir

    run_dir = tmp_path / "ours"
    scratch_run_dir(run_dir)  # new: nothing to clear, the owner file is written beside it
    run_dir.mkdir()
    (run_dir / "train_log.jsonl").write_text("{}\n")
    scratch_run_dir(run_dir)  # ours: the old records go
    assert not run_dir.exists() and (tmp_path / "ours.owner").is_file()

    theirs = tmp_path / "stock"
    theirs.mkdir()
    (theirs / "checkpoint-100").mkdir()
    with pytest.raises(ValueError, match="was not left by hf-zero3.*pass another --work-dir"):
        scratch_run_dir(theirs)
    assert (theirs / "checkpoint-100").is_dir()


def test_tuned_settings_for_a_model_the_8b_defaults_do_not_fit():
    """13b on 2 x H200: stock ZeRO-3 fits only with checkpointing (micro 4 planned), so `--tuned stock_tuned=4+ckpt`."""
    from hf_zero3.ops.bench import Tuned

    tuned = Tuned.collect(["stock_tuned=4+ckpt", "fsdp2_tuned=2+ckpt"])
    variants = {v.name: v for v in build_variants(RECIPE, ["stock_tuned", "fsdp2_tuned", "zero2_tuned"], False, True,
                                                   global_batch=16, gpus=2, tuned=tuned)}
    stock, fsdp2, zero2 = variants["stock_tuned"], variants["fsdp2_tuned"], variants["zero2_tuned"]
    assert _value(stock.overrides, "--per_device_train_batch_size") == "4"
    assert _value(stock.overrides, "--gradient_accumulation_steps") == "2"
    assert _value(stock.overrides, "--gradient_checkpointing") == "true"
    assert json.loads(_value(stock.overrides, "--gradient_checkpointing_kwargs")) == {"use_reentrant": False}
    # FSDP2 recomputes through its own config, never twice through the Trainer's flag too
    assert json.loads(_value(fsdp2.overrides, "--fsdp_config"))["activation_checkpointing"] is True
    assert _value(fsdp2.overrides, "--gradient_checkpointing") == "false"
    assert _value(zero2.overrides, "--per_device_train_batch_size") == str(TUNED_MICRO_BATCH["zero2_tuned"])


def test_several_settings_of_one_baseline_each_run_and_the_report_names_the_best():
    """"Tuned by hand" is the better of checkpointing on and off: on one H200 a 7B's stock ZeRO-3 was fastest with
    checkpointing at micro 8, not without it at micro 1 (benchmarks/results/2026-12-01_ckpt-micro-7b-1gpu/report.md)."""
    from hf_zero3.ops.bench import Tuned, baseline_groups

    tuned = Tuned.collect(["stock_tuned=1", "stock_tuned=8+ckpt", "stock_tuned=1"])  # a repeat runs once
    variants = build_variants(RECIPE, ["stock_tuned", "zero2_tuned"], False, True, global_batch=16, gpus=1,
                              tuned=tuned)
    by_name = {v.name: v for v in variants}
    assert list(by_name) == ["ours", "stock_tuned_1", "stock_tuned_8_ckpt", "zero2_tuned"]
    assert _value(by_name["stock_tuned_1"].overrides, "--gradient_accumulation_steps") == "16"
    assert _value(by_name["stock_tuned_8_ckpt"].overrides, "--gradient_accumulation_steps") == "2"
    assert _value(by_name["stock_tuned_8_ckpt"].overrides, "--gradient_checkpointing") == "true"
    assert by_name["stock_tuned_1"].ds_config == by_name["stock_tuned_8_ckpt"].ds_config
    groups = baseline_groups(variants)
    assert groups == {"stock_tuned": ["stock_tuned_1", "stock_tuned_8_ckpt"]}  # zero2_tuned: one setting, no group

    meta = {"title": "t", "date": "d", "hardware": "h", "versions": {}, "model": "m", "seq_len": 4096,
            "global_batch": 16, "steps": 4, "warmup": 2, "commands": ["c"], "configs": {}, "groups": groups}
    results = {"ours": aggregate([_run(10_118, 114)]), "stock_tuned_1": aggregate([_run(6_044, 125)]),
               "stock_tuned_8_ckpt": aggregate([_run(8_221, 121)])}
    text = render_report(meta, results)
    assert ("ours / the best stock_tuned (stock_tuned_8_ckpt, 8,221 tokens/s/GPU; of stock_tuned_1, "
            "stock_tuned_8_ckpt): 1.23x tokens/s") in text
    results["stock_tuned_8_ckpt"] = aggregate([{"error": "exit 1: OOM"}])  # the best of those that ran
    assert "ours / the best stock_tuned (stock_tuned_1, 6,044" in render_report(meta, results)


def test_bench_only_accepts_the_names_of_several_tuned_settings(capsys):
    from hf_zero3.cli import main

    argv = ["bench", "tiny", "--against", "stock_tuned", "--tuned", "stock_tuned=1", "--tuned", "stock_tuned=2+ckpt"]
    assert main([*argv, "--only", "stock_tuned_3"]) == 2
    err = capsys.readouterr().err
    assert "['stock_tuned_3'] not in this bench" in err and "stock_tuned_2_ckpt" in err


@pytest.mark.parametrize("bad", ["stock=4", "stock_tuned=0", "stock_tuned=four", "stock_tuned=4+offload"])
def test_a_bad_tuned_setting_names_the_form(bad):
    from hf_zero3.ops.bench import Tuned

    with pytest.raises(ValueError, match=r"NAME=MICRO or NAME=MICRO\+ckpt"):
        Tuned.parse(bad)


def test_bench_refuses_tuned_settings_for_a_baseline_it_does_not_run(capsys):
    from hf_zero3.cli import main

    assert main(["bench", "tiny", "--against", "stock", "--tuned", "stock_tuned=2"]) == 2
    assert "--tuned sets ['stock_tuned'], which --against does not run" in capsys.readouterr().err
    assert main(["bench", "tiny", "--against", "stock_tuned", "--tuned", "stock_tuned=x"]) == 2
    assert "give NAME=MICRO" in capsys.readouterr().err
